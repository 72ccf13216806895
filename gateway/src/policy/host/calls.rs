//! Calling policies: the request-time router and adapter selector (on the
//! host's call threads, or directly for dry runs and tests), the dataset
//! transform in batches, and the checks on what a guest answers (sizes,
//! statuses, known adapter ids, one outcome per record).

use std::sync::Arc;
use std::time::Instant;

use super::PolicyHost;
use crate::policy::bindings::{Packed, dataset, router};
use crate::policy::error::{FailureKind, PolicyError};
use crate::policy::pool::PolicyCall;
use crate::policy::reuse::fact_names;
use crate::policy::runtime::{Bound, Budget, Failure, LoadedPolicy, truncate};
use crate::policy::types::{
    AdapterInfo, BackendState, PolicyKind, RecordOutcome, RequestFacts, RouteDecision,
};

/// Most adapters a selector may return.
const MAX_ADAPTERS: usize = 64;

impl PolicyHost {
    /// Asks the bound router where to send a request. On `Err`, callers check
    /// [`PolicyError::is_fail_open`]: true (nothing bound, or a failing
    /// `fail_open` policy) means "use the default route"; false means refuse
    /// (503, mapped in `http/error.rs`).
    pub fn route(
        &self,
        facts: &RequestFacts,
        backends: &[BackendState],
    ) -> Result<RouteDecision, PolicyError> {
        let snap = self.snap();
        decide(snap.bound(PolicyKind::Router)?, facts, || backends)
    }

    /// Whether a router is bound that may read `prompt_tokens`: one that
    /// declared no decision inputs, or declared them including it. The
    /// count costs a tokenization, so requests skip it otherwise.
    pub fn router_reads_prompt_tokens(&self) -> bool {
        let snap = self.snap();
        snap.bound_arc(PolicyKind::Router)
            .is_ok_and(|p| p.decisions.as_ref().is_none_or(|t| t.reads_prompt_tokens()))
    }

    /// Whether the bound router (if any) may read its caller's quota: it
    /// declared no `decision-inputs` (a router that did cannot depend on it).
    pub fn router_reads_quota(&self) -> bool {
        let snap = self.snap();
        snap.bound_arc(PolicyKind::Router)
            .is_ok_and(|p| p.decisions.is_none())
    }

