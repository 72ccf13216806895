//! The web console: its static files under `/console/` (built into the
//! binary by `build.rs`, or read from `[console] dir` on every request while
//! working on it), `/` sending browsers there, and `GET /console/session`,
//! which tells the sign-in page who a key is and what its scopes allow.
//!
//! The pages hold nothing of their own: every figure they show comes from
//! the public APIs with the signed-in key, so a key sees in the console
//! exactly what it could fetch with curl. Its routes sit at the end of the
//! route table, after every API route, so API requests never compare
//! against them.

use std::path::Path;
use std::sync::LazyLock;

use base64::Engine as _;
use http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG, HeaderValue, IF_NONE_MATCH,
    LOCATION, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use http::{Method, Request, Response, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::auth::api_key;
use super::body::{self, Body, ReqBody};
use super::{ApiError, Ctx, Route};
use crate::auth::Scope;

type HandlerResult = Result<Response<Body>, ApiError>;

/// The embedded files: (path under `/console/`, bytes, ETag).
static ASSETS: &[(&str, &[u8], &str)] = include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));

/// What the console answers to; `http::AppState` adds them last.
pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::GET, "/", |_cx, _req| {
            Box::pin(async { redirect("/console/") })
        }),
        Route::new(Method::GET, "/console", |_cx, _req| {
            Box::pin(async { redirect("/console/") })
        }),
        Route::new(Method::GET, "/console/", |cx, req| {
            Box::pin(async move { asset(&cx, &req, "index.html") })
        }),
        Route::new(Method::GET, "/console/session", |cx, req| {
            Box::pin(session(cx, req))
        }),
        Route::new(Method::GET, "/console/{file}", |cx, req| {
            Box::pin(async move {
                let file = cx.param("file").unwrap_or_default().to_owned();
                asset(&cx, &req, &file)
            })
        }),
        Route::new(Method::GET, "/console/vendor/{file}", |cx, req| {
            Box::pin(async move {
                let file = format!("vendor/{}", cx.param("file").unwrap_or_default());
                asset(&cx, &req, &file)
            })
        }),
    ]
}

fn redirect(to: &'static str) -> HandlerResult {
    Response::builder()
        .status(StatusCode::FOUND)
        .header(LOCATION, to)
        .body(body::empty())
        .map_err(|e| ApiError::Internal(format!("building a redirect: {e}")))
}

/// `GET /console/session`: the key in `Authorization` (or `x-api-key`),
/// its tenant and scopes; 401 for a missing or unknown key. With no keys
/// configured at all, inference is open and the answer says so.
async fn session(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let keys = &cx.state.keys;
    if keys.is_empty() {
        return body::json(
            StatusCode::OK,
            &json!({"key_id": "anonymous", "tenant": null, "scopes": [Scope::Infer.as_str()],
                    "keys_configured": false}),
        );
    }
    let token = api_key(req.headers()).ok_or(ApiError::MissingApiKey)??;
    let key = keys.lookup(token).ok_or(ApiError::InvalidApiKey)?;
    let scopes: Vec<&str> = key.scopes.iter().map(|s| s.as_str()).collect();
    body::json(
        StatusCode::OK,
        &json!({"key_id": key.id, "tenant": key.tenant, "scopes": scopes, "keys_configured": true}),
    )
}

