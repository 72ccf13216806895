#!/usr/bin/env bash
# GPU benchmark of one model directory, in one sitting on the GPU machine
# (run through scripts/gpu/remote.sh, which sets MLXGATE and the libraries):
# mlxgate over HTTP (benches/serve_load.py at 1/8/32/128 streams of short
# chats decoding 64 tokens back to back, then the same numbers of requests
# sent at once, whose decode rate while all decode together is what a peer's
# static batch measures; and a 2,048-token prefill), then Hugging Face
# transformers and Python mlx-lm on the same weights (scripts/gpu/bench_peers.py).
#
#   scripts/gpu/bench.sh MODEL_DIR OUT_DIR
#   GPU_BENCH_PEERS="transformers mlx-lm"   which peers (mlx-lm needs PYTHONPATH
#                                          with the mlx and mlx-lm packages)
#   GPU_BENCH_STREAMS=1,8,32,128  GPU_BENCH_DURATION=10  GPU_BENCH_PREFILL_CHUNK=512
#   GPU_BENCH_MAX_TOKENS=64   tokens each answer decodes (mlxgate and the peers);
#                             longer answers give the `batch` scenario a longer
#                             window in which all N decode together
#   GPU_BENCH_TRACE=1    log every engine step's timings and summarise them
#                        (scripts/gpu/steps_summary.py) into OUT_DIR/steps.txt
#   GPU_BENCH_SCENARIOS="concurrency batch"   serve_load.py's scenarios to run
#                        (`batch` alone: the step trace holds its steps only;
#                        `none`: the prefill alone)
#   GPU_BENCH_PREFILL_TOKENS=2048   the prefill's prompt lengths (comma-separated)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
model=$1 out=$2
mkdir -p "$out"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$out/gateway.toml" <<TOML
[server]
max_concurrent_requests_per_key = 0

[scheduler]
max_batch = 128
max_queued = 512
prefill_chunk = ${GPU_BENCH_PREFILL_CHUNK:-512}
kv_cache_mb = 40000
TOML
if [ "${GPU_BENCH_TRACE:-0}" = 1 ]; then
    export MLXGATE_LOG_FORMAT=json RUST_LOG=info,mlxgate::engine::steps=debug
fi
"$MLXGATE" serve -c "$out/gateway.toml" -p "$port" -m "$model" --data-dir "$out/data" > "$out/gateway.log" 2>&1 &
gw=$!
trap 'kill $gw 2>/dev/null || true' EXIT
url="http://127.0.0.1:$port"
python3 "$root/scripts/gpu/bench_prefill.py" "$url" "${GPU_BENCH_PREFILL_TOKENS:-2048}" --wait-ready 600 | tee "$out/mlxgate-prefill.json" || true
scenarios=()
for scenario in ${GPU_BENCH_SCENARIOS:-concurrency batch}; do scenarios+=(--scenario "$scenario"); done
if [ "${GPU_BENCH_SCENARIOS:-}" != none ]; then
    python3 "$root/benches/serve_load.py" --target "mlxgate=$url" --wait-ready 600 "${scenarios[@]}" \
        --streams "${GPU_BENCH_STREAMS:-1,8,32,128}" --duration "${GPU_BENCH_DURATION:-10}" --max-tokens "${GPU_BENCH_MAX_TOKENS:-64}" \
        --warmup 2 --json "$out/mlxgate-load.json" | tee "$out/mlxgate-load.txt"
fi
kill $gw; wait $gw 2>/dev/null || true; trap - EXIT
rm -rf "$out/data"
if [ "${GPU_BENCH_TRACE:-0}" = 1 ]; then
    python3 "$root/scripts/gpu/steps_summary.py" "$out/gateway.log" | tee "$out/steps.txt"
fi
for peer in ${GPU_BENCH_PEERS-transformers mlx-lm}; do
    python3 "$root/scripts/gpu/bench_peers.py" "$peer" "$model" --batches "${GPU_BENCH_STREAMS:-1,8,32,128}" --new "${GPU_BENCH_MAX_TOKENS:-64}" \
        2>"$out/$peer.err" | tee "$out/$peer.json" || tail -5 "$out/$peer.err"
done
