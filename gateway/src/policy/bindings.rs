//! Host-side bindings for the guest worlds in `guest-sdk/wit/policy.wit`, one
//! module per world. The `types` interface is generated once (in `router`) and
//! shared, so request facts are one Rust type for every kind. [`Packed`]
//! turns the host's facts into that type.

/// Router world; home of the shared `mlxgate:policy/types` types.
pub mod router {
    wasmtime::component::bindgen!({
        path: "../guest-sdk/wit",
        world: "router-policy",
        additional_derives: [PartialEq],
    });
}

/// Adapter-selector world.
pub mod adapter {
    wasmtime::component::bindgen!({
        path: "../guest-sdk/wit",
        world: "adapter-selector-policy",
        with: {
            "mlxgate:policy/types": super::router::mlxgate::policy::types,
        },
    });
}

/// Dataset-transform world.
pub mod dataset {
    wasmtime::component::bindgen!({
        path: "../guest-sdk/wit",
        world: "dataset-transform-policy",
    });
}

pub use router::mlxgate::policy::types::BackendKind;

use super::types::{AdapterInfo, BackendState, RequestFacts};
use router::mlxgate::policy::types as wit;

/// Each backend of a router call and its latency: what
/// `backend-stats.latency-ms` answers from during the call (shared with
/// the store, not copied into it).
pub(crate) type Latencies = std::sync::Arc<[(String, Option<f32>)]>;

/// The arguments of a router or adapter-selector call in the WIT shape:
/// every string (facts, then backend names or adapter ids) appended to the
/// facts' one text, so lowering them into the guest takes three allocation
/// calls into it (text, headers, items) whatever the number of strings.
pub(crate) struct Packed<T> {
    pub(crate) facts: wit::RequestFacts,
    pub(crate) items: Vec<T>,
    /// A router's backends and their latency, which it may ask for during
    /// the call (`backend-stats.latency-ms`); empty for other kinds.
    pub(crate) latencies: Latencies,
    /// What `caller-quota.remaining` answers during a router call.
    pub(crate) quota: super::types::Quota,
}

impl Packed<wit::BackendState> {
    pub(crate) fn router(facts: &RequestFacts, backends: &[BackendState]) -> Self {
        let mut packed = Packed::new(facts, backends, |text, b| wit::BackendState {
            name: text.span(&b.name),
            kind: b.kind,
            healthy: b.healthy,
            in_flight: b.in_flight,
            queue_depth: b.queue_depth,
        });
        packed.latencies = backends
            .iter()
            .map(|b| (b.name.clone(), b.latency_ms))
            .collect::<Vec<_>>()
            .into();
        packed
    }
}

impl Packed<wit::AdapterInfo> {
    pub(crate) fn selector(facts: &RequestFacts, adapters: &[AdapterInfo]) -> Self {
        Packed::new(facts, adapters, |text, a| wit::AdapterInfo {
            id: text.span(&a.id),
            rank: a.rank,
            scale: a.scale,
            base_model: text.span(&a.base_model),
        })
    }
}

impl<T> Packed<T> {
    fn new<I>(f: &RequestFacts, items: &[I], pack: impl Fn(&mut Text, &I) -> T) -> Self {
        let mut text = Text(String::with_capacity(256));
        let mut facts = wit::RequestFacts {
            text: String::new(),
            method: text.span(f.method),
            path: text.span(f.path),
            model: text.span(f.model),
            headers: f
                .headers
                .iter()
                .map(|(name, value)| wit::Header {
                    name: text.span(name),
                    value: text.span(value),
                })
                .collect(),
            api_key_id: text.span(f.api_key_id.unwrap_or_default()),
            tenant: text.span(f.tenant.unwrap_or_default()),
            prompt_tokens: f.prompt_tokens,
            max_tokens: f.max_tokens,
            streaming: f.streaming,
        };
        let items = items.iter().map(|i| pack(&mut text, i)).collect();
        facts.text = text.0;
        Packed {
            facts,
            items,
            latencies: Latencies::default(),
            quota: f.quota,
        }
    }
}

/// The text being packed.
struct Text(String);

impl Text {
    /// Appends `s`; its span (offset in the high 32 bits, length in the
    /// low). Facts are bounded by the request body limit, far below 4 GiB; a
    /// longer text would give spans the guest SDK reads as "" rather than a
    /// trap.
    fn span(&mut self, s: &str) -> wit::Span {
        let offset = self.0.len();
        self.0.push_str(s);
        let to_u32 = |n: usize| u64::from(u32::try_from(n).unwrap_or(u32::MAX));
        to_u32(offset) << 32 | to_u32(s.len())
    }
}
