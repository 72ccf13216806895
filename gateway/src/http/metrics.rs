//! Request metrics in the Prometheus text exposition format (0.0.4).
//!
//! Written by hand rather than with a metrics crate: the server needs one
//! counter and one histogram family with a fixed label set, which is a few
//! dozen lines, and it keeps the dependency tree (and two-core build) small.
//! Labels are the HTTP method (known methods only), the matched route
//! *pattern* (never the raw path) and the status, so cardinality is bounded
//! by the route table.
//!
//! Who may scrape is decided by [`authorize_scrape`] from the `[metrics]`
//! config section: a scrape token or an admin key, or, with no token set,
//! no credentials from loopback.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use http::{HeaderMap, Method};

use super::auth::{KeyHash, KeyStore, Scope};
use super::error::ApiError;
use crate::config::MetricsConfig;

/// Whether a `GET /metrics` may be answered. A bearer credential must be
/// the `[metrics]` scrape token or an admin key (401 or 403 otherwise).
/// Without one: 401 when a token is configured; else loopback peers pass
/// when `open_on_loopback`, and everyone else gets a 403 that says how to
/// configure a token. `peer` is the connection's (`None`: unknown).
pub fn authorize_scrape(
    config: &MetricsConfig,
    keys: &KeyStore,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> Result<(), ApiError> {
    if let Some(token) = super::auth::api_key(headers) {
        let token = token?;
        if config
            .token_sha256
            .is_some_and(|h| h.ct_eq(&KeyHash::of(token)))
        {
            return Ok(());
        }
        return match keys.lookup(token) {
            Some(k) if k.scopes.contains(&Scope::Admin) => Ok(()),
            Some(k) => Err(ApiError::InsufficientScope {
                key_id: k.id.clone(),
                scope: Scope::Admin,
            }),
            None => Err(ApiError::InvalidApiKey),
        };
    }
    if config.token_sha256.is_some() {
        return Err(ApiError::MissingApiKey);
    }
    let loopback = peer.ip().to_canonical().is_loopback();
    if config.open_on_loopback && loopback {
        return Ok(());
    }
    let who = if config.open_on_loopback {
        "GET /metrics answers loopback clients only while no scrape token is configured"
    } else {
        "GET /metrics needs credentials ([metrics] open_on_loopback = false)"
    };
    Err(ApiError::Forbidden {
        message: format!(
            "{who}. Set token_sha256 in the [metrics] section of the config (`mlxgate keys hash TOKEN` prints it) and scrape with Authorization: Bearer TOKEN, or use an admin key."
        ),
        code: "metrics_forbidden",
    })
}

/// Upper bounds of the latency buckets, in seconds. Inference requests run
/// for seconds, health checks for microseconds, hence the wide range.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Route label for requests that matched no route.
pub const UNMATCHED: &str = "unmatched";

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct SeriesKey {
    method: &'static str,
    route: &'static str,
    status: u16,
}

/// Counts of observations per latency bucket, their sum and number.
#[derive(Debug, Clone, Copy, Default)]
pub struct Histogram {
    count: u64,
    sum: f64,
    /// Non-cumulative counts per bucket; made cumulative when rendered.
    buckets: [u64; BUCKETS.len()],
}

impl Histogram {
    pub fn observe(&mut self, secs: f64) {
        self.count += 1;
        self.sum += secs;
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i] += 1;
        }
    }

    pub fn merge(&mut self, other: &Histogram) {
        self.count += other.count;
        self.sum += other.sum;
        for (a, b) in self.buckets.iter_mut().zip(other.buckets) {
            *a += b;
        }
    }

    /// Appends the series of `name` with labels `l` (`k="v",...`).
    fn render(&self, out: &mut String, name: &str, l: &str) {
        let mut cumulative = 0;
        for (bound, n) in BUCKETS.iter().zip(self.buckets.iter()) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{{l},le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{l},le=\"+Inf\"}} {}\n{name}_sum{{{l}}} {}\n{name}_count{{{l}}} {}",
            self.count, self.sum, self.count
        );
    }
}

/// Where a request's tokens went: its tenant, the model it was served as
/// and the backend that served it (`local` or an upstream); shared names.
type UsageKey = [std::sync::Arc<str>; 3];

#[derive(Debug, Default)]
struct UsageSeries {
    requests: u64,
    /// Prompt, completion and cached prompt tokens.
    tokens: [u64; 3],
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    /// Local models only: time waiting for the engine.
    queue: Histogram,
}

