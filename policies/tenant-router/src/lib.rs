//! Tenant router: sends each tenant to its own local model or upstream and
//! enforces a per-tenant deny list of requested models.
//!
//! The tenant comes from the API key (trusted); only when the key has none is
//! the configured header consulted. Config:
//! ```json
//! {"header": "x-tenant",
//!  "tenants": {"acme": {"local": "llama-3-8b", "deny": ["gpt-4o"], "priority": 1},
//!              "globex": {"upstream": "openai", "model": "gpt-4o-mini"}},
//!  "unknown": "reject"}
//! ```
//! `unknown` is `"reject"` (403) or `"pass"` (serve the requested model locally).
//! `priority` (-128 to 127, default 0) is the tenant's class while its
//! requests wait for a local model: higher classes start first.

use std::collections::HashMap;

use mlxgate_guest::router::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default = "default_header")]
    header: String,
    #[serde(default)]
    tenants: HashMap<String, Tenant>,
    #[serde(default)]
    unknown: Unknown,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Tenant {
    local: Option<String>,
    upstream: Option<String>,
    model: Option<String>,
    #[serde(default)]
    deny: Vec<String>,
    #[serde(default)]
    priority: i8,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Unknown {
    #[default]
    Reject,
    Pass,
}

fn default_header() -> String {
    "x-tenant".to_string()
}

struct TenantRouter(Config);

impl Router for TenantRouter {
    fn init(config: &str) -> Result<Self, String> {
        let config = if config.trim().is_empty() {
            "{}"
        } else {
            config
        };
        let cfg: Config =
            serde_json::from_str(config).map_err(|e| format!("tenant-router config: {e}"))?;
        for (name, t) in &cfg.tenants {
            if t.local.is_some() && t.upstream.is_some() {
                return Err(format!(
                    "tenant `{name}`: set `local` or `upstream`, not both"
                ));
            }
        }
        Ok(TenantRouter(cfg))
    }

    fn route(&self, facts: &RequestFacts, _backends: &[BackendState]) -> RouteDecision {
        let cfg = &self.0;
        let tenant = facts.tenant.or_else(|| facts.header(&cfg.header));
        let Some(t) = tenant.and_then(|n| cfg.tenants.get(n)) else {
            return match cfg.unknown {
                Unknown::Pass => RouteDecision::Local(facts.model.to_string()),
                Unknown::Reject => RouteDecision::reject(403, "unknown tenant"),
            };
        };
        if t.deny.iter().any(|m| m == facts.model) {
            return RouteDecision::reject(
                403,
                format!("model `{}` is not allowed for this tenant", facts.model),
            );
        }
        if t.priority != 0 {
            set_priority(t.priority);
        }
        match (&t.local, &t.upstream) {
            (Some(local), _) => RouteDecision::Local(local.clone()),
            (None, Some(up)) => RouteDecision::upstream(up.clone(), t.model.clone()),
            (None, None) => RouteDecision::Local(facts.model.to_string()),
        }
    }

    /// Decisions follow from the tenant (key or header) and the model
    /// alone, so the gateway may reuse them.
    fn decision_inputs(&self) -> Option<FactSet> {
        Some(FactSet::TENANT | FactSet::HEADERS | FactSet::MODEL)
    }
}

mlxgate_guest::export_router!(TenantRouter);
