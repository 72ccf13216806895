#!/usr/bin/env bash
# Builds a JavaScript policy into a WebAssembly component with
# componentize-js (StarlingMonkey), against mlxgate's WIT, with every WASI
# feature disabled (no stdio, clock, randomness or network).
#
#   guest-sdk/js/build.sh KIND APP_DIR OUT.wasm [MODULE]
#
# KIND is dataset-transform, router or adapter-selector; APP_DIR holds
# MODULE (default app.js), an ES module exporting the object of its kind
# (datasetTransform, router, adapterSelector); it may import
# './mlxgate-policy.js' (this folder's helpers, copied beside it for the
# build). componentize-js comes from .deps/cjs (scripts/setup.sh --tests
# installs it there from guest-sdk/js/package-lock.json).
set -euo pipefail
sdk="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$sdk/../.." && pwd)"
[ $# -ge 3 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
kind=$1 app=$2 out=$3 module=${4:-app.js}
case "$kind" in
  dataset-transform|router|adapter-selector) ;;
  *) echo "KIND must be dataset-transform, router or adapter-selector, not '$kind'" >&2; exit 2 ;;
esac
cjs="$root/.deps/cjs/node_modules/.bin/componentize-js"
[ -x "$cjs" ] || { echo "componentize-js not found: run scripts/setup.sh --tests" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$app"/. "$work/"
cp "$sdk/mlxgate-policy.js" "$work/"
mkdir -p "$(dirname "$out")"
out_abs="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
"$cjs" "$work/$module" -w "$sdk/../wit" -n "$kind-policy" \
    -d stdio random clocks http fetch-event -o "$out_abs" >/dev/null
