//! The server's one policy host, opened on first use.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use crate::policy::{HostConfig, PolicyError, PolicyHost};

/// The policy host of the server's data dir. Opening it loads (and
/// compiles) every stored policy, so it happens once, on first use: a
/// server whose data dir has no policy store creates none until an
/// operator uploads a policy. One host per data dir: two on one directory
/// would overwrite each other's bindings.
pub struct Policies {
    data_dir: PathBuf,
    host: OnceLock<Arc<PolicyHost>>,
    /// Held while opening, so two first uses open it once.
    opening: Mutex<()>,
    /// Until when (milliseconds on [`Policies::clock`]) the store is known
    /// to be absent: a request asks several times whether a router is
    /// bound, and each answer would otherwise be a `stat` of the data dir.
    absent_until_ms: AtomicU64,
    clock: Instant,
}

impl Policies {
    pub fn new(data_dir: PathBuf) -> Policies {
        Policies {
            data_dir,
            host: OnceLock::new(),
            opening: Mutex::new(()),
            absent_until_ms: AtomicU64::new(0),
            clock: Instant::now(),
        }
    }

    /// The host, opened now if it was not yet (blocking: compiles the
    /// stored guests). A failure is not kept: the next use tries again.
    pub fn open(&self) -> Result<Arc<PolicyHost>, PolicyError> {
        if let Some(h) = self.host.get() {
            return Ok(Arc::clone(h));
        }
        let _opening = self.opening.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = self.host.get() {
            return Ok(Arc::clone(h));
        }
        let host = Arc::new(PolicyHost::open(HostConfig::new(&self.data_dir))?);
        for e in host.load_errors() {
            tracing::warn!(error = %e, "policy store");
        }
        Ok(Arc::clone(self.host.get_or_init(|| host)))
    }

    /// The host if it is open already (one atomic load).
    pub fn opened(&self) -> Option<Arc<PolicyHost>> {
        self.host.get().cloned()
    }

    /// Whether the data dir has a policy store (policies were ever stored).
    /// An absent store is looked for again a second later at the soonest
    /// (this server's own uploads open the host, which needs no look).
    pub fn stored(&self) -> bool {
        let now_ms = self.clock.elapsed().as_millis() as u64;
        if now_ms < self.absent_until_ms.load(Ordering::Relaxed) {
            return false;
        }
        let stored = self.data_dir.join("policies").is_dir();
        if !stored {
            self.absent_until_ms.store(now_ms + 1000, Ordering::Relaxed);
        }
        stored
    }
}
