//! Every error a client can see, and the one place that turns it into the
//! OpenAI error shape `{"error":{"message","type","param","code"}}`.
//!
//! Handlers return `Result<_, ApiError>`; the dispatcher calls
//! [`ApiError::into_response`]. New failure kinds get a variant here rather
//! than ad-hoc JSON in a handler, so status, type and code stay consistent.

use http::header::{ALLOW, CONNECTION, CONTENT_TYPE, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use serde::Serialize;

use super::auth::Scope;
use super::body::{Body, full};
use crate::app::{ModelError, RouteError};
use crate::engine::EngineError;
use crate::engine::prompt_cache::SaveError;
use crate::jobs::JobError;
use crate::limits::{LimitError, LimitKind};
use crate::policy::PolicyError;
use crate::upstream::UpstreamError;

/// `Retry-After` on answers to a caller over a connection or concurrency
/// cap: slots free as other requests finish, so a second is a fair wait.
pub const RETRY_AFTER_SECS: &str = "1";

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("Invalid URL ({method} {path})")]
    UnknownRoute { method: String, path: String },

    #[error("Method {method} is not allowed on {path}; allowed: {allowed}")]
    MethodNotAllowed {
        method: String,
        path: String,
        /// Comma-separated, also sent as the `Allow` header.
        allowed: String,
    },

    #[error("The model `{0}` does not exist or you do not have access to it.")]
    ModelNotFound(String),

    /// Some other resource is missing; `code` says what (`job_not_found`).
    #[error("{message}")]
    NotFound { message: String, code: &'static str },

    /// The resource's state forbids the request (`job_finished`).
    #[error("{message}")]
    Conflict { message: String, code: &'static str },

    #[error("We could not parse the JSON body of your request: {0}")]
    InvalidJson(String),

    /// A request that parsed but makes no sense; `param` names the field.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },

    /// One request field is wrong: type, range, missing or unsupported.
    /// `code` is OpenAI's (`invalid_type`, `missing_required_parameter`, ...).
    #[error("{message}")]
    InvalidParam {
        message: String,
        param: String,
        code: &'static str,
    },

    /// The prompt plus the completion do not fit in the model's context;
    /// `param` is `messages` or `prompt`.
    #[error("{message}")]
    ContextLengthExceeded {
        message: String,
        param: &'static str,
    },

    #[error("Request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },

    #[error("Could not read the request body: {0}")]
    BodyRead(String),

    /// The body did not arrive within `[server] request_timeout_secs` of
    /// the head (slow or stalled client); the connection is closed.
    #[error(
        "The request body did not arrive within {secs} s of the request head; send the whole request at once and retry"
    )]
    RequestTimeout { secs: u64 },

    /// Over `[server] max_connections`; answered at accept and closed.
    #[error("The server has too many open connections (limit {limit}); retry shortly")]
    TooManyConnections { limit: usize },

    /// Over `[server] max_connections_per_ip`; answered at accept and closed.
    #[error(
        "Too many open connections from your address (limit {limit}); reuse keep-alive connections or close idle ones, then retry"
    )]
    TooManyConnectionsFromIp { limit: usize },

    /// The caller already has its most inference requests in progress.
    #[error(
        "Too many concurrent requests for {who} (limit {limit}); wait for one to finish (or a stream to end) and retry"
    )]
    ConcurrencyLimitExceeded { who: String, limit: u32 },

    #[error(
        "You didn't provide an API key. Send it in an Authorization header using Bearer auth (Authorization: Bearer YOUR_KEY)."
    )]
    MissingApiKey,

    #[error("Incorrect API key provided.")]
    InvalidApiKey,

    #[error("API key '{key_id}' lacks the '{scope}' scope this endpoint needs")]
    InsufficientScope { key_id: String, scope: Scope },

    #[error(
        "The {scope} API is closed because no API key is configured; set MLXGATE_ADMIN_KEY (or add a [[keys]] entry with the '{scope}' scope to the config) and restart"
    )]
    ZoneClosed { scope: Scope },

    /// Refused for who or where the caller is (e.g. `/metrics` from
    /// another host); the message says how to get access.
    #[error("{message}")]
    Forbidden { message: String, code: &'static str },

    #[error("{0}")]
    NotReady(String),

    /// The model's engine stopped (shutdown or a fatal runtime error).
    #[error("{0}")]
    EngineUnavailable(String),

    /// The model's queue is full (503), or the caller's tenant fills its
    /// share of it (429); both say when to retry.
    #[error("{message}")]
    Overloaded {
        message: String,
        tenant_share: bool,
        retry_after: std::time::Duration,
    },

    #[error("{0}")]
    Internal(String),

    /// Over a `[limits]` rate or budget (429), or the shared limits' store
    /// is unreachable and the config says to refuse (503).
    /// (Boxed: it carries the quota, and every `Result` of the handlers
    /// carries an `ApiError`.)
    #[error(transparent)]
    RateLimited(Box<LimitError>),

    /// A router policy's refusal, a `fail_closed` policy failure, or an
    /// upstream failure; carries its own status and code.
    #[error(transparent)]
    Route(#[from] RouteError),

    /// A policy operation of the admin API that failed (upload, bind, ...).
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// The status of a policy failure: the admin API's answer or, for a
/// call, the request's.
pub fn policy_status(e: &PolicyError) -> StatusCode {
    use PolicyError::*;
    match e {
        InvalidName(_) | InvalidLimits(_) | NotWasm(_) | CoreModule | Malformed(_)
        | NotBindable(_) => StatusCode::BAD_REQUEST,
        TooLarge { .. } | ConfigTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        WrongKind { .. }
        | IncompatibleVersion { .. }
        | MissingExport { .. }
        | UnsatisfiedImports(_)
        | InterfaceMismatch(_)
        | InitRejected(_)
        | ValidationFailed { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        NotFound(_) => StatusCode::NOT_FOUND,
        KindMismatch { .. } | InUse { .. } => StatusCode::CONFLICT,
        Storage(_) | Engine(_) => StatusCode::INTERNAL_SERVER_ERROR,
        NotBound(_) | Guest { .. } => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The status of a routing failure: the router's own for a refusal.
pub fn route_status(e: &RouteError) -> StatusCode {
    match e {
        RouteError::Rejected { status, .. } => {
            StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }
        RouteError::PolicyFailed(_) => StatusCode::SERVICE_UNAVAILABLE,
        RouteError::Upstream(e) => upstream_status(e),
    }
}

fn route_code(e: &RouteError) -> &'static str {
    match e {
        RouteError::Rejected { .. } => "policy_rejected",
        RouteError::PolicyFailed(_) => "policy_failed",
        RouteError::Upstream(e) => upstream_code(e),
    }
}

/// The status of a proxied request that failed before the upstream's
/// answer began (the upstream's own error answers pass through as they are).
pub fn upstream_status(e: &UpstreamError) -> StatusCode {
    match e {
        UpstreamError::Unknown(_) | UpstreamError::Unavailable { .. } => StatusCode::BAD_GATEWAY,
        UpstreamError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        UpstreamError::InvalidPath { .. } => StatusCode::BAD_REQUEST,
        UpstreamError::Request { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        UpstreamError::Protocol { .. } => StatusCode::BAD_GATEWAY,
        UpstreamError::Skipped { .. } => StatusCode::SERVICE_UNAVAILABLE,
    }
}

fn upstream_code(e: &UpstreamError) -> &'static str {
    match e {
        UpstreamError::Unknown(_) => "unknown_upstream",
        UpstreamError::Unavailable { .. } => "upstream_unavailable",
        UpstreamError::Timeout { .. } => "upstream_timeout",
        UpstreamError::InvalidPath { .. } => "invalid_path",
        UpstreamError::Request { .. } => "upstream_request_failed",
        UpstreamError::Protocol { .. } => "upstream_protocol_mismatch",
        UpstreamError::Skipped { .. } => "upstream_unavailable",
    }
}

/// Where an API keeps the prompt and the output format, for errors to
/// name: OpenAI's chat (`messages`, `response_format`), completions
/// (`prompt`, `response_format`), Anthropic's (`messages`,
/// `output_config.format`), Responses (`input`, `text.format`).
#[derive(Debug, Clone, Copy)]
pub struct ApiParams {
    pub prompt: &'static str,
    pub format: &'static str,
}

impl From<&'static str> for ApiParams {
    /// An OpenAI endpoint whose prompt is in `prompt`.
    fn from(prompt: &'static str) -> ApiParams {
        ApiParams {
            prompt,
            format: "response_format",
        }
    }
}

/// OpenAI's `type` for an error known only by its status (a router's
/// `reject(status, ...)`, a policy failure).
pub fn type_for_status(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        429 => "rate_limit_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        use ApiError::*;
        match self {
            UnknownRoute { .. } | ModelNotFound(_) | NotFound { .. } => StatusCode::NOT_FOUND,
            Conflict { .. } => StatusCode::CONFLICT,
            MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            InvalidJson(_)
            | InvalidRequest { .. }
            | InvalidParam { .. }
            | ContextLengthExceeded { .. }
            | BodyRead(_) => StatusCode::BAD_REQUEST,
            BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            TooManyConnectionsFromIp { .. } | ConcurrencyLimitExceeded { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Overloaded { tenant_share, .. } => {
                if *tenant_share {
                    StatusCode::TOO_MANY_REQUESTS
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }
            TooManyConnections { .. } => StatusCode::SERVICE_UNAVAILABLE,
            MissingApiKey | InvalidApiKey => StatusCode::UNAUTHORIZED,
            InsufficientScope { .. } | ZoneClosed { .. } | Forbidden { .. } => {
                StatusCode::FORBIDDEN
            }
            NotReady(_) | EngineUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            RateLimited(e) if matches!(**e, LimitError::Refused { .. }) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            RateLimited(_) => StatusCode::SERVICE_UNAVAILABLE,
            Route(e) => route_status(e),
            Policy(e) => policy_status(e),
        }
    }

    /// The OpenAI `type` field.
    pub fn error_type(&self) -> &'static str {
        use ApiError::*;
        match self {
            // OpenAI reports bad or missing keys as invalid requests.
            MissingApiKey | InvalidApiKey => "invalid_request_error",
            UnknownRoute { .. } | ModelNotFound(_) | NotFound { .. } => "not_found_error",
            Conflict { .. } => "conflict_error",
            MethodNotAllowed { .. }
            | InvalidJson(_)
            | InvalidRequest { .. }
            | InvalidParam { .. }
            | ContextLengthExceeded { .. }
            | BodyTooLarge { .. }
            | BodyRead(_)
            | RequestTimeout { .. } => "invalid_request_error",
            TooManyConnectionsFromIp { .. } | ConcurrencyLimitExceeded { .. } => "rate_limit_error",
            TooManyConnections { .. } => "server_error",
            Overloaded { .. } => type_for_status(self.status()),
            InsufficientScope { .. } | ZoneClosed { .. } | Forbidden { .. } => "permission_error",
            NotReady(_) | EngineUnavailable(_) | Internal(_) => "server_error",
            // OpenAI's own: the kind of limit, or the quota.
            RateLimited(e) => match &**e {
                LimitError::Refused { refusal, .. } => match refusal.kind {
                    LimitKind::RequestsPerMinute => "requests",
                    LimitKind::TokensPerMinute => "tokens",
                    LimitKind::DailyTokens => "insufficient_quota",
                },
                LimitError::Unavailable => "server_error",
            },
            Route(e) => type_for_status(route_status(e)),
            Policy(e) => type_for_status(policy_status(e)),
        }
    }

    /// The OpenAI `code` field: stable, machine-readable.
    pub fn code(&self) -> &'static str {
        use ApiError::*;
        match self {
            UnknownRoute { .. } => "unknown_url",
            MethodNotAllowed { .. } => "method_not_allowed",
            ModelNotFound(_) => "model_not_found",
            InvalidJson(_) => "invalid_json",
            NotFound { code, .. } | Conflict { code, .. } | Forbidden { code, .. } => code,
            InvalidRequest { .. } => "invalid_request",
            InvalidParam { code, .. } => code,
            ContextLengthExceeded { .. } => "context_length_exceeded",
            BodyTooLarge { .. } => "request_too_large",
            BodyRead(_) => "body_read_failed",
            RequestTimeout { .. } => "request_timeout",
            TooManyConnections { .. } | TooManyConnectionsFromIp { .. } => "too_many_connections",
            ConcurrencyLimitExceeded { .. } => "concurrency_limit_exceeded",
            Overloaded {
                tenant_share: false,
                ..
            } => "overloaded",
            Overloaded { .. } => "tenant_queue_share_exceeded",
            MissingApiKey | InvalidApiKey => "invalid_api_key",
            InsufficientScope { .. } => "insufficient_scope",
            ZoneClosed { .. } => "api_closed",
            NotReady(_) => "model_not_ready",
            EngineUnavailable(_) => "engine_unavailable",
            Internal(_) => "internal_error",
            RateLimited(e) => match &**e {
                LimitError::Refused { refusal, .. } => match refusal.kind {
                    LimitKind::DailyTokens => "insufficient_quota",
                    _ => "rate_limit_exceeded",
                },
                LimitError::Unavailable => "rate_limiter_unavailable",
            },
            Route(e) => route_code(e),
            Policy(e) => e.code(),
        }
    }

    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            ApiError::InvalidParam { param, .. } => Some(param),
            ApiError::ContextLengthExceeded { param, .. } => Some(param),
            _ => None,
        }
    }

    /// Maps an engine failure; `prompt_param` names the request field the
    /// prompt came from (`messages` or `prompt`), for the client's benefit.
    pub fn from_engine(e: EngineError, prompt_param: &'static str) -> ApiError {
        ApiError::from_engine_in(e, ApiParams::from(prompt_param))
    }

    /// [`ApiError::from_engine`] for an API that keeps its prompt and its
    /// output format in the fields `params` names.
    pub fn from_engine_in(e: EngineError, params: ApiParams) -> ApiError {
        let prompt_param = params.prompt;
        match e {
            EngineError::ContextLengthExceeded { .. } | EngineError::PromptTooLong { .. } => {
                ApiError::ContextLengthExceeded {
                    message: e.to_string(),
                    param: prompt_param,
                }
            }
            EngineError::InvalidPrompt(message) => ApiError::InvalidParam {
                message,
                param: prompt_param.to_owned(),
                code: "invalid_value",
            },
            // Templates reject message sequences they cannot render
            // (e.g. roles out of order): the client's messages are at fault.
            EngineError::Template(_) => ApiError::InvalidParam {
                message: e.to_string(),
                param: "messages".to_owned(),
                code: "invalid_value",
            },
            EngineError::Unavailable | EngineError::ProcessGroup(_) => {
                ApiError::EngineUnavailable(e.to_string())
            }
            EngineError::Overloaded { retry_after, .. } => ApiError::Overloaded {
                message: e.to_string(),
                tenant_share: false,
                retry_after,
            },
            EngineError::TenantQueueFull { retry_after, .. } => ApiError::Overloaded {
                message: e.to_string(),
                tenant_share: true,
                retry_after,
            },
            EngineError::Internal(_) => ApiError::Internal(e.to_string()),
            EngineError::PromptCacheNotFound(_) => ApiError::InvalidParam {
                message: e.to_string(),
                param: "prompt_cache".to_owned(),
                code: "prompt_cache_not_found",
            },
            EngineError::PromptCache(message) => ApiError::InvalidParam {
                message,
                param: "prompt_cache".to_owned(),
                code: "invalid_value",
            },
            EngineError::UnknownAdapter { .. } => ApiError::InvalidParam {
                message: e.to_string(),
                param: "adapter".to_owned(),
                code: "adapter_not_found",
            },
            EngineError::Adapter(message) => ApiError::InvalidParam {
                message,
                param: "adapter".to_owned(),
                code: "invalid_adapter",
            },
            EngineError::Grammar(message) => ApiError::InvalidParam {
                message: format!("Invalid '{}': {message}", params.format),
                param: params.format.to_owned(),
                code: "invalid_value",
            },
            EngineError::ToolSchema(message) => ApiError::InvalidParam {
                message: format!("Invalid 'tools': {message}"),
                param: "tools".to_owned(),
                code: "invalid_value",
            },
        }
    }

    /// Maps a failure to save a named prompt cache; `param` names the
    /// request field that asked for it.
    pub fn from_save(e: SaveError, param: &'static str) -> ApiError {
        match e {
            e @ SaveError::NameTaken(_) => ApiError::Conflict {
                message: format!("{}.", capitalized(&e.to_string())),
                code: "prompt_cache_name_taken",
            },
            // 400, not 507: retrying cannot help (and SDKs retry 5xx); deleting can.
            e @ SaveError::OverBudget { .. } => ApiError::InvalidParam {
                message: format!("{}.", capitalized(&e.to_string())),
                param: param.to_owned(),
                code: "prompt_cache_budget_exceeded",
            },
            SaveError::File(e) => ApiError::Internal(format!("cannot write the prompt cache: {e}")),
        }
    }

    /// The OpenAI error JSON, as sent in a response body or an SSE `error` event.
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Envelope<'a> {
            error: Inner<'a>,
        }
        #[derive(Serialize)]
        struct Inner<'a> {
            message: String,
            #[serde(rename = "type")]
            kind: &'static str,
            param: Option<&'a str>,
            code: &'static str,
        }
        serde_json::to_vec(&Envelope {
            error: Inner {
                message: self.to_string(),
                kind: self.error_type(),
                param: self.param(),
                code: self.code(),
            },
        })
        // Serialising strings cannot fail; keep a valid body regardless.
        .unwrap_or_else(|_| br#"{"error":{"message":"internal error","type":"server_error","param":null,"code":"internal_error"}}"#.to_vec())
    }

    pub fn into_response(self) -> Response<Body> {
        let body = self.to_json();
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status();
        let headers = resp.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        match &self {
            ApiError::MethodNotAllowed { allowed, .. } => {
                if let Ok(v) = HeaderValue::from_str(allowed) {
                    headers.insert(ALLOW, v);
                }
            }
            ApiError::MissingApiKey | ApiError::InvalidApiKey => {
                headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ApiError::TooManyConnections { .. }
            | ApiError::TooManyConnectionsFromIp { .. }
            | ApiError::ConcurrencyLimitExceeded { .. } => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
            }
            ApiError::RequestTimeout { .. } => {
                headers.insert(CONNECTION, HeaderValue::from_static("close"));
            }
            ApiError::RateLimited(e) => {
                headers.insert(RETRY_AFTER, HeaderValue::from(e.retry_after_secs()));
            }
            ApiError::Route(RouteError::Upstream(UpstreamError::Skipped {
                retry_after: Some(wait),
                ..
            }))
            | ApiError::Overloaded {
                retry_after: wait, ..
            } => {
                // Whole seconds, at least one.
                let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                headers.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
            }
            _ => {}
        }
        resp
    }
}

