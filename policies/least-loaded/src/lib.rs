//! Least-loaded routing: among healthy backends able to serve the requested
//! model, pick the one with the fewest requests in flight plus queued; ties go
//! to local backends, then to the upstream that starts its answers soonest
//! (its recent latency, asked of the gateway; one not measured yet first),
//! then to the earlier backend in the list.
//!
//! Candidates for a model are the local backend of that name plus every
//! upstream, unless config names them: `{"candidates": {"llama": ["llama",
//! "openai"]}}`. No healthy candidate: 503.

use std::collections::HashMap;

use mlxgate_guest::router::*;
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct LeastLoaded {
    #[serde(default)]
    candidates: HashMap<String, Vec<String>>,
}

impl LeastLoaded {
    fn eligible(&self, model: &str, b: &BackendState) -> bool {
        match self.candidates.get(model) {
            Some(names) => names.iter().any(|n| n == b.name),
            None => b.kind == BackendKind::Upstream || b.name == model,
        }
    }
}

impl Router for LeastLoaded {
    fn init(config: &str) -> Result<Self, String> {
        if config.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_json::from_str(config).map_err(|e| format!("least-loaded config: {e}"))
    }

    fn route(&self, facts: &RequestFacts, backends: &[BackendState]) -> RouteDecision {
        let load = |b: &BackendState| {
            let load = u64::from(b.in_flight) + u64::from(b.queue_depth);
            (load, b.kind != BackendKind::Local)
        };
        // Not measured yet sorts first, so that a new upstream gets tried.
        let latency = |b: &BackendState| b.latency_ms().unwrap_or(0.0);
        let best = backends
            .iter()
            .filter(|b| b.healthy && self.eligible(facts.model, b))
            .min_by(|a, b| {
                load(a)
                    .cmp(&load(b))
                    .then_with(|| latency(a).total_cmp(&latency(b)))
            });
        match best {
            Some(b) if b.kind == BackendKind::Local => RouteDecision::Local(b.name.to_string()),
            Some(b) => RouteDecision::upstream(b.name, None),
            None => RouteDecision::reject(
                503,
                format!("no healthy backend for model `{}`", facts.model),
            ),
        }
    }
}

mlxgate_guest::export_router!(LeastLoaded);
