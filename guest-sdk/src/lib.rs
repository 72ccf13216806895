//! SDK for mlxgate policy guests.
//!
//! Each guest kind (router, adapter selector, dataset transform) is a WIT world
//! in `wit/policy.wit` that exports one versioned interface of the package
//! `mlxgate:policy@0.3.3`. This crate turns each world into a Rust trait with
//! state created once per instance from the operator's configuration string,
//! plus an export macro that wires the trait to the component exports:
//!
//! ```ignore
//! use mlxgate_guest::router::*;
//!
//! struct Echo;
//! impl Router for Echo {
//!     fn init(_config: &str) -> Result<Self, String> { Ok(Echo) }
//!     fn route(&self, facts: &RequestFacts, _backends: &[BackendState]) -> RouteDecision {
//!         RouteDecision::Local(facts.model.to_string())
//!     }
//! }
//! mlxgate_guest::export_router!(Echo);
//! ```
//!
//! Build guests for `wasm32-unknown-unknown` linked by `wasm-component-ld`
//! (see the README): the result is a component with no imports at all.
//! The crate also compiles natively so that it can live in the host workspace;
//! the export macros are only meaningful on `wasm32`.

#![forbid(unsafe_op_in_unsafe_fn)]

/// Raw `wit-bindgen` output, one module per world. Not a stable API: use the
/// per-kind modules below.
#[doc(hidden)]
pub mod bindings {
    /// Router world; also the home of the shared `types` interface.
    pub mod router {
        wit_bindgen::generate!({
            path: "wit",
            world: "router-policy",
            pub_export_macro: true,
            export_macro_name: "__export_router_world",
            default_bindings_module: "mlxgate_guest::bindings::router",
            additional_derives: [PartialEq],
        });
    }

    /// Adapter-selector world, sharing the router's `types`.
    pub mod adapter {
        wit_bindgen::generate!({
            path: "wit",
            world: "adapter-selector-policy",
            pub_export_macro: true,
            export_macro_name: "__export_adapter_world",
            default_bindings_module: "mlxgate_guest::bindings::adapter",
            with: {
                "mlxgate:policy/types@0.3.3": crate::bindings::router::mlxgate::policy::types,
            },
        });
    }

    /// Dataset-transform world.
    pub mod dataset {
        wit_bindgen::generate!({
            path: "wit",
            world: "dataset-transform-policy",
            pub_export_macro: true,
            export_macro_name: "__export_dataset_world",
            default_bindings_module: "mlxgate_guest::bindings::dataset",
            additional_derives: [PartialEq],
        });
    }
}

/// Types shared by the request-time guests: borrowed views of what the
/// host passed. The host sends every string of a call in one text (one copy
/// into the guest instead of one per string); these views resolve its spans,
/// so guests read plain `&str` fields.
pub mod types {
    use crate::bindings::router::mlxgate::policy::types as wit;
    pub use wit::BackendKind;

    /// The span's text (offset in the high 32 bits, length in the low);
    /// "" for a span the text does not hold (the host never sends one, and a
    /// guest must not trap on it).
    fn resolve(text: &str, span: wit::Span) -> &str {
        let start = (span >> 32) as usize;
        let len = (span & u64::from(u32::MAX)) as usize;
        text.get(start..start.saturating_add(len))
            .unwrap_or_default()
    }

    /// A span's text, `None` when empty (no key, or a key without tenant).
    fn resolve_nonempty(text: &str, span: wit::Span) -> Option<&str> {
        Some(resolve(text, span)).filter(|s| !s.is_empty())
    }

