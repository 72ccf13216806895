#!/usr/bin/env bash
# Packs what an NVIDIA machine with no network needs to run mlxgate on MLX's
# CUDA backend, in parts small enough to travel one at a time:
#
#   scripts/gpu/pack.sh [FILE_OR_DIR...]   -> .gpu/part-00, part-01, ..., .gpu/SHA256SUMS
#                                             and .gpu/tools (a zstd for the other side)
#
# Then, with the device tool, one call per part made right after the last
# (the machine stays warm ~30 s): carry [".gpu/part-00", ".gpu/SHA256SUMS",
# ".gpu/tools"] with command `scripts/gpu/remote.sh stage`, and so on; the
# last call carries the last part and runs `scripts/gpu/remote.sh run CMD`.
#
# The payload: this checkout's release `mlxgate` (stripped; its MLX headers
# are the CUDA wheel's, so the same binary runs with either libmlx.so), the
# `mlx-cuda-13` wheel's libmlx.so and the libraries it bundles, and any
# extra files named (models, test binaries), kept under their paths relative
# to the checkout (test binaries from target/*/deps/ are stripped and lose
# OpenBLAS and their rpath like the binary). On the GPU machine, scripts/gpu/remote.sh stages the
# parts, unpacks them and runs commands with the CUDA libraries found.
#   GPU_PART_MB=55      size of each part (MiB): a call carries 64 MiB with the
#                       working tree (~5 MiB) and .gpu/tools, so 58 no longer fits
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
for tool in patchelf zstd strip; do
    command -v "$tool" >/dev/null || { echo "pack.sh needs $tool: apt-get install patchelf zstd binutils" >&2; exit 1; }
done
version=$(sed -n "s/^MLX_VERSION=//p" scripts/setup.sh)
version=${version:-0.32.2}
wheels="$root/.deps/gpu-wheels"
if [ ! -f "$wheels/mlx/lib/libmlx.so" ]; then
    echo "==> downloading mlx-cuda-13==$version"
    mkdir -p "$wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_35_x86_64 -d "$wheels" "mlx-cuda-13==$version"
    (cd "$wheels" && unzip -q -o mlx_cuda_13-*.whl 'mlx/lib/*' 'mlx/include/*' 'mlx_cuda_13.libs/*')
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
# Python MLX and mlx-lm, the peers on the GPU (their libmlx.so is the one
# above): the wheels unpacked into the payload's root, its PYTHONPATH there.
if [ ! -d "$wheels/py" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 -d "$wheels/py" "mlx==$version" "mlx-lm==$version"
fi
for whl in "$wheels"/py/*.whl; do unzip -q -o "$whl" -d "$stage" -x '*.dist-info/*'; done
for extra in "$@"; do
    rel=$(realpath --relative-to="$root" "$extra")
    mkdir -p "$stage/$(dirname "$rel")"
    cp -r "$extra" "$stage/$rel"
    case "$rel" in target/*/deps/*)
        strip "$stage/$rel"
        patchelf --remove-needed libopenblas.so.0 --remove-rpath "$stage/$rel" ;;
    esac
done
rm -rf .gpu && mkdir -p .gpu
echo "==> packing $(du -sh "$stage" | cut -f1) into parts of ${GPU_PART_MB:-55} MiB"
tar -C "$stage" -cf - . | zstd -q -T0 -12 --long=27 | split -b "${GPU_PART_MB:-55}M" -d - .gpu/part-
(cd .gpu && sha256sum part-* > SHA256SUMS)
# The GPU machine has no zstd: this one, with the libraries it loads.
mkdir -p .gpu/tools
cp "$(command -v zstd)" .gpu/tools/
ldd "$(command -v zstd)" | awk '/=> \// {print $3}' | grep -v -E '/lib(c|m|pthread|dl)\.so' | xargs -r -I{} cp {} .gpu/tools/
ls -l .gpu
