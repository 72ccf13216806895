//! One inference request's accounting: its rate limits checked before it
//! is routed ([`admit`]), then its tokens charged to them as they are read
//! and produced, and at its end counted in `/metrics` and the usage ledger
//! with its latencies ([`Meter`]). The remaining quota goes back to the
//! client as OpenAI's `x-ratelimit-*` headers ([`QuotaSlot`]).
//!
//! A local answer is metered by observing its generation streams (each
//! token as it comes, the prompt when it is queued); a proxied one when its
//! usage passes through (`upstream_usage.rs`), at its end.
//!
//! A local answer that is not streamed also says where its time went, in
//! a `Server-Timing` header ([`Meter::timed`]).
//!
//! `GET /admin/usage?tenant=&from=&to=` reports the ledger ([`routes`]).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use serde_json::json;

use super::body::{self, Body, ReqBody};
use super::metrics::{Histogram, Timings};
use super::{ApiError, AppState, Caller, Ctx, Route};
use crate::app::usage::RequestUsage;
use crate::engine::{GenerateEvent, GenerationStream};
use crate::limits::{Headroom, Plan, Quota};

/// Where [`admit`] leaves the caller's remaining quota for the answer's
/// headers (in the request's extensions; the dispatcher writes them).
#[derive(Debug, Clone, Default)]
pub struct QuotaSlot(Arc<OnceLock<Quota>>);

impl QuotaSlot {
    pub fn get(&self) -> Option<&Quota> {
        self.0.get()
    }
}

/// What is left of `caller`'s limits for `model`, as a router sees it
/// (`caller-quota`): looked up only when the bound router may read it.
pub async fn peek(state: &AppState, caller: Option<&Caller>, model: &str) -> crate::policy::Quota {
    let limits = &state.app.limits;
    let Some(plan) = caller.and_then(|c| limits.plan(&c.key_id, model)) else {
        return crate::policy::Quota::default();
    };
    if !state.app.router_reads_quota().await {
        return crate::policy::Quota::default();
    }
    let q = limits.peek(plan).await;
    crate::policy::Quota {
        requests_per_minute: q.requests.map(|h| h.remaining),
        tokens_per_minute: q.tokens.map(|h| h.remaining),
        daily_tokens: q.daily_tokens.map(|h| h.remaining),
    }
}

/// Checks the limits of `caller`'s requests for `model` and takes this
/// request from them: the plan its tokens are charged to (`None`: no
/// limits apply), or 429/503. The quota left is put in `slot` either way.
pub async fn admit(
    state: &AppState,
    caller: Option<&Caller>,
    model: &str,
    slot: Option<&QuotaSlot>,
) -> Result<Option<Arc<Plan>>, ApiError> {
    let limits = &state.app.limits;
    let Some(plan) = caller.and_then(|c| limits.plan(&c.key_id, model)) else {
        return Ok(None);
    };
    let result = limits.admit(plan).await;
    let quota = match &result {
        Ok(q) => Some(q),
        Err(e) => e.quota(),
    };
    if let (Some(slot), Some(q)) = (slot, quota) {
        let _ = slot.0.set(*q);
    }
    result?;
    Ok(Some(Arc::clone(plan)))
}

static LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
static REMAINING_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
static RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
static LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
static REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
static RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
static LIMIT_DAILY: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens-day");
static REMAINING_DAILY: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens-day");
static RESET_DAILY: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens-day");

/// OpenAI's rate-limit headers for `quota` (the daily budget in
/// `-tokens-day` headers of the same form): the limit, what remains, and
/// the time until it is whole again as a Go duration (`1s`, `6m0s`).
pub fn write_headers(headers: &mut HeaderMap, quota: &Quota) {
    let kinds = [
        (
            quota.requests,
            [&LIMIT_REQUESTS, &REMAINING_REQUESTS, &RESET_REQUESTS],
        ),
        (
            quota.tokens,
            [&LIMIT_TOKENS, &REMAINING_TOKENS, &RESET_TOKENS],
        ),
        (
            quota.daily_tokens,
            [&LIMIT_DAILY, &REMAINING_DAILY, &RESET_DAILY],
        ),
    ];
    headers.reserve(9);
    for (headroom, [limit, remaining, reset]) in kinds {
        let Some(Headroom {
            limit: l,
            remaining: r,
            reset_us,
        }) = headroom
        else {
            continue;
        };
        headers.insert(limit.clone(), limit_value(l));
        headers.insert(remaining.clone(), HeaderValue::from(r));
        // The text moves into the value, not copied.
        let text = bytes::Bytes::from(go_duration(reset_us));
        if let Ok(v) = HeaderValue::from_maybe_shared(text) {
            headers.insert(reset.clone(), v);
        }
    }
}

