#!/usr/bin/env bash
# Runs on the GPU machine, in the checkout copy the device tool lays there.
#
#   scripts/gpu/remote.sh stage        copy the carried .gpu/part-* to /tmp/mlxgate-gpu
#   scripts/gpu/remote.sh run CMD...   stage, unpack once all parts are there,
#                                      then run CMD with the CUDA libraries found
#
# CMD sees MLXGATE=/tmp/mlxgate-gpu/payload/bin/mlxgate, PAYLOAD (the
# unpacked files, at their checkout paths), LD_LIBRARY_PATH (libmlx.so and
# the nvidia-* libraries of the machine's python3), PYTHONPATH (Python mlx
# and mlx-lm in the payload), and /work/main linked
# to this checkout (test binaries look for files there).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
home=/tmp/mlxgate-gpu
mkdir -p "$home/parts"
[ -f "$root/.gpu/SHA256SUMS" ] && cp "$root/.gpu/SHA256SUMS" "$home/parts/"
for p in "$root"/.gpu/part-*; do [ -f "$p" ] && cp "$p" "$home/parts/"; done
echo "staged: $(cd "$home/parts" && ls part-* 2>/dev/null | tr '\n' ' ')"
[ "${1:-}" = run ] || exit 0
shift
if [ ! -x "$home/payload/bin/mlxgate" ]; then
    (cd "$home/parts" && sha256sum -c --quiet SHA256SUMS) || { echo "parts missing or damaged" >&2; exit 1; }
    mkdir -p "$home/payload"
    # zstd, or Python's zstandard (PyTorch images carry it) where it is missing.
    if [ -x "$root/.gpu/tools/zstd" ]; then unzstd=(env LD_LIBRARY_PATH="$root/.gpu/tools" "$root/.gpu/tools/zstd" -dc --long=27)
    elif command -v zstd >/dev/null; then unzstd=(zstd -dc --long=27); else
        unzstd=(python3 -c 'import sys, zstandard; zstandard.ZstdDecompressor(max_window_size=1 << 27).copy_stream(sys.stdin.buffer, sys.stdout.buffer)')
    fi
    cat "$home"/parts/part-* | "${unzstd[@]}" | tar -C "$home/payload" -xf -
    rm -rf "$home/parts"
fi
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
nvidia=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$home/payload/mlx/lib:$nvidia${LD_LIBRARY_PATH:-}"
export MLXGATE="$home/payload/bin/mlxgate" PAYLOAD="$home/payload" PYTHONPATH="$home/payload${PYTHONPATH:+:$PYTHONPATH}"
[ -e /work/main ] || { mkdir -p /work && ln -s "$root" /work/main; }
"$@"
