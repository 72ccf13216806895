#!/usr/bin/env bash
# Sets the machine up, builds mlxgate (the `dist` profile) and serves the default model on
# http://127.0.0.1:8080. Extra arguments go to `mlxgate serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# `dist`: the whole-program-optimized build (Cargo.toml says why).
exec cargo run --profile dist --locked -p mlxgate -- serve "$@"