/// A limit as a header value. Limits are few and fixed, so each is made
/// once per serving thread and shared after (a clone shares its bytes).
fn limit_value(limit: u64) -> HeaderValue {
    thread_local! {
        static MADE: std::cell::RefCell<Vec<(u64, HeaderValue)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    MADE.with_borrow_mut(|made| {
        if let Some((_, v)) = made.iter().find(|(l, _)| *l == limit) {
            return v.clone();
        }
        let v = HeaderValue::from(limit);
        if made.len() < 64 {
            made.push((limit, v.clone()));
        }
        v
    })
}

/// `us` microseconds as Go prints a duration, to the millisecond: `250ms`,
/// `1.5s`, `6m0s`, `1h2m3s`. Integer arithmetic only (a float's formatting
/// costs more than the rest of a request's limits).
fn go_duration(us: f64) -> String {
    use std::fmt::Write;
    let ms = (us.max(0.0) / 1e3).round() as u64;
    let mut out = String::with_capacity(16);
    if ms < 1000 {
        let _ = write!(out, "{ms}ms");
        return out;
    }
    let (h, m, s, frac) = (
        ms / 3_600_000,
        ms % 3_600_000 / 60_000,
        ms % 60_000 / 1000,
        ms % 1000,
    );
    if h > 0 {
        let _ = write!(out, "{h}h");
    }
    if h > 0 || m > 0 {
        let _ = write!(out, "{m}m");
    }
    let _ = write!(out, "{s}");
    if frac > 0 {
        // Milliseconds without trailing zeros: .5, .25, .125.
        let mut digits = format!("{frac:03}");
        while digits.ends_with('0') {
            digits.pop();
        }
        let _ = write!(out, ".{digits}");
    }
    out.push('s');
    out
}

// ----------------------------------------------------------------- report

/// `GET /admin/usage`.
pub fn routes() -> Vec<Route> {
    vec![Route::new(Method::GET, "/admin/usage", |cx, req| {
        Box::pin(usage_report(cx, req))
    })]
}

/// Tokens and requests per day, tenant, key, model and backend, for days
/// `from..=to` (`YYYY-MM-DD`, UTC; both default to today), of one
/// `tenant` or all, with their totals.
async fn usage_report(
    cx: Ctx,
    req: Request<ReqBody>,
) -> Result<http::Response<body::Body>, ApiError> {
    let q = body::query_params(&req)?;
    let day = |name: &str| -> Result<String, ApiError> {
        match q.get(name) {
            None => Ok(crate::util::time::Date::today().iso()),
            Some(v) => crate::util::time::Date::parse_iso(v)
                .map(|d| d.iso())
                .ok_or_else(|| ApiError::InvalidRequest {
                    message: format!("'{name}' must be a date as YYYY-MM-DD (UTC), not `{v}`"),
                    param: Some(name.to_owned()),
                }),
        }
    };
    let (from, to) = (day("from")?, day("to")?);
    if from > to {
        return Err(ApiError::InvalidRequest {
            message: format!("'from' ({from}) is after 'to' ({to})"),
            param: Some("from".into()),
        });
    }
    let tenant = q.get("tenant").cloned();
    let ledger = std::sync::Arc::clone(&cx.state.app.usage);
    let (f, t, who) = (from.clone(), to.clone(), tenant.clone());
    let rows = tokio::task::spawn_blocking(move || ledger.report(who.as_deref(), &f, &t))
        .await
        .map_err(|e| ApiError::Internal(format!("usage report failed: {e}")))?
        .map_err(ApiError::Internal)?;
    let sum = |f: fn(&crate::app::usage::UsageRow) -> u64| rows.iter().map(f).sum::<u64>();
    let (prompt, completion) = (sum(|r| r.prompt_tokens), sum(|r| r.completion_tokens));
    let totals = json!({
        "requests": sum(|r| r.requests),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": sum(|r| r.cached_tokens),
        "total_tokens": prompt + completion,
    });
    body::json(
        StatusCode::OK,
        &json!({"object": "usage_report", "from": from, "to": to, "tenant": tenant, "totals": totals, "data": rows}),
    )
}

// ------------------------------------------------------------------ meter

/// One request's tokens and times; shared by every stream and body of its
/// answer, and counted when the last of them is done. Cloning shares it.
#[derive(Clone)]
pub struct Meter(Arc<Inner>);

struct Inner {
    state: Arc<AppState>,
    plan: Option<Arc<Plan>>,
    tenant: Arc<str>,
    key_id: Arc<str>,
    model: Arc<str>,
    started: Instant,
    tally: Mutex<Tally>,
    /// The request's span, kept open until the answer ends (traces on).
    span: tracing::Span,
}

#[derive(Default)]
struct Tally {
    /// `local`, or the upstream that answered.
    backend: Option<Arc<str>>,
    prompt: u64,
    completion: u64,
    cached: u64,
    /// Tokens counted but not yet charged to the limits (batched).
    uncharged: u64,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// When the first choice finished: where it gave no token (its first
    /// pick ended it), its prefill ends there.
    finished: Option<Instant>,
    inter_token: Histogram,
    /// When a local answer was queued, and how long it waited.
    queued_at: Option<Instant>,
    queue_wait: Option<Duration>,
}

/// A local answer's phases: waiting in the engine's queue, prefilling its
/// prompt (to the first token), decoding (to the last).
type Phases = [(&'static str, Instant, Instant); 3];

impl Tally {
    /// The phases so far; `None` before a local answer's first token (and
    /// for a proxied answer). An answer that ended at once (its first pick
    /// ended it) prefilled until it finished.
    fn phases(&self) -> Option<Phases> {
        let first = self.first_token.or(self.finished)?;
        let (queued, wait) = (self.queued_at?, self.queue_wait?);
        let started = queued + wait;
        let last = self.last_token.unwrap_or(first);
        Some([
            ("queue", queued, started),
            ("prefill", started, first),
            ("decode", first, last),
        ])
    }
}

impl Meter {
    /// The meter of a request that arrived at `started`, from `caller`,
    /// for `model`, served by `backend`, charging `plan`.
    pub fn new(
        state: &Arc<AppState>,
        caller: Option<&Caller>,
        (model, backend): (&str, &str),
        plan: Option<Arc<Plan>>,
        started: Instant,
    ) -> Meter {
        let (tenant, key_id) = match caller {
            Some(c) => (Arc::clone(&c.tenant), Arc::clone(&c.key_id)),
            None => (Arc::from(Caller::ANONYMOUS), Arc::from(Caller::ANONYMOUS)),
        };
        Meter(Arc::new(Inner {
            state: Arc::clone(state),
            plan,
            tenant,
            key_id,
            model: model.into(),
            started,
            tally: Mutex::new(Tally {
                backend: Some(backend_name(backend)),
                ..Tally::default()
            }),
            span: match super::telemetry::enabled() {
                true => tracing::Span::current(),
                false => tracing::Span::none(),
            },
        }))
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.0.tally.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds tokens to the tally with `count` and charges them to the
    /// limits once a batch is due.
    fn count(&self, tokens: u64, count: impl FnOnce(&mut Tally)) {
        let due = {
            let mut t = self.tally();
            count(&mut t);
            t.uncharged += tokens;
            let batch = self.0.state.app.limits.charge_batch();
            (t.uncharged >= batch).then(|| std::mem::take(&mut t.uncharged))
        };
        if let (Some(n), Some(plan)) = (due, &self.0.plan) {
            self.0.state.app.limits.charge(plan, n);
        }
    }

    /// Prompt tokens read (embeddings: every input token).
    pub fn prompt(&self, tokens: u64) {
        self.count(tokens, |t| t.prompt += tokens);
    }

    /// Watches a local answer's streams (one per choice): the prompt is
    /// counted now, once; each choice's tokens as they come.
    pub fn watch(&self, streams: &mut [GenerationStream]) {
        if let Some(first) = streams.first() {
            self.prompt(first.prompt_tokens() as u64);
            self.tally().queued_at = Some(Instant::now());
        }
        for (i, stream) in streams.iter_mut().enumerate() {
            let meter = self.clone();
            let mut seen = 0u64;
            let mut last: Option<Instant> = None;
            stream.observe(Box::new(move |event, queue_wait| match event {
                Ok(GenerateEvent::Delta { generated, .. }) if *generated as u64 > seen => {
                    let n = *generated as u64 - seen;
                    seen += n;
                    let now = Instant::now();
                    let gap = last.map(|l| now.duration_since(l).as_secs_f64() / n as f64);
                    last = Some(now);
                    meter.count(n, |t| {
                        t.completion += n;
                        t.first_token.get_or_insert(now);
                        t.last_token = Some(now);
                        if i == 0 && t.queue_wait.is_none() {
                            t.queue_wait = queue_wait;
                        }
                        if let Some(gap) = gap {
                            (0..n).for_each(|_| t.inter_token.observe(gap));
                        }
                    });
                }
                Ok(GenerateEvent::Finished { usage, .. }) => {
                    // Tokens after the last delta (held back, then dropped
                    // with a stop string).
                    let rest = (usage.completion_tokens as u64).saturating_sub(seen);
                    let cached = if i == 0 {
                        usage.cached_tokens as u64
                    } else {
                        0
                    };
                    let now = Instant::now();
                    meter.count(rest, |t| {
                        t.completion += rest;
                        t.cached += cached;
                        if i == 0 {
                            t.finished.get_or_insert(now);
                            t.queue_wait = t.queue_wait.or(queue_wait);
                        }
                    });
                }
                _ => {}
            }));
        }
    }

    /// The upstream answering (its name); its first byte is the answer's
    /// first token as far as latency goes.
    pub fn answered_by(&self, upstream: &str) {
        let mut t = self.tally();
        if t.backend.as_deref() != Some(upstream) {
            t.backend = Some(upstream.into());
        }
        t.first_token.get_or_insert_with(Instant::now);
    }

    /// `resp` (a local answer, read to its end) with a `Server-Timing`
    /// header (W3C; milliseconds): `prepare` (from the request's arrival to
    /// its queueing: routing, chat template, tokens), `queue`, `prefill`,
    /// `decode`, and `total` (arrival to now). Browsers' developer tools
    /// show it; benchmarks read the server's own prefill from it.
    pub fn timed(&self, mut resp: Response<Body>) -> Response<Body> {
        let value = {
            let t = self.tally();
            let (Some(phases), Some(queued)) = (t.phases(), t.queued_at) else {
                return resp;
            };
            let ms =
                |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1e3;
            let mut value = format!("prepare;dur={:.2}", ms(self.0.started, queued));
            for (name, from, to) in phases {
                let _ = write!(value, ", {name};dur={:.2}", ms(from, to));
            }
            let _ = write!(
                value,
                ", total;dur={:.2}",
                ms(self.0.started, Instant::now())
            );
            value
        };
        if let Ok(value) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert("server-timing", value);
        }
        resp
    }

    /// A proxied answer's usage, as the upstream reported it.
    pub fn upstream_usage(&self, prompt: u64, completion: u64) {
        self.count(prompt + completion, |t| {
            t.prompt += prompt;
            t.completion += completion;
        });
    }
}

/// A backend's name, shared: `local` and each upstream's name are made
/// once per serving thread and cloned after (a request's accounting copies
/// no strings, and takes no lock other threads contend for).
fn backend_name(name: &str) -> Arc<str> {
    thread_local! {
        static NAMES: std::cell::RefCell<Vec<Arc<str>>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    NAMES.with_borrow_mut(|names| {
        if let Some(n) = names.iter().find(|n| &***n == name) {
            return Arc::clone(n);
        }
        let n: Arc<str> = name.into();
        // Upstream names come from the config: few. Past that, stop keeping.
        if names.len() < 256 {
            names.push(Arc::clone(&n));
        }
        n
    })
}

impl Drop for Inner {
    fn drop(&mut self) {
        let t = std::mem::take(self.tally.get_mut().unwrap_or_else(|p| p.into_inner()));
        let phases = t.phases();
        let app = &self.state.app;
        if let Some(plan) = &self.plan {
            app.limits.charge(plan, t.uncharged);
        }
        let usage = RequestUsage {
            tenant: Arc::clone(&self.tenant),
            key_id: Arc::clone(&self.key_id),
            model: Arc::clone(&self.model),
            backend: t.backend.unwrap_or_else(|| backend_name("local")),
            prompt_tokens: t.prompt,
            completion_tokens: t.completion,
            cached_tokens: t.cached,
        };
        let timings = Timings {
            first_token: t
                .first_token
                .map(|f| f.duration_since(self.started).as_secs_f64()),
            inter_token: t.inter_token,
            end_to_end: self.started.elapsed().as_secs_f64(),
            queue_wait: t.queue_wait.map(|d| d.as_secs_f64()),
        };
        self.state.metrics.record_request(&usage, &timings);
        app.usage.record(&usage);
        if let Some(phases) = phases {
            super::telemetry::record_phases(&self.span, &phases);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_prints_them() {
        assert_eq!(go_duration(250e3), "250ms");
        assert_eq!(go_duration(1.5e6), "1.5s");
        assert_eq!(go_duration(20e6), "20s");
        assert_eq!(go_duration(360e6), "6m0s");
        assert_eq!(go_duration(3723e6), "1h2m3s");
        assert_eq!(go_duration(-5.0), "0ms");
        assert_eq!(go_duration(61_250e3), "1m1.25s");
        assert_eq!(go_duration(66_185_991e3), "18h23m5.991s");
    }
}
