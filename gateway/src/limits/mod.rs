//! Rate limits and quotas per API key and per tenant: requests and tokens
//! per minute, daily token budgets, with per-model entries; kept in this
//! process or, shared by every replica, in Redis.
//!
//! A request's limits are a [`Plan`]: the counters it is checked against
//! (its key, its tenant, and each one's entry for the requested model), made
//! once per key at start. [`Limiter::admit`] checks every counter of a plan
//! and takes the request from all of them or from none; the tokens a
//! request reads and writes are charged afterwards, as they are produced
//! ([`Limiter::charge`]). The arithmetic is [`gcra`]'s; the stores only keep
//! counters: `memory.rs` in this process, `redis_store.rs` in Redis through
//! two Lua scripts, atomically, on Redis's clock.
//!
//! Concurrent-request caps are per process and live with the connection
//! caps (`http::inflight`); this module only carries their configuration.

pub mod gcra;
mod memory;
mod redis_store;

use std::collections::{BTreeMap, HashMap};

use crate::util::FnvBuild;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

pub use gcra::{Headroom, LimitKind, Rates};

/// The `[limits]` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Where the counters live: `memory` (this process, the default) or
    /// `redis` (shared by every gateway using the same Redis).
    pub backend: Backend,
    /// `redis://[:password@]host:port[/db]` or `rediss://` (TLS); needed
    /// with `backend = "redis"`.
    pub redis_url: Option<String>,
    /// What a request gets while Redis cannot be reached: `allow` (served
    /// unlimited, the default) or `refuse` (503 `rate_limiter_unavailable`).
    pub on_redis_error: OnRedisError,
    /// How long one Redis call may take before it counts as unreachable
    /// (default 250 ms).
    pub redis_timeout_ms: u64,
    /// Prefix of the counters' Redis keys. The `{...}` hash tag puts them
    /// in one Redis Cluster slot, which a script over several needs.
    pub redis_key_prefix: String,
    /// Limits of one API key, by key id.
    pub keys: BTreeMap<String, LimitSpec>,
    /// Limits of one tenant (every key of it together), by tenant name;
    /// open inference's callers are the tenant `anonymous`.
    pub tenants: BTreeMap<String, LimitSpec>,
    /// Limits of each tenant that has no entry in `tenants`.
    pub default_tenant: Option<LimitSpec>,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            backend: Backend::Memory,
            redis_url: None,
            on_redis_error: OnRedisError::Allow,
            redis_timeout_ms: 250,
            redis_key_prefix: "mlxgate:{limits}:".into(),
            keys: BTreeMap::new(),
            tenants: BTreeMap::new(),
            default_tenant: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Memory,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRedisError {
    Allow,
    Refuse,
}

/// The limits of one key or tenant. Omitted fields are no limit.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    pub requests_per_minute: Option<u32>,
    /// Prompt and completion tokens (cached prompt tokens included), counted
    /// as they are read and produced, streamed and proxied answers too.
    pub tokens_per_minute: Option<u64>,
    /// Tokens per UTC calendar day; over it, 429 `insufficient_quota`
    /// until midnight UTC.
    pub daily_tokens: Option<u64>,
    /// Most inference requests in progress at once (per gateway process).
    pub max_concurrent_requests: Option<u32>,
    /// Limits of the requests for one model (the `model` the client
    /// names), counted apart and checked besides the limits above.
    #[serde(default)]
    pub models: BTreeMap<String, ModelLimits>,
}

/// The limits of one key's or tenant's requests for one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimits {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub daily_tokens: Option<u64>,
}

impl ModelLimits {
    fn rates(&self) -> Rates {
        Rates {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            daily_tokens: self.daily_tokens,
        }
    }
}

impl LimitSpec {
    fn rates(&self) -> Rates {
        Rates {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            daily_tokens: self.daily_tokens,
        }
    }

