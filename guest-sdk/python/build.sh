#!/usr/bin/env bash
# Builds a Python policy into a WebAssembly component with componentize-py,
# against mlxgate's WIT, with WASI stubbed out (a guest gets no files,
# clock, randomness or network; calling one traps).
#
#   guest-sdk/python/build.sh KIND APP_DIR OUT.wasm [MODULE]
#
# KIND is dataset-transform, router or adapter-selector; APP_DIR holds
# MODULE.py (default app.py) with the class the kind exports
# (DatasetTransform, Router, AdapterSelector). componentize-py comes from
# PATH or .deps/cpy (scripts/setup.sh --tests installs it there).
set -euo pipefail
sdk="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$sdk/../.." && pwd)"
[ $# -ge 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
kind=$1 app=$2 out=$3 module=${4:-app}
case "$kind" in
  dataset-transform|router|adapter-selector) ;;
  *) echo "KIND must be dataset-transform, router or adapter-selector, not '$kind'" >&2; exit 2 ;;
esac
cpy=$(command -v componentize-py || echo "$root/.deps/cpy/bin/componentize-py")
[ -x "$cpy" ] || { echo "componentize-py not found: run scripts/setup.sh --tests (or pip install componentize-py==0.25.1)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
"$cpy" --quiet -d "$sdk/../wit" -w "$kind-policy" componentize --stub-wasi \
    -p "$app" -p "$sdk" "$module" -o "$out"
