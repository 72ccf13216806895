//! The server's jobs service: opened (and its ledger recovered) once, at
//! start or on first use, and stopped with the server.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use super::App;
use crate::jobs::{JobError, Jobs, PolicyProvider, Services};

/// The jobs service of the data dir, once opened.
#[derive(Default)]
pub struct JobsService(Mutex<Option<Arc<Jobs>>>);

impl App {
    /// The jobs service of the data dir, opened (and recovered) once.
    /// Must run inside the tokio runtime: recovery schedules queued jobs.
    pub fn jobs(&self) -> Result<Arc<Jobs>, JobError> {
        let mut slot = self.jobs.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(j) = slot.as_ref() {
            return Ok(Arc::clone(j));
        }
        let dir = &self.config.data_dir;
        let _ = std::fs::create_dir_all(dir);
        let policies = Arc::clone(&self.policies);
        let policies: PolicyProvider = Arc::new(move || policies.open().map_err(|e| e.to_string()));
        let services = Services {
            policies: Some(policies),
            adapter_stores: self.config.adapter_stores(),
            adapters: Some(super::adapters::job_mounts(&self.models)),
        };
        let jobs = Jobs::open(dir, self.config.jobs.clone(), services)?;
        jobs.start()?;
        *slot = Some(Arc::clone(&jobs));
        Ok(jobs)
    }

    /// Opens the jobs service at server start, so that rows of a previous
    /// process are recovered (and queued ones re-run) before any request.
    /// When `shutdown` completes (SIGINT/SIGTERM) it stops running jobs at
    /// once, while the server drains its connections, which followers'
    /// event streams would otherwise hold open.
    pub fn start_jobs(&self, shutdown: impl Future<Output = ()> + Send + 'static) {
        match self.jobs() {
            Ok(jobs) => {
                tokio::spawn(async move {
                    shutdown.await;
                    jobs.shutdown();
                });
            }
            Err(e) => {
                tracing::error!(error = %e, "the jobs service cannot start; /api/jobs will answer 500")
            }
        }
    }

    /// After the server stopped: lets stopping jobs record their end (up to
    /// the shutdown grace period).
    pub async fn stop_jobs(&self) {
        if let Ok(jobs) = self.jobs() {
            jobs.shutdown();
            jobs.drain(self.config.shutdown_grace).await;
        }
    }
}
