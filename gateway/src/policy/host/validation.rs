//! The checks an upload passes before a policy is stored: a boring name, a
//! Wasm component (not a core module) exporting the interface of its kind
//! at a compatible version, and one probe call within its limits.

use wasmtime::component::Component;

use super::calls::{declared_inputs, guest_error, route_on, select_on, transform_on};
use crate::policy::error::{FailureKind, PolicyError};
use crate::policy::runtime::{LoadedPolicy, truncate};
use crate::policy::types::{
    API_VERSION, AdapterInfo, BackendKind, BackendState, PolicyKind, RequestFacts,
};

/// Names are file names and URL path segments: keep them boring.
pub(super) fn validate_name(name: &str) -> Result<(), PolicyError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(PolicyError::InvalidName(truncate(name.to_string(), 80)))
    }
}

/// Tells a component from a core module from anything else, before the
/// compiler sees the bytes, so the error can say what to do.
pub(super) fn check_header(bytes: &[u8]) -> Result<(), PolicyError> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(PolicyError::NotWasm(
            "missing the \\0asm magic number".to_string(),
        ));
    }
    match (&bytes[4..6], &bytes[6..8]) {
        (_, [1, 0]) => Ok(()),
        ([1, 0], [0, 0]) => Err(PolicyError::CoreModule),
        (v, l) => Err(PolicyError::NotWasm(format!(
            "unknown binary version {v:?} layer {l:?}"
        ))),
    }
}

/// Finds the interface of `kind` among the component's exports and checks its
/// version; says precisely what is wrong otherwise.
pub(super) fn exported_interface(
    engine: &wasmtime::Engine,
    component: &Component,
    kind: PolicyKind,
) -> Result<String, PolicyError> {
    let ty = component.component_type();
    let names: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
    let wanted = kind.interface();
    if let Some(found) = names.iter().find(|n| n.starts_with(&format!("{wanted}@"))) {
        let version = &found[wanted.len() + 1..];
        let compatible = version
            .strip_prefix(API_VERSION)
            .is_some_and(|patch| patch.starts_with('.'));
        if compatible {
            return Ok(found.clone());
        }
        return Err(PolicyError::IncompatibleVersion {
            expected: wanted,
            found: found.clone(),
        });
    }
    for other in PolicyKind::ALL {
        let iface = other.interface();
        if let Some(found) = names
            .iter()
            .find(|n| n.starts_with(&format!("{iface}@")) || **n == iface)
        {
            return Err(PolicyError::WrongKind {
                expected: kind,
                found_kind: other,
                found: found.clone(),
            });
        }
    }
    let listed = if names.is_empty() {
        "none".to_string()
    } else {
        truncate(names.join(", "), 512)
    };
    Err(PolicyError::MissingExport {
        expected: wanted,
        exports: listed,
    })
}

/// Facts of the upload probe call. Policies see model `mlxgate-probe`.
pub fn probe_facts() -> RequestFacts<'static> {
    RequestFacts {
        method: "POST",
        path: "/v1/chat/completions",
        model: "mlxgate-probe",
        headers: vec![],
        api_key_id: None,
        tenant: None,
        prompt_tokens: 16,
        max_tokens: Some(16),
        streaming: false,
        quota: Default::default(),
    }
}

/// One call on the freshly loaded policy, within its limits, at upload; for
/// a router, also its declared decision inputs. A timeout is retried once:
/// a guest that loops fails twice, while a thread stalled by the OS for a
/// few milliseconds should not fail an upload.
pub(super) fn synthetic_call(p: &LoadedPolicy) -> Result<Option<Vec<String>>, PolicyError> {
    match probe_once(p) {
        Err(PolicyError::ValidationFailed {
            kind: FailureKind::Timeout,
            ..
        }) => probe_once(p),
        other => other,
    }
}

fn probe_once(p: &LoadedPolicy) -> Result<Option<Vec<String>>, PolicyError> {
    let facts = probe_facts();
    let outcome = match p.info.kind {
        PolicyKind::Router => {
            let backends = [BackendState {
                name: "mlxgate-probe".to_string(),
                kind: BackendKind::Local,
                healthy: true,
                in_flight: 0,
                queue_depth: 0,
                latency_ms: None,
            }];
            route_on(p, &facts, &backends).and_then(|_| declared_inputs(p))
        }
        PolicyKind::AdapterSelector => {
            let adapters = [AdapterInfo {
                id: "mlxgate-probe-adapter".to_string(),
                rank: 8,
                scale: 1.0,
                base_model: "mlxgate-probe".to_string(),
            }];
            select_on(p, &facts, &adapters).map(|_| None)
        }
        PolicyKind::DatasetTransform => transform_on(p, &["{}".to_string()])
            .map_err(|f| guest_error(p, f))
            .map(|_| None),
    };
    match outcome {
        Ok(inputs) => Ok(inputs),
        Err(PolicyError::Guest {
            kind: FailureKind::InitFailed,
            detail,
            ..
        }) => Err(PolicyError::InitRejected(detail)),
        Err(PolicyError::Guest { kind, detail, .. }) => {
            Err(PolicyError::ValidationFailed { kind, detail })
        }
        Err(other) => Err(other),
    }
}
