//! `mlxgate adapters list|available|mount|unmount` against a running
//! gateway's `/v1/adapters` (`--url`, key from `MLXGATE_API_KEY`; mounting
//! and unmounting need a key with the `admin` scope).

use clap::Subcommand;
use http::Method;
use serde_json::json;

use super::remote::{Remote, call_and_print};

#[derive(Subcommand, Debug)]
pub enum AdaptersCommand {
    /// List mounted adapters.
    List(Remote),
    /// List adapter directories in the gateway's adapter stores.
    Available(Remote),
    /// Mount the adapter directory PATH (inside an adapter store) as ID;
    /// requests then pick it with `"adapter": "ID"` or `X-Adapter: ID`.
    Mount {
        id: String,
        path: String,
        /// The base model to mount on (default: the first served model).
        #[arg(long)]
        model: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Unmount ID (requests using it finish first).
    Unmount {
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
}

pub fn run(cmd: AdaptersCommand) -> anyhow::Result<()> {
    let (remote, method, path, body) = match cmd {
        AdaptersCommand::List(remote) => (remote, Method::GET, "/v1/adapters".to_owned(), None),
        AdaptersCommand::Available(remote) => (
            remote,
            Method::GET,
            "/v1/adapters/available".to_owned(),
            None,
        ),
        AdaptersCommand::Mount {
            id,
            path,
            model,
            remote,
        } => {
            let body = json!({"id": id, "path": path, "model": model});
            (remote, Method::POST, "/v1/adapters".to_owned(), Some(body))
        }
        AdaptersCommand::Unmount { id, remote } => {
            (remote, Method::DELETE, format!("/v1/adapters/{id}"), None)
        }
    };
    call_and_print(&remote, method, &path, body)
}
