//! Host-side bindings for the guest worlds in `guest-sdk/wit/policy.wit`, one
//! module per world. The `types` interface is generated once (in `router`) and
//! shared, so request facts are one Rust type for every kind.

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

pub use router::mlxgate::policy::types::{AdapterInfo, BackendKind, BackendState, RequestFacts};