/// Most (tenant, model, backend) series kept; later combinations count
/// under the model `other` (clients name models, so their number is open).
const MAX_USAGE_SERIES: usize = 1000;

/// One finished request's latencies, in seconds.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    /// Time to the first token (local) or the answer's first byte (proxied).
    pub first_token: Option<f64>,
    /// The gaps between tokens.
    pub inter_token: Histogram,
    pub end_to_end: f64,
    pub queue_wait: Option<f64>,
}

#[derive(Debug, Default)]
pub struct Metrics {
    series: Mutex<BTreeMap<SeriesKey, Histogram>>,
    in_flight: AtomicI64,
    usage: Mutex<std::collections::HashMap<UsageKey, UsageSeries, crate::util::FnvBuild>>,
}

/// Keeps the in-flight gauge right even when a request future is dropped.
pub struct InFlight<'a>(&'a Metrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    pub fn start(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self)
    }

    pub fn observe(&self, method: &Method, route: &'static str, status: u16, elapsed: Duration) {
        let key = SeriesKey {
            method: method_label(method),
            route,
            status,
        };
        let mut map = self.series.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(key).or_default().observe(elapsed.as_secs_f64());
    }

    /// Counts one finished inference request: its tokens and latencies.
    pub fn record_request(&self, u: &crate::app::usage::RequestUsage, t: &Timings) {
        use std::sync::Arc;
        let mut key = [
            Arc::clone(&u.tenant),
            Arc::clone(&u.model),
            Arc::clone(&u.backend),
        ];
        let mut map = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= MAX_USAGE_SERIES && !map.contains_key(&key) {
            key[1] = "other".into();
        }
        let s = map.entry(key).or_default();
        s.requests += 1;
        s.tokens[0] += u.prompt_tokens;
        s.tokens[1] += u.completion_tokens;
        s.tokens[2] += u.cached_tokens;
        if let Some(v) = t.first_token {
            s.ttft.observe(v);
        }
        s.itl.merge(&t.inter_token);
        s.e2e.observe(t.end_to_end);
        if let Some(v) = t.queue_wait {
            s.queue.observe(v);
        }
    }

    /// Renders all series; `model_ready` is sampled by the caller at scrape time.
    pub fn render(&self, model_ready: bool) -> String {
        let map = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::with_capacity(1024 + map.len() * 1200);
        out.push_str(
            "# HELP mlxgate_http_requests_total HTTP requests answered, by method, matched route pattern and status.\n\
             # TYPE mlxgate_http_requests_total counter\n",
        );
        for (k, s) in map.iter() {
            let _ = writeln!(
                out,
                "mlxgate_http_requests_total{{{}}} {}",
                labels(k),
                s.count
            );
        }
        out.push_str(
            "# HELP mlxgate_http_request_duration_seconds Time from request head to response head, by method, matched route pattern and status.\n\
             # TYPE mlxgate_http_request_duration_seconds histogram\n",
        );
        for (k, s) in map.iter() {
            s.render(
                &mut out,
                "mlxgate_http_request_duration_seconds",
                &labels(k),
            );
        }
        drop(map);
        let _ = write!(
            out,
            "# HELP mlxgate_http_requests_in_flight Requests being handled now.\n\
             # TYPE mlxgate_http_requests_in_flight gauge\n\
             mlxgate_http_requests_in_flight {}\n\
             # HELP mlxgate_model_ready 1 when the model is loaded and the server is ready.\n\
             # TYPE mlxgate_model_ready gauge\n\
             mlxgate_model_ready {}\n",
            self.in_flight.load(Ordering::Relaxed),
            u8::from(model_ready)
        );
        self.render_usage(&mut out);
        out
    }

    /// The inference series: requests and tokens by tenant, model and
    /// backend; latency histograms by model and backend.
    fn render_usage(&self, out: &mut String) {
        let usage = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        if usage.is_empty() {
            return;
        }
        // In label order, so scrapes read alike.
        let map: BTreeMap<&UsageKey, &UsageSeries> = usage.iter().collect();
        let label = crate::util::prometheus_label;
        let full = |[tenant, model, backend]: &UsageKey| {
            format!(
                "tenant=\"{}\",model=\"{}\",backend=\"{}\"",
                label(tenant),
                label(model),
                label(backend)
            )
        };
        out.push_str(
            "# HELP mlxgate_requests_total Inference requests finished, by tenant, model and backend (local or the upstream).\n\
             # TYPE mlxgate_requests_total counter\n",
        );
        for (k, s) in map.iter() {
            let _ = writeln!(out, "mlxgate_requests_total{{{}}} {}", full(k), s.requests);
        }
        out.push_str(
            "# HELP mlxgate_tokens_total Tokens read and written, by tenant, model, backend and kind (prompt, completion; cached: prompt tokens served from a prompt cache).\n\
             # TYPE mlxgate_tokens_total counter\n",
        );
        for (k, s) in map.iter() {
            for (kind, n) in ["prompt", "completion", "cached"].iter().zip(s.tokens) {
                let _ = writeln!(
                    out,
                    "mlxgate_tokens_total{{{},kind=\"{kind}\"}} {n}",
                    full(k)
                );
            }
        }
        // Latencies by model and backend: tenants merged.
        let mut by_model: BTreeMap<(&str, &str), [Histogram; 4]> = BTreeMap::new();
        for (k, s) in map.iter() {
            let h = by_model.entry((&k[1], &k[2])).or_default();
            for (a, b) in h.iter_mut().zip([&s.ttft, &s.itl, &s.e2e, &s.queue]) {
                a.merge(b);
            }
        }
        let families = [
            (
                "mlxgate_time_to_first_token_seconds",
                "Time from the request to its first token (proxied: the answer's first byte), by model and backend.",
            ),
            (
                "mlxgate_inter_token_latency_seconds",
                "Time between consecutive tokens of an answer, by model and backend.",
            ),
            (
                "mlxgate_request_latency_seconds",
                "Time from the request to the answer's last token, by model and backend.",
            ),
            (
                "mlxgate_queue_wait_seconds",
                "Time a request waited for a local model's engine to start it, by model.",
            ),
        ];
        for (i, (name, help)) in families.into_iter().enumerate() {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for ((model, backend), h) in &by_model {
                if h[i].count == 0 && i == 3 {
                    continue;
                }
                let l = format!("model=\"{}\",backend=\"{}\"", label(model), label(backend));
                h[i].render(out, name, &l);
            }
        }
    }
}

