//! Quota spillover: serves a caller locally while its `[limits]` budget for
//! the requested model lasts, then sends it to an upstream instead of
//! letting the gateway refuse it. Config:
//! ```json
//! {"upstream": "openai", "model": "gpt-4o-mini", "min_tokens": 200}
//! ```
//! A request spills over when the caller has fewer than `min_tokens`
//! (default 1) tokens left this minute or today, or no request left this
//! minute. `model` (optional) rewrites the model name upstream; give the
//! upstream's model its own `[limits]` entry (or none) so it is not
//! refused by the budget it spills from.

use mlxgate_guest::router::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    upstream: String,
    model: Option<String>,
    #[serde(default = "one")]
    min_tokens: u64,
}

fn one() -> u64 {
    1
}

struct QuotaSpillover(Config);

impl Router for QuotaSpillover {
    fn init(config: &str) -> Result<Self, String> {
        let config: Config = serde_json::from_str(config)
            .map_err(|e| format!("config: {e} (expected {{\"upstream\": NAME, \"model\": MODEL?, \"min_tokens\": N?}})"))?;
        Ok(QuotaSpillover(config))
    }

    fn route(&self, facts: &RequestFacts, _backends: &[BackendState]) -> RouteDecision {
        let left = caller_quota();
        let short = |tokens: Option<u64>| tokens.is_some_and(|n| n < self.0.min_tokens);
        let spent = left.requests_per_minute == Some(0)
            || short(left.tokens_per_minute)
            || short(left.daily_tokens);
        if spent {
            RouteDecision::upstream(&self.0.upstream, self.0.model.clone())
        } else {
            RouteDecision::Local(facts.model.to_string())
        }
    }

    // `decision_inputs` stays `None`: the quota changes with every
    // request, so no decision may be kept.
}

mlxgate_guest::export_router!(QuotaSpillover);
