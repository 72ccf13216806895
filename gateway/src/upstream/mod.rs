//! Configured upstream OpenAI-compatible endpoints and the proxy that
//! forwards requests to them.
//!
//! Upstreams exist only in the config (`[[upstreams]]`): a router policy can
//! name one but never supply a URL, so a guest cannot make the gateway talk
//! to an arbitrary host. The proxy forwards the method, the path under `/v1`
//! (normalized, never the client's query string), the body (with `model`
//! rewritten when the decision names one), the gateway's request id and an
//! allow-list of client headers (`FORWARDED` in `client.rs`); it authenticates with the
//! upstream's own key (never the client's), and streams the answer back
//! frame by frame, so server-sent events reach the client as the upstream
//! writes them. Errors the client sees name the upstream by its configured
//! `name` only; addresses and causes go to the log (and to the admin's
//! `GET /admin/upstreams`).
//!
//! Each upstream keeps its own pool of keep-alive connections, driven on
//! the request's task (`pool.rs`), an in-flight count and its
//! last error, which the router sees as the upstream's backend state.
//!
//! This is the one module below `http` that speaks HTTP, as a client
//! (hyper's client connections): `mod.rs` holds the specs as configured and
//! how a base URL maps the gateway's `/v1` paths, `client.rs` the proxy,
//! `pool.rs` the keep-alive connections. What an upstream failure answers
//! (status, code) is decided in `http/error.rs`.

mod breaker;
mod client;
mod fallback;
mod h1;
mod pool;

pub use client::{
    Outgoing, ProxyBody, UPSTREAM_HEADER, Upstream, UpstreamError, UpstreamStatus, Upstreams, proxy,
};
pub use fallback::proxy_in_order;

use std::fmt;
use std::path::PathBuf;

use http::Uri;
use serde::Deserialize;

use crate::util::tls::{ClientTls, client_config};

/// Default for `timeout_secs`: connect plus first byte of the answer. A
/// non-streamed completion sends its first byte only when it is done.
pub const DEFAULT_TIMEOUT_SECS: f64 = 60.0;

/// One `[[upstreams]]` entry.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSpec {
    /// What router policies call it.
    pub name: String,
    /// `http://host:port/v1` or `https://host/v1`: a request for
    /// `/v1/chat/completions` goes to `{base_url}/chat/completions`.
    pub base_url: String,
    /// `https://` only: a PEM bundle of the CAs to trust instead of the
    /// built-in Mozilla roots (a private CA).
    pub ca_file: Option<PathBuf>,
    /// `https://` only: a PEM certificate chain presented to an upstream
    /// that asks for one (mutual TLS), with `client_key`.
    pub client_cert: Option<PathBuf>,
    /// The PEM private key of `client_cert`.
    pub client_key: Option<PathBuf>,
    /// Environment variable holding the upstream's API key (preferred).
    pub api_key_env: Option<String>,
    /// The API key itself, for keys that are not secret (local servers).
    pub api_key: Option<String>,
    /// Connect plus first byte, in seconds (fractions allowed).
    pub timeout_secs: Option<f64>,
    /// Models sent here when no router policy decides (none bound, or a
    /// `fail_open` one failed): a static route table. A bound router
    /// overrides it.
    #[serde(default)]
    pub models: Vec<String>,
    /// The APIs it speaks: `openai` (chat, completions, responses) and/or
    /// `anthropic` (messages). A request goes as the client sent it to an
    /// upstream that speaks its API; a Messages request to an OpenAI-only
    /// upstream is translated (`http/anthropic/translate.rs`), the other
    /// way is refused.
    #[serde(default = "openai_only")]
    pub protocols: Vec<Protocol>,
    /// Upstreams tried in order when this one fails before its answer
    /// starts (unreachable, no answer head in time, 429, 5xx) or is passed
    /// over (circuit open, Retry-After, `max_in_flight`).
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// Most requests in flight here at once; past it, requests go to a
    /// fallback (or get 503).
    pub max_in_flight: Option<u32>,
    /// Consecutive failures that open the circuit (default 5; 0: never).
    pub breaker_failures: Option<u32>,
    /// Seconds an open circuit keeps requests away before one probe goes
    /// (default 30).
    pub breaker_cooldown_secs: Option<f64>,
    /// An active health check (off unless set).
    pub health_check: Option<HealthCheckSpec>,
    /// Whether a streamed OpenAI request that does not ask for usage is
    /// sent with `stream_options.include_usage` so its tokens are counted
    /// (default true; false for a server that refuses the field).
    pub stream_usage: Option<bool>,
}