/// Each local model's queue and load: depth, bound, refusals, preemptions,
/// running sequences and their KV memory.
pub fn render_model_queues(models: &[crate::app::LoadedModel]) -> String {
    const FAMILIES: [(&str, &str, &str); 8] = [
        (
            "mlxgate_model_queue_waiting",
            "gauge",
            "Requests waiting to start, by model.",
        ),
        (
            "mlxgate_model_queue_limit",
            "gauge",
            "The most requests that may wait ([scheduler] max_queued).",
        ),
        (
            "mlxgate_model_sequences_in_flight",
            "gauge",
            "Generations queued or running, by model.",
        ),
        (
            "mlxgate_model_requests_rejected_total",
            "counter",
            "Requests refused at admission, by model and reason (overloaded: 503; tenant_share: 429).",
        ),
        (
            "mlxgate_model_preemptions_total",
            "counter",
            "Sequences preempted for KV memory and recomputed later.",
        ),
        (
            "mlxgate_model_sequences_running",
            "gauge",
            "Sequences decoding or prefilling after the engine's last step, by model.",
        ),
        (
            "mlxgate_model_kv_cache_bytes",
            "gauge",
            "KV cache memory the running sequences hold, by model.",
        ),
        (
            "mlxgate_model_kv_cache_limit_bytes",
            "gauge",
            "The KV memory running sequences may hold ([scheduler] kv_cache_mb).",
        ),
    ];
    let mut out = String::new();
    for (name, kind, help) in FAMILIES {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    for m in models {
        let q = m.engine.queue_stats();
        let (in_flight, _) = m.engine.current_load();
        let model = format!("model=\"{}\"", crate::util::prometheus_label(&m.id));
        let series = [
            (
                "mlxgate_model_queue_waiting",
                String::new(),
                q.waiting as u64,
            ),
            (
                "mlxgate_model_queue_limit",
                String::new(),
                q.max_queued as u64,
            ),
            (
                "mlxgate_model_sequences_in_flight",
                String::new(),
                in_flight as u64,
            ),
            (
                "mlxgate_model_requests_rejected_total",
                ",reason=\"overloaded\"".into(),
                q.rejected_overloaded,
            ),
            (
                "mlxgate_model_requests_rejected_total",
                ",reason=\"tenant_share\"".into(),
                q.rejected_tenant_share,
            ),
            (
                "mlxgate_model_preemptions_total",
                String::new(),
                q.preempted,
            ),
            ("mlxgate_model_sequences_running", String::new(), q.running),
            ("mlxgate_model_kv_cache_bytes", String::new(), q.kv_bytes),
            (
                "mlxgate_model_kv_cache_limit_bytes",
                String::new(),
                q.kv_limit,
            ),
        ];
        for (name, more, value) in series {
            let _ = writeln!(out, "{name}{{{model}{more}}} {value}");
        }
    }
    out
}

fn labels(k: &SeriesKey) -> String {
    // Route patterns come from the route table (static, no quotes or
    // backslashes), so no escaping is needed.
    format!(
        "method=\"{}\",route=\"{}\",status=\"{}\"",
        k.method, k.route, k.status
    )
}

fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use http::header::AUTHORIZATION;

    use super::*;
    use crate::http::auth::ApiKey;

    #[test]
    fn scrape_access() {
        let keys = KeyStore::new(vec![
            ApiKey::for_test("adm", &[Scope::Admin], "admin-key"),
            ApiKey::for_test("app", &[Scope::Infer], "infer-key"),
        ]);
        let bearer = |t: &str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, format!("Bearer {t}").parse().unwrap());
            h
        };
        let none = HeaderMap::new();
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:5000".parse().unwrap();
        let remote: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        let other: SocketAddr = "[2001:db8::1]:5000".parse().unwrap();
        let code = |r: Result<(), ApiError>| r.map_err(|e| (e.status().as_u16(), e.code()));

        let open = MetricsConfig::default();
        assert_eq!(code(authorize_scrape(&open, &keys, &none, local)), Ok(()));
        assert_eq!(code(authorize_scrape(&open, &keys, &none, mapped)), Ok(()));
        for peer in [remote, other] {
            assert_eq!(
                code(authorize_scrape(&open, &keys, &none, peer)),
                Err((403, "metrics_forbidden"))
            );
        }
        assert_eq!(
            code(authorize_scrape(&open, &keys, &bearer("admin-key"), remote)),
            Ok(())
        );
        assert_eq!(
            code(authorize_scrape(&open, &keys, &bearer("infer-key"), remote)),
            Err((403, "insufficient_scope"))
        );

        let closed = MetricsConfig {
            open_on_loopback: false,
            ..MetricsConfig::default()
        };
        let e = authorize_scrape(&closed, &keys, &none, local).unwrap_err();
        assert!(e.to_string().contains("token_sha256"), "{e}");

        let token = MetricsConfig {
            token_sha256: Some(KeyHash::of("scrape")),
            ..MetricsConfig::default()
        };
        assert_eq!(
            code(authorize_scrape(&token, &keys, &none, local)),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(authorize_scrape(&token, &keys, &bearer("wrong"), local)),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(authorize_scrape(&token, &keys, &bearer("scrape"), remote)),
            Ok(())
        );
        assert_eq!(
            code(authorize_scrape(
                &token,
                &keys,
                &bearer("admin-key"),
                remote
            )),
            Ok(())
        );
        let mut basic = HeaderMap::new();
        basic.insert(AUTHORIZATION, "Basic scrape".parse().unwrap());
        assert_eq!(
            code(authorize_scrape(&token, &keys, &basic, local)),
            Err((401, "invalid_api_key"))
        );
    }

    #[test]
    fn histogram_is_cumulative_and_counts_match() {
        let m = Metrics::default();
        m.observe(&Method::GET, "/healthz", 200, Duration::from_micros(500));
        m.observe(&Method::GET, "/healthz", 200, Duration::from_millis(20));
        m.observe(&Method::GET, "/healthz", 200, Duration::from_secs(100));
        let text = m.render(true);
        let l = r#"method="GET",route="/healthz",status="200""#;
        assert!(text.contains(&format!("mlxgate_http_requests_total{{{l}}} 3\n")));
        assert!(text.contains(&format!(
            "mlxgate_http_request_duration_seconds_bucket{{{l},le=\"0.001\"}} 1\n"
        )));
        assert!(text.contains(&format!(
            "mlxgate_http_request_duration_seconds_bucket{{{l},le=\"30\"}} 2\n"
        )));
        assert!(text.contains(&format!(
            "mlxgate_http_request_duration_seconds_bucket{{{l},le=\"+Inf\"}} 3\n"
        )));
        assert!(text.contains("mlxgate_model_ready 1\n"));
    }
}