    fn check(&self, what: &str) -> Result<(), String> {
        let zero =
            |name: &str| format!("{what}: {name} = 0 refuses everything; omit it for no limit");
        let check_rates = |r: Rates, at: &str| -> Result<(), String> {
            let prefix = if at.is_empty() {
                String::new()
            } else {
                format!("models.{at}.")
            };
            if r.requests_per_minute == Some(0) {
                return Err(zero(&format!("{prefix}requests_per_minute")));
            }
            if r.tokens_per_minute == Some(0) {
                return Err(zero(&format!("{prefix}tokens_per_minute")));
            }
            if r.daily_tokens == Some(0) {
                return Err(zero(&format!("{prefix}daily_tokens")));
            }
            Ok(())
        };
        check_rates(self.rates(), "")?;
        for (model, limits) in &self.models {
            check_rates(limits.rates(), model)?;
        }
        if self.max_concurrent_requests == Some(0) {
            return Err(zero("max_concurrent_requests"));
        }
        Ok(())
    }
}

/// The tenant name of open inference's callers.
pub const ANONYMOUS: &str = "anonymous";

impl LimitsConfig {
    /// Checks the section against the configured keys (`(id, tenant)`): an
    /// entry naming no key or tenant is a typo that would leave a limit
    /// unenforced, so it is an error.
    pub fn validate<'a>(
        &self,
        keys: impl Iterator<Item = (&'a str, &'a str)> + Clone,
    ) -> Result<(), String> {
        if self.backend == Backend::Redis {
            let Some(url) = &self.redis_url else {
                return Err(
                    "backend = \"redis\" needs redis_url (e.g. \"redis://127.0.0.1:6379\")".into(),
                );
            };
            redis::Client::open(url.as_str()).map_err(|e| format!("redis_url: {e}"))?;
        }
        if self.redis_timeout_ms == 0 {
            return Err("redis_timeout_ms must be greater than 0".into());
        }
        for (id, spec) in &self.keys {
            if !keys.clone().any(|(k, _)| k == id) {
                return Err(format!("keys.{id}: no [[keys]] entry has id '{id}'"));
            }
            spec.check(&format!("keys.{id}"))?;
        }
        for (tenant, spec) in &self.tenants {
            if tenant != ANONYMOUS && !keys.clone().any(|(_, t)| t == tenant) {
                return Err(format!(
                    "tenants.{tenant}: no [[keys]] entry has tenant '{tenant}' (open inference's callers are the tenant '{ANONYMOUS}')"
                ));
            }
            spec.check(&format!("tenants.{tenant}"))?;
        }
        if let Some(spec) = &self.default_tenant {
            spec.check("default_tenant")?;
        }
        Ok(())
    }

    /// The concurrency cap of tenant `tenant`, if any.
    pub fn tenant_concurrency(&self, tenant: &str) -> Option<u32> {
        self.tenant_spec(tenant)
            .and_then(|s| s.max_concurrent_requests)
    }

    fn tenant_spec(&self, tenant: &str) -> Option<&LimitSpec> {
        self.tenants.get(tenant).or(self.default_tenant.as_ref())
    }

    fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis_timeout_ms)
    }
}

// ------------------------------------------------------------------ plans

/// One counter a request is checked against.
#[derive(Debug)]
pub struct Counter {
    /// Stable name, the counter's key in a store: `key:ID`, `tenant:NAME`,
    /// either followed by `:model:MODEL`.
    pub id: Arc<str>,
    /// Whose requests it counts.
    pub scope: Scope,
    /// Who it limits, for messages: "API key 'a'", "tenant 't' on model 'm'".
    pub who: String,
    pub rates: Rates,
    /// Its slot in the in-process store.
    slot: usize,
}

/// Whose requests a counter counts: one key's or one tenant's, for one
/// model or all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Key { id: String, model: Option<String> },
    Tenant { name: String, model: Option<String> },
}

impl Scope {
    /// Whether a request of `key` (of `tenant`) for `model` counts here.
    pub fn covers(&self, key: &str, tenant: &str, model: &str) -> bool {
        let (who, wanted, m) = match self {
            Scope::Key { id, model } => (key, id, model),
            Scope::Tenant { name, model } => (tenant, name, model),
        };
        who == wanted && m.as_deref().is_none_or(|m| m == model)
    }