    /// What the gateway knows about a request before it is scheduled.
    #[derive(Debug, Clone, Copy)]
    pub struct RequestFacts<'a> {
        /// HTTP method, upper case ("POST").
        pub method: &'a str,
        /// Request path ("/v1/chat/completions").
        pub path: &'a str,
        /// The model the client asked for, verbatim.
        pub model: &'a str,
        /// Identifier of the API key that authenticated the call, if any.
        pub api_key_id: Option<&'a str>,
        /// Tenant of that key, when the key belongs to one (never empty).
        pub tenant: Option<&'a str>,
        /// Prompt length in tokens: for a model served by the gateway,
        /// exact (its chat template and tokenizer, the count its prefill
        /// uses); for any other model an estimate, the body's bytes / 4.
        /// Counted only for routers that may read it (no `decision_inputs`,
        /// or ones naming `PROMPT_TOKENS`); 0 for the others.
        pub prompt_tokens: u32,
        /// `max_tokens` from the request, when given.
        pub max_tokens: Option<u32>,
        /// Whether the client asked for a streamed answer.
        pub streaming: bool,
        text: &'a str,
        headers: &'a [wit::Header],
    }

    impl<'a> RequestFacts<'a> {
        #[doc(hidden)]
        pub fn from_wit(raw: &'a wit::RequestFacts) -> Self {
            let text = raw.text.as_str();
            RequestFacts {
                method: resolve(text, raw.method),
                path: resolve(text, raw.path),
                model: resolve(text, raw.model),
                api_key_id: resolve_nonempty(text, raw.api_key_id),
                tenant: resolve_nonempty(text, raw.tenant),
                prompt_tokens: raw.prompt_tokens,
                max_tokens: raw.max_tokens,
                streaming: raw.streaming,
                text,
                headers: &raw.headers,
            }
        }

        /// The headers the operator selected for policies, (lower-case
        /// name, value), in the host's order.
        pub fn headers(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
            let text = self.text;
            self.headers
                .iter()
                .map(move |h| (resolve(text, h.name), resolve(text, h.value)))
        }

        /// The value of a selected header, by case-insensitive name.
        pub fn header(&self, name: &str) -> Option<&'a str> {
            self.headers()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        }
    }

    /// Load and health of one backend at decision time.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct BackendState<'a> {
        /// Local model name or upstream name.
        pub name: &'a str,
        pub kind: BackendKind,
        pub healthy: bool,
        /// Requests currently being served.
        pub in_flight: u32,
        /// Requests waiting for a slot.
        pub queue_depth: u32,
    }

    impl<'a> BackendState<'a> {
        /// Moving average, in milliseconds, of the time this backend took to
        /// start its answers (asked of the gateway when called): `None` for
        /// a local model and for an upstream not measured yet. A router that
        /// reads it depends on the backends' state, so its
        /// `decision_inputs` must be `None`.
        pub fn latency_ms(&self) -> Option<f32> {
            crate::bindings::router::mlxgate::policy::backend_stats::latency_ms(self.name)
        }

        #[doc(hidden)]
        pub fn from_wit(facts: &'a wit::RequestFacts, raw: &[wit::BackendState]) -> Vec<Self> {
            raw.iter()
                .map(|b| BackendState {
                    name: resolve(&facts.text, b.name),
                    kind: b.kind,
                    healthy: b.healthy,
                    in_flight: b.in_flight,
                    queue_depth: b.queue_depth,
                })
                .collect()
        }
    }

    /// A LoRA adapter mounted on a local base model.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct AdapterInfo<'a> {
        pub id: &'a str,
        pub rank: u32,
        pub scale: f32,
        /// The local model the adapter is mounted on.
        pub base_model: &'a str,
    }

    impl<'a> AdapterInfo<'a> {
        #[doc(hidden)]
        pub fn from_wit(facts: &'a wit::RequestFacts, raw: &[wit::AdapterInfo]) -> Vec<Self> {
            raw.iter()
                .map(|a| AdapterInfo {
                    id: resolve(&facts.text, a.id),
                    rank: a.rank,
                    scale: a.scale,
                    base_model: resolve(&facts.text, a.base_model),
                })
                .collect()
        }
    }
}

/// Routing guests: implement [`router::Router`] and call [`export_router!`].
pub mod router {
    pub use crate::bindings::router::exports::mlxgate::policy::router::{
        Rejection, RouteDecision, UpstreamTarget,
    };
    pub use crate::bindings::router::mlxgate::policy::types::FactSet;
    pub use crate::types::{BackendKind, BackendState, RequestFacts};

    pub use crate::bindings::router::mlxgate::policy::caller_quota::Quota;

    /// What is left of the caller's `[limits]` for the requested model,
    /// before this request: for each kind (requests and tokens per minute,
    /// tokens today) the least left across its key, tenant and their model
    /// entries; `None` where no limit of that kind applies. Call it from
    /// `route`; a router that does must leave `decision_inputs` at `None`.
    pub fn caller_quota() -> Quota {
        crate::bindings::router::mlxgate::policy::caller_quota::remaining()
    }

    /// Sets the routed request's priority class while it waits for a local
    /// model: higher classes start first (default 0), fairness between
    /// tenants holding within a class. Call it from `route`; the last call
    /// counts and is part of the decision (reused like it when
    /// `decision_inputs` allows). Upstream requests ignore it.
    pub fn set_priority(class: i8) {
        crate::bindings::router::mlxgate::policy::request_control::set_priority(class)
    }

