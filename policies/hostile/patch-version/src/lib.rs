//! A router built against `mlxgate:policy@0.3.0`, without the SDK: patch versions of the
//! interface are compatible, so upload must succeed and calls must work.

wit_bindgen::generate!({ path: "wit", world: "router-policy" });

use exports::mlxgate::policy::router::{BackendState, FactSet, Guest, RequestFacts, RouteDecision};

struct V030;

impl Guest for V030 {
    fn init(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn route(facts: RequestFacts, _backends: Vec<BackendState>) -> RouteDecision {
        // The raw interface: strings are spans of the facts' one text.
        let (start, len) = ((facts.model >> 32) as usize, facts.model as u32 as usize);
        let model = &facts.text[start..start + len];
        RouteDecision::Local(model.to_string())
    }

    fn decision_inputs() -> Option<FactSet> {
        None
    }
}

export!(V030);
