//! Background jobs: a durable ledger, a bounded runner and streamed events.
//!
//! `POST /api/jobs` (see `http::jobs`) lands in [`Jobs::submit`], which checks
//! the kind's config (a bad field is a [`ConfigError`] naming it), records a
//! `queued` row in the redb [`ledger`] and schedules the job. The runner
//! gives each kind a bounded number of slots; a job runs on a blocking thread
//! and reports through [`JobCtx::emit`]: events are appended to
//! `<data_dir>/jobs/<id>.ndjson` (the seed's grammar: `started` -> `log` /
//! `stage` / `metric` -> `done` | `failed` | `cancelled`) and `progress` /
//! `message` update the row. [`Jobs::follow`] replays a log and then follows
//! it live. On start-up, rows left `running` by a dead process become
//! `zombie` and `queued` rows run again.
//!
//! This module knows nothing of HTTP.

pub mod config;
pub mod events;
pub mod kinds;
pub mod ledger;
pub mod runner;
pub mod types;

pub use config::{JobsConfig, PathGuard};
pub use kinds::{AdapterMounts, ConfigError, PolicyProvider};
pub use ledger::{Filter, Ledger, LedgerError, Listing, Page};
pub use runner::{Followed, JobCtx, JobError, Jobs, RunError, Services};
pub use types::{JobEvent, JobKind, JobRow, JobStatus, StoredEvent};