    /// [`PolicyHost::route`] for the request path, to be awaited: the facts
    /// are only gathered when a router is bound (else `Err(NotBound)`, which
    /// is fail-open), and the backend states only when the guest is called.
    /// A reused decision (`policy/reuse.rs`) is answered here, a table
    /// lookup; a guest call runs on the host's call threads
    /// (`policy/pool.rs`), never on the caller's thread, and fails as a
    /// `capacity` failure when their queue is full.
    pub fn route_if_bound<'a>(
        &self,
        facts: impl FnOnce() -> RequestFacts<'a>,
        backends: impl FnOnce() -> Vec<BackendState>,
    ) -> PolicyCall<RouteDecision> {
        let snap = self.snap();
        let p = match snap.bound_arc(PolicyKind::Router) {
            Ok(p) => p,
            Err(e) => return PolicyCall::ready(Err(e)),
        };
        let facts = facts();
        let key = match &p.decisions {
            Some(table) => {
                let key = table.key(&facts);
                if let Some(decision) = table.get(&key) {
                    p.counters.decision_reused();
                    return PolicyCall::ready(Ok(decision));
                }
                Some(key)
            }
            None => None,
        };
        let args = Packed::router(&facts, &backends());
        self.off_thread(Arc::clone(p), move |p| {
            let decision = route_packed(p, &args)?;
            if let (Some(table), Some(key)) = (&p.decisions, key) {
                table.insert(key, decision.clone());
            }
            Ok(decision)
        })
    }

    /// Runs `f` on a call thread; a full queue fails like the guest would,
    /// with `capacity`, under the policy's `on_error`.
    fn off_thread<T: Send + 'static>(
        &self,
        p: Arc<LoadedPolicy>,
        f: impl FnOnce(&LoadedPolicy) -> Result<T, PolicyError> + Send + 'static,
    ) -> PolicyCall<T> {
        let refused = Arc::clone(&p);
        match self.calls.submit(move || f(&p)) {
            Ok(call) => call,
            Err(full) => {
                refused
                    .counters
                    .record(std::time::Duration::ZERO, Some(FailureKind::Capacity));
                PolicyCall::ready(Err(guest_error(
                    &refused,
                    (
                        FailureKind::Capacity,
                        format!(
                            "all {} policy call threads are busy and {} calls are queued; \
                             the call was not made (lower the policy's deadline or fix a slow policy)",
                            full.threads, full.queue
                        ),
                    ),
                )))
            }
        }
    }

    /// Asks the router policy `name` directly (dry runs, tests).
    pub fn route_with(
        &self,
        name: &str,
        facts: &RequestFacts,
        backends: &[BackendState],
    ) -> Result<RouteDecision, PolicyError> {
        let p = self.policy(name, PolicyKind::Router)?;
        decide(&p, facts, || backends)
    }

    /// Asks the bound adapter selector which mounted adapters apply, in
    /// order. `Ok(None)`: no opinion. Every returned id is one of `adapters`.
    pub fn select_adapters(
        &self,
        facts: &RequestFacts,
        adapters: &[AdapterInfo],
    ) -> Result<Option<Vec<String>>, PolicyError> {
        let snap = self.snap();
        select_on(snap.bound(PolicyKind::AdapterSelector)?, facts, adapters)
    }

    /// [`PolicyHost::select_adapters`] for the request path, to be awaited:
    /// the guest call runs on the host's call threads, like
    /// [`PolicyHost::route_if_bound`]'s.
    pub fn select_if_bound(
        &self,
        facts: &RequestFacts,
        adapters: Vec<AdapterInfo>,
    ) -> PolicyCall<Option<Vec<String>>> {
        let p = match self.snap().bound_arc(PolicyKind::AdapterSelector) {
            Ok(p) => Arc::clone(p),
            Err(e) => return PolicyCall::ready(Err(e)),
        };
        let args = Packed::selector(facts, &adapters);
        self.off_thread(p, move |p| select_packed(p, &args, &adapters))
    }

    /// Calls the adapter-selector policy `name` directly.
    pub fn select_adapters_with(
        &self,
        name: &str,
        facts: &RequestFacts,
        adapters: &[AdapterInfo],
    ) -> Result<Option<Vec<String>>, PolicyError> {
        let p = self.policy(name, PolicyKind::AdapterSelector)?;
        select_on(&p, facts, adapters)
    }

    /// Runs the dataset-transform policy `name` on a batch, one outcome per
    /// record, in order. The batch gets `len` times the per-record budget; if
    /// it fails as a whole (trap, budget, memory, wrong outcome count), each
    /// record is retried alone with its own budget, so one bad record only
    /// costs its own `Error` outcome. Keep batches modest (tens of records)
    /// so they fit the memory cap. `Err` only for policy-level problems
    /// (unknown policy, wrong kind).
    pub fn transform_batch(
        &self,
        name: &str,
        records: &[String],
    ) -> Result<Vec<RecordOutcome>, PolicyError> {
        let p = self.policy(name, PolicyKind::DatasetTransform)?;
        if records.is_empty() {
            return Ok(vec![]);
        }
        match transform_on(&p, records) {
            Ok(out) => Ok(out),
            Err((kind, detail)) if records.len() == 1 => Ok(vec![RecordOutcome::Error(format!(
                "policy {kind}: {detail}"
            ))]),
            Err(_) => Ok(records
                .iter()
                .map(|r| match transform_on(&p, std::slice::from_ref(r)) {
                    Ok(mut v) => v.pop().unwrap_or_else(|| {
                        RecordOutcome::Error("policy returned no outcome".to_string())
                    }),
                    Err((kind, detail)) => RecordOutcome::Error(format!("policy {kind}: {detail}")),
                })
                .collect()),
        }
    }

    fn policy(&self, name: &str, kind: PolicyKind) -> Result<Arc<LoadedPolicy>, PolicyError> {
        self.snap().of_kind(name, kind).cloned()
    }
}

