#!/usr/bin/env bash
# Checks the CUDA bodies of the ragged decode attention kernels on the CPU
# (scripts/gpu/kernel_emulator.cpp): the one in use, read from
# mlx-sys/kernels/ragged_attention.cpp, and the candidate in
# scripts/gpu/ragged_gqa_candidate.cu. Each must match attention computed
# plainly within 1e-4 (float32). Run by scripts/test.sh; needs g++ (C++20).
#
#   scripts/gpu/check_kernels.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The body between the raw string's markers, as attention_probe.py reads it.
python3 - "$root/mlx-sys/kernels/ragged_attention.cpp" "$work/in_use.cu" <<'PY'
import sys
text = open(sys.argv[1]).read()
open(sys.argv[2], "w").write(text[text.index('R"cuda(') + len('R"cuda('):text.index(')cuda"')])
PY
check() {
    local name=$1 body=$2 threads=$3 per_kv_head=$4
    g++ -std=c++20 -O1 -pthread -DBODY="\"$body\"" -DTHREADS="$threads" -DPER_KV_HEAD="$per_kv_head" \
        -o "$work/$name" "$root/scripts/gpu/kernel_emulator.cpp"
    printf '%s: ' "$name"
    "$work/$name"
}
check in-use "$work/in_use.cu" 128 0
check candidate "$root/scripts/gpu/ragged_gqa_candidate.cu" 256 1
