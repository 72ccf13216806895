#!/usr/bin/env bash
# mlxgate's engine vs llama.cpp, same machine, same run, same prompt token ids:
# prefill and decode tokens/s on SmolLM2-135M (Q4_1) and Qwen2.5-Coder-0.5B
# (Q4_K_M), their ratios, and a roofline line (benches/engine_vs_llama_cpp.rs,
# which drives scripts/llama_cpp_speed.py).
#
# llama.cpp comes from llama-cpp-python built from source into a scratch venv
# (.deps/llamacpp-venv, git-ignored; never a project dependency). The first run
# compiles llama.cpp (tens of minutes on 2 cores); later runs reuse it.
#
#   MLXGATE_BENCH_RUNS=3 MLXGATE_BENCH_DECODE_TOKENS=64 MLXGATE_BENCH_PROMPTS=128,512 \
#   MLXGATE_BENCH_MODELS=a.gguf,b.gguf  scripts/bench-vs-llama-cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
# Portable x86-64 build: a -march=native build segfaulted on this machine's CPU.
# AVX/AVX2/FMA/F16C/BMI2 stay on (llama.cpp's x86 fast path), AVX-512 and AMX
# off; no BLAS, no libcurl, no multimodal library. Options this llama.cpp
# version (ggml/CMakeLists.txt) has; unknown ones would only warn.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
CMAKE_ARGS+=" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
CMAKE_ARGS+=" -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS+=" -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF"

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

qwen=models/qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
if [ -f "$qwen" ]; then
  scripts/setup.sh
else
  step "installing the opt-in models (Qwen2.5-Coder-0.5B) through scripts/setup.sh"
  MLXGATE_EXTRA_MODELS=1 scripts/setup.sh
fi

venv=.deps/llamacpp-venv
want="$LLAMA_CPP_PYTHON $CMAKE_ARGS"
if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$want" ] \
  || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  step "llama.cpp: building $LLAMA_CPP_PYTHON from source into $venv (log: .deps/llamacpp-build.log)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" uninstall -q -y llama-cpp-python >/dev/null 2>&1 || true
  # The build folder is kept to show what CMake chose (CMakeCache.txt); pip
  # unpacks the source in a new temporary folder each time, so start it empty.
  rm -rf .deps/llamacpp-build && mkdir -p .deps/llamacpp-build
  if ! CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$venv/bin/pip" install -v --disable-pip-version-check --no-cache-dir \
    --no-binary llama-cpp-python -C build-dir="$PWD/.deps/llamacpp-build" \
    "$LLAMA_CPP_PYTHON" >.deps/llamacpp-build.log 2>&1; then
    tail -30 .deps/llamacpp-build.log >&2
    echo "llama-cpp-python failed to build (full log: .deps/llamacpp-build.log)" >&2
    exit 1
  fi
  echo "$want" >"$venv/.installed"
else
  step "llama.cpp: $LLAMA_CPP_PYTHON present in $venv"
fi
# What the CPU backend was built with: AVX2 / FMA / F16C must read 1.
"$venv/bin/python" -c 'import llama_cpp; print("llama.cpp system info:", llama_cpp.llama_print_system_info().decode())'

step "bench: cargo bench -p mlxgate --bench engine_vs_llama_cpp"
MLXGATE_LLAMA_CPP_PYTHON="$PWD/$venv/bin/python" \
  cargo bench --locked -p mlxgate --bench engine_vs_llama_cpp
