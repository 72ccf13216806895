#!/usr/bin/env bash
# A whole GPU sitting in one command, the most wanted results first, each
# written under OUT_DIR as it finishes (a call that runs out of time still
# brings back what finished). Runs on the GPU machine through
# scripts/gpu/remote.sh, after packing here the test binary of
# `cargo test --release --no-run --test decode_slab` (README, GPU):
#
#   scripts/gpu/remote.sh run scripts/gpu/sitting.sh OUT_DIR [3b|8b]
#
# 1. the random-weight model (scripts/gpu/random_model.py) and its benchmark
#    against Python mlx-lm, with the step trace (scripts/gpu/bench.sh);
# 2. the decode_slab tests in float32 (the packed test binary);
# 3. one and 32 streams with projections stacked
#    (MLXGATE_STACK_PROJECTIONS=1), to measure what stacking brings;
# 4. mlx-lm's decode step graph there, to hold against mlxgate's (each bench
#    counts the nodes of mlxgate's steps, MLXGATE_GRAPH_DOT).
set -u
out=$1 size=${2:-3b}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
model=/tmp/m$size
[ -d "$model" ] || python3 "$root/scripts/gpu/random_model.py" "$size" "$model" "$PAYLOAD/target/gpu-tokenizer" > "$out/model.log" 2>&1 \
    || { tail -5 "$out/model.log"; exit 1; }
bench() {
    local name=$1; shift
    mkdir -p "/tmp/dot-$name"
    env "$@" GPU_BENCH_PREFILL_CHUNK=2048 GPU_BENCH_TRACE=1 GPU_BENCH_DURATION=5 MLXGATE_GRAPH_DOT="/tmp/dot-$name" \
        "$root/scripts/gpu/bench.sh" "$model" "$out/$name" > "$out/$name.txt" 2>&1
    rm -f "$out/$name/gateway.log"
    grep -E '^ +[0-9]+ |"prefill_tok_s"|"peer"|Traceback|Error' "$out/$name.txt" | head -30
    cat "$out/$name/steps.txt" 2>/dev/null
    # The GPU step's nodes by primitive, per batch width (MLXGATE_GRAPH_DOT).
    python3 "$root/scripts/gpu/graph_nodes.py" --count /tmp/dot-$name/decode-*.dot 2>&1 | head -40
}
echo "== $size, mlxgate and mlx-lm"
bench "$size" GPU_BENCH_PEERS=mlx-lm
echo "== decode_slab, float32"
"$root/scripts/gpu/slab_tests.sh" "$out"
echo "== $size, projections stacked"
bench "$size-stacked" MLXGATE_STACK_PROJECTIONS=1 GPU_BENCH_STREAMS=1,32 GPU_BENCH_PEERS=
echo "== mlx-lm's step graph on the GPU, 1 and 8 rows"
for rows in 1 8; do
    echo "mlx-lm, $rows rows: a step's graph built in $(python3 "$root/scripts/gpu/graph_nodes.py" --mlx-lm "$model" "/tmp/dot-mlx-lm-$rows.dot" $rows 2>&1 | tail -1) ms (median)"
done
python3 "$root/scripts/gpu/graph_nodes.py" --count /tmp/dot-mlx-lm-*.dot
