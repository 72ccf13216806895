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

#[derive(Debug, Default)]
struct Series {
    count: u64,
    sum: f64,
    /// Non-cumulative counts per bucket; made cumulative when rendered.
    buckets: [u64; BUCKETS.len()],
}

#[derive(Debug, Default)]
pub struct Metrics {
    series: Mutex<BTreeMap<SeriesKey, Series>>,
    in_flight: AtomicI64,
    /// Tokens of proxied answers: (upstream, kind) to count. Upstream names
    /// come from the config, so the series are few and need no escaping.
    upstream_tokens: Mutex<BTreeMap<String, [u64; 2]>>,
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
        let secs = elapsed.as_secs_f64();
        let mut map = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let s = map.entry(key).or_default();
        s.count += 1;
        s.sum += secs;
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            s.buckets[i] += 1;
        }
    }

    /// Adds a proxied answer's usage to `upstream`'s token counters.
    pub fn count_upstream_tokens(&self, upstream: &str, prompt: u64, completion: u64) {
        let mut map = self
            .upstream_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let counts = match map.get_mut(upstream) {
            Some(c) => c,
            None => map.entry(upstream.to_owned()).or_default(),
        };
        counts[0] += prompt;
        counts[1] += completion;
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
            let l = labels(k);
            let mut cumulative = 0;
            for (bound, n) in BUCKETS.iter().zip(s.buckets.iter()) {
                cumulative += n;
                let _ = writeln!(
                    out,
                    "mlxgate_http_request_duration_seconds_bucket{{{l},le=\"{bound}\"}} {cumulative}"
                );
            }
            let _ = writeln!(
                out,
                "mlxgate_http_request_duration_seconds_bucket{{{l},le=\"+Inf\"}} {}\n\
                 mlxgate_http_request_duration_seconds_sum{{{l}}} {}\n\
                 mlxgate_http_request_duration_seconds_count{{{l}}} {}",
                s.count, s.sum, s.count
            );
        }
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
        let tokens = self
            .upstream_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !tokens.is_empty() {
            out.push_str(
                "# HELP mlxgate_upstream_tokens_total Tokens of proxied answers as the upstream reported them, by upstream and kind (prompt, completion).\n\
                 # TYPE mlxgate_upstream_tokens_total counter\n",
            );
            for (i, kind) in ["prompt", "completion"].into_iter().enumerate() {
                for (upstream, counts) in tokens.iter() {
                    let _ = writeln!(
                        out,
                        "mlxgate_upstream_tokens_total{{upstream=\"{upstream}\",kind=\"{kind}\"}} {}",
                        counts[i]
                    );
                }
            }
        }
        out
    }
}

/// Each local model's queue: depth, bound, refusals and preemptions.
pub fn render_model_queues(models: &[crate::app::LoadedModel]) -> String {
    const FAMILIES: [(&str, &str, &str); 5] = [
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
