#!/usr/bin/env bash
# Checks the CUDA bodies of the ragged decode attention kernels on the CPU
# (scripts/gpu/kernel_emulator.cpp): both in mlx-sys/kernels/ragged_attention.cpp
# (a block per query head, and a block per key/value head), and a candidate
# body laid out like the second, if one is named. Each must match attention
# computed plainly within 1e-4 (float32). Run by scripts/test.sh; needs g++
# (C++20).
#
#   scripts/gpu/check_kernels.sh [CANDIDATE.cu]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Each body between its raw string's markers, as attention_probe.py reads them.
python3 - "$root/mlx-sys/kernels/ragged_attention.cpp" "$work" <<'PY'
import sys
text = open(sys.argv[1]).read()
for name in ("per_head", "per_kv_head"):
    body = text[text.index(f'R"{name}(') + len(f'R"{name}('):text.index(f'){name}"')]
    open(f"{sys.argv[2]}/{name}.cu", "w").write(body)
PY
check() {
    local name=$1 body=$2 threads=$3 per_kv_head=$4
    g++ -std=c++20 -O1 -pthread -DBODY="\"$body\"" -DTHREADS="$threads" -DPER_KV_HEAD="$per_kv_head" \
        -o "$work/$name" "$root/scripts/gpu/kernel_emulator.cpp"
    printf '%s: ' "$name"
    "$work/$name"
}
check per-head "$work/per_head.cu" 128 0
check per-kv-head "$work/per_kv_head.cu" 256 1
if [ $# -gt 0 ]; then check candidate "$1" 256 1; fi
