#!/usr/bin/env bash
# Packs what an NVIDIA machine with no network needs to run mlxgate on MLX's
# CUDA backend, in parts small enough to travel one at a time:
#
#   scripts/gpu/pack.sh [FILE_OR_DIR...]      -> .gpu/part-00, part-01, ... + .gpu/SHA256SUMS
#
# The payload: this checkout's release `mlxgate` (stripped; its MLX headers
# are the CUDA wheel's, so the same binary runs with either libmlx.so), the
# `mlx-cuda-13` wheel's libmlx.so and the libraries it bundles, and any
# extra files named (models, test binaries), kept under their paths relative
# to the checkout. On the GPU machine, scripts/gpu/remote.sh stages the
# parts, unpacks them and runs commands with the CUDA libraries found.
#   GPU_PART_MB=58      size of each part
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
version=$(sed -n "s/^MLX_VERSION=//p" scripts/setup.sh)
version=${version:-0.32.2}
wheels="$root/.deps/gpu-wheels"
if [ ! -f "$wheels/mlx/lib/libmlx.so" ]; then
    echo "==> downloading mlx-cuda-13==$version"
    mkdir -p "$wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_35_x86_64 -d "$wheels" "mlx-cuda-13==$version"
    (cd "$wheels" && unzip -q -o mlx_cuda_13-*.whl 'mlx/lib/*' 'mlx_cuda_13.libs/*')
fi
cargo build --release --locked -q -p mlxgate --bin mlxgate
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin"
cp target/release/mlxgate "$stage/bin/mlxgate"
strip "$stage/bin/mlxgate"
# OpenBLAS speeds MLX's CPU backend here; the GPU machine has none, and
# the rpath names this checkout: LD_LIBRARY_PATH finds libmlx.so there.
patchelf --remove-needed libopenblas.so.0 --remove-rpath "$stage/bin/mlxgate"
cp -r "$wheels/mlx" "$wheels/mlx_cuda_13.libs" "$stage/"
for extra in "$@"; do
    rel=$(realpath --relative-to="$root" "$extra")
    mkdir -p "$stage/$(dirname "$rel")"
    cp -r "$extra" "$stage/$rel"
    case "$rel" in target/*/deps/*) strip "$stage/$rel" 2>/dev/null || true ;; esac
done
rm -rf .gpu && mkdir -p .gpu
echo "==> packing $(du -sh "$stage" | cut -f1) into parts of ${GPU_PART_MB:-58} MB"
tar -C "$stage" -cf - . | zstd -q -T0 -12 --long=27 | split -b "${GPU_PART_MB:-58}M" -d - .gpu/part-
(cd .gpu && sha256sum part-* > SHA256SUMS)
ls -l .gpu
