//! The arithmetic of every limit: GCRA (the generic cell rate algorithm)
//! for requests and tokens per minute, and a calendar-day counter for daily
//! token budgets. Pure functions over a counter's state and the time, so the
//! embedded store and the Redis script (`redis_store.rs`, a line-by-line
//! port) decide alike.
//!
//! GCRA keeps one number per rate, the *theoretical arrival time* (TAT):
//! the moment the counter would be empty again if nothing more came. A
//! cost of `c` moves it `c` emission intervals (`60 s / limit`) later; a
//! request is allowed while the TAT stays within one period of now. So a
//! fresh counter takes `limit` requests at once, then one more every
//! interval: a token bucket of `limit` cells refilled continuously, with
//! one float of state.
//!
//! Tokens are charged *after* they are produced, which a request cannot
//! be refused for, so the token TAT may run past the period (debt); a
//! request is admitted while at least one token of room is left. That is
//! why this is not `governor`: its GCRA refuses a cost that does not fit
//! and cannot record one after the fact, and it cannot check several
//! counters (key, tenant, model) all-or-nothing, which both stores here do.
//!
//! Times are microseconds since [`EPOCH_SECS`] as `f64`: small enough that
//! a double keeps sub-microsecond precision (Lua's numbers are doubles), so
//! limits count exactly up to about a thousand million a minute.

/// The period of the per-minute rates, in microseconds.
pub const PERIOD_US: f64 = 60e6;

/// The origin of the time scale (2025-01-01T00:00:00Z): recent, so times
/// stay near 1e14 µs, where a double resolves nanoseconds.
pub const EPOCH_SECS: u64 = 1_735_689_600;

/// How early a request may be, for the rounding of the float sums: half a
/// microsecond, or half an interval for limits over a hundred million a
/// minute (doubles near 1e14 still resolve a few nanoseconds).
fn slack(interval: f64) -> f64 {
    (interval / 2.0).min(0.5)
}

/// Microseconds in a day (daily budgets reset at 00:00 UTC).
pub const DAY_US: f64 = 86_400e6;

/// What the limits of one counter are; `None` is no limit of that kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rates {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub daily_tokens: Option<u64>,
}

impl Rates {
    pub fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.daily_tokens.is_none()
    }
}

/// One counter's state; all zero is a fresh counter.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct State {
    /// TAT of requests.
    pub request_tat: f64,
    /// TAT of tokens (may run ahead of the period: debt).
    pub token_tat: f64,
    /// The UTC day `day_tokens` counts (days since the time scale's origin).
    pub day: i64,
    pub day_tokens: u64,
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    RequestsPerMinute,
    TokensPerMinute,
    DailyTokens,
}

/// A refusal: which limit, and how long until a request would pass it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusal {
    pub kind: LimitKind,
    pub limit: u64,
    pub retry_after_us: f64,
}

fn interval(limit: u64) -> f64 {
    PERIOD_US / limit as f64
}

/// The UTC day of `now`.
pub fn day_of(now: f64) -> i64 {
    (now / DAY_US).floor() as i64
}

/// Whether one more request passes `rates` in `state` at `now`: `Ok` with
/// the request's new TAT (to store when every counter of the request
/// passes), or the refusal that waits longest.
pub fn admit(state: &State, rates: &Rates, now: f64) -> Result<f64, Refusal> {
    let mut refusal: Option<Refusal> = None;
    let mut refuse = |r: Refusal| {
        if refusal.is_none_or(|old| r.retry_after_us > old.retry_after_us) {
            refusal = Some(r);
        }
    };
    if let Some(budget) = rates.daily_tokens
        && used_today(state, now) >= budget
    {
        let next_day = (day_of(now) + 1) as f64 * DAY_US;
        refuse(Refusal {
            kind: LimitKind::DailyTokens,
            limit: budget,
            retry_after_us: next_day - now,
        });
    }
    if let Some(tpm) = rates.tokens_per_minute {
        let t = interval(tpm);
        let used = state.token_tat.max(now) - now;
        if PERIOD_US - used < t - slack(t) {
            refuse(Refusal {
                kind: LimitKind::TokensPerMinute,
                limit: tpm,
                retry_after_us: used - (PERIOD_US - t),
            });
        }
    }
    let mut request_tat = state.request_tat;
    if let Some(rpm) = rates.requests_per_minute {
        let t = interval(u64::from(rpm));
        let next = state.request_tat.max(now) + t;
        if next - now > PERIOD_US + slack(t) {
            refuse(Refusal {
                kind: LimitKind::RequestsPerMinute,
                limit: u64::from(rpm),
                retry_after_us: next - now - PERIOD_US,
            });
        }
        request_tat = next;
    }
    match refusal {
        Some(r) => Err(r),
        None => Ok(request_tat),
    }
}

/// Charges `tokens` produced at `now` to `state`.
pub fn charge(state: &mut State, rates: &Rates, tokens: u64, now: f64) {
    if let Some(tpm) = rates.tokens_per_minute {
        state.token_tat = state.token_tat.max(now) + tokens as f64 * interval(tpm);
    }
    if rates.daily_tokens.is_some() {
        let day = day_of(now);
        if state.day != day {
            state.day = day;
            state.day_tokens = 0;
        }
        state.day_tokens += tokens;
    }
}

fn used_today(state: &State, now: f64) -> u64 {
    if state.day == day_of(now) {
        state.day_tokens
    } else {
        0
    }
}

