//! `mlxgate jobs submit|list|show|watch|cancel`: a client of a running
//! gateway's `/api/jobs` (`--url`; the key rule is [`super::remote`]'s). `watch`
//! follows the job's event stream with a progress bar, reconnecting with
//! `Last-Event-ID` if the connection drops.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Subcommand;
use http::Method;
use http::header::ACCEPT;
use http_body_util::BodyExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use super::remote::{Payload, Remote, api_failure, print};
use crate::jobs::types::{JobEvent, StoredEvent};

/// One JSON call to the gateway.
async fn call(
    r: &Remote,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    super::remote::call(r, method, path, body.map_or(Payload::None, Payload::Json)).await
}

#[derive(Subcommand, Debug)]
pub enum JobsCommand {
    /// Submit a job and print its row (or, with --watch, follow it).
    Submit {
        /// noop, crash, dataset or quantize.
        kind: String,
        /// The job's config as JSON, e.g. '{"steps": 3}'.
        #[arg(long, conflicts_with = "config_file")]
        config: Option<String>,
        /// Read the config JSON from a file.
        #[arg(long, value_name = "FILE")]
        config_file: Option<PathBuf>,
        /// Follow the job until it ends, as `watch` does.
        #[arg(long)]
        watch: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// List jobs, newest first.
    List {
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        kind: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// `next_cursor` of the previous page.
        #[arg(long)]
        cursor: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Print one job's row.
    Show {
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Follow a job's events with a progress bar until it ends; exits
    /// non-zero unless it ends `done`.
    Watch {
        id: String,
        /// Print each event as an NDJSON line on stdout instead of a bar.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Cancel a queued or running job.
    Cancel {
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
}

/// Runs a `jobs` subcommand.
pub fn run(cmd: JobsCommand) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run_async(cmd))
}

async fn run_async(cmd: JobsCommand) -> anyhow::Result<()> {
    match cmd {
        JobsCommand::Submit {
            kind,
            config,
            config_file,
            watch,
            remote,
        } => {
            let text = match (config, config_file) {
                (Some(c), _) => c,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .with_context(|| format!("cannot read {}", f.display()))?,
                (None, None) => "{}".to_owned(),
            };
            let config: Value = serde_json::from_str(&text).context("--config is not JSON")?;
            let body = json!({ "kind": kind, "config": config });
            let row = call(&remote, Method::POST, "/api/jobs", Some(body)).await?;
            if watch {
                let id = row["id"].as_str().unwrap_or_default().to_owned();
                return watch_job(&remote, &id, false).await;
            }
            print(&row);
            Ok(())
        }
        JobsCommand::List {
            status,
            kind,
            limit,
            cursor,
            remote,
        } => {
            let mut path = format!("/api/jobs?limit={limit}");
            for (k, v) in [("status", status), ("kind", kind), ("cursor", cursor)] {
                if let Some(v) = v {
                    path.push_str(&format!("&{k}={v}"));
                }
            }
            let v = call(&remote, Method::GET, &path, None).await?;
            print(&v);
            Ok(())
        }
        JobsCommand::Show { id, remote } => {
            print(&call(&remote, Method::GET, &format!("/api/jobs/{id}"), None).await?);
            Ok(())
        }
        JobsCommand::Cancel { id, remote } => {
            print(&call(&remote, Method::DELETE, &format!("/api/jobs/{id}"), None).await?);
            Ok(())
        }
        JobsCommand::Watch { id, json, remote } => watch_job(&remote, &id, json).await,
    }
}

/// Splits SSE text into events; returns the `data` of complete ones and
/// keeps a partial event in `buf`.
fn take_events(buf: &mut String) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(end) = buf.find("\n\n") {
        let block: String = buf.drain(..end + 2).collect();
        let data: Vec<&str> = block
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if !data.is_empty() {
            out.push(data.join("\n"));
        }
    }
    out
}

async fn watch_job(r: &Remote, id: &str, json_lines: bool) -> anyhow::Result<()> {
    let tty = std::io::stderr().is_terminal() && !json_lines;
    let bar = if tty {
        let b = ProgressBar::new(1000);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.enable_steady_tick(Duration::from_millis(200));
        b
    } else {
        ProgressBar::hidden()
    };
    let mut last_seq = 0u64;
    let mut ended = None;
    let mut attempts = 0;
    while ended.is_none() {
        let mut conn = r.connect().await?;
        let mut req = conn.request(
            Method::GET,
            &format!("/api/jobs/{id}/events"),
            Payload::None,
        )?;
        req.headers_mut()
            .insert(ACCEPT, "text/event-stream".parse()?);
        if last_seq > 0 {
            req.headers_mut()
                .insert("last-event-id", last_seq.to_string().parse()?);
        }
        let resp = conn.sender.send_request(req).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body.collect().await?.to_bytes();
            return Err(api_failure(status, &bytes));
        }
        let mut buf = String::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.push_str(&String::from_utf8_lossy(&data));
            for text in take_events(&mut buf) {
                let Ok(e) = serde_json::from_str::<StoredEvent>(&text) else {
                    continue;
                };
                last_seq = e.seq;
                if json_lines {
                    println!("{text}");
                } else {
                    show(&bar, tty, &e.event);
                }
                if e.event.is_terminal() {
                    ended = Some(e.event);
                }
            }
        }
        if ended.is_none() {
            attempts += 1;
            if attempts > 5 {
                bail!("the event stream of {id} keeps ending before the job does");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    bar.finish_and_clear();
    let row = call(r, Method::GET, &format!("/api/jobs/{id}"), None).await?;
    if !json_lines {
        print(&row);
    }
    match ended {
        Some(JobEvent::Done { .. }) => Ok(()),
        Some(JobEvent::Failed { error, .. }) => bail!("job {id} failed: {error}"),
        _ => bail!("job {id} was cancelled"),
    }
}

/// Shows one event on the bar (terminal) or as a line on stderr.
fn show(bar: &ProgressBar, tty: bool, e: &JobEvent) {
    let line = match e {
        JobEvent::Started {} => "started".to_owned(),
        JobEvent::Log { line } => line.clone(),
        JobEvent::Stage {
            stage,
            progress,
            message,
            ..
        } => {
            if let Some(p) = progress {
                bar.set_position((p.clamp(0.0, 1.0) * 1000.0) as u64);
            }
            bar.set_message(format!("{stage}: {}", message.as_deref().unwrap_or("")));
            if tty {
                return;
            }
            format!(
                "{stage} {:>5.1}% {}",
                progress.unwrap_or(0.0) * 100.0,
                message.as_deref().unwrap_or("")
            )
        }
        JobEvent::Metric {
            kind,
            step,
            loss,
            progress,
            message,
            ..
        } => {
            if let Some(p) = progress {
                bar.set_position((p.clamp(0.0, 1.0) * 1000.0) as u64);
            }
            if tty {
                return;
            }
            let loss = loss.map(|l| format!(" loss {l:.4}")).unwrap_or_default();
            format!(
                "{kind} step {step}{loss} {}",
                message.as_deref().unwrap_or("")
            )
        }
        JobEvent::Done { .. } => "done".to_owned(),
        JobEvent::Failed { error, .. } => format!("failed: {error}"),
        JobEvent::Cancelled { .. } => "cancelled".to_owned(),
    };
    if tty {
        bar.println(line);
    } else {
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sse_parsing_keeps_partial_events() {
        let mut buf = "id: 1\ndata: {\"a\":1}\n\n: keep-alive\n\nid: 2\ndata: {\"b\"".to_owned();
        assert_eq!(super::take_events(&mut buf), vec!["{\"a\":1}".to_owned()]);
        buf.push_str(":2}\n\n");
        assert_eq!(super::take_events(&mut buf), vec!["{\"b\":2}".to_owned()]);
        assert!(buf.is_empty());
    }
}