/// `health_check = { path = "/models", interval_secs = 10, timeout_secs = 5 }`:
/// `GET {base_url}{path}` every interval; a failure counts as one towards
/// the circuit breaker, a success closes the circuit.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckSpec {
    /// Under the base URL's path (default `/models`).
    #[serde(default = "default_health_path")]
    pub path: String,
    #[serde(default = "default_health_interval")]
    pub interval_secs: f64,
    #[serde(default = "default_health_timeout")]
    pub timeout_secs: f64,
}

fn default_health_path() -> String {
    "/models".into()
}

fn default_health_interval() -> f64 {
    10.0
}

fn default_health_timeout() -> f64 {
    5.0
}

/// Default for `breaker_failures`.
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
/// Default for `breaker_cooldown_secs`.
pub const DEFAULT_BREAKER_COOLDOWN_SECS: f64 = 30.0;

/// An API family an upstream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// `/v1/chat/completions`, `/v1/completions`, `/v1/responses`; the key
    /// goes as `Authorization: Bearer`.
    Openai,
    /// `/v1/messages`; the key goes as `x-api-key`, with `anthropic-version`.
    Anthropic,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Openai => "openai",
            Protocol::Anthropic => "anthropic",
        }
    }
}

fn openai_only() -> Vec<Protocol> {
    vec![Protocol::Openai]
}

impl UpstreamSpec {
    /// An upstream at `base_url` with no key, the default timeout and no
    /// static models.
    pub fn new(name: &str, base_url: &str) -> UpstreamSpec {
        UpstreamSpec {
            name: name.into(),
            base_url: base_url.into(),
            ca_file: None,
            client_cert: None,
            client_key: None,
            api_key_env: None,
            api_key: None,
            timeout_secs: None,
            models: vec![],
            protocols: openai_only(),
            fallbacks: vec![],
            max_in_flight: None,
            breaker_failures: None,
            breaker_cooldown_secs: None,
            health_check: None,
            stream_usage: None,
        }
    }
}

impl UpstreamSpec {
    /// What the TLS client trusts and presents (`https://` base URLs).
    pub(crate) fn client_tls(&self) -> ClientTls<'_> {
        ClientTls {
            ca_file: self.ca_file.as_deref(),
            client_cert: self.client_cert.as_deref().zip(self.client_key.as_deref()),
        }
    }

    /// Checks the TLS settings: only with `https://`, a certificate with
    /// its key, files that load.
    fn check_tls(&self, base: &Base) -> Result<(), String> {
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err("set client_cert and client_key together".into());
        }
        let tls_set = self.ca_file.is_some() || self.client_cert.is_some();
        if !base.tls {
            return if tls_set {
                Err("ca_file, client_cert and client_key need an https:// base_url".into())
            } else {
                Ok(())
            };
        }
        client_config(&self.client_tls()).map(drop)
    }
}

impl fmt::Debug for UpstreamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamSpec")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("api_key_env", &self.api_key_env)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("timeout_secs", &self.timeout_secs)
            .field("models", &self.models)
            .field("fallbacks", &self.fallbacks)
            .finish_non_exhaustive()
    }
}