    fn id(&self) -> String {
        match self {
            Scope::Key { id, model: None } => format!("key:{id}"),
            Scope::Key { id, model: Some(m) } => format!("key:{id}:model:{m}"),
            Scope::Tenant { name, model: None } => format!("tenant:{name}"),
            Scope::Tenant {
                name,
                model: Some(m),
            } => format!("tenant:{name}:model:{m}"),
        }
    }

    fn who(&self) -> String {
        match self {
            Scope::Key { id, model: None } => format!("API key '{id}'"),
            Scope::Key { id, model: Some(m) } => format!("API key '{id}' on model '{m}'"),
            Scope::Tenant { name, model: None } => format!("tenant '{name}'"),
            Scope::Tenant {
                name,
                model: Some(m),
            } => format!("tenant '{name}' on model '{m}'"),
        }
    }
}

/// The counters one caller's requests for one model are checked against.
#[derive(Debug, Default)]
pub struct Plan {
    pub counters: Vec<Arc<Counter>>,
}

/// The plans of one caller: without a model entry, and per model named in
/// its key's or tenant's `models`.
#[derive(Debug, Default)]
struct CallerPlans {
    base: Option<Arc<Plan>>,
    by_model: HashMap<String, Arc<Plan>, FnvBuild>,
}

/// Builds every caller's plans, naming each counter once.
struct PlanBuilder<'c> {
    config: &'c LimitsConfig,
    counters: HashMap<Arc<str>, Arc<Counter>>,
}

impl PlanBuilder<'_> {
    fn counter(&mut self, scope: Scope, rates: Rates) -> Option<Arc<Counter>> {
        if rates.is_empty() {
            return None;
        }
        let slot = self.counters.len();
        let id: Arc<str> = scope.id().into();
        let entry = self.counters.entry(Arc::clone(&id)).or_insert_with(|| {
            Arc::new(Counter {
                id,
                who: scope.who(),
                scope,
                rates,
                slot,
            })
        });
        Some(Arc::clone(entry))
    }

    fn caller(&mut self, key_id: &str, tenant: &str) -> CallerPlans {
        let config = self.config;
        let key = config.keys.get(key_id);
        let tenant_spec = config.tenant_spec(tenant);
        let mut base = Vec::new();
        if let Some(spec) = key {
            base.extend(self.counter(
                Scope::Key {
                    id: key_id.to_owned(),
                    model: None,
                },
                spec.rates(),
            ));
        }
        if let Some(spec) = tenant_spec {
            base.extend(self.counter(
                Scope::Tenant {
                    name: tenant.to_owned(),
                    model: None,
                },
                spec.rates(),
            ));
        }
        let mut models: Vec<&String> = key
            .iter()
            .chain(tenant_spec.iter())
            .flat_map(|s| s.models.keys())
            .collect();
        models.sort();
        models.dedup();
        let mut by_model = HashMap::default();
        for model in models {
            let mut counters = base.clone();
            if let Some(m) = key.and_then(|s| s.models.get(model)) {
                counters.extend(self.counter(
                    Scope::Key {
                        id: key_id.to_owned(),
                        model: Some(model.clone()),
                    },
                    m.rates(),
                ));
            }
            if let Some(m) = tenant_spec.and_then(|s| s.models.get(model)) {
                counters.extend(self.counter(
                    Scope::Tenant {
                        name: tenant.to_owned(),
                        model: Some(model.clone()),
                    },
                    m.rates(),
                ));
            }
            debug_assert!(counters.len() <= MAX_COUNTERS);
            by_model.insert(model.clone(), Arc::new(Plan { counters }));
        }
        CallerPlans {
            base: (!base.is_empty()).then(|| Arc::new(Plan { counters: base })),
            by_model,
        }
    }
}

// ---------------------------------------------------------------- limiter

