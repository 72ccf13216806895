#!/usr/bin/env bash
# Where batched decode stops scaling, for each model size named, mlxgate
# against Python mlx-lm in one sitting on the GPU machine: 1, 8, 32, 64 and
# 128 streams, answers of 256 tokens (so that N requests sent at once share a
# window of several seconds in which all N decode), and the 2,048-token
# prefill. Run through scripts/gpu/remote.sh (README, GPU):
#
#   scripts/gpu/remote.sh run scripts/gpu/scale.sh OUT_DIR [8b 3b ...]
#   SCALE_COMPARE="NAME=VALUE ...[; NAME=VALUE ...]"   then mlxgate alone
#                                    again with each set of switches (README, GPU)
#   SCALE_COMPARE_STREAMS=32,128     the streams those runs take
#   SCALE_PEERS="mlx-lm mlx-lm-batch"  the peers (scripts/gpu/bench_peers.py; empty: none)
#   GPU_BENCH_STREAMS, GPU_BENCH_SCENARIOS   as scripts/gpu/bench.sh takes them
set -u
out=$1; shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# One mlxgate benchmark (bench.sh, 256-token answers, the step trace) under
# OUT_DIR/NAME, with the settings given; prints its table and step summary.
run() {
    local name=$1 model=$2; shift 2
    env GPU_BENCH_MAX_TOKENS=256 GPU_BENCH_DURATION=5 GPU_BENCH_PREFILL_CHUNK=2048 GPU_BENCH_TRACE=1 "$@" \
        "$root/scripts/gpu/bench.sh" "$model" "$out/$name" > "$out/$name.txt" 2>&1
    rm -f "$out/$name/gateway.log"
    grep -E '^ +[0-9]+ |"prefill_tok_s"|"peer"|Traceback|Error' "$out/$name.txt" | head -40
    # Steps by kind and batch size, and the slowest decode steps of the
    # largest batch.
    grep -E '^(decode step|slab decode step|prefill chunk|prefill together|buffer cache emptied) ' "$out/$name/steps.txt" 2>/dev/null | cut -c1-330
    grep -A10 '^decode steps of' "$out/$name/steps.txt" 2>/dev/null
}
for size in "${@:-8b}"; do
    model=/tmp/m$size
    [ -d "$model" ] || python3 "$root/scripts/gpu/random_model.py" "$size" "$model" "$PAYLOAD/target/gpu-tokenizer" \
        > "$out/model-$size.log" 2>&1 || { tail -5 "$out/model-$size.log"; continue; }
    echo "== $size"
    run "$size" "$model" GPU_BENCH_PEERS="${SCALE_PEERS-mlx-lm mlx-lm-batch}" GPU_BENCH_STREAMS="${GPU_BENCH_STREAMS:-1,8,32,64,128}"
    IFS=';' read -ra variants <<< "${SCALE_COMPARE:-}"
    for i in "${!variants[@]}"; do
        echo "== $size with ${variants[$i]}"
        # shellcheck disable=SC2086 # NAME=VALUE pairs, split on purpose
        run "$size-compare$i" "$model" ${variants[$i]} GPU_BENCH_PEERS= GPU_BENCH_STREAMS="${SCALE_COMPARE_STREAMS:-32,128}"
    done
done