/// `s` with its first letter in upper case (domain errors are written as
/// clauses; OpenAI's messages are sentences).
fn capitalized(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map_or_else(String::new, |c| c.to_uppercase().chain(chars).collect())
}

impl From<LimitError> for ApiError {
    fn from(e: LimitError) -> Self {
        ApiError::RateLimited(Box::new(e))
    }
}

impl From<UpstreamError> for ApiError {
    fn from(e: UpstreamError) -> Self {
        ApiError::Route(RouteError::Upstream(e))
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::NotFound(id) => ApiError::ModelNotFound(id),
            ModelError::NotReady(message) => ApiError::NotReady(message),
            ModelError::WrongKind(message) => ApiError::InvalidParam {
                message,
                param: "model".into(),
                code: "model_not_supported",
            },
        }
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::Config(c) => ApiError::InvalidRequest {
                message: c.message,
                param: Some(c.param),
            },
            JobError::NotFound(id) => ApiError::NotFound {
                message: format!("No job `{id}`"),
                code: "job_not_found",
            },
            e @ JobError::Finished { .. } => ApiError::Conflict {
                message: e.to_string(),
                code: "job_finished",
            },
            e @ (JobError::Ledger(_) | JobError::Internal(_)) => {
                tracing::error!(error = %e, "jobs service");
                ApiError::Internal(format!("jobs service: {e}"))
            }
        }
    }
}