/// Checks `[[upstreams]]`: unique plain names, `http://` or `https://` base
/// URLs (with TLS files that load), at most one key source and its
/// environment variable set, a sane timeout. Each error names its entry.
pub fn validate_specs(specs: &[UpstreamSpec]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    let mut models = std::collections::HashSet::new();
    for s in specs {
        let ok_name = (1..=64).contains(&s.name.len())
            && s.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok_name {
            return Err(format!(
                "invalid upstream name `{}`: use 1-64 characters from [A-Za-z0-9_.-]",
                s.name
            ));
        }
        if !seen.insert(s.name.as_str()) {
            return Err(format!("upstream name `{}` is used twice", s.name));
        }
        if let Some(m) = s.models.iter().find(|m| !models.insert(m.as_str())) {
            return Err(format!("model `{m}` is listed by two upstreams"));
        }
        let base = Base::parse(&s.base_url).map_err(|e| format!("upstream `{}`: {e}", s.name))?;
        s.check_tls(&base)
            .map_err(|e| format!("upstream `{}`: {e}", s.name))?;
        if s.protocols.is_empty() {
            return Err(format!(
                "upstream `{}`: `protocols` is empty; list \"openai\" and/or \"anthropic\"",
                s.name
            ));
        }
        if s.api_key.is_some() && s.api_key_env.is_some() {
            return Err(format!(
                "upstream `{}`: set api_key or api_key_env, not both",
                s.name
            ));
        }
        if let Some(var) = &s.api_key_env
            && std::env::var_os(var).is_none_or(|v| v.is_empty())
        {
            return Err(format!(
                "upstream `{}`: environment variable {var} (api_key_env) is not set",
                s.name
            ));
        }
        s.check_resilience(specs)
            .map_err(|e| format!("upstream `{}`: {e}", s.name))?;
    }
    Ok(())
}

/// `secs` as a duration in (0, 3600] seconds, or why not.
fn seconds(field: &str, secs: f64) -> Result<(), String> {
    if secs.is_finite() && secs > 0.0 && secs <= 3600.0 {
        Ok(())
    } else {
        Err(format!("{field} must be in (0, 3600], not {secs}"))
    }
}

impl UpstreamSpec {
    /// Timeouts, fallbacks that name other configured upstreams once,
    /// limits and the health check.
    fn check_resilience(&self, all: &[UpstreamSpec]) -> Result<(), String> {
        seconds(
            "timeout_secs",
            self.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS),
        )?;
        let cooldown = self
            .breaker_cooldown_secs
            .unwrap_or(DEFAULT_BREAKER_COOLDOWN_SECS);
        seconds("breaker_cooldown_secs", cooldown)?;
        if self.max_in_flight == Some(0) {
            return Err("max_in_flight must be at least 1 (leave it out for no cap)".into());
        }
        let mut seen = std::collections::HashSet::new();
        for f in &self.fallbacks {
            if *f == self.name {
                return Err("fallbacks lists the upstream itself".into());
            }
            if !all.iter().any(|u| u.name == *f) {
                return Err(format!("fallbacks names `{f}`, which is not configured"));
            }
            if !seen.insert(f) {
                return Err(format!("fallbacks lists `{f}` twice"));
            }
        }
        if let Some(h) = &self.health_check {
            seconds("health_check.interval_secs", h.interval_secs)?;
            seconds("health_check.timeout_secs", h.timeout_secs)?;
            normalize_path(&h.path)
                .map_err(|why| format!("health_check.path `{}`: {why}", h.path))?;
        }
        Ok(())
    }
}

/// Scheme, authority and path prefix of a base URL.
#[derive(Debug, Clone)]
pub(crate) struct Base {
    /// `https://`.
    pub(crate) tls: bool,
    pub(crate) authority: http::uri::Authority,
    /// Without a trailing `/`; may be empty.
    pub(crate) prefix: String,
}

