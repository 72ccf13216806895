//! Whether an upstream takes a request now: its circuit breaker, the wait
//! it asked for (`Retry-After`), its in-flight cap; and what the router and
//! the admin see of it (health, last error, recent latency).
//!
//! The breaker opens after `breaker_failures` consecutive failures
//! (unreachable, no answer in time, 5xx, a failed health check) and stays
//! open `breaker_cooldown_secs`; then one request (or health check) is let
//! through as a probe: success closes the circuit, failure opens it again.
//! A 429 is not a failure of the upstream, only a request to wait: its
//! `Retry-After` keeps requests away until then, as an open circuit does.
//! Pure state over `Instant`s, so it is tested without a clock.

use std::time::{Duration, Instant};

/// Longest `Retry-After` honoured; a longer one waits this long.
pub(super) const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// After a failure an upstream reports unhealthy for this long (or until a
/// request succeeds), so routers that avoid unhealthy backends retry it later.
const UNHEALTHY_FOR: Duration = Duration::from_secs(10);
/// Weight of the newest answer in the latency average.
const LATENCY_WEIGHT: f64 = 0.2;

/// The breaker's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct BreakerSettings {
    /// Consecutive failures that open the circuit (0: never opens).
    pub(super) failures: u32,
    pub(super) cooldown: Duration,
    /// Most requests in flight at once (`None`: no cap).
    pub(super) max_in_flight: Option<u32>,
    /// How long a probe may run before another may start (the upstream's
    /// timeout: a probe whose outcome never comes must not block forever).
    pub(super) probe_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Circuit {
    Closed,
    Open {
        until: Instant,
    },
    /// Cooled down; a probe started at `since` decides.
    HalfOpen {
        since: Instant,
    },
}

/// Why an upstream was passed over without being asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Skip {
    /// A fixed phrase for the client.
    pub reason: &'static str,
    /// When it may be asked again, if known.
    pub retry_after: Option<Duration>,
}

/// One upstream's state.
#[derive(Debug)]
pub(super) struct Breaker {
    settings: BreakerSettings,
    circuit: Circuit,
    consecutive_failures: u32,
    wait_until: Option<Instant>,
    last_error: Option<(String, Instant)>,
    last_ok: Option<Instant>,
    /// Moving average of the time to the answer's head, in milliseconds.
    latency_ms: Option<f64>,
}

impl Breaker {
    pub(super) fn new(settings: BreakerSettings) -> Breaker {
        Breaker {
            settings,
            circuit: Circuit::Closed,
            consecutive_failures: 0,
            wait_until: None,
            last_error: None,
            last_ok: None,
            latency_ms: None,
        }
    }

    /// Whether a request may go now, with `in_flight` already under way.
    /// Letting one through an open circuit that has cooled down makes it
    /// the probe.
    pub(super) fn admit(&mut self, now: Instant, in_flight: u32) -> Result<(), Skip> {
        match self.wait_until {
            Some(until) if until > now => {
                return Err(Skip {
                    reason: "it asked to wait (Retry-After)",
                    retry_after: Some(until - now),
                });
            }
            Some(_) => self.wait_until = None,
            None => {}
        }
        match self.circuit {
            Circuit::Open { until } if until > now => {
                return Err(Skip {
                    reason: "its circuit is open after repeated failures",
                    retry_after: Some(until - now),
                });
            }
            Circuit::Open { .. } => self.circuit = Circuit::HalfOpen { since: now },
            Circuit::HalfOpen { since } if now - since < self.settings.probe_timeout => {
                return Err(Skip {
                    reason: "a probe after repeated failures is under way",
                    retry_after: Some(self.settings.probe_timeout - (now - since)),
                });
            }
            Circuit::HalfOpen { .. } => self.circuit = Circuit::HalfOpen { since: now },
            Circuit::Closed => {}
        }
        if self
            .settings
            .max_in_flight
            .is_some_and(|max| in_flight >= max)
        {
            return Err(Skip {
                reason: "it is at its max_in_flight",
                retry_after: None,
            });
        }
        Ok(())
    }

    /// Whether `admit` may refuse: the circuit is not closed, a wait is
    /// pending, or in-flight requests are capped.
    pub(super) fn guards(&self) -> bool {
        !matches!(self.circuit, Circuit::Closed)
            || self.wait_until.is_some()
            || self.settings.max_in_flight.is_some()
    }

    /// An answer arrived (any status but 5xx) after `latency`.
    pub(super) fn succeeded(&mut self, now: Instant, latency: Option<Duration>) {
        self.consecutive_failures = 0;
        self.circuit = Circuit::Closed;
        self.last_ok = Some(now);
        if let Some(l) = latency {
            let ms = l.as_secs_f64() * 1e3;
            self.latency_ms = Some(match self.latency_ms {
                Some(avg) => avg + LATENCY_WEIGHT * (ms - avg),
                None => ms,
            });
        }
    }

    /// The upstream failed; `what` (which may name its address) is kept for
    /// the admin and the log.
    pub(super) fn failed(&mut self, now: Instant, what: String) {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.last_error = Some((what, now));
        let threshold = self.settings.failures;
        let reopen = matches!(self.circuit, Circuit::HalfOpen { .. })
            || (threshold > 0 && self.consecutive_failures >= threshold);
        if reopen {
            self.circuit = Circuit::Open {
                until: now + self.settings.cooldown,
            };
        }
    }