/// How much of one limit is left, as OpenAI's `x-ratelimit-*` headers say
/// it: the limit, what remains of it, and the time until it is whole again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Headroom {
    pub limit: u64,
    pub remaining: u64,
    pub reset_us: f64,
}

/// What is left of `rates` in `state` at `now`, per kind.
pub fn headroom(state: &State, rates: &Rates, now: f64) -> [Option<Headroom>; 3] {
    let rate = |tat: f64, limit: u64| {
        let t = interval(limit);
        let used = tat.max(now) - now;
        Headroom {
            limit,
            remaining: (((PERIOD_US - used + slack(t)) / t).floor().max(0.0) as u64).min(limit),
            reset_us: used,
        }
    };
    [
        rates
            .requests_per_minute
            .map(|l| rate(state.request_tat, u64::from(l))),
        rates.tokens_per_minute.map(|l| rate(state.token_tat, l)),
        rates.daily_tokens.map(|budget| Headroom {
            limit: budget,
            remaining: budget.saturating_sub(used_today(state, now)),
            reset_us: (day_of(now) + 1) as f64 * DAY_US - now,
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: f64 = 3.0e13;

    fn rpm(n: u32) -> Rates {
        Rates {
            requests_per_minute: Some(n),
            ..Rates::default()
        }
    }

    #[test]
    fn a_fresh_counter_takes_the_limit_at_once_then_one_per_interval() {
        let mut s = State::default();
        for _ in 0..7 {
            s.request_tat = admit(&s, &rpm(7), NOW).unwrap();
        }
        let r = admit(&s, &rpm(7), NOW).unwrap_err();
        assert_eq!(r.kind, LimitKind::RequestsPerMinute);
        let t = PERIOD_US / 7.0;
        assert!((r.retry_after_us - t).abs() < 1.0, "{r:?}");
        assert!(admit(&s, &rpm(7), NOW + t - 10.0).is_err());
        assert!(admit(&s, &rpm(7), NOW + t).is_ok());
        let [req, _, _] = headroom(&s, &rpm(7), NOW);
        let req = req.unwrap();
        assert_eq!((req.limit, req.remaining), (7, 0));
        assert!((req.reset_us - PERIOD_US).abs() < 1.0);
    }

    #[test]
    fn tokens_are_charged_after_the_fact_and_debt_delays_the_next_request() {
        let rates = Rates {
            tokens_per_minute: Some(60),
            ..Rates::default()
        };
        let mut s = State::default();
        admit(&s, &rates, NOW).unwrap();
        charge(&mut s, &rates, 59, NOW);
        assert!(admit(&s, &rates, NOW).is_ok(), "one token of room is left");
        assert_eq!(headroom(&s, &rates, NOW)[1].unwrap().remaining, 1);
        charge(&mut s, &rates, 11, NOW);
        let r = admit(&s, &rates, NOW).unwrap_err();
        // 70 tokens used of 60 a minute at one a second: 11 s until one is free.
        assert!((r.retry_after_us - 11e6).abs() < 1.0, "{r:?}");
        assert_eq!(headroom(&s, &rates, NOW)[1].unwrap().remaining, 0);
        assert!(admit(&s, &rates, NOW + 11e6).is_ok());
    }

    #[test]
    fn daily_budgets_reset_at_midnight_utc() {
        let rates = Rates {
            daily_tokens: Some(100),
            ..Rates::default()
        };
        let midnight = (day_of(NOW) + 1) as f64 * DAY_US;
        let mut s = State::default();
        charge(&mut s, &rates, 100, midnight - 5e6);
        let r = admit(&s, &rates, midnight - 5e6).unwrap_err();
        assert_eq!(r.kind, LimitKind::DailyTokens);
        assert!((r.retry_after_us - 5e6).abs() < 1.0);
        assert!(admit(&s, &rates, midnight).is_ok());
        assert_eq!(headroom(&s, &rates, midnight)[2].unwrap().remaining, 100);
    }

    #[test]
    fn huge_limits_never_report_more_than_the_limit() {
        let rates = Rates {
            requests_per_minute: Some(1_000_000_000),
            tokens_per_minute: Some(1_000_000_000),
            daily_tokens: None,
        };
        let mut s = State::default();
        s.request_tat = admit(&s, &rates, NOW).unwrap();
        charge(&mut s, &rates, 2, NOW);
        let [r, t, _] = headroom(&s, &rates, NOW);
        assert_eq!(r.unwrap().remaining, 999_999_999);
        assert_eq!(t.unwrap().remaining, 999_999_998);
        // Fresh: the limit, not a few more for the rounding slack.
        let [r, t, _] = headroom(&State::default(), &rates, NOW);
        assert_eq!(
            (r.unwrap().remaining, t.unwrap().remaining),
            (1_000_000_000, 1_000_000_000)
        );
    }

    #[test]
    fn the_longest_wait_is_reported() {
        let rates = Rates {
            requests_per_minute: Some(1),
            tokens_per_minute: Some(60),
            daily_tokens: None,
        };
        let mut s = State::default();
        s.request_tat = admit(&s, &rates, NOW).unwrap();
        charge(&mut s, &rates, 65, NOW);
        let r = admit(&s, &rates, NOW).unwrap_err();
        assert_eq!(r.kind, LimitKind::RequestsPerMinute);
        assert!((r.retry_after_us - 60e6).abs() < 1.0);
    }
}