    /// A routing policy. `init` runs once per fresh instance with the operator's
    /// configuration string ("" when none); `route` runs per request and must
    /// be quick: the host interrupts it after a few milliseconds.
    pub trait Router: Sized + Send + Sync + 'static {
        fn init(config: &str) -> Result<Self, String>;
        fn route(&self, facts: &RequestFacts, backends: &[BackendState]) -> RouteDecision;

        /// The facts `route`'s decisions depend on, when they depend on
        /// nothing else (not the backends' state, not earlier calls): the
        /// gateway then calls `route` once per distinct combination of them
        /// and reuses the decision for requests that agree on them, e.g.
        /// `Some(FactSet::TENANT | FactSet::MODEL)`. The default, `None`,
        /// calls `route` for every request; keep it for policies that
        /// balance load, count or rotate.
        fn decision_inputs(&self) -> Option<FactSet> {
            None
        }
    }

    impl RouteDecision {
        /// `Reject` with the given status and message.
        pub fn reject(status: u16, message: impl Into<String>) -> Self {
            RouteDecision::Reject(Rejection {
                status,
                message: message.into(),
            })
        }

        /// `Upstream` to `name`, optionally rewriting the model. The
        /// gateway tries `name`'s configured `fallbacks` after it.
        pub fn upstream(name: impl Into<String>, model: Option<String>) -> Self {
            RouteDecision::Upstream(UpstreamTarget {
                name: name.into(),
                model,
            })
        }

        /// `Upstream` to the first of `names` that answers, in order: the
        /// next is tried when one fails before its answer starts
        /// (unreachable, timeout, 429, 5xx) or is not taking requests
        /// (circuit open, Retry-After, max_in_flight). `model`, if given,
        /// is rewritten for all of them.
        pub fn upstreams(names: &[&str], model: Option<String>) -> Self {
            RouteDecision::Upstream(UpstreamTarget {
                name: names.join(","),
                model,
            })
        }
    }
}

/// Adapter-selection guests: implement [`adapter::AdapterSelector`] and call
/// [`export_adapter_selector!`].
pub mod adapter {
    pub use crate::types::{AdapterInfo, RequestFacts};

    /// An adapter-selection policy. Return `None` for "no opinion" (the
    /// gateway's default), `Some(vec![])` for "no adapters".
    pub trait AdapterSelector: Sized + Send + Sync + 'static {
        fn init(config: &str) -> Result<Self, String>;
        fn select(&self, facts: &RequestFacts, adapters: &[AdapterInfo]) -> Option<Vec<String>>;
    }
}

/// Dataset-transform guests: implement [`dataset::DatasetTransform`] and call
/// [`export_dataset_transform!`].
pub mod dataset {
    pub use crate::bindings::dataset::exports::mlxgate::policy::dataset_transform::RecordOutcome;

    /// A dataset transform, called on batches of records (one JSON document
    /// each). `transform_record` is the per-record hook; override
    /// `transform` only to share work across a batch. The host meters
    /// instructions (fuel), so a runaway record fails deterministically.
    pub trait DatasetTransform: Sized + Send + Sync + 'static {
        fn init(config: &str) -> Result<Self, String>;
        fn transform_record(&self, record: &str) -> RecordOutcome;
        fn transform(&self, records: Vec<String>) -> Vec<RecordOutcome> {
            records.iter().map(|r| self.transform_record(r)).collect()
        }
    }
}

/// Support code for the export macros. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::bindings::adapter::exports::mlxgate::policy::adapter_selector::Guest as AdapterGuest;
    pub use crate::bindings::dataset::exports::mlxgate::policy::dataset_transform::Guest as DatasetGuest;
    pub use crate::bindings::router::exports::mlxgate::policy::router::Guest as RouterGuest;
    pub use crate::bindings::router::mlxgate::policy::types as wit;
    pub use std::sync::OnceLock;

    /// Stores the state from `init`; a second `init` on the same instance is
    /// an error (the host never does that: it makes a fresh instance).
    pub fn init_once<T>(
        slot: &OnceLock<T>,
        config: &str,
        init: fn(&str) -> Result<T, String>,
    ) -> Result<(), String> {
        if slot.get().is_some() {
            return Err("policy already initialised".to_string());
        }
        let state = init(config)?;
        slot.set(state)
            .map_err(|_| "policy already initialised".to_string())
    }

    /// The state from `init`, initialising with an empty configuration when
    /// the host never called `init` (a failure then traps the instance).
    pub fn state<T>(slot: &OnceLock<T>, init: fn(&str) -> Result<T, String>) -> &T {
        slot.get_or_init(|| match init("") {
            Ok(state) => state,
            Err(msg) => panic!("policy init failed: {msg}"),
        })
    }
}

