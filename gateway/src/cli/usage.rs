//! `mlxgate usage`: a running gateway's token usage report
//! (`GET /admin/usage`; an admin key from `MLXGATE_ADMIN_KEY`).

use clap::Args;
use http::Method;

use super::remote::{Remote, call_and_print, query_value};

#[derive(Args, Debug)]
pub struct UsageArgs {
    /// Only this tenant's usage (default: every tenant).
    #[arg(long)]
    tenant: Option<String>,
    /// First day, as YYYY-MM-DD (UTC) [default: today].
    #[arg(long)]
    from: Option<String>,
    /// Last day, as YYYY-MM-DD (UTC) [default: today].
    #[arg(long)]
    to: Option<String>,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(args: UsageArgs) -> anyhow::Result<()> {
    let query: Vec<String> = [
        ("tenant", &args.tenant),
        ("from", &args.from),
        ("to", &args.to),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.as_deref().map(|v| format!("{k}={}", query_value(v))))
    .collect();
    let path = match query.is_empty() {
        true => "/admin/usage".to_owned(),
        false => format!("/admin/usage?{}", query.join("&")),
    };
    call_and_print(&args.remote, Method::GET, &path, None)
}