/// What is left of a caller's limits after a request: for each kind, the
/// counter with the least left.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quota {
    pub requests: Option<Headroom>,
    pub tokens: Option<Headroom>,
    pub daily_tokens: Option<Headroom>,
}

impl Quota {
    fn of(plan: &Plan, states: &[gcra::State], now: f64) -> Quota {
        let mut q = Quota::default();
        for (c, s) in plan.counters.iter().zip(states) {
            let [r, t, d] = gcra::headroom(s, &c.rates, now);
            for (slot, h) in [
                (&mut q.requests, r),
                (&mut q.tokens, t),
                (&mut q.daily_tokens, d),
            ] {
                if let Some(h) = h
                    && slot.is_none_or(|old| h.remaining < old.remaining)
                {
                    *slot = Some(h);
                }
            }
        }
        q
    }
}

/// Most counters a plan has: its key's, its tenant's, and each one's entry
/// for the model.
pub const MAX_COUNTERS: usize = 4;

/// Whether a request passes every counter of `plan` (in `states`, in
/// the plan's order) at `now`: the counters' new request TATs (the first
/// `states.len()`), or the refusal that waits longest. Allocates nothing
/// on the way that admits (every request's).
fn decide(
    plan: &Plan,
    states: &[gcra::State],
    now: f64,
) -> Result<[f64; MAX_COUNTERS], LimitError> {
    let mut refused: Option<(&Counter, gcra::Refusal)> = None;
    let mut tats = [0.0; MAX_COUNTERS];
    for ((c, s), tat) in plan.counters.iter().zip(states).zip(&mut tats) {
        match gcra::admit(s, &c.rates, now) {
            Ok(t) => *tat = t,
            Err(r) => {
                if refused.is_none_or(|(_, old)| r.retry_after_us > old.retry_after_us) {
                    refused = Some((c, r));
                }
            }
        }
    }
    match refused {
        None => Ok(tats),
        Some((c, refusal)) => Err(LimitError::Refused {
            who: c.who.clone(),
            refusal,
            quota: Box::new(Quota::of(plan, states, now)),
        }),
    }
}

/// Why [`Limiter::admit`] refused a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LimitError {
    #[error("{}", refused_message(.who, .refusal))]
    Refused {
        /// The counter that refused, as a phrase.
        who: String,
        refusal: gcra::Refusal,
        quota: Box<Quota>,
    },
    /// The Redis backend cannot be reached and `on_redis_error = "refuse"`.
    #[error(
        "The rate limiter's store (Redis) cannot be reached, and this gateway refuses requests it cannot count ([limits] on_redis_error = \"refuse\"); retry shortly"
    )]
    Unavailable,
}

fn refused_message(who: &str, r: &gcra::Refusal) -> String {
    let secs = retry_after_secs(r.retry_after_us);
    match r.kind {
        LimitKind::RequestsPerMinute => format!(
            "Rate limit reached for {who} on requests per minute: limit {}. Retry after {secs} s (the Retry-After header).",
            r.limit
        ),
        LimitKind::TokensPerMinute => format!(
            "Rate limit reached for {who} on tokens per minute: limit {}. Retry after {secs} s (the Retry-After header).",
            r.limit
        ),
        LimitKind::DailyTokens => format!(
            "You exceeded the daily token budget of {who}: {} tokens. It renews at 00:00 UTC, in {secs} s (the Retry-After header); an operator can raise daily_tokens in [limits].",
            r.limit
        ),
    }
}

/// Whole seconds to wait, at least one.
pub fn retry_after_secs(us: f64) -> u64 {
    ((us / 1e6).ceil() as u64).max(1)
}

impl LimitError {
    pub fn retry_after_secs(&self) -> u64 {
        match self {
            LimitError::Refused { refusal, .. } => retry_after_secs(refusal.retry_after_us),
            LimitError::Unavailable => 1,
        }
    }

    pub fn quota(&self) -> Option<&Quota> {
        match self {
            LimitError::Refused { quota, .. } => Some(&**quota),
            LimitError::Unavailable => None,
        }
    }
}

