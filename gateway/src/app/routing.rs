//! Where an inference request goes: the bound router policy's decision (a
//! local model, a configured upstream, or a refusal), or the default route
//! when none is bound or a `fail_open` one failed (the upstream whose
//! `[[upstreams]] models` lists the model, otherwise the model locally).
//!
//! Guest calls never run on the async worker: they go to the policy host's
//! few call threads (`policy/pool.rs`) and are awaited, bounded by the
//! policy's deadline (5 ms by default, at most 1 s for request-time
//! policies); a full call queue is a guest failure, so `fail_open` /
//! `fail_closed` applies. A router that declared its decision inputs is
//! called once per distinct combination of them (`policy/reuse.rs`); a
//! reused decision is a table lookup, answered inline without a thread hop.

use std::sync::Arc;

use super::App;
use crate::policy::{
    BackendKind, BackendState, PolicyError, PolicyHost, RequestFacts, RouteDecision,
};
use crate::upstream::{Upstream, UpstreamError};

/// Where a request goes.
#[derive(Clone)]
pub enum Destination {
    /// Serve with this local model, the request in this priority class
    /// (a router's choice; higher starts first).
    Local { model: String, priority: i8 },
    /// Forward to the first of these configured upstreams that answers
    /// (never empty; see `upstream/fallback.rs`), with `model` rewritten if
    /// given.
    Upstream {
        order: Vec<Arc<Upstream>>,
        model: Option<String>,
    },
}

/// A request refused by routing, or an upstream that failed.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The router's `reject(status, message)`.
    /// `status` is the router's, within 400..=599.
    #[error("{message}")]
    Rejected { status: u16, message: String },
    /// The router failed and is configured `fail_closed`, or the policy
    /// store could not be opened.
    #[error("{0}")]
    PolicyFailed(String),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

impl App {
    /// The policy host, if this data dir has a policy store. Cached once
    /// found, so the common case costs one atomic load.
    pub async fn policy_host(&self) -> Result<Option<Arc<PolicyHost>>, RouteError> {
        if let Some(h) = self.policies.opened() {
            return Ok(Some(h));
        }
        if !self.policies.stored() {
            return Ok(None);
        }
        let policies = Arc::clone(&self.policies);
        let opened = tokio::task::spawn_blocking(move || policies.open())
            .await
            .map_err(|e| RouteError::PolicyFailed(format!("policy host task failed: {e}")))?;
        match opened {
            Ok(h) => Ok(Some(h)),
            Err(e) => {
                tracing::error!(error = %e, "cannot open the policy store; refusing routed requests");
                Err(RouteError::PolicyFailed(format!(
                    "request refused: the routing policy store cannot be opened ({})",
                    e.code()
                )))
            }
        }
    }

    /// Whether the bound router (if any) may read the prompt's length in
    /// tokens, so the request must count it before routing.
    pub async fn router_reads_prompt_tokens(&self) -> bool {
        matches!(self.policy_host().await, Ok(Some(h)) if h.router_reads_prompt_tokens())
    }

    /// Whether the bound router (if any) may read its caller's quota, so
    /// the request must look it up before routing.
    pub async fn router_reads_quota(&self) -> bool {
        matches!(self.policy_host().await, Ok(Some(h)) if h.router_reads_quota())
    }

    /// Decides where a request for `model` goes. No router bound: the
    /// default route; the facts and backend states are only gathered when a
    /// router is bound.
    pub async fn route<'a>(
        &self,
        model: &str,
        facts: impl FnOnce() -> RequestFacts<'a>,
    ) -> Result<Destination, RouteError> {
        let Some(host) = self.policy_host().await? else {
            return Ok(self.default_route(model));
        };
        match host.route_if_bound(facts, || self.backends()).await {
            Ok(RouteDecision::Local { model, priority }) => {
                Ok(Destination::Local { model, priority })
            }
            Ok(RouteDecision::Upstream { name, model }) => {
                // A decision may name several upstreams, comma-separated,
                // to be tried in order.
                let names: Vec<&str> = name.split(',').map(str::trim).collect();
                let order = self.upstreams.in_order(&names)?;
                Ok(Destination::Upstream { order, model })
            }
            Ok(RouteDecision::Reject { status, message }) => Err(RouteError::Rejected {
                status: status.clamp(400, 599),
                message,
            }),
            Err(e) if e.is_fail_open() => {
                if !matches!(e, PolicyError::NotBound(_)) {
                    tracing::warn!(error = %e, "router policy failed; fail_open: default route");
                }
                Ok(self.default_route(model))
            }
            Err(e) => Err(fail_closed(&e, "routing")),
        }
    }

    /// Where a request goes when no policy decides: the upstream that lists
    /// the model in its `models`, otherwise the requested model, locally.
    fn default_route(&self, model: &str) -> Destination {
        let order = self
            .upstreams
            .for_model(model)
            .and_then(|u| self.upstreams.in_order(&[&u.name]).ok());
        match order {
            Some(order) => Destination::Upstream { order, model: None },
            None => Destination::Local {
                model: model.to_owned(),
                priority: 0,
            },
        }
    }

    /// Backend states for the router: each ready local model, each
    /// upstream. Local load comes from each model's engine (live streams,
    /// not yet admitted).
    fn backends(&self) -> Vec<BackendState> {
        let local = self.models.ready().into_iter().map(|m| {
            let (in_flight, queued) = m.engine.current_load();
            BackendState {
                name: m.id,
                kind: BackendKind::Local,
                healthy: true,
                in_flight: in_flight as u32,
                queue_depth: queued as u32,
                latency_ms: None,
            }
        });
        let upstreams = self.upstreams.statuses().into_iter().map(|u| BackendState {
            name: u.name,
            kind: BackendKind::Upstream,
            healthy: u.healthy,
            in_flight: u.in_flight,
            queue_depth: 0,
            latency_ms: u.latency_ms.map(|ms| ms as f32),
        });
        local.chain(upstreams).collect()
    }
}

/// The refusal for a policy that failed and is configured `fail_closed`;
/// `role` is `routing` or `adapter selection`.
pub(crate) fn fail_closed(e: &PolicyError, role: &str) -> RouteError {
    tracing::warn!(error = %e, role, "policy failed; fail_closed: refusing the request");
    let what = match e {
        PolicyError::Guest { policy, kind, .. } => {
            format!("the {role} policy `{policy}` failed ({kind})")
        }
        other => format!("{role} failed ({})", other.code()),
    };
    RouteError::PolicyFailed(format!(
        "request refused: {what} and is configured fail_closed"
    ))
}