impl Base {
    pub(crate) fn parse(url: &str) -> Result<Base, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("invalid base_url `{url}`: {e}"))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(format!(
                    "base_url `{url}` must start with http:// or https://"
                ));
            }
        };
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("base_url `{url}` has no host"))?;
        if uri.query().is_some() {
            return Err(format!("base_url `{url}` must not have a query"));
        }
        let prefix = normalize_path(uri.path())
            .map_err(|why| format!("base_url `{url}`: its path is not plain: {why}"))?;
        Ok(Base {
            tls,
            authority,
            prefix,
        })
    }

    /// The upstream request target (origin form, as sent on the wire) for a
    /// gateway path under `/v1`, already normalized ([`normalize_path`]):
    /// `/v1/x` goes to `{prefix}/x`.
    pub(crate) fn target_for(&self, path: &str) -> Result<Uri, String> {
        let rest = match path.strip_prefix("/v1") {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            _ => return Err(format!("only paths under /v1 are proxied, not `{path}`")),
        };
        let mut target = String::with_capacity(self.prefix.len() + rest.len() + 1);
        target.push_str(&self.prefix);
        target.push_str(rest);
        if target.is_empty() {
            target.push('/');
        }
        Uri::try_from(target).map_err(|e| format!("cannot build the upstream URL: {e}"))
    }

    /// `host:port` to connect to (port 80, or 443 for https, when the URL
    /// names none).
    pub(crate) fn socket_authority(&self) -> String {
        let default = if self.tls { 443 } else { 80 };
        let port = self.authority.port_u16().unwrap_or(default);
        format!("{}:{port}", self.authority.host())
    }
}

/// Gateway paths that are proxied; their upstream targets are built once.
pub(crate) const PROXIED_PATHS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/responses",
];