enum Store {
    Memory(memory::MemoryStore),
    Redis(Box<redis_store::RedisStore>),
}

/// Every caller's limits and where their counters are kept.
pub struct Limiter {
    store: Store,
    by_key: HashMap<String, CallerPlans, FnvBuild>,
    /// Plans of callers without a configured key (open inference).
    anonymous: CallerPlans,
    /// No caller has any rate or budget.
    empty: bool,
    /// Every counter, once.
    counters: Vec<Arc<Counter>>,
}

impl Limiter {
    /// The limiter of `config` for the configured keys (`(id, tenant)`).
    /// With the Redis backend this must run inside a Tokio runtime, whose
    /// tasks keep the connection (it connects on first use).
    pub fn new<'a>(
        config: &LimitsConfig,
        keys: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> Limiter {
        let mut builder = PlanBuilder {
            config,
            counters: HashMap::new(),
        };
        let by_key: HashMap<String, CallerPlans, FnvBuild> = keys
            .map(|(id, tenant)| (id.to_owned(), builder.caller(id, tenant)))
            .collect();
        let anonymous = builder.caller(ANONYMOUS, ANONYMOUS);
        let store = match config.backend {
            Backend::Memory => Store::Memory(memory::MemoryStore::new(builder.counters.len())),
            Backend::Redis => Store::Redis(Box::new(redis_store::RedisStore::new(config))),
        };
        let unlimited = |p: &CallerPlans| p.base.is_none() && p.by_model.is_empty();
        let empty = unlimited(&anonymous) && by_key.values().all(unlimited);
        Limiter {
            store,
            by_key,
            anonymous,
            empty,
            counters: builder.counters.into_values().collect(),
        }
    }

    /// Whether no caller has any rate or budget (nothing to check or count).
    pub fn is_empty(&self) -> bool {
        self.empty
    }

    /// The counters of `key_id`'s requests for `model`; `None` when no
    /// limit applies to them.
    pub fn plan(&self, key_id: &str, model: &str) -> Option<&Arc<Plan>> {
        let plans = self.by_key.get(key_id).unwrap_or(&self.anonymous);
        plans.by_model.get(model).or(plans.base.as_ref())
    }

    /// Takes one request from every counter of `plan`, or from none: what
    /// is left, or why not.
    pub async fn admit(&self, plan: &Plan) -> Result<Quota, LimitError> {
        match &self.store {
            Store::Memory(m) => m.admit(plan),
            Store::Redis(r) => r.admit(plan).await,
        }
    }

    /// What is left of `plan`'s limits, taking nothing; nothing is known
    /// (all `None`) when the shared store cannot be reached.
    pub async fn peek(&self, plan: &Plan) -> Quota {
        match &self.store {
            Store::Memory(m) => m.peek(plan),
            Store::Redis(r) => r.peek(plan).await,
        }
    }

    /// Charges `tokens` read or produced to every counter of `plan` that
    /// counts tokens. With Redis the call is sent on its own task.
    pub fn charge(&self, plan: &Arc<Plan>, tokens: u64) {
        if tokens == 0 {
            return;
        }
        match &self.store {
            Store::Memory(m) => m.charge(plan, tokens),
            Store::Redis(r) => r.charge(plan, tokens),
        }
    }

    /// Sets what each daily budget kept in this process has used today,
    /// from `used_today(counter)` (the usage ledger, which outlives a
    /// restart); Redis keeps its own across restarts.
    pub fn restore_daily_usage(&self, used_today: impl Fn(&Counter) -> u64) {
        if let Store::Memory(m) = &self.store {
            for c in self
                .counters
                .iter()
                .filter(|c| c.rates.daily_tokens.is_some())
            {
                m.restore_day(c, used_today(c), now_us());
            }
        }
    }

    /// Whether any counter has a daily budget.
    pub fn has_daily_budgets(&self) -> bool {
        self.counters.iter().any(|c| c.rates.daily_tokens.is_some())
    }

