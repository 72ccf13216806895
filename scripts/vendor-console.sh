#!/usr/bin/env bash
# The console's front-end libraries, pinned by gateway/console/package-lock.json:
# installs them (and playwright-core, the console test's browser driver) from
# the npm registry into .deps/console/node_modules, then copies the files the
# console serves into gateway/console/vendor/ (committed, so building the
# gateway needs no Node.js).
#
#   scripts/vendor-console.sh           install, then copy into vendor/
#   scripts/vendor-console.sh --check   install, then fail if vendor/ differs
#                                       from the pinned packages (CI runs this)
#   scripts/vendor-console.sh --install install only (what setup.sh runs)
#
# To move to newer versions: edit gateway/console/package.json, run
# `npm install --package-lock-only --ignore-scripts` in gateway/console, then this.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-copy}
src=gateway/console
deps=.deps/console

# package file -> vendored name
files=(
  "preact/dist/preact.mjs preact.mjs"
  "preact/hooks/dist/hooks.mjs hooks.mjs"
  "preact/LICENSE LICENSE.preact"
  "htm/dist/htm.mjs htm.mjs"
  "htm/LICENSE LICENSE.htm"
  "uplot/dist/uPlot.iife.min.js uPlot.iife.min.js"
  "uplot/dist/uPlot.min.css uPlot.min.css"
  "uplot/LICENSE LICENSE.uplot"
)

command -v npm >/dev/null || { echo "npm is missing: apt-get install nodejs npm" >&2; exit 1; }
if ! cmp -s "$src/package-lock.json" "$deps/package-lock.json" || [ ! -d "$deps/node_modules" ]; then
  echo "==> npm: installing the console's pinned packages into $deps"
  mkdir -p "$deps"
  cp "$src/package.json" "$src/package-lock.json" "$deps/"
  (cd "$deps" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi
[ "$mode" = --install ] && exit 0

status=0
for entry in "${files[@]}"; do
  read -r from to <<<"$entry"
  if [ "$mode" = --check ]; then
    cmp -s "$deps/node_modules/$from" "$src/vendor/$to" || {
      echo "gateway/console/vendor/$to differs from npm's $from: run scripts/vendor-console.sh" >&2
      status=1
    }
  else
    mkdir -p "$src/vendor"
    cp "$deps/node_modules/$from" "$src/vendor/$to"
  fi
done
[ "$mode" = --check ] && [ $status = 0 ] && echo "==> console: vendor/ matches the pinned npm packages"
exit $status
