//! The Wasm policy host: one engine, linker and instance pools for all guests.
//!
//! Operators upload WebAssembly components implementing one of the worlds in
//! `guest-sdk/wit/policy.wit` (package `mlxgate:policy@0.3.3`): a router, an
//! adapter selector or a dataset transform. [`PolicyHost`] validates and
//! precompiles them, stores them durably under the data dir, and calls them
//! under strict limits (deadline, fuel, memory, stack; no capabilities: the
//! one import is `backend-stats`, which reads the running call's backends). This module knows nothing of HTTP: the HTTP layer
//! maps [`PolicyError`] to statuses (`http/error.rs`) and renders
//! [`render_prometheus`].

mod bindings;
mod engine;
mod error;
mod host;
pub mod jsonl;
mod metrics;
mod pool;
mod reuse;
mod runtime;
mod storage;
mod types;

pub use engine::HostConfig;
pub use error::{FailureKind, PolicyError};
pub use host::{PolicyHost, probe_facts};
pub use metrics::{LATENCY_BUCKETS_S, PolicyMetrics, render_prometheus};
pub use pool::PolicyCall;
pub use types::{
    AdapterInfo, BackendKind, BackendState, Limits, LoadOrigin, OnError, PolicyInfo, PolicyKind,
    PolicyOptions, Quota, RecordOutcome, RequestFacts, RouteDecision,
};
