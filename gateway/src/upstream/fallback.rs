//! Fallback: a request goes to the first of its upstreams that answers.
//!
//! Each upstream in order is asked unless it is passed over (circuit open,
//! `Retry-After`, `max_in_flight`); one that fails before its answer
//! begins (unreachable, TLS, no answer head within its timeout) or answers
//! 429 or 5xx hands the request to the next, within `max_attempts` asks.
//! Nothing is retried once an answer is handed back: the choice is made on
//! the answer's head, before any byte reaches the client, so a stream that
//! breaks midway stays broken. When every upstream failed, the client gets
//! the last upstream's own 429/5xx answer if one came (it says more than a
//! gateway error), else the last failure.

use std::sync::Arc;

use http::{Response, StatusCode};

use super::client::{Outgoing, ProxyBody, Upstream, UpstreamError, proxy};

/// Whether an answer with `status` hands the request to the next upstream.
fn falls_back(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
}

/// Forwards `out` to the first of `order` that answers (see the module
/// doc), asking at most `max_attempts` of them (passed-over ones do not
/// count). `order` must not be empty.
pub async fn proxy_in_order(
    order: &[Arc<Upstream>],
    out: Outgoing<'_>,
    max_attempts: usize,
) -> Result<Response<ProxyBody>, UpstreamError> {
    let mut asked = 0;
    let mut held: Option<Response<ProxyBody>> = None;
    let mut last_error = None;
    for upstream in order {
        if asked >= max_attempts.max(1) {
            break;
        }
        match proxy(upstream, out.clone()).await {
            Ok(resp) if falls_back(resp.status()) => {
                asked += 1;
                tracing::info!(upstream = %upstream.name, status = %resp.status(), "upstream answered an error; trying the next, if any");
                // Dropping an earlier held answer closes its connection.
                held = Some(resp);
            }
            Ok(resp) => return Ok(resp),
            Err(e) if e.falls_back() => {
                if !matches!(e, UpstreamError::Skipped { .. }) {
                    asked += 1;
                }
                tracing::info!(upstream = %upstream.name, error = %e, "upstream failed or passed over; trying the next, if any");
                last_error = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    match (held, last_error) {
        (Some(resp), _) => Ok(resp),
        (None, Some(e)) => Err(e),
        (None, None) => Err(UpstreamError::Unknown(String::new())),
    }
}