impl From<ApiError> for Response<Body> {
    fn from(e: ApiError) -> Self {
        e.into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(e: impl Into<ApiError>) -> (u16, &'static str, &'static str) {
        let e = e.into();
        (e.status().as_u16(), e.error_type(), e.code())
    }

    #[test]
    fn routing_failures_keep_the_routers_status_and_name_their_cause() {
        let rejected = RouteError::Rejected {
            status: 429,
            message: "slow down".into(),
        };
        assert_eq!(
            answer(rejected),
            (429, "rate_limit_error", "policy_rejected")
        );
        assert_eq!(
            answer(RouteError::PolicyFailed(String::new())),
            (503, "server_error", "policy_failed")
        );
        let invalid = UpstreamError::InvalidPath {
            name: "up".into(),
            why: "it has a `.` or `..` segment",
        };
        assert_eq!(
            answer(invalid),
            (400, "invalid_request_error", "invalid_path")
        );
        let slow = UpstreamError::Timeout {
            name: "up".into(),
            secs: 1.0,
        };
        assert_eq!(answer(slow), (504, "server_error", "upstream_timeout"));
    }

    #[test]
    fn model_errors_are_404_once_unknown_and_503_while_not_ready() {
        assert_eq!(
            answer(ModelError::NotFound("m".into())),
            (404, "not_found_error", "model_not_found")
        );
        assert_eq!(
            answer(ModelError::NotReady("loading".into())),
            (503, "server_error", "model_not_ready")
        );
    }
}
