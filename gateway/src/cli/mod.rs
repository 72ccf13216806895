//! The `mlxgate` subcommands that are not the server: clients of a running
//! gateway (`policy`, `jobs`, `cache`, `adapters`, `usage`, all through
//! [`remote`])
//! and offline tools (`dataset transform`, `cache inspect`, `policy
//! --data-dir`), and a served group's `worker` ([`group`]). The top of the
//! command line (`serve`, `keys`, `doctor`, `convert`) is `main.rs`.

pub mod adapters;
pub mod cache;
pub mod generate;
pub mod group;
pub mod jobs;
pub mod policy;
pub mod remote;
pub mod usage;