pub(super) fn guest_error(p: &LoadedPolicy, (kind, detail): Failure) -> PolicyError {
    PolicyError::Guest {
        policy: p.info.name.clone(),
        kind,
        on_error: p.info.on_error,
        detail,
    }
}

fn bad_output(msg: impl Into<String>) -> Failure {
    (FailureKind::BadOutput, msg.into())
}

/// The router `p`'s decision for `facts`: a reused one when `p` declared its
/// decision inputs and a request agreeing on them was decided before (see
/// `policy/reuse.rs`), else a call, whose decision is then kept.
fn decide<B: AsRef<[BackendState]>>(
    p: &LoadedPolicy,
    facts: &RequestFacts,
    backends: impl FnOnce() -> B,
) -> Result<RouteDecision, PolicyError> {
    let Some(table) = &p.decisions else {
        return route_on(p, facts, backends().as_ref());
    };
    let key = table.key(facts);
    if let Some(decision) = table.get(&key) {
        p.counters.decision_reused();
        return Ok(decision);
    }
    let decision = route_on(p, facts, backends().as_ref())?;
    table.insert(key, decision.clone());
    Ok(decision)
}

/// The facts a router declares its decisions depend on (WIT names), asked
/// once at upload.
pub(super) fn declared_inputs(p: &LoadedPolicy) -> Result<Option<Vec<String>>, PolicyError> {
    p.call(Budget::of(&p.info.limits, 1), |store, b| match b {
        Bound::Router(r) => r.mlxgate_policy_router().call_decision_inputs(store),
        _ => wasmtime::bail!("not a router"),
    })
    .map(|inputs| inputs.map(fact_names))
    .map_err(|f| guest_error(p, f))
}

pub(super) fn route_on(
    p: &LoadedPolicy,
    facts: &RequestFacts,
    backends: &[BackendState],
) -> Result<RouteDecision, PolicyError> {
    route_packed(p, &Packed::router(facts, backends))
}

/// The router call itself, on arguments already packed (owned, so they can
/// go to a call thread).
fn route_packed(
    p: &LoadedPolicy,
    args: &Packed<router::mlxgate::policy::types::BackendState>,
) -> Result<RouteDecision, PolicyError> {
    let start = Instant::now();
    let res = p
        .call(Budget::of(&p.info.limits, 1), |store, b| match b {
            Bound::Router(r) => {
                store.data_mut().latencies = std::sync::Arc::clone(&args.latencies);
                store.data_mut().quota = args.quota;
                store.data_mut().priority = 0;
                let decision =
                    r.mlxgate_policy_router()
                        .call_route(&mut *store, &args.facts, &args.items)?;
                Ok((decision, store.data().priority))
            }
            _ => wasmtime::bail!("not a router"),
        })
        .and_then(|(d, priority)| check_route(d, priority, p.info.limits.max_output_bytes));
    p.counters
        .record(start.elapsed(), res.as_ref().err().map(|f| f.0));
    res.map_err(|f| guest_error(p, f))
}

