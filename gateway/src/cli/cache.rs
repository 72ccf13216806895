//! `mlxgate cache save|list|show|rm` against a running gateway's
//! `/v1/prompt_caches` (`--url`, key from `MLXGATE_API_KEY`), and
//! `mlxgate cache inspect FILE`, which reads a cache file offline.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use http::Method;
use serde_json::{Value, json};

use super::remote::{Remote, call_and_print};
use crate::engine::prompt_cache::file::{MappedFile, read_header};

#[derive(Subcommand, Debug)]
pub enum CacheCommand {
    /// Prefill a prompt on the gateway and save its cache as NAME; requests
    /// then start from it with `"prompt_cache": "NAME"`.
    Save(SaveArgs),
    /// List saved prompt caches.
    List(Remote),
    /// Print one prompt cache's details.
    Show {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Delete a prompt cache (requests using it finish first).
    Rm {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Read a cache file's header (no gateway needed); --verify also checks
    /// every tensor's checksum.
    Inspect {
        file: PathBuf,
        #[arg(long)]
        verify: bool,
    },
}

#[derive(Args, Debug)]
pub struct SaveArgs {
    /// 1-64 of [A-Za-z0-9._-].
    name: String,
    /// The model id (see GET /v1/models).
    #[arg(long)]
    model: String,
    /// The prompt text.
    #[arg(long, conflicts_with_all = ["prompt_file", "messages_file"])]
    prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long, value_name = "FILE", conflicts_with = "messages_file")]
    prompt_file: Option<PathBuf>,
    /// A JSON array of chat messages (e.g. a system prompt), rendered with
    /// the model's chat template.
    #[arg(long, value_name = "FILE")]
    messages_file: Option<PathBuf>,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(cmd: CacheCommand) -> anyhow::Result<()> {
    let (remote, method, path, body) = match cmd {
        CacheCommand::Inspect { file, verify } => return inspect(&file, verify),
        CacheCommand::Save(args) => {
            let body = save_body(&args)?;
            eprintln!(
                "prefilling and saving `{}` (long prompts take a while on CPU)...",
                args.name
            );
            (
                args.remote,
                Method::POST,
                "/v1/prompt_caches".to_owned(),
                Some(body),
            )
        }
        CacheCommand::List(remote) => (remote, Method::GET, "/v1/prompt_caches".to_owned(), None),
        CacheCommand::Show { name, remote } => (
            remote,
            Method::GET,
            format!("/v1/prompt_caches/{name}"),
            None,
        ),
        CacheCommand::Rm { name, remote } => (
            remote,
            Method::DELETE,
            format!("/v1/prompt_caches/{name}"),
            None,
        ),
    };
    call_and_print(&remote, method, &path, body)
}

/// The `POST /v1/prompt_caches` body for `save`.
fn save_body(args: &SaveArgs) -> anyhow::Result<Value> {
    let mut body = json!({"name": args.name, "model": args.model});
    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
    };
    match (&args.prompt, &args.prompt_file, &args.messages_file) {
        (Some(text), _, _) => body["prompt"] = json!(text),
        (_, Some(path), _) => body["prompt"] = json!(read(path)?),
        (_, _, Some(path)) => {
            let messages: Value = serde_json::from_str(&read(path)?)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            body["messages"] = messages;
        }
        _ => bail!("give the prompt: --prompt, --prompt-file or --messages-file"),
    }
    Ok(body)
}

fn inspect(path: &std::path::Path, verify: bool) -> anyhow::Result<()> {
    let info = read_header(path)?;
    if verify {
        MappedFile::open(path)?;
    }
    let h = &info.header;
    let rotating = h.layers.iter().filter(|l| l.window.is_some()).count();
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "name": h.name,
            "owner": h.owner,
            "version": h.version,
            "created": h.created,
            "fingerprint": h.fingerprint,
            "tokens": h.tokens.len(),
            "layers": h.layers.len(),
            "rotating_layers": rotating,
            "data_bytes": h.data_bytes(),
            "file_bytes": info.file_len,
            "checksums": if verify { "verified" } else { "not checked (use --verify)" },
        }))?
    );
    Ok(())
}
