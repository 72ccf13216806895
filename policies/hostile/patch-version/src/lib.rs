//! A router built against `mlxgate:policy@0.1.1`: patch versions of the
//! interface are compatible, so upload must succeed and calls must work.

wit_bindgen::generate!({ path: "wit", world: "router-policy" });

use exports::mlxgate::policy::router::{BackendState, Guest, RequestFacts, RouteDecision};

struct V011;

impl Guest for V011 {
    fn init(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn route(facts: RequestFacts, _backends: Vec<BackendState>) -> RouteDecision {
        RouteDecision::Local(facts.model)
    }
}

export!(V011);
