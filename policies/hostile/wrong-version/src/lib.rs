//! A router built against `mlxgate:policy@0.1.0`, the interface before packed
//! facts, which the host no longer speaks: upload must fail with an
//! incompatible-version error (422).

wit_bindgen::generate!({ path: "wit", world: "router-policy" });

use exports::mlxgate::policy::router::{BackendState, Guest, RequestFacts, RouteDecision};

struct V010;

impl Guest for V010 {
    fn init(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn route(facts: RequestFacts, _backends: Vec<BackendState>) -> RouteDecision {
        RouteDecision::Local(facts.model)
    }
}

export!(V010);
