//! Adapter selection by tenant: each tenant gets its configured LoRA adapters,
//! in order, among those mounted on the requested base model.
//!
//! Config: `{"tenants": {"acme": ["acme-sql", "acme-tone"]}, "default": []}`.
//! Unknown tenant: `default` when set, otherwise no opinion.

use std::collections::HashMap;

use mlxgate_guest::adapter::*;
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AdapterByTenant {
    #[serde(default)]
    tenants: HashMap<String, Vec<String>>,
    default: Option<Vec<String>>,
}

impl AdapterSelector for AdapterByTenant {
    fn init(config: &str) -> Result<Self, String> {
        if config.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_json::from_str(config).map_err(|e| format!("adapter-by-tenant config: {e}"))
    }

    fn select(&self, facts: &RequestFacts, adapters: &[AdapterInfo]) -> Option<Vec<String>> {
        let wanted = facts
            .tenant
            .and_then(|t| self.tenants.get(t))
            .or(self.default.as_ref())?;
        Some(
            wanted
                .iter()
                .filter(|id| {
                    adapters
                        .iter()
                        .any(|a| a.id == id.as_str() && a.base_model == facts.model)
                })
                .cloned()
                .collect(),
        )
    }
}

mlxgate_guest::export_adapter_selector!(AdapterByTenant);