    /// Tokens worth batching before a charge: every token in this
    /// process's memory, larger batches when each charge is a Redis call.
    pub fn charge_batch(&self) -> u64 {
        match &self.store {
            Store::Memory(_) => 1,
            Store::Redis(_) => 64,
        }
    }
}

/// Now on [`gcra`]'s time scale, from this machine's clock.
fn now_us() -> f64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (since.as_secs() as f64 - gcra::EPOCH_SECS as f64) * 1e6 + f64::from(since.subsec_micros())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml_text: &str) -> LimitsConfig {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn plans_name_the_key_the_tenant_and_their_model_entries() {
        let c = config(
            "[keys.a]\nrequests_per_minute = 2\n[tenants.t]\ntokens_per_minute = 100\n[tenants.t.models.m]\nrequests_per_minute = 1\n",
        );
        let keys = [("a", "t"), ("b", "t"), ("c", "u")];
        c.validate(keys.iter().copied()).unwrap();
        let l = Limiter::new(&c, keys.iter().copied());
        let ids = |p: Option<&Arc<Plan>>| {
            p.map(|p| {
                p.counters
                    .iter()
                    .map(|c| c.id.to_string())
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(ids(l.plan("a", "x")).unwrap(), ["key:a", "tenant:t"]);
        assert_eq!(
            ids(l.plan("a", "m")).unwrap(),
            ["key:a", "tenant:t", "tenant:t:model:m"]
        );
        assert_eq!(
            ids(l.plan("b", "m")).unwrap(),
            ["tenant:t", "tenant:t:model:m"]
        );
        assert_eq!(ids(l.plan("c", "m")), None);
        assert_eq!(ids(l.plan("nobody", "m")), None);
        // Keys of one tenant share its counter.
        let slot = |k: &str| {
            l.plan(k, "x")
                .unwrap()
                .counters
                .iter()
                .find(|c| &*c.id == "tenant:t")
                .unwrap()
                .slot
        };
        assert_eq!(slot("a"), slot("b"));
    }

    #[test]
    fn typos_and_zero_limits_are_errors() {
        let keys = [("a", "t")];
        let err = |s: &str| config(s).validate(keys.iter().copied()).unwrap_err();
        assert!(
            err("[keys.x]\nrequests_per_minute = 1\n").contains("no [[keys]] entry has id 'x'")
        );
        assert!(
            err("[tenants.z]\nrequests_per_minute = 1\n")
                .contains("no [[keys]] entry has tenant 'z'")
        );
        assert!(err("[tenants.t]\ntokens_per_minute = 0\n").contains("omit it"));
        assert!(err("[tenants.t.models.m]\ndaily_tokens = 0\n").contains("models.m.daily_tokens"));
        assert!(err("backend = \"redis\"\n").contains("redis_url"));
        assert!(
            toml::from_str::<LimitsConfig>("[tenants.t.models.m]\nmax_concurrent_requests = 1\n")
                .is_err()
        );
        config("[tenants.anonymous]\nrequests_per_minute = 1\n")
            .validate(keys.iter().copied())
            .unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn memory_store_refuses_all_or_nothing() {
        let c = config("[keys.a]\nrequests_per_minute = 1\n[tenants.t]\nrequests_per_minute = 2\n");
        let keys = [("a", "t"), ("b", "t")];
        let l = Limiter::new(&c, keys.iter().copied());
        let (a, b) = (
            Arc::clone(l.plan("a", "m").unwrap()),
            Arc::clone(l.plan("b", "m").unwrap()),
        );
        let q = l.admit(&a).await.unwrap();
        assert_eq!(q.requests.unwrap().remaining, 0);
        // The key's own limit refuses; the tenant's counter is not taken.
        let e = l.admit(&a).await.unwrap_err();
        assert!(e.to_string().contains("API key 'a'"), "{e}");
        l.admit(&b).await.unwrap();
        let e = l.admit(&b).await.unwrap_err();
        assert!(e.to_string().contains("tenant 't'"), "{e}");
        assert!(e.retry_after_secs() >= 29);
    }
}
