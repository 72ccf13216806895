//! `POST /v1/completions` (the legacy text completion API).

use http::{Request, StatusCode};
use serde_json::Value;

use super::sse::{self, Framer, Kind};
use super::types::{CompletionLogprobs, TextChoice, TextCompletion};
use super::{
    HandlerResult, collect_all, generate_request, merged, start_blocking, total_usage, validate,
};
use crate::engine::Prompt;
use crate::http::body::{self, ReqBody};
use crate::http::routing::{self, Routed};
use crate::http::{ApiError, Ctx};
use crate::util::time::unix_secs;

pub async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    // Routing first: a router policy may send this request upstream or refuse it.
    let local = match routing::dispatch(&cx, req, validate::Endpoint::Completions).await? {
        Routed::Local(local) => local,
        Routed::Proxied(resp) => return Ok(resp),
    };
    let json: &Value = &local.json;
    let completion = validate::completion_request(json)?;
    let model = cx.state.app.models.resolve(&completion.common.model)?;
    let engine = model.engine.clone();
    // Tokens first: the adapter selector sees the prompt's length. Routing
    // may have counted them already with this model.
    let ids = match local.counted_for(&model.id) {
        Some(ids) => ids,
        None => {
            let (engine, prompt) = (engine.clone(), completion.prompt.clone());
            start_blocking(&cx, move || engine.prompt_tokens(prompt), "prompt").await?
        }
    };
    let prompt = Prompt::Tokens(ids);
    let request = generate_request(&cx, &local, prompt, &completion.common, &model).await?;
    let n = completion.common.n;
    let mut streams = start_blocking(&cx, move || engine.generate_n(request, n), "prompt").await?;
    local.meter.watch(&mut streams);
    let engine_err = |e| ApiError::from_engine(e, "prompt");

    let id = format!("cmpl-{}", cx.request_id);
    let created = unix_secs();
    let logprobs = completion.common.logprobs.is_some();
    if completion.common.stream {
        let mut framer = Framer::new(Kind::Completion, id, created, model.id, n);
        framer.include_usage = completion.common.include_usage;
        framer.logprobs = logprobs;
        return Ok(sse::response(framer, merged(streams)));
    }
    let done = collect_all(streams, logprobs).await.map_err(engine_err)?;
    let usage = total_usage(&done);
    let fingerprint = super::system_fingerprint();
    body::json(
        StatusCode::OK,
        &TextCompletion {
            id: &id,
            object: "text_completion",
            created,
            model: &model.id,
            system_fingerprint: &fingerprint,
            choices: done
                .into_iter()
                .enumerate()
                .map(|(index, done)| TextChoice {
                    text: done.text,
                    index,
                    logprobs: logprobs.then(|| {
                        let mut l = CompletionLogprobs::default();
                        l.push(&done.tokens, &mut 0);
                        l
                    }),
                    finish_reason: Some(done.reason.as_str()),
                })
                .collect(),
            usage: Some(Some(usage.into())),
        },
    )
    .map(|resp| local.meter.timed(resp))
}
