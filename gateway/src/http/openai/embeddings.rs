//! `POST /v1/embeddings`: routed like the other inference endpoints, and
//! forwarded to the upstream that serves the model. No local model embeds
//! yet, so a request routed here is refused with what to do instead.

use http::Request;

use super::{HandlerResult, validate};
use crate::http::body::ReqBody;
use crate::http::routing::{self, Routed};
use crate::http::{ApiError, Ctx};

pub async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let local = match routing::dispatch(&cx, req, validate::Endpoint::Embeddings).await? {
        Routed::Local(local) => local,
        Routed::Proxied(resp) => return Ok(resp),
    };
    let model = local.json["model"].as_str().unwrap_or_default();
    // An unknown model is a 404 as on the other endpoints.
    cx.state.app.models.resolve(model)?;
    Err(ApiError::InvalidParam {
        message: format!(
            "The model `{model}` does not produce embeddings: mlxgate serves no local embedding model. Send embeddings to an upstream that does (list the model in its `[[upstreams]] models`, or route it with a router policy)."
        ),
        param: "model".into(),
        code: "model_not_supported",
    })
}
