//! A router built against `mlxgate:policy@0.2.0`, a version the host does not
//! speak: upload must fail with an incompatible-version error.

wit_bindgen::generate!({ path: "wit", world: "router-policy" });

use exports::mlxgate::policy::router::{BackendState, Guest, RequestFacts, RouteDecision};

struct V2;

impl Guest for V2 {
    fn init(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn route(facts: RequestFacts, _backends: Vec<BackendState>) -> RouteDecision {
        RouteDecision::Local(facts.model)
    }
}

export!(V2);