/// One of the console's files, with a validator the browser revalidates
/// against (`no-cache`: always asks, usually gets a 304).
fn asset(cx: &Ctx, req: &Request<ReqBody>, path: &str) -> HandlerResult {
    let not_found = || ApiError::UnknownRoute {
        method: "GET".into(),
        path: format!("/console/{path}"),
    };
    let (bytes, etag, csp) = match &cx.state.app.config.console.dir {
        Some(dir) => {
            let bytes = read_from(dir, path).ok_or_else(not_found)?;
            let etag = format!("\"{:x}\"", Sha256::digest(&bytes));
            let csp = if path.ends_with(".html") {
                content_security_policy(&bytes)
            } else {
                EMBEDDED_CSP.clone()
            };
            (bytes::Bytes::from(bytes), etag, csp)
        }
        None => {
            let (_, bytes, etag) = ASSETS
                .iter()
                .find(|(p, _, _)| *p == path)
                .ok_or_else(not_found)?;
            let csp = EMBEDDED_CSP.clone();
            (bytes::Bytes::from_static(bytes), (*etag).to_owned(), csp)
        }
    };
    let fresh = req
        .headers()
        .get(IF_NONE_MATCH)
        .is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let mut resp = Response::builder()
        .status(if fresh {
            StatusCode::NOT_MODIFIED
        } else {
            StatusCode::OK
        })
        .header(CONTENT_TYPE, content_type(path))
        .header(CACHE_CONTROL, "no-cache")
        .header(ETAG, etag)
        .header(X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header(REFERRER_POLICY, "no-referrer")
        .header(X_FRAME_OPTIONS, "DENY");
    if path.ends_with(".html") {
        resp = resp.header(CONTENT_SECURITY_POLICY, csp);
    }
    resp.body(if fresh {
        body::empty()
    } else {
        body::full(bytes)
    })
    .map_err(|e| ApiError::Internal(format!("building a console answer: {e}")))
}

/// A file of `dir` named by one or two URL segments, when it is one the
/// console serves (no hidden files, nothing outside `dir`).
fn read_from(dir: &Path, path: &str) -> Option<Vec<u8>> {
    let servable = path
        .split('/')
        .all(|s| !s.is_empty() && !s.starts_with('.'))
        && content_type(path) != "application/octet-stream";
    if !servable {
        return None;
    }
    std::fs::read(dir.join(path)).ok()
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map_or("", |(_, ext)| ext) {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        _ => "application/octet-stream",
    }
}

/// The CSP of the embedded `index.html`, made once.
static EMBEDDED_CSP: LazyLock<HeaderValue> = LazyLock::new(|| {
    let index = ASSETS.iter().find(|(p, _, _)| *p == "index.html");
    content_security_policy(index.map_or(&[][..], |(_, b, _)| b))
});

/// The page's policy: its own files only (no CDN, no inline script but the
/// import map, allowed by its hash), no framing. Inline `style` attributes
/// are allowed: the chart library positions its parts with them.
fn content_security_policy(html: &[u8]) -> HeaderValue {
    let text = String::from_utf8_lossy(html);
    let import_map = text
        .split_once("<script type=\"importmap\">")
        .and_then(|(_, rest)| rest.split_once("</script>"))
        .map(|(map, _)| {
            let digest = Sha256::digest(map.as_bytes());
            format!(
                " 'sha256-{}'",
                base64::engine::general_purpose::STANDARD.encode(digest)
            )
        })
        .unwrap_or_default();
    let policy = format!(
        "default-src 'self'; script-src 'self'{import_map}; style-src 'self' 'unsafe-inline'; \
         img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; \
         base-uri 'none'; form-action 'self'"
    );
    HeaderValue::from_str(&policy)
        .unwrap_or_else(|_| HeaderValue::from_static("default-src 'self'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_console_has_its_page_and_libraries() {
        for p in [
            "index.html",
            "vendor/preact.mjs",
            "vendor/uPlot.iife.min.js",
        ] {
            assert!(ASSETS.iter().any(|(a, _, _)| *a == p), "{p} not embedded");
        }
    }

    #[test]
    fn the_import_map_is_allowed_by_its_hash_only() {
        let csp = content_security_policy(b"<script type=\"importmap\">{\"imports\":{}}</script>");
        let csp = csp.to_str().unwrap();
        let digest = Sha256::digest(b"{\"imports\":{}}");
        let b64 = base64::engine::general_purpose::STANDARD.encode(digest);
        assert!(
            csp.contains(&format!("script-src 'self' 'sha256-{b64}';")),
            "{csp}"
        );
        let scripts = csp
            .split(';')
            .find(|d| d.trim().starts_with("script-src"))
            .unwrap();
        assert!(!scripts.contains("unsafe-inline"), "{csp}");
    }

    #[test]
    fn only_servable_files_are_read_from_a_folder() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("app.js"), "x").unwrap();
        std::fs::write(dir.path().join(".secret.js"), "x").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
        assert_eq!(read_from(dir.path(), "app.js"), Some(b"x".to_vec()));
        assert_eq!(read_from(dir.path(), ".secret.js"), None);
        assert_eq!(read_from(dir.path(), "notes.txt"), None);
        assert_eq!(read_from(dir.path(), "../app.js"), None);
    }
}
