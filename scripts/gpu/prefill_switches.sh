#!/usr/bin/env bash
# What two prefill switches bring under load, on the GPU machine (through
# scripts/gpu/remote.sh, README GPU): the 3B model at 32 streams of chats
# and 32 requests at once (256-token answers), with the step trace, run as
# built, with cuDNN's attention (MLX_CUDA_USE_CUDNN_SDPA=1) and with fresh
# fresh prompts attending together (MLXGATE_FRESH_TOGETHER=1); then Python
# mlx-lm at 1, 8 and 32 sequences decoding 64 and 256 tokens.
#
#   scripts/gpu/remote.sh run scripts/gpu/prefill_switches.sh OUT_DIR
set -u
out=$1
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$out"
[ -d /tmp/m3b ] || python3 "$root/scripts/gpu/random_model.py" 3b /tmp/m3b "$PAYLOAD/target/gpu-tokenizer" > "$out/model.log" 2>&1
for variant in as-built cudnn-on fresh-together; do
    switch=
    [ $variant = cudnn-on ] && switch="MLX_CUDA_USE_CUDNN_SDPA=1"
    [ $variant = fresh-together ] && switch="MLXGATE_FRESH_TOGETHER=1"
    echo "== $variant"
    env $switch GPU_BENCH_PEERS= GPU_BENCH_STREAMS=32 GPU_BENCH_MAX_TOKENS=256 GPU_BENCH_DURATION=5 \
        GPU_BENCH_PREFILL_CHUNK=2048 GPU_BENCH_TRACE=1 "$root/scripts/gpu/bench.sh" /tmp/m3b "$out/$variant" > "$out/$variant.txt" 2>&1
    rm -f "$out/$variant/gateway.log"
    grep -E '^ +[0-9]+ |prefill_tok_s' "$out/$variant.txt"
    grep -E "prefill|slab decode step   size<=32 " "$out/$variant/steps.txt"
done
for new in 64 256; do
    echo "== mlx-lm, $new tokens"
    python3 "$root/scripts/gpu/bench_peers.py" mlx-lm /tmp/m3b --batches 1,8,32 --new $new 2> "$out/mlx-lm-$new.err" | grep batch
done
