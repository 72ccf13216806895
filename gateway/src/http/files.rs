//! The data store's files, for dataset and fine-tune jobs to read (all
//! under `/api/`, and all needing the `admin` scope too, as those jobs do):
//!
//! - `PUT /api/files/{name}` streams the body into the store (the first
//!   `[jobs] allowed_paths` folder, by default `<data_dir>/files`): written
//!   to a hidden temporary file while its SHA-256 is computed, synced, then
//!   renamed over `name` at once, so readers never see half a file. 201 for
//!   a new name, 200 for a replaced one; the answer has the size and
//!   SHA-256. At most `[jobs] max_upload_bytes` (64 GiB); the body deadline
//!   bounds a stall (no data for `request_timeout_secs`), not the transfer.
//! - `GET /api/files` lists them (name, bytes, modified).
//! - `DELETE /api/files/{name}` removes one.
//!
//! Names are one path segment of letters, digits, `.`, `-` and `_`, not
//! starting with `.`: nothing can be written outside the store.

use std::path::PathBuf;
use std::time::UNIX_EPOCH;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::auth::{Caller, Scope};
use super::body::{self, Body, BodyLimit, ReqBody};
use super::{ApiError, Ctx, Route};
use crate::config::Config;

type HandlerResult = Result<Response<Body>, ApiError>;

pub fn routes(config: &Config) -> Vec<Route> {
    vec![
        Route::new(Method::GET, "/api/files", |cx, req| Box::pin(list(cx, req))),
        Route::new(Method::DELETE, "/api/files/{name}", |cx, req| {
            Box::pin(delete(cx, req))
        }),
        Route::new(Method::PUT, "/api/files/{name}", |cx, req| {
            Box::pin(put(cx, req))
        })
        .with_streamed_body(config.jobs.max_upload_bytes()),
    ]
}

/// The store (the jobs service creates it at start, as an allowed path;
/// an upload creates it again if it was removed); every call needs the
/// admin scope.
fn store(cx: &Ctx, req: &Request<ReqBody>) -> Result<PathBuf, ApiError> {
    let caller = req.extensions().get::<Caller>();
    cx.state.keys.require(caller, Scope::Admin)?;
    let config = &cx.state.app.config;
    Ok(config.jobs.file_store(&config.data_dir))
}

fn file_name(cx: &Ctx) -> Result<String, ApiError> {
    let name = cx.param("name").unwrap_or_default();
    let ok = (1..=200).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !ok {
        return Err(ApiError::InvalidRequest {
            message: format!(
                "invalid file name `{name}`: use 1-200 letters, digits, `.`, `-` and `_`, not starting with `.`"
            ),
            param: Some("name".into()),
        });
    }
    Ok(name.to_owned())
}

async fn put(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let dir = store(&cx, &req)?;
    let name = file_name(&cx)?;
    let limit = req.extensions().get::<BodyLimit>().map_or(0, |l| l.0);
    let target = dir.join(&name);
    let temp = dir.join(format!(".{name}.upload-{}", cx.request_id));
    let io = |what: &str, e: std::io::Error| ApiError::Internal(format!("{what}: {e}"));
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| io("cannot create the file store", e))?;
    let mut file = tokio::fs::File::create(&temp)
        .await
        .map_err(|e| io("cannot create the upload file", e))?;
    let mut body = req.into_body();
    let mut hash = Sha256::new();
    let mut bytes = 0u64;
    let copied: Result<(), ApiError> = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| body::body_error(&e, limit))?;
            if let Ok(data) = frame.into_data() {
                hash.update(&data);
                bytes += data.len() as u64;
                file.write_all(&data)
                    .await
                    .map_err(|e| io("cannot write the upload", e))?;
            }
        }
        file.sync_all()
            .await
            .map_err(|e| io("cannot sync the upload", e))
    }
    .await;
    drop(file);
    if let Err(e) = copied {
        let _ = tokio::fs::remove_file(&temp).await;
        return Err(e);
    }
    let replaced = tokio::fs::try_exists(&target).await.unwrap_or(false);
    if let Err(e) = tokio::fs::rename(&temp, &target).await {
        let _ = tokio::fs::remove_file(&temp).await;
        return Err(io("cannot move the upload into place", e));
    }
    let sha256 = format!("{:x}", hash.finalize());
    tracing::info!(file = %name, bytes, %sha256, "file stored");
    body::json(
        if replaced {
            StatusCode::OK
        } else {
            StatusCode::CREATED
        },
        &json!({"object": "file", "name": name, "bytes": bytes, "sha256": sha256,
                "path": target.display().to_string()}),
    )
}

async fn list(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let dir = store(&cx, &req)?;
    // Off the serving thread: a store may hold many files.
    let files = tokio::task::spawn_blocking(move || list_store(&dir))
        .await
        .map_err(|e| ApiError::Internal(format!("listing failed: {e}")))??;
    body::json(StatusCode::OK, &json!({"object": "list", "data": files}))
}

fn list_store(dir: &std::path::Path) -> Result<Vec<serde_json::Value>, ApiError> {
    let mut files = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(e) => {
            return Err(ApiError::Internal(format!(
                "cannot list {}: {e}",
                dir.display()
            )));
        }
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(meta) = e.metadata() else { continue };
        if name.starts_with('.') || !meta.is_file() {
            continue;
        }
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        files.push(
            json!({"object": "file", "name": name, "bytes": meta.len(), "modified": modified,
                          "path": e.path().display().to_string()}),
        );
    }
    files.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    Ok(files)
}

async fn delete(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let dir = store(&cx, &req)?;
    let name = file_name(&cx)?;
    match std::fs::remove_file(dir.join(&name)) {
        Ok(()) => body::json(StatusCode::OK, &json!({"name": name, "deleted": true})),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ApiError::NotFound {
            message: format!("No file `{name}` in the store"),
            code: "file_not_found",
        }),
        Err(e) => Err(ApiError::Internal(format!("cannot delete {name}: {e}"))),
    }
}
