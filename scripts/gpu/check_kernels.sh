#!/usr/bin/env bash
# Checks mlxgate's CUDA kernel bodies on the CPU (scripts/gpu/emulation.h):
# both ragged decode attention bodies in mlx-sys/kernels/ragged_attention.cpp
# (a block per query head, and a block per key/value head; harness
# kernel_emulator.cpp), a candidate body laid out like the second if one is
# named, and the decode matmul, plain and gated (mlx-sys/kernels/decode_matmul.cpp;
# harness decode_matmul_emulator.cpp). Each must match the plain computation
# (float32). Run by scripts/test.sh; needs g++ (C++20).
#
#   scripts/gpu/check_kernels.sh [CANDIDATE.cu]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Each body between its raw string's markers, as the probes read them.
for body in ragged_attention.cpp:write_column ragged_attention.cpp:per_head ragged_attention.cpp:per_kv_head \
    decode_matmul.cpp:decode_matmul; do
    python3 "$root/scripts/gpu/kernel_source.py" "${body%%:*}" "${body#*:}" > "$work/${body#*:}.cu"
done
# check NAME HARNESS BODY THREADS [g++ flags]
check() {
    local name=$1 harness=$2 body=$3 threads=$4
    shift 4
    g++ -std=c++20 -O1 -pthread -DBODY="\"$body\"" -DHEADER="\"$work/write_column.cu\"" -DBLOCK_THREADS="$threads" "$@" \
        -o "$work/$name" "$root/scripts/gpu/$harness"
    printf '%s: ' "$name"
    "$work/$name"
}
check per-head kernel_emulator.cpp "$work/per_head.cu" 128 -DPER_KV_HEAD=0
check per-kv-head kernel_emulator.cpp "$work/per_kv_head.cu" 256 -DPER_KV_HEAD=1
check decode-matmul decode_matmul_emulator.cpp "$work/decode_matmul.cu" 256
if [ $# -gt 0 ]; then check candidate kernel_emulator.cpp "$1" 256 -DPER_KV_HEAD=1; fi
