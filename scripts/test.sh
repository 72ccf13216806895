#!/usr/bin/env bash
# Sets the machine up and runs every check CI runs: formatting, clippy, the
# Wasm example policies, and all tests (unit, integration over real HTTP).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests
# Each step says when it started (seconds into the run), so a CI log shows
# where the time goes.
step() { printf '\033[1m==> %s\033[0m (at %ds)\n' "$*" "$SECONDS"; }

step "format"
cargo fmt --all --check
step "layers (dependencies point down: docs/ARCHITECTURE.md)"
scripts/check-layers.sh
step "console libraries (gateway/console/vendor matches its package-lock.json)"
scripts/vendor-console.sh --check
step "CUDA kernel bodies, emulated on the CPU (scripts/gpu/kernel_emulator.cpp)"
scripts/gpu/check_kernels.sh
step "Wasm policies"
scripts/build-policies.sh
step "clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
step "tests"
cargo test --locked --workspace
step "all checks passed"
