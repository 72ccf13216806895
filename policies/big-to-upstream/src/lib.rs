//! The guest SDK README's complete router (`guest-sdk/README.md`, "A
//! complete router"), kept word for word: `tests/routing_prompt_tokens.rs`
//! checks the two agree and routes with it.

use mlxgate_guest::router::*;

/// Sends "big" prompts upstream, the rest to the local model asked for.
struct BigToUpstream {
    threshold: u32,
}

impl Router for BigToUpstream {
    fn init(config: &str) -> Result<Self, String> {
        // config is what the operator passed at upload ("" if nothing).
        let threshold = if config.is_empty() { 4096 } else {
            config.trim().parse().map_err(|e| format!("bad threshold: {e}"))?
        };
        Ok(BigToUpstream { threshold })
    }

    fn route(&self, facts: &RequestFacts, _backends: &[BackendState]) -> RouteDecision {
        if facts.prompt_tokens > self.threshold {
            RouteDecision::upstream("openai", None)
        } else {
            RouteDecision::Local(facts.model.to_string())
        }
    }
}

mlxgate_guest::export_router!(BigToUpstream);