    /// The upstream asked to be left alone for `wait` (`Retry-After`).
    pub(super) fn wait(&mut self, now: Instant, wait: Duration) {
        let until = now + wait.min(MAX_RETRY_AFTER);
        self.wait_until = Some(self.wait_until.map_or(until, |u| u.max(until)));
    }

    /// Healthy: the circuit is closed and no failure came after the last
    /// success within [`UNHEALTHY_FOR`].
    pub(super) fn healthy(&self, now: Instant) -> bool {
        if !matches!(self.circuit, Circuit::Closed) {
            return false;
        }
        match &self.last_error {
            None => true,
            Some((_, at)) => self.last_ok.is_some_and(|ok| ok > *at) || now - *at > UNHEALTHY_FOR,
        }
    }

    /// `closed`, `open` or `half_open`.
    pub(super) fn circuit_name(&self) -> &'static str {
        match self.circuit {
            Circuit::Closed => "closed",
            Circuit::Open { .. } => "open",
            Circuit::HalfOpen { .. } => "half_open",
        }
    }

    pub(super) fn last_error(&self) -> Option<String> {
        self.last_error.as_ref().map(|(e, _)| e.clone())
    }

    pub(super) fn latency_ms(&self) -> Option<f64> {
        self.latency_ms
    }
}

/// `Retry-After` as seconds or an HTTP date, from `now` (`SystemTime` for
/// the date form); `None` when absent or unreadable.
pub(super) fn retry_after(value: &http::HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(BreakerSettings {
            failures: 3,
            cooldown: Duration::from_secs(30),
            max_in_flight: Some(2),
            probe_timeout: Duration::from_secs(5),
        })
    }

    #[test]
    fn opens_after_consecutive_failures_and_closes_after_a_good_probe() {
        let t0 = Instant::now();
        let mut b = breaker();
        for i in 0..2 {
            b.failed(t0, format!("boom {i}"));
            assert!(b.admit(t0, 0).is_ok());
        }
        b.succeeded(t0, None);
        for _ in 0..3 {
            b.failed(t0, "boom".into());
        }
        let skip = b.admit(t0, 0).unwrap_err();
        assert_eq!(skip.retry_after, Some(Duration::from_secs(30)));
        assert_eq!(b.circuit_name(), "open");
        assert!(!b.healthy(t0));
        // Cooled down: one probe goes, the next waits for its outcome.
        let later = t0 + Duration::from_secs(31);
        assert!(b.admit(later, 0).is_ok());
        assert_eq!(b.circuit_name(), "half_open");
        assert!(b.admit(later, 0).is_err());
        b.succeeded(later, Some(Duration::from_millis(20)));
        assert_eq!(b.circuit_name(), "closed");
        assert!(b.admit(later, 0).is_ok());
        assert!(b.healthy(later));
    }

    #[test]
    fn a_failed_probe_opens_the_circuit_again_and_a_lost_one_expires() {
        let t0 = Instant::now();
        let mut b = breaker();
        for _ in 0..3 {
            b.failed(t0, "boom".into());
        }
        let t1 = t0 + Duration::from_secs(31);
        assert!(b.admit(t1, 0).is_ok());
        b.failed(t1, "still down".into());
        assert!(b.admit(t1 + Duration::from_secs(29), 0).is_err());
        let t2 = t1 + Duration::from_secs(31);
        assert!(b.admit(t2, 0).is_ok());
        // The probe's outcome never came: after the probe timeout another goes.
        assert!(b.admit(t2 + Duration::from_secs(1), 0).is_err());
        assert!(b.admit(t2 + Duration::from_secs(6), 0).is_ok());
    }

    #[test]
    fn retry_after_and_max_in_flight_skip_without_failing() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.wait(t0, Duration::from_secs(2));
        let skip = b.admit(t0, 0).unwrap_err();
        assert_eq!(skip.retry_after, Some(Duration::from_secs(2)));
        assert!(b.admit(t0 + Duration::from_secs(2), 0).is_ok());
        let t3 = t0 + Duration::from_secs(3);
        assert!(b.admit(t3, 2).is_err() && b.admit(t3, 1).is_ok());
        b.wait(t0, Duration::from_secs(3600));
        let capped = b.admit(t0, 0).unwrap_err().retry_after.unwrap();
        assert_eq!(capped, MAX_RETRY_AFTER);
        assert_eq!(b.circuit_name(), "closed");
    }

    #[test]
    fn latency_is_a_moving_average() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.succeeded(t0, Some(Duration::from_millis(100)));
        b.succeeded(t0, Some(Duration::from_millis(200)));
        assert!((b.latency_ms().unwrap() - 120.0).abs() < 1e-6);
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let v = |s: &str| http::HeaderValue::from_str(s).unwrap();
        assert_eq!(retry_after(&v("7")), Some(Duration::from_secs(7)));
        let soon = std::time::SystemTime::now() + Duration::from_secs(60);
        let wait = retry_after(&v(&httpdate::fmt_http_date(soon))).unwrap();
        assert!(
            wait > Duration::from_secs(55) && wait <= Duration::from_secs(60),
            "{wait:?}"
        );
        assert_eq!(
            retry_after(&v("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&v("soon")), None);
    }
}
