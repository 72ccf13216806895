//! `POST /api/datasets/preview` (the `jobs` scope): runs a dataset pipeline
//! over a few records and answers each one's fate, writing nothing: what a
//! `dataset` job would keep, drop or reject, seen before a long run.
//!
//! ```json
//! {"steps": [{"policy": "alpaca"}, {"dedupe": ["messages"]}],
//!  "records": [{"instruction": "Hi", "output": "Hello"}]}
//! ```
//! answers
//! ```json
//! {"object": "dataset.preview", "steps": ["policy alpaca", "dedupe"],
//!  "results": [{"index": 0, "outcome": "keep", "output": {"messages": [...]},
//!               "step": null, "reason": null}],
//!  "counts": {"keep": 1, "drop": 0, "error": 0}}
//! ```
//! `transform: NAME` is shorthand for `steps: [{"policy": NAME}]`. The
//! records are `records` (an array), `jsonl` (the text of a JSONL file:
//! blank lines skipped; a line that is not JSON reaches the steps as it
//! is), or `input`: a file, folder or glob on the server, as a job's
//! `input`, of which the first `limit` records (default 20) are read; that
//! one needs the `admin` scope too, as dataset jobs do, and each result
//! then names its `file` and `line`.

use http::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::{Caller, Scope};
use super::body::{self, Body, ReqBody};
use super::{ApiError, Ctx, Route};
use crate::datasets::Fate;

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
    #[serde(default)]
    transform: Option<String>,
    #[serde(default)]
    steps: Option<Value>,
    #[serde(default)]
    records: Option<Vec<Value>>,
    #[serde(default)]
    jsonl: Option<String>,
    #[serde(default)]
    input: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidRequest {
        message: message.into(),
        param: Some(param.to_owned()),
    }
}

/// The records sent inline, as the JSON text the steps take.
fn inline_records(
    records: Option<Vec<Value>>,
    jsonl: Option<String>,
) -> Result<Vec<String>, ApiError> {
    let records: Vec<String> = match (records, jsonl) {
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
                "give exactly one of `records` (an array), `jsonl` (text) or `input` (a file on the server)",
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
    let caller = req.extensions().get::<Caller>().cloned();
    let body: PreviewRequest = body::read_json(req).await?;
    let shorthand = body.transform.is_some();
    let steps = match (body.steps, body.transform) {
        (Some(steps), None) => steps,
        (None, Some(name)) => json!([{ "policy": name }]),
        _ => {
            return Err(invalid(
                "steps",
                "give `steps` (a list) or `transform` (a policy name)",
            ));
        }
    };
    let limit = body.limit.unwrap_or(20);
    if !(1..=MAX_PREVIEW_RECORDS).contains(&limit) {
        return Err(invalid(
            "limit",
            format!("`limit` must be in 1..={MAX_PREVIEW_RECORDS}"),
        ));
    }
    let (input, records) = match body.input {
        Some(input) if body.records.is_none() && body.jsonl.is_none() => {
            // Reading files on the server is an operator's right, as dataset jobs are.
            cx.state.keys.require(caller.as_ref(), Scope::Admin)?;
            (Some(input), Vec::new())
        }
        Some(_) => return Err(invalid("input", "give `input` or inline records, not both")),
        None => (None, inline_records(body.records, body.jsonl)?),
    };
    let preview = super::jobs::jobs(&cx)?
        .preview_dataset(steps, input, records, limit)
        .await
        .map_err(|e| match ApiError::from(e) {
            // Errors of the one step `transform` stands for are its own.
            ApiError::InvalidRequest { message, param } if shorthand => ApiError::InvalidRequest {
                message,
                param: param.map(|p| p.replace("steps[0].policy", "transform")),
            },
            e => e,
        })?;
    let mut counts = [0u64; 3];
    let results: Vec<Value> = preview
        .rows
        .into_iter()
        .enumerate()
        .map(|(index, row)| {
            let (i, outcome, output, step, reason) = match row.fate {
                Fate::Keep(text) => {
                    let output = serde_json::from_str(&text).unwrap_or(Value::String(text));
                    (0, "keep", output, None, None)
                }
                Fate::Drop { step, reason } => (1, "drop", Value::Null, Some(step), Some(reason)),
                Fate::Error { step, reason } => (2, "error", Value::Null, Some(step), Some(reason)),
            };
            counts[i] += 1;
            let mut v = json!({"index": index, "outcome": outcome, "output": output,
                "step": step.and_then(|s| preview.steps.get(s).cloned()), "reason": reason});
            if let Some((file, line)) = row.origin {
                v["file"] = json!(file.display().to_string());
                v["line"] = json!(line);
                v["input"] = serde_json::from_str(&row.input).unwrap_or(Value::String(row.input));
            }
            v
        })
        .collect();
    body::json(
        StatusCode::OK,
        &json!({
            "object": "dataset.preview",
            "steps": preview.steps,
            "results": results,
            "counts": {"keep": counts[0], "drop": counts[1], "error": counts[2]},
        }),
    )
}
