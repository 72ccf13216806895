//! Serving one model split over several processes: the flags `serve` takes
//! to be rank 0 of a group, and `mlxgate worker`, every other rank
//! (`engine::distributed::lockstep` says how they keep in step).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::engine::distributed::lockstep::{self, Leader, WorkerOptions};
use crate::mlx::kernels::{self, KernelChoice};

/// `serve`'s flags for rank 0 of a process group.
#[derive(clap::Args, Debug)]
pub struct GroupArgs {
    /// Split the model over the processes of this MLX ring host file (a
    /// JSON list, one `["ip:port"]` per rank, as `mlx.launch` writes) and
    /// serve it as rank 0; the other ranks run `mlxgate worker`.
    #[arg(long, value_name = "FILE", requires = "control")]
    pub hostfile: Option<PathBuf>,
    /// Where rank 0 listens for its workers (and they connect), e.g.
    /// 127.0.0.1:40100: a port of its own, not one of the host file's.
    #[arg(long, value_name = "ADDR", requires = "hostfile")]
    pub control: Option<SocketAddr>,
}

/// `mlxgate worker`: one rank other than 0 of a served group.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Example (two processes on this machine; rank 0 serves HTTP):
  echo '[[\"127.0.0.1:40101\"], [\"127.0.0.1:40102\"]]' > hosts.json
  mlxgate serve -m MODEL --hostfile hosts.json --control 127.0.0.1:40100 &
  mlxgate worker -m MODEL --hostfile hosts.json --control 127.0.0.1:40100 --rank 1

A worker exits when rank 0 closes its connection (rank 0 stopped, or the
group lost a rank); start it again, with the others, to resume serving.")]
pub struct WorkerArgs {
    /// The model rank 0 serves: the same .gguf file or directory.
    #[arg(short, long)]
    pub model: PathBuf,
    /// MLX's ring host file, the same as rank 0's.
    #[arg(long, value_name = "FILE")]
    pub hostfile: PathBuf,
    /// This process's rank (1 or more).
    #[arg(long)]
    pub rank: usize,
    /// Rank 0's control address (its --control).
    #[arg(long, value_name = "ADDR")]
    pub control: SocketAddr,
}

/// Points MLX's ring at `hostfile` as `rank`; returns every rank's ring
/// addresses. Call before any other thread starts (it sets the
/// environment).
pub fn enter(hostfile: &Path, rank: usize) -> anyhow::Result<Vec<Vec<String>>> {
    let text = std::fs::read_to_string(hostfile)
        .with_context(|| format!("cannot read the host file {}", hostfile.display()))?;
    let ranks: Vec<Vec<String>> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not an MLX ring host file (a JSON list of [\"ip:port\"] lists, one per rank)",
            hostfile.display()
        )
    })?;
    anyhow::ensure!(
        rank < ranks.len(),
        "rank {rank} is not in {} ({} ranks: 0 to {})",
        hostfile.display(),
        ranks.len(),
        ranks.len().saturating_sub(1)
    );
    // SAFETY: called from `main` before this process starts a thread, so
    // nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("MLX_HOSTFILE", hostfile);
        std::env::set_var("MLX_RANK", rank.to_string());
    }
    Ok(ranks)
}

/// Makes this process rank 0 of the group `args` names, if any: it waits
/// for its workers on the control address. Before the runtime starts.
/// `models`: how many models the config serves (a split one is served
/// alone: the workers load the one model they are given).
pub fn lead(args: &GroupArgs, models: usize) -> anyhow::Result<()> {
    let (Some(hostfile), Some(control)) = (&args.hostfile, args.control) else {
        return Ok(());
    };
    anyhow::ensure!(
        models == 1,
        "a model split over processes (--hostfile) is served alone; the config lists {models} models: remove its [[models]] entries"
    );
    let ranks = enter(hostfile, 0)?;
    // Addresses given by host name are not cut on a silent worker (see
    // `lockstep`): the ring's sockets are found by address.
    let ring = ranks
        .iter()
        .flatten()
        .filter_map(|a| a.parse().ok())
        .collect();
    Leader::start(control, ranks.len(), ring)
        .with_context(|| format!("cannot listen for workers on {control}"))?;
    Ok(())
}

/// Runs `mlxgate worker` until rank 0 lets it go; an error says why.
pub fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rank >= 1,
        "rank 0 is the server: run `mlxgate serve --hostfile ... --control ...`"
    );
    let world = enter(&args.hostfile, args.rank)?.len();
    kernels::prepare_engine_thread(KernelChoice::default_for_process());
    let options = WorkerOptions {
        control: args.control,
        rank: args.rank,
        world,
    };
    lockstep::run_worker(&options, || {
        crate::engine::load_for_worker(&args.model)
            .map_err(|e| format!("cannot load {}: {e}", args.model.display()))
    })
    .map_err(anyhow::Error::msg)
}