/// Exports a [`router::Router`] implementation as the component's
/// `mlxgate:policy/router@0.3.3` interface. Use once per guest crate.
#[macro_export]
macro_rules! export_router {
    ($ty:ty) => {
        const _: () = {
            static STATE: $crate::__private::OnceLock<$ty> = $crate::__private::OnceLock::new();
            struct MlxgateRouterExport;
            impl $crate::__private::RouterGuest for MlxgateRouterExport {
                fn init(config: String) -> Result<(), String> {
                    $crate::__private::init_once(
                        &STATE,
                        &config,
                        <$ty as $crate::router::Router>::init,
                    )
                }
                fn route(
                    facts: $crate::__private::wit::RequestFacts,
                    backends: Vec<$crate::__private::wit::BackendState>,
                ) -> $crate::router::RouteDecision {
                    let state =
                        $crate::__private::state(&STATE, <$ty as $crate::router::Router>::init);
                    let backends = $crate::router::BackendState::from_wit(&facts, &backends);
                    let facts = $crate::router::RequestFacts::from_wit(&facts);
                    <$ty as $crate::router::Router>::route(state, &facts, &backends)
                }
                fn decision_inputs() -> Option<$crate::router::FactSet> {
                    let state =
                        $crate::__private::state(&STATE, <$ty as $crate::router::Router>::init);
                    <$ty as $crate::router::Router>::decision_inputs(state)
                }
            }
            $crate::bindings::router::__export_router_world!(
                MlxgateRouterExport with_types_in $crate::bindings::router
            );
        };
    };
}

/// Exports an [`adapter::AdapterSelector`] implementation as the component's
/// `mlxgate:policy/adapter-selector@0.3.3` interface.
#[macro_export]
macro_rules! export_adapter_selector {
    ($ty:ty) => {
        const _: () = {
            static STATE: $crate::__private::OnceLock<$ty> = $crate::__private::OnceLock::new();
            struct MlxgateAdapterExport;
            impl $crate::__private::AdapterGuest for MlxgateAdapterExport {
                fn init(config: String) -> Result<(), String> {
                    $crate::__private::init_once(
                        &STATE,
                        &config,
                        <$ty as $crate::adapter::AdapterSelector>::init,
                    )
                }
                fn select(
                    facts: $crate::__private::wit::RequestFacts,
                    adapters: Vec<$crate::__private::wit::AdapterInfo>,
                ) -> Option<Vec<String>> {
                    let state = $crate::__private::state(
                        &STATE,
                        <$ty as $crate::adapter::AdapterSelector>::init,
                    );
                    let adapters = $crate::adapter::AdapterInfo::from_wit(&facts, &adapters);
                    let facts = $crate::adapter::RequestFacts::from_wit(&facts);
                    <$ty as $crate::adapter::AdapterSelector>::select(state, &facts, &adapters)
                }
            }
            $crate::bindings::adapter::__export_adapter_world!(
                MlxgateAdapterExport with_types_in $crate::bindings::adapter
            );
        };
    };
}

/// Exports a [`dataset::DatasetTransform`] implementation as the component's
/// `mlxgate:policy/dataset-transform@0.3.3` interface.
#[macro_export]
macro_rules! export_dataset_transform {
    ($ty:ty) => {
        const _: () = {
            static STATE: $crate::__private::OnceLock<$ty> = $crate::__private::OnceLock::new();
            struct MlxgateDatasetExport;
            impl $crate::__private::DatasetGuest for MlxgateDatasetExport {
                fn init(config: String) -> Result<(), String> {
                    $crate::__private::init_once(
                        &STATE,
                        &config,
                        <$ty as $crate::dataset::DatasetTransform>::init,
                    )
                }
                fn transform(records: Vec<String>) -> Vec<$crate::dataset::RecordOutcome> {
                    let state = $crate::__private::state(
                        &STATE,
                        <$ty as $crate::dataset::DatasetTransform>::init,
                    );
                    <$ty as $crate::dataset::DatasetTransform>::transform(state, records)
                }
            }
            $crate::bindings::dataset::__export_dataset_world!(
                MlxgateDatasetExport with_types_in $crate::bindings::dataset
            );
        };
    };
}
