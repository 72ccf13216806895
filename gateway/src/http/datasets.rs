//! `POST /api/datasets/preview` (the `jobs` scope): runs a dataset-transform
//! policy over records sent in the request and answers each one's outcome,
//! writing nothing: what a `dataset` job would keep, drop or reject, seen
//! before a long run.
//!
//! ```json
//! {"transform": "alpaca", "records": [{"instruction": "Hi", "output": "Hello"}]}
//! ```
//! answers
//! ```json
//! {"object": "dataset.preview", "transform": "alpaca",
//!  "results": [{"index": 0, "outcome": "keep", "output": {"messages": [...]}, "reason": null}],
//!  "counts": {"keep": 1, "drop": 0, "error": 0}}
//! ```
//! `records` may instead be `jsonl`: the text of a JSONL file (blank lines
//! skipped; a line that is not JSON is an `error` outcome, as in a job).

use http::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::body::{self, Body, ReqBody};
use super::{ApiError, Ctx, Route};
use crate::policy::RecordOutcome;

type HandlerResult = Result<Response<Body>, ApiError>;

/// Most records one preview runs: enough to judge a transform, small
/// enough to answer at once.
pub const MAX_PREVIEW_RECORDS: usize = 100;

pub fn routes() -> Vec<Route> {
    vec![Route::new(
        Method::POST,
        "/api/datasets/preview",
        |cx, req| Box::pin(preview(cx, req)),
    )]
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PreviewRequest {
    transform: String,
    #[serde(default)]
    records: Option<Vec<Value>>,
    #[serde(default)]
    jsonl: Option<String>,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidRequest {
        message: message.into(),
        param: Some(param.to_owned()),
    }
}

/// The records to run, as the JSON text a transform takes; a JSONL line that
/// does not parse is kept as is (the transform then reports it).
fn records_of(req: PreviewRequest) -> Result<Vec<String>, ApiError> {
    let records: Vec<String> = match (req.records, req.jsonl) {
        (Some(values), None) => values.iter().map(Value::to_string).collect(),
        (None, Some(text)) => text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => {
            return Err(invalid(
                "records",
                "give exactly one of `records` (an array) or `jsonl` (text)",
            ));
        }
    };
    if records.is_empty() {
        return Err(invalid("records", "no records to preview"));
    }
    if records.len() > MAX_PREVIEW_RECORDS {
        return Err(invalid(
            "records",
            format!(
                "{} records; a preview runs at most {MAX_PREVIEW_RECORDS} (run a dataset job for more)",
                records.len()
            ),
        ));
    }
    Ok(records)
}

async fn preview(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let body: PreviewRequest = body::read_json(req).await?;
    let name = body.transform.clone();
    let records = records_of(body)?;
    let state = cx.state.clone();
    let policy = name.clone();
    let outcomes = tokio::task::spawn_blocking(move || {
        state
            .app
            .policies
            .open()?
            .transform_batch(&policy, &records)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("preview task failed: {e}")))??;
    let mut counts = [0u64; 3];
    let results: Vec<Value> = outcomes
        .into_iter()
        .enumerate()
        .map(|(index, outcome)| {
            let (i, outcome, output, reason) = match outcome {
                RecordOutcome::Keep(text) => {
                    let output = serde_json::from_str(&text).unwrap_or(Value::String(text));
                    (0, "keep", output, None)
                }
                RecordOutcome::Drop(reason) => (1, "drop", Value::Null, Some(reason)),
                RecordOutcome::Error(reason) => (2, "error", Value::Null, Some(reason)),
            };
            counts[i] += 1;
            json!({"index": index, "outcome": outcome, "output": output, "reason": reason})
        })
        .collect();
    body::json(
        StatusCode::OK,
        &json!({
            "object": "dataset.preview",
            "transform": name,
            "results": results,
            "counts": {"keep": counts[0], "drop": counts[1], "error": counts[2]},
        }),
    )
}
