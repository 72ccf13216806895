//! Errors of the policy host. Upload errors each say why a component was
//! refused (not usable bytes, or a component of the wrong shape or
//! behaviour); call errors carry the policy's `on_error` so callers can fail
//! open (default route) or closed. Which status a client sees for each is
//! decided by the wire layer, not here.

use serde::Serialize;

use super::types::{API_VERSION, OnError, PolicyKind};

/// Why a guest call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// Epoch deadline passed.
    Timeout,
    /// Instruction budget spent.
    OutOfFuel,
    /// The memory cap stopped a `memory.grow`.
    MemoryLimit,
    /// Wasm stack exhausted (deep recursion).
    StackOverflow,
    /// Guest panic or abort (`unreachable`).
    Panic,
    /// Any other trap (out-of-bounds access, division by zero, ...).
    Trap,
    /// The guest answered something the host refuses (too large, invalid).
    BadOutput,
    /// The guest's `init` failed on a fresh instance.
    InitFailed,
    /// No instance slot was free in the pooling allocator.
    Capacity,
}

impl FailureKind {
    pub const ALL: [FailureKind; 9] = [
        FailureKind::Timeout,
        FailureKind::OutOfFuel,
        FailureKind::MemoryLimit,
        FailureKind::StackOverflow,
        FailureKind::Panic,
        FailureKind::Trap,
        FailureKind::BadOutput,
        FailureKind::InitFailed,
        FailureKind::Capacity,
    ];

    /// snake_case label for metrics and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Timeout => "timeout",
            FailureKind::OutOfFuel => "out_of_fuel",
            FailureKind::MemoryLimit => "memory_limit",
            FailureKind::StackOverflow => "stack_overflow",
            FailureKind::Panic => "panic",
            FailureKind::Trap => "trap",
            FailureKind::BadOutput => "bad_output",
            FailureKind::InitFailed => "init_failed",
            FailureKind::Capacity => "capacity",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    // ---- upload validation: the bytes ----
    #[error("invalid policy name `{0}`: use 1-64 characters from [A-Za-z0-9_-]")]
    InvalidName(String),
    #[error("invalid limits: {0}")]
    InvalidLimits(String),
    #[error("component is {size} bytes, over the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
    #[error("config is {size} bytes, over the {max}-byte limit")]
    ConfigTooLarge { size: usize, max: usize },
    #[error("not a WebAssembly binary: {0}")]
    NotWasm(String),
    #[error(
        "a core WebAssembly module, not a component: link it with wasm-component-ld (see guest-sdk/README.md)"
    )]
    CoreModule,
    #[error("malformed or truncated component: {0}")]
    Malformed(String),

    // ---- upload validation: the component's shape and behaviour ----
    #[error("component exports `{found}`, a {found_kind} policy, not a {expected} policy")]
    WrongKind {
        expected: PolicyKind,
        found_kind: PolicyKind,
        found: String,
    },
    #[error(
        "component exports `{found}`; this gateway speaks `{expected}@{API_VERSION}.x` \
         (rebuild the policy with the current mlxgate-guest SDK)"
    )]
    IncompatibleVersion { expected: String, found: String },
    #[error("component does not export `{expected}@{API_VERSION}.x` (its exports: {exports})")]
    MissingExport { expected: String, exports: String },
    #[error("component imports what the sandbox does not provide: {0}")]
    UnsatisfiedImports(String),
    #[error("exported interface does not match the WIT of mlxgate:policy@{API_VERSION}.0: {0}")]
    InterfaceMismatch(String),
    #[error("policy `init` refused its configuration: {0}")]
    InitRejected(String),
    #[error("validation call failed ({kind}): {detail}")]
    ValidationFailed { kind: FailureKind, detail: String },

    // ---- management ----
    #[error("no policy named `{0}`")]
    NotFound(String),
    #[error("policy `{name}` is a {actual} policy, not a {wanted} policy")]
    KindMismatch {
        name: String,
        wanted: PolicyKind,
        actual: PolicyKind,
    },
    #[error("{0} policies are not bound; call them by name")]
    NotBindable(PolicyKind),
    #[error("policy `{name}` is bound as {kind}; unbind it first")]
    InUse { name: String, kind: PolicyKind },
    #[error("policy storage: {0}")]
    Storage(String),
    #[error("wasm engine: {0}")]
    Engine(String),

    // ---- calls ----
    #[error("no {0} policy is bound")]
    NotBound(PolicyKind),
    #[error("policy `{policy}` failed ({kind}): {detail}")]
    Guest {
        policy: String,
        kind: FailureKind,
        on_error: OnError,
        detail: String,
    },
}

impl PolicyError {
    /// Whether a caller should proceed with its default behaviour: nothing
    /// bound, or the policy failed and is configured `fail_open`.
    pub fn is_fail_open(&self) -> bool {
        match self {
            PolicyError::NotBound(_) => true,
            PolicyError::Guest { on_error, .. } => *on_error == OnError::FailOpen,
            _ => false,
        }
    }

    /// A short machine-readable code for error bodies.
    pub fn code(&self) -> &'static str {
        use PolicyError::*;
        match self {
            InvalidName(_) => "invalid_name",
            InvalidLimits(_) => "invalid_limits",
            TooLarge { .. } => "too_large",
            ConfigTooLarge { .. } => "config_too_large",
            NotWasm(_) => "not_wasm",
            CoreModule => "core_module",
            Malformed(_) => "malformed_component",
            WrongKind { .. } => "wrong_kind",
            IncompatibleVersion { .. } => "incompatible_version",
            MissingExport { .. } => "missing_export",
            UnsatisfiedImports(_) => "unsatisfied_imports",
            InterfaceMismatch(_) => "interface_mismatch",
            InitRejected(_) => "init_rejected",
            ValidationFailed { .. } => "validation_failed",
            NotFound(_) => "not_found",
            KindMismatch { .. } => "kind_mismatch",
            NotBindable(_) => "not_bindable",
            InUse { .. } => "in_use",
            Storage(_) => "storage",
            Engine(_) => "engine",
            NotBound(_) => "not_bound",
            Guest { .. } => "policy_failed",
        }
    }

    /// The failure kind of a call or validation error.
    pub fn failure_kind(&self) -> Option<FailureKind> {
        match self {
            PolicyError::Guest { kind, .. } | PolicyError::ValidationFailed { kind, .. } => {
                Some(*kind)
            }
            _ => None,
        }
    }
}
