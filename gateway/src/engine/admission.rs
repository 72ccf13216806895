//! Admission control: how much work a model takes before it says no.
//!
//! A request is admitted to a model's queue or refused at once, never left
//! to wait without bound: beyond `max_queued` waiting requests the model is
//! overloaded (the HTTP layer answers 503), and one tenant may hold at most
//! its share of the queue (429), so a flood from one tenant leaves room for
//! the others. Requests without a tenant (open inference) are bound by the
//! queue alone. Refusals carry a wait estimate for `Retry-After`, from how
//! long requests have recently taken.
//!
//! The queue here is the requests sent to the engine thread and not yet
//! started (prefill not begun); running sequences are bounded by the
//! scheduler's batch and KV memory instead.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::api::EngineError;

/// How a model's engine schedules and bounds its work (`[scheduler]`).
#[derive(Debug, Clone)]
pub struct SchedulingOptions {
    /// Most sequences decoded together in one step.
    pub max_batch: usize,
    /// Most requests waiting to start; more are refused as overload.
    pub max_queued: usize,
    /// The fraction of `max_queued` one tenant's waiting requests may fill.
    pub tenant_queue_share: f64,
    /// Prompt tokens prefilled per engine step while other sequences decode
    /// (chunked prefill); a prompt alone is prefilled in larger chunks.
    pub prefill_chunk: usize,
    /// Bytes the running sequences' KV caches may hold; past it the newest
    /// sequence is preempted (its cache dropped, recomputed when resumed).
    pub kv_cache_bytes: usize,
    /// Weighted-fair shares of the engine between tenants (default 1 each).
    pub tenant_weights: HashMap<String, u32>,
}

impl Default for SchedulingOptions {
    fn default() -> Self {
        SchedulingOptions {
            max_batch: 16,
            max_queued: 64,
            tenant_queue_share: 0.5,
            prefill_chunk: 16,
            kv_cache_bytes: 4 << 30,
            tenant_weights: HashMap::new(),
        }
    }
}

impl SchedulingOptions {
    /// A tenant's weight in the fair order.
    pub fn weight(&self, tenant: Option<&str>) -> u32 {
        tenant
            .and_then(|t| self.tenant_weights.get(t))
            .copied()
            .unwrap_or(1)
            .max(1)
    }

    /// Most waiting requests one tenant may have.
    fn tenant_cap(&self) -> usize {
        ((self.max_queued as f64 * self.tenant_queue_share).floor() as usize).max(1)
    }
}

/// A model's admission state, shared by its handles and its engine thread.
#[derive(Debug)]
pub struct Admission {
    max_queued: usize,
    tenant_cap: usize,
    max_batch: usize,
    /// The KV memory running sequences may hold (for the gauges).
    kv_limit: u64,
    waiting: Mutex<Waiting>,
    /// Recent time a request spent in the engine, admission to its end
    /// (an exponential moving average, microseconds; 0 before the first).
    service_micros: AtomicU64,
    pub(super) counters: AdmissionCounters,
}

#[derive(Debug, Default)]
struct Waiting {
    total: usize,
    by_tenant: HashMap<Option<String>, usize>,
}

/// What `/metrics` reports of a model's scheduling.
#[derive(Debug, Default)]
pub struct AdmissionCounters {
    pub rejected_overloaded: AtomicU64,
    pub rejected_tenant_share: AtomicU64,
    pub preempted: AtomicU64,
    /// Sequences running (decoding or prefilling) after the last step.
    pub running: AtomicU64,
    /// KV cache bytes those hold.
    pub kv_bytes: AtomicU64,
}

/// A snapshot of [`Admission`] for metrics and routers.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueStats {
    pub waiting: usize,
    pub max_queued: usize,
    pub rejected_overloaded: u64,
    pub rejected_tenant_share: u64,
    pub preempted: u64,
    pub running: u64,
    pub kv_bytes: u64,
    /// `[scheduler] kv_cache_mb`, in bytes.
    pub kv_limit: u64,
}

impl Admission {
    pub fn new(options: &SchedulingOptions) -> Arc<Admission> {
        Arc::new(Admission {
            max_queued: options.max_queued,
            tenant_cap: options.tenant_cap(),
            max_batch: options.max_batch.max(1),
            kv_limit: options.kv_cache_bytes as u64,
            waiting: Mutex::default(),
            service_micros: AtomicU64::new(0),
            counters: AdmissionCounters::default(),
        })
    }

