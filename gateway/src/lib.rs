//! mlxgate: an OpenAI-compatible LLM gateway on MLX, programmable with
//! sandboxed WebAssembly guests.
//!
//! Layers (see `docs/ARCHITECTURE.md`): `http` speaks the wire protocol and knows
//! nothing of MLX; `mlx` wraps the runtime and model files; `policy` hosts Wasm
//! guests; `config` is the one place settings are resolved.

pub mod app;
pub mod auth;
pub mod cli;
pub mod config;
pub mod datasets;
pub mod engine;
pub mod fixtures;
pub mod http;
pub mod jobs;
pub mod limits;
pub mod mlx;
pub mod policy;
pub mod upstream;
pub mod util;