/// `path` with repeated `/` collapsed and no trailing `/` (`""` for the
/// root). Refuses what an upstream could resolve to another path than the
/// one the gateway routed: `.` and `..` segments, and `%2e`, `%2f`, `%5c`
/// or `\`, which some servers decode into them.
pub(crate) fn normalize_path(path: &str) -> Result<String, &'static str> {
    let mut out = String::with_capacity(path.len());
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        if seg == "." || seg == ".." {
            return Err("it has a `.` or `..` segment");
        }
        let b = seg.as_bytes();
        let encoded = b.windows(3).any(|w| {
            w[0] == b'%'
                && matches!(
                    (w[1], w[2].to_ascii_lowercase()),
                    (b'2', b'e' | b'f') | (b'5', b'c')
                )
        });
        if encoded || b.contains(&b'\\') {
            return Err("it has an encoded `.`, `/` or `\\`");
        }
        out.push('/');
        out.push_str(seg);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, url: &str) -> UpstreamSpec {
        UpstreamSpec::new(name, url)
    }

    #[test]
    fn base_urls_map_paths_under_v1() {
        let b = Base::parse("http://127.0.0.1:9000/v1/").unwrap();
        assert_eq!(
            b.target_for("/v1/chat/completions").unwrap().to_string(),
            "/v1/chat/completions"
        );
        assert_eq!(b.socket_authority(), "127.0.0.1:9000");
        let b = Base::parse("http://h:1").unwrap();
        assert_eq!(
            b.target_for("/v1/completions").unwrap().to_string(),
            "/completions"
        );
        assert_eq!(b.target_for("/v1").unwrap().to_string(), "/");
        assert!(b.target_for("/v1x").is_err());
        assert!(b.target_for("/admin").is_err());
        // The base path is normalized once, at parse time.
        let b = Base::parse("http://h:1//api//v1/").unwrap();
        assert_eq!(
            b.target_for("/v1/models").unwrap().to_string(),
            "/api/v1/models"
        );
        assert!(Base::parse("http://h:1/api/../admin").is_err());
        assert_eq!(
            Base::parse("http://example.com/api/v1")
                .unwrap()
                .socket_authority(),
            "example.com:80"
        );
        let b = Base::parse("https://api.openai.com/v1").unwrap();
        assert!(b.tls);
        assert_eq!(b.socket_authority(), "api.openai.com:443");
        assert!(Base::parse("ftp://x/v1").is_err());
        assert!(Base::parse("not a url").is_err());
    }

    #[test]
    fn paths_are_normalized() {
        assert_eq!(
            normalize_path("//v1///chat/completions/").unwrap(),
            "/v1/chat/completions"
        );
        assert_eq!(normalize_path("/").unwrap(), "");
        for bad in [
            "/v1/../admin",
            "/v1/./x",
            "/v1/%2e%2E/admin",
            "/v1/a%2Fb",
            "/v1/a%5cb",
            "/v1/a\\b",
        ] {
            assert!(normalize_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn specs_are_validated() {
        assert!(validate_specs(&[spec("a", "http://x/v1"), spec("b", "http://y/v1")]).is_ok());
        assert!(validate_specs(&[spec("a", "http://x/v1"), spec("a", "http://y/v1")]).is_err());
        assert!(validate_specs(&[spec("a b", "http://x/v1")]).is_err());
        let (mut a, mut b) = (spec("a", "http://x/v1"), spec("b", "http://y/v1"));
        a.models = vec!["m".into()];
        b.models = vec!["m".into()];
        assert!(
            validate_specs(&[a, b])
                .unwrap_err()
                .contains("two upstreams")
        );
        let mut s = spec("a", "http://x/v1");
        s.api_key = Some("k".into());
        s.api_key_env = Some("MLXGATE_TEST_NO_SUCH_VAR".into());
        assert!(validate_specs(&[s.clone()]).is_err());
        s.api_key = None;
        assert!(validate_specs(&[s]).unwrap_err().contains("not set"));
        let mut s = spec("a", "http://x/v1");
        s.timeout_secs = Some(0.0);
        assert!(validate_specs(&[s]).is_err());
    }

    #[test]
    fn fallbacks_and_limits_are_checked() {
        let (mut a, b) = (spec("a", "http://x/v1"), spec("b", "http://y/v1"));
        a.fallbacks = vec!["b".into()];
        assert!(validate_specs(&[a.clone(), b.clone()]).is_ok());
        for (fallbacks, wanted) in [
            (vec!["c"], "`c`, which is not configured"),
            (vec!["a"], "itself"),
            (vec!["b", "b"], "twice"),
        ] {
            a.fallbacks = fallbacks.into_iter().map(String::from).collect();
            let e = validate_specs(&[a.clone(), b.clone()]).unwrap_err();
            assert!(e.contains("upstream `a`") && e.contains(wanted), "{e}");
        }
        let mut s = spec("a", "http://x/v1");
        s.max_in_flight = Some(0);
        assert!(validate_specs(&[s]).unwrap_err().contains("max_in_flight"));
        let mut s = spec("a", "http://x/v1");
        s.health_check = Some(HealthCheckSpec {
            path: "/../admin".into(),
            interval_secs: 1.0,
            timeout_secs: 1.0,
        });
        assert!(
            validate_specs(&[s])
                .unwrap_err()
                .contains("health_check.path")
        );
    }

    #[test]
    fn tls_settings_are_checked_and_name_the_entry() {
        assert!(validate_specs(&[spec("hosted", "https://api.example.com/v1")]).is_ok());
        let mut s = spec("plain", "http://x/v1");
        s.ca_file = Some("ca.pem".into());
        let e = validate_specs(&[s]).unwrap_err();
        assert!(e.contains("`plain`") && e.contains("https://"), "{e}");
        let mut s = spec("private", "https://x/v1");
        s.ca_file = Some("/no/such/ca.pem".into());
        let e = validate_specs(&[s]).unwrap_err();
        assert!(
            e.contains("`private`") && e.contains("/no/such/ca.pem"),
            "{e}"
        );
        let mut s = spec("mtls", "https://x/v1");
        s.client_cert = Some("c.pem".into());
        let e = validate_specs(&[s]).unwrap_err();
        assert!(e.contains("`mtls`") && e.contains("client_key"), "{e}");
    }

    #[test]
    fn debug_redacts_the_key() {
        let mut s = spec("a", "http://x/v1");
        s.api_key = Some("sk-secret".into());
        assert!(!format!("{s:?}").contains("sk-secret"));
    }
}
