//! Public value types of the policy host: kinds, limits, outcomes, info.

use serde::{Deserialize, Serialize};

pub use super::bindings::BackendKind;

/// Major.minor of `mlxgate:policy` (`guest-sdk/wit/policy.wit`) this host
/// speaks; components exporting any patch version of it are accepted.
pub(crate) const API_VERSION: &str = "0.3";

/// The guest kinds; each is one WIT world exporting one interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    Router,
    AdapterSelector,
    DatasetTransform,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 3] = [
        PolicyKind::Router,
        PolicyKind::AdapterSelector,
        PolicyKind::DatasetTransform,
    ];

    /// The kebab-case name used in the API, CLI and WIT.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Router => "router",
            PolicyKind::AdapterSelector => "adapter-selector",
            PolicyKind::DatasetTransform => "dataset-transform",
        }
    }

    /// The interface a component of this kind must export, without version.
    pub fn interface(self) -> String {
        format!("mlxgate:policy/{}", self.as_str())
    }

    /// Whether requests are routed through one bound policy of this kind.
    pub fn is_bindable(self) -> bool {
        !matches!(self, PolicyKind::DatasetTransform)
    }

    /// Safe default limits for the kind.
    pub fn default_limits(self) -> Limits {
        match self {
            PolicyKind::Router | PolicyKind::AdapterSelector => Limits {
                deadline_ms: 5,
                fuel: None,
                memory_bytes: 16 << 20,
                warm_instances: 4,
                max_output_bytes: 64 << 10,
            },
            PolicyKind::DatasetTransform => Limits {
                deadline_ms: 2_000,
                fuel: Some(200_000_000),
                memory_bytes: 64 << 20,
                warm_instances: 2,
                max_output_bytes: 1 << 20,
            },
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!("unknown policy kind `{s}` (router, adapter-selector, dataset-transform)")
            })
    }
}

/// What callers do when a policy call fails (trap, timeout, bad output).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Carry on as if no policy were bound (the caller's default route).
    #[default]
    FailOpen,
    /// Refuse the request (503).
    FailClosed,
}

impl std::str::FromStr for OnError {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fail_open" | "fail-open" | "open" => Ok(OnError::FailOpen),
            "fail_closed" | "fail-closed" | "closed" => Ok(OnError::FailClosed),
            _ => Err(format!("unknown on_error `{s}` (fail_open, fail_closed)")),
        }
    }
}

/// Per-policy resource limits. For routers and adapter selectors they apply
/// per call; for dataset transforms `deadline_ms` and `fuel` apply per record
/// (a batch gets n times the budget) and `max_output_bytes` per record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Wall-clock deadline, enforced by epoch interruption (the watchdog
    /// advances the epoch when a deadline comes).
    pub deadline_ms: u32,
    /// Instruction budget (fuel); `None`: not metered beyond the deadline.
    pub fuel: Option<u64>,
    /// Linear memory cap of one instance.
    pub memory_bytes: usize,
    /// Warm instances kept for reuse.
    pub warm_instances: u32,
    /// Largest accepted output (one string, or the sum of a list).
    pub max_output_bytes: usize,
}

/// Everything an operator supplies with an upload besides the bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyOptions {
    /// `None`: the kind's defaults.
    pub limits: Option<Limits>,
    pub on_error: OnError,
    /// Passed to the guest's `init` on each fresh instance ("" when `None`).
    pub config: Option<String>,
}

/// Where a loaded policy's compiled code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadOrigin {
    /// Compiled at upload.
    Uploaded,
    /// Precompiled artifact from the data dir, reused after a restart.
    Artifact,
    /// Recompiled after a restart (artifact missing, stale or corrupt).
    Recompiled,
}

/// Public description of an uploaded policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyInfo {
    pub name: String,
    pub kind: PolicyKind,
    /// sha256 of the component bytes, hex.
    pub sha256: String,
    pub size_bytes: u64,
    /// The exported interface, with version, e.g. `mlxgate:policy/router@0.3.3`.
    pub interface: String,
    pub limits: Limits,
    pub on_error: OnError,
    pub config: Option<String>,
    /// Seconds since the Unix epoch.
    pub uploaded_at: u64,
    /// Increases by one on each upload under the same name.
    pub version: u64,
    pub origin: LoadOrigin,
    /// Kinds this policy is currently bound for.
    pub bound_as: Vec<PolicyKind>,
    /// For a router that declared them at upload (`decision-inputs`): the
    /// request facts its decisions depend on, by WIT name (`tenant`,
    /// `model`, ...). Its decisions are reused for requests that agree on
    /// them. `None`: every request calls the guest.
    #[serde(default)]
    pub decision_inputs: Option<Vec<String>>,
}

/// What the gateway knows about a request before it is scheduled, as the
/// host's callers give it, borrowed from the request; the call packs every
/// string into one text (see `request-facts` in the WIT).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts<'a> {
    /// HTTP method, upper case.
    pub method: &'a str,
    pub path: &'a str,
    /// The model the client asked for, verbatim.
    pub model: &'a str,
    /// The headers selected for policies, (lower-case name, value).
    pub headers: Vec<(&'a str, &'a str)>,
    /// `None` and `Some("")` reach guests alike, as an empty span (the SDK
    /// gives `None`): the spans are plain `u64`s to keep a call's arguments
    /// in registers.
    pub api_key_id: Option<&'a str>,
    pub tenant: Option<&'a str>,
    /// 0 when not counted yet.
    pub prompt_tokens: u32,
    pub max_tokens: Option<u32>,
    pub streaming: bool,
    /// What is left of the caller's limits (`caller-quota.remaining`).
    pub quota: Quota,
}

/// What is left of a caller's limits before its request is taken: for each
/// kind, the least left across its counters; `None` where none applies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub daily_tokens: Option<u64>,
}

/// Load and health of one backend at decision time.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendState {
    /// Local model name or upstream name.
    pub name: String,
    pub kind: BackendKind,
    pub healthy: bool,
    pub in_flight: u32,
    pub queue_depth: u32,
    /// Moving average of the time to an answer's head, in milliseconds,
    /// when measured (upstreams); a router asks for it by name
    /// (`backend-stats.latency-ms`).
    pub latency_ms: Option<f32>,
}

/// A LoRA adapter mounted on a local base model, as selectors see it.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    pub id: String,
    pub rank: u32,
    pub scale: f32,
    pub base_model: String,
}

/// A router's decision, validated by the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "route", rename_all = "snake_case")]
pub enum RouteDecision {
    /// Serve with this local model, the request in this priority class
    /// (the router's `request-control.set-priority`; 0 by default).
    Local {
        model: String,
        #[serde(default)]
        priority: i8,
    },
    Upstream {
        name: String,
        model: Option<String>,
    },
    Reject {
        status: u16,
        message: String,
    },
}

impl RouteDecision {
    /// Serve with the local `model`, in the default priority class.
    pub fn local(model: impl Into<String>) -> RouteDecision {
        RouteDecision::Local {
            model: model.into(),
            priority: 0,
        }
    }
}

/// One dataset record's fate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "value", rename_all = "snake_case")]
pub enum RecordOutcome {
    /// The transformed record (JSON text).
    Keep(String),
    /// Left out on purpose, with the reason.
    Drop(String),
    /// Invalid record or guest failure on it, with the reason.
    Error(String),
}
