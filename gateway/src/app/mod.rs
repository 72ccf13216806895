//! The application: what the server owns and decides, below the wire
//! (`http` parses requests, calls in here and maps the results) and above
//! the domain modules (`engine`, `policy`, `jobs`, `upstream`). Nothing here
//! speaks HTTP.
//!
//! One [`App`] is built when the server starts and lives as long as it:
//! the served models, where requests go (router policy, upstreams), which
//! adapters they run with, the policy host, the jobs service and the
//! prompt-cache files. (API keys are the wire's: `http/auth.rs`.) No process-wide statics.

pub mod adapters;
pub mod jobs;
pub mod models;
pub mod policies;
pub mod responses;
pub mod routing;
pub mod usage;

use std::future::Future;
use std::sync::Arc;

use tracing::error;

use crate::config::Config;
use crate::engine::prompt_cache::{CacheStore, PromptCacheOptions};
use crate::engine::{EngineOptions, Faults};
use crate::upstream::Upstreams;
pub use models::{
    Engine, LoadedEncoder, LoadedModel, ModelError, ModelLoader, ModelRegistry, ModelState,
};
pub use policies::Policies;
pub use routing::{Destination, RouteError};

/// What the server owns, shared by every request.
pub struct App {
    pub config: Config,
    /// The configured models and their load state.
    pub models: Arc<ModelRegistry>,
    /// The configured upstreams, their pools and health.
    pub upstreams: Upstreams,
    /// The policy host of the data dir, opened on first use.
    pub policies: Arc<Policies>,
    /// The jobs service, opened at start ([`App::start`]).
    jobs: jobs::JobsService,
    /// The prompt-cache files, shared by every model's engine; `None` when
    /// the directory cannot be opened (logged at start).
    pub prompt_caches: Option<Arc<CacheStore>>,
    /// Stored `/v1/responses`, opened on first use.
    responses: std::sync::OnceLock<Result<responses::ResponseStore, String>>,
    /// Rate limits and quotas per key and tenant (`[limits]`).
    pub limits: crate::limits::Limiter,
    /// Token usage per day, tenant, key, model and backend.
    pub usage: Arc<usage::UsageLedger>,
}

impl App {
    pub fn new(config: Config) -> App {
        let dir = config.prompt_cache_dir();
        let auto_budget = config.prompt_cache.auto_disk_mb * 1024 * 1024;
        let prompt_caches = match CacheStore::open(&dir, auto_budget) {
            Ok(store) => Some(Arc::new(
                store.with_named_budget(config.prompt_cache.named_disk_bytes()),
            )),
            Err(e) => {
                error!(dir = %dir.display(), error = %e, "prompt cache files disabled: cannot open the directory");
                None
            }
        };
        App {
            models: Arc::new(ModelRegistry::new(&config.models)),
            upstreams: Upstreams::new(&config.upstreams),
            policies: Arc::new(Policies::new(config.data_dir.clone())),
            jobs: jobs::JobsService::default(),
            prompt_caches,
            responses: std::sync::OnceLock::new(),
            limits: crate::limits::Limiter::new(
                &config.limits,
                config
                    .keys
                    .iter()
                    .map(|k| (k.id.as_str(), k.tenant.as_str())),
            ),
            usage: Arc::new(usage::UsageLedger::new(config.data_dir.join("usage.redb"))),
            config,
        }
    }

    /// Starts what runs beside the requests: the jobs service (stopped when
    /// `shutdown` completes) and the loading of every model with `load`,
    /// in the background, each with its configured adapters.
    pub fn start(&self, load: ModelLoader, shutdown: impl Future<Output = ()> + Send + 'static) {
        self.start_jobs(shutdown);
        self.restore_daily_usage();
        self.start_usage_flushes();
        self.upstreams.start_health_checks();
        let mounts = adapters::startup_mounts(&self.config);
        self.models
            .load_in_background(load, self.engine_options(), mounts);
    }

    /// Daily budgets kept in this process start from what the usage ledger
    /// says was used today, so a restart does not renew them.
    fn restore_daily_usage(&self) {
        if !self.limits.has_daily_budgets() {
            return;
        }
        let today = crate::util::time::Date::today().iso();
        let rows = match self.usage.report(None, &today, &today) {
            Ok(rows) => rows,
            Err(e) => {
                error!(error = %e, "daily budgets start from zero: the usage ledger cannot be read");
                return;
            }
        };
        self.limits.restore_daily_usage(|counter| {
            rows.iter()
                .filter(|r| counter.scope.covers(&r.key_id, &r.tenant, &r.model))
                .map(|r| r.prompt_tokens + r.completion_tokens)
                .sum()
        });
    }

    /// Folds the usage of finished requests into its database every few
    /// seconds, on a blocking thread (a redb commit syncs to disk).
    fn start_usage_flushes(&self) {
        let usage = Arc::clone(&self.usage);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let usage = Arc::clone(&usage);
                match tokio::task::spawn_blocking(move || usage.flush()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => error!(error = %e, "usage not saved; kept for the next try"),
                    Err(e) => error!(error = %e, "usage flush failed"),
                }
            }
        });
    }

    /// Stops what runs beside the requests, at shutdown: jobs drain, and
    /// the usage not yet saved is.
    pub async fn stop(&self) {
        self.stop_jobs().await;
        let usage = Arc::clone(&self.usage);
        match tokio::task::spawn_blocking(move || usage.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => error!(error = %e, "usage of the last seconds not saved"),
            Err(e) => error!(error = %e, "usage flush failed"),
        }
    }

    /// The store of `/v1/responses` (`<data_dir>/responses.redb`), opened
    /// on first use; the error says why it cannot be.
    pub fn responses(&self) -> Result<&responses::ResponseStore, String> {
        self.responses
            .get_or_init(|| {
                let path = self.config.data_dir.join("responses.redb");
                responses::ResponseStore::open(&path, self.config.responses.clone())
                    .map_err(|e| format!("{e} ({})", path.display()))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// How every model's engine runs, from the config.
    pub fn engine_options(&self) -> EngineOptions {
        let c = &self.config.prompt_cache;
        EngineOptions {
            prompt_cache: PromptCacheOptions {
                memory_bytes: (c.memory_mb * 1024 * 1024) as usize,
                store: self.prompt_caches.clone(),
                auto_save_min_tokens: (c.auto_save_min_tokens > 0)
                    .then_some(c.auto_save_min_tokens),
            },
            scheduling: self.config.scheduler.options(),
            faults: self.injected_faults(),
            ..EngineOptions::default()
        }
    }

    /// Engine faults for tests of fault isolation: `MLXGATE_TEST_ENGINE_FAULTS`
    /// (`decode_panic=TOKEN,...`, see [`Faults`]), read only by debug builds
    /// serving `test_routes` (loopback only).
    fn injected_faults(&self) -> Faults {
        if !(cfg!(debug_assertions) && self.config.test_routes) {
            return Faults::default();
        }
        let spec = std::env::var("MLXGATE_TEST_ENGINE_FAULTS").unwrap_or_default();
        Faults::parse(&spec).unwrap_or_else(|e| {
            error!(error = %e, "MLXGATE_TEST_ENGINE_FAULTS ignored");
            Faults::default()
        })
    }
}
