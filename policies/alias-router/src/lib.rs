//! Model aliasing: maps public model names to served ones and rejects
//! unknown models with a 404 before any backend sees the request.
//!
//! Config: `{"aliases": {"gpt-4o": "llama-3-8b"}, "models": ["qwen-7b"]}`.
//! Known models are the local backends plus `models`; an alias must resolve to
//! a known model. Without config, only local backend names are accepted.

use std::collections::HashMap;

use mlxgate_guest::router::*;
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AliasRouter {
    #[serde(default)]
    aliases: HashMap<String, String>,
    #[serde(default)]
    models: Vec<String>,
}

impl Router for AliasRouter {
    fn init(config: &str) -> Result<Self, String> {
        if config.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_json::from_str(config).map_err(|e| format!("alias-router config: {e}"))
    }

    fn route(&self, facts: &RequestFacts, backends: &[BackendState]) -> RouteDecision {
        let target = self
            .aliases
            .get(facts.model)
            .map_or(facts.model, String::as_str);
        let served = backends
            .iter()
            .any(|b| b.kind == BackendKind::Local && b.name == target)
            || self.models.iter().any(|m| m == target);
        if served {
            RouteDecision::Local(target.to_string())
        } else {
            RouteDecision::reject(404, format!("The model `{}` does not exist", facts.model))
        }
    }
}

mlxgate_guest::export_router!(AliasRouter);
