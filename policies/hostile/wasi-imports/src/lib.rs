//! A router that reads an environment variable. Built for `wasm32-wasip2`
//! (see `scripts/build-policies.sh`) it imports `wasi:cli/environment`, so
//! upload must fail with `unsatisfied_imports`: guests get no capabilities.

use mlxgate_guest::router::*;

struct EnvRouter(String);

impl Router for EnvRouter {
    fn init(_config: &str) -> Result<Self, String> {
        Ok(EnvRouter(
            std::env::var("MODEL").unwrap_or_else(|_| "default".to_string()),
        ))
    }

    fn route(&self, _facts: &RequestFacts, _backends: &[BackendState]) -> RouteDecision {
        RouteDecision::Local(self.0.clone())
    }
}

mlxgate_guest::export_router!(EnvRouter);
