#!/usr/bin/env bash
# Sets the machine up, builds mlxgate (release) and serves the default model on
# http://127.0.0.1:8080. Extra arguments go to `mlxgate serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec cargo run --release --locked -p mlxgate -- serve "$@"