fn check_route(
    d: router::exports::mlxgate::policy::router::RouteDecision,
    priority: i8,
    max: usize,
) -> Result<RouteDecision, Failure> {
    use router::exports::mlxgate::policy::router::RouteDecision as W;
    let sized = |what: &str, s: &str| {
        if s.len() > max {
            Err(bad_output(format!(
                "{what} is {} bytes, over the {max}-byte output limit",
                s.len()
            )))
        } else {
            Ok(())
        }
    };
    match d {
        W::Local(model) => {
            sized("model", &model)?;
            if model.is_empty() {
                return Err(bad_output("empty local model name"));
            }
            Ok(RouteDecision::Local { model, priority })
        }
        W::Upstream(t) => {
            sized("upstream name", &t.name)?;
            if let Some(m) = &t.model {
                sized("model", m)?;
            }
            if t.name.is_empty() {
                return Err(bad_output("empty upstream name"));
            }
            Ok(RouteDecision::Upstream {
                name: t.name,
                model: t.model,
            })
        }
        W::Reject(r) => {
            sized("reject message", &r.message)?;
            if !(400..=599).contains(&r.status) {
                return Err(bad_output(format!(
                    "reject status {} is not 4xx/5xx",
                    r.status
                )));
            }
            Ok(RouteDecision::Reject {
                status: r.status,
                message: r.message,
            })
        }
    }
}

pub(super) fn select_on(
    p: &LoadedPolicy,
    facts: &RequestFacts,
    adapters: &[AdapterInfo],
) -> Result<Option<Vec<String>>, PolicyError> {
    select_packed(p, &Packed::selector(facts, adapters), adapters)
}

/// The selector call itself, on arguments already packed; `adapters` are
/// the ones packed, to check the answer against.
fn select_packed(
    p: &LoadedPolicy,
    args: &Packed<router::mlxgate::policy::types::AdapterInfo>,
    adapters: &[AdapterInfo],
) -> Result<Option<Vec<String>>, PolicyError> {
    let start = Instant::now();
    let res = p
        .call(Budget::of(&p.info.limits, 1), |store, b| match b {
            Bound::Adapter(a) => {
                a.mlxgate_policy_adapter_selector()
                    .call_select(store, &args.facts, &args.items)
            }
            _ => wasmtime::bail!("not an adapter selector"),
        })
        .and_then(|ids| {
            let Some(ids) = ids else { return Ok(None) };
            if ids.len() > MAX_ADAPTERS {
                return Err(bad_output(format!(
                    "{} adapters returned, at most {MAX_ADAPTERS} allowed",
                    ids.len()
                )));
            }
            for (i, id) in ids.iter().enumerate() {
                if !adapters.iter().any(|a| &a.id == id) {
                    return Err(bad_output(format!(
                        "unknown adapter `{}`",
                        truncate(id.clone(), 128)
                    )));
                }
                if ids[..i].contains(id) {
                    return Err(bad_output(format!("adapter `{id}` returned twice")));
                }
            }
            Ok(Some(ids))
        });
    p.counters
        .record(start.elapsed(), res.as_ref().err().map(|f| f.0));
    res.map_err(|f| guest_error(p, f))
}

pub(super) fn transform_on(
    p: &LoadedPolicy,
    records: &[String],
) -> Result<Vec<RecordOutcome>, Failure> {
    use dataset::exports::mlxgate::policy::dataset_transform::RecordOutcome as W;
    let start = Instant::now();
    let max = p.info.limits.max_output_bytes;
    let units = records.len() as u64;
    let res = p
        .call(Budget::of(&p.info.limits, units), |store, b| match b {
            Bound::Dataset(d) => d
                .mlxgate_policy_dataset_transform()
                .call_transform(store, records),
            _ => wasmtime::bail!("not a dataset transform"),
        })
        .and_then(|outs| {
            if outs.len() != records.len() {
                return Err(bad_output(format!(
                    "{} outcomes for {} records",
                    outs.len(),
                    records.len()
                )));
            }
            Ok(outs
                .into_iter()
                .map(|o| match o {
                    W::Keep(s) if s.len() > max => RecordOutcome::Error(format!(
                        "output is {} bytes, over the {max}-byte limit",
                        s.len()
                    )),
                    W::Keep(s) => RecordOutcome::Keep(s),
                    W::Drop(s) => RecordOutcome::Drop(truncate(s, 1024)),
                    W::Error(s) => RecordOutcome::Error(truncate(s, 1024)),
                })
                .collect())
        });
    p.counters
        .record(start.elapsed(), res.as_ref().err().map(|f| f.0));
    res
}
