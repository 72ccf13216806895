//! MLX runtime facts and model files loaded through MLX.
//!
//! Everything here is blocking (MLX calls hold the thread): async callers use
//! `tokio::task::spawn_blocking`.

mod doctor;
pub mod kernels;
mod model_file;
mod runtime;

pub use doctor::doctor_report;
pub use model_file::{ModelFileError, ModelSummary, model_id};
pub use runtime::{Backend, RuntimeInfo};