    /// Takes a place in the queue for `tenant`'s request, or says why not.
    pub fn enter(self: &Arc<Self>, tenant: Option<&str>) -> Result<Ticket, EngineError> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if waiting.total >= self.max_queued {
            self.counters
                .rejected_overloaded
                .fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::Overloaded {
                waiting: waiting.total,
                retry_after: self.retry_after(waiting.total),
            });
        }
        let key = tenant.map(str::to_owned);
        let mine = waiting.by_tenant.get(&key).copied().unwrap_or(0);
        // Requests without a tenant (open inference, in-process callers)
        // are one anonymous crowd: only the queue's bound holds them.
        if key.is_some() && mine >= self.tenant_cap {
            self.counters
                .rejected_tenant_share
                .fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::TenantQueueFull {
                limit: self.tenant_cap,
                retry_after: self.retry_after(mine),
            });
        }
        waiting.total += 1;
        *waiting.by_tenant.entry(key.clone()).or_default() += 1;
        Ok(Ticket {
            admission: Arc::clone(self),
            tenant: key,
            entered: std::time::Instant::now(),
            waited: Arc::default(),
        })
    }

    /// Requests waiting to start.
    pub fn waiting(&self) -> usize {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).total
    }

    pub fn stats(&self) -> QueueStats {
        let c = &self.counters;
        QueueStats {
            waiting: self.waiting(),
            max_queued: self.max_queued,
            rejected_overloaded: c.rejected_overloaded.load(Ordering::Relaxed),
            rejected_tenant_share: c.rejected_tenant_share.load(Ordering::Relaxed),
            preempted: c.preempted.load(Ordering::Relaxed),
            running: c.running.load(Ordering::Relaxed),
            kv_bytes: c.kv_bytes.load(Ordering::Relaxed),
            kv_limit: self.kv_limit,
        }
    }

    /// What the engine holds after a step, for the gauges.
    pub(super) fn publish_load(&self, running: usize, kv_bytes: usize) {
        let c = &self.counters;
        c.running.store(running as u64, Ordering::Relaxed);
        c.kv_bytes.store(kv_bytes as u64, Ordering::Relaxed);
    }

    /// Records how long a finished request took in the engine.
    pub(super) fn record_service(&self, took: Duration) {
        let sample = took.as_micros().min(u64::MAX as u128) as u64;
        let old = self.service_micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            (old * 7 + sample) / 8
        };
        self.service_micros.store(new, Ordering::Relaxed);
    }

    /// A fair wait before retrying, with `ahead` requests queued before the
    /// caller: the batches they make times a recent request's time, in whole
    /// seconds from 1 to 60.
    fn retry_after(&self, ahead: usize) -> Duration {
        let each = Duration::from_micros(self.service_micros.load(Ordering::Relaxed));
        let batches = (ahead / self.max_batch + 1) as u32;
        let secs = (each * batches).as_secs_f64().ceil() as u64;
        Duration::from_secs(secs.clamp(1, 60))
    }

    fn leave(&self, tenant: &Option<String>) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.total = waiting.total.saturating_sub(1);
        if let Some(count) = waiting.by_tenant.get_mut(tenant) {
            *count -= 1;
            if *count == 0 {
                waiting.by_tenant.remove(tenant);
            }
        }
    }
}

/// A request's place in its model's queue, given up when dropped: when the
/// engine starts the request (or drops it).
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    tenant: Option<String>,
    entered: std::time::Instant,
    /// How long the request waited, set when it gives up its place (it
    /// starts, or is dropped); its stream reads it (queue-wait metrics).
    waited: Arc<std::sync::OnceLock<std::time::Duration>>,
}

impl Ticket {
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// Where the wait is written when the ticket is given up.
    pub fn waited(&self) -> Arc<std::sync::OnceLock<std::time::Duration>> {
        Arc::clone(&self.waited)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let _ = self.waited.set(self.entered.elapsed());
        self.admission.leave(&self.tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(max_queued: usize, share: f64) -> SchedulingOptions {
        SchedulingOptions {
            max_queued,
            tenant_queue_share: share,
            max_batch: 4,
            ..SchedulingOptions::default()
        }
    }

    #[test]
    fn a_full_queue_refuses_with_a_wait_and_frees_places_as_tickets_drop() {
        let admission = Admission::new(&options(3, 1.0));
        let tickets: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|t| admission.enter(Some(t)).unwrap())
            .collect();
        assert_eq!(admission.waiting(), 3);
        match admission.enter(Some("d")) {
            Err(EngineError::Overloaded {
                waiting,
                retry_after,
            }) => {
                assert_eq!(waiting, 3);
                assert!(retry_after >= Duration::from_secs(1));
            }
            other => panic!("expected overload, got {other:?}"),
        }
        drop(tickets);
        assert_eq!(admission.waiting(), 0);
        assert!(admission.enter(Some("d")).is_ok());
        assert_eq!(admission.stats().rejected_overloaded, 1);
    }

    #[test]
    fn one_tenant_holds_at_most_its_share_and_others_still_get_in() {
        let admission = Admission::new(&options(8, 0.5));
        let flood: Vec<_> = (0..4)
            .map(|_| admission.enter(Some("a")).unwrap())
            .collect();
        assert!(matches!(
            admission.enter(Some("a")),
            Err(EngineError::TenantQueueFull { limit: 4, .. })
        ));
        let other = admission.enter(Some("b")).expect("another tenant gets in");
        assert_eq!(admission.waiting(), 5);
        // Without a tenant, only the queue's bound applies.
        let anonymous: Vec<_> = (0..3).map(|_| admission.enter(None).unwrap()).collect();
        assert!(matches!(
            admission.enter(None),
            Err(EngineError::Overloaded { .. })
        ));
        drop((flood, other, anonymous));
        assert_eq!(admission.stats().rejected_tenant_share, 1);
    }

    #[test]
    fn the_wait_grows_with_the_queue_and_the_recent_service_time() {
        let admission = Admission::new(&options(100, 1.0));
        admission.record_service(Duration::from_millis(2500));
        assert_eq!(admission.retry_after(0), Duration::from_secs(3));
        // 9 ahead in batches of 4: three batches of 2.5 s.
        assert_eq!(admission.retry_after(9), Duration::from_secs(8));
        admission.record_service(Duration::from_secs(1000));
        assert_eq!(admission.retry_after(1000), Duration::from_secs(60));
    }
}
