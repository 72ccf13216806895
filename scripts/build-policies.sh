#!/usr/bin/env bash
# Builds every policy guest in policies/ (examples and hostile test guests) as
# Wasm components: wasm32-unknown-unknown, linked by the toolchain's
# wasm-component-ld, release profile. Output:
#   policies/target/wasm32-unknown-unknown/release/<crate_name>.wasm
# plus one test guest built for wasm32-wasip2 (it must import WASI):
#   policies/target/wasm32-wasip2/release/wasi_imports.wasm
# Idempotent; cargo makes it a fast no-op when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/policies"

target=wasm32-unknown-unknown
for t in "$target" wasm32-wasip2; do
    if ! rustup target list --installed 2>/dev/null | grep -qx "$t"; then
        rustup target add "$t"
    fi
done
host="$(rustc -vV | sed -n 's/^host: //p')"
linker="$(rustc --print sysroot)/lib/rustlib/$host/bin/wasm-component-ld"
if [[ ! -x "$linker" ]]; then
    echo "build-policies: $linker not found (needs a Rust toolchain that ships wasm-component-ld)" >&2
    exit 1
fi
export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER="$linker"
cargo build --release --target "$target" --workspace --exclude wasi-imports "$@"
cargo build --release --target wasm32-wasip2 -p wasi-imports "$@"

# Python policies (guest-sdk/python), when componentize-py is installed
# (scripts/setup.sh --tests): each policies/python/<name>/app.py, and the
# hostile test guest, into policies/target/python/<name>.wasm.
py_out="$root/policies/target/python"
if [ -x "$root/.deps/cpy/bin/componentize-py" ] || command -v componentize-py >/dev/null; then
    build_py() { # <kind> <app dir> <name> [module]
        local out="$py_out/$3.wasm"
        if [ -f "$out" ] && [ -z "$(find "$2" "$root/guest-sdk/python" "$root/guest-sdk/wit" -newer "$out" -type f | head -1)" ]; then
            return
        fi
        "$root/guest-sdk/python/build.sh" "$1" "$2" "$out" "${4:-app}"
    }
    build_py dataset-transform "$root/policies/python/alpaca_to_chat" alpaca_to_chat
    build_py router "$root/policies/python/tenant_router" tenant_router
    build_py adapter-selector "$root/policies/python/adapter_by_tenant" adapter_by_tenant
    build_py dataset-transform "$root/policies/python/hostile" spin_or_hog spin_or_hog
    ls -1 "$py_out"/*.wasm
else
    echo "build-policies: componentize-py not installed (scripts/setup.sh --tests): Python policies not built" >&2
fi

# JavaScript policies (guest-sdk/js), when componentize-js is installed
# (scripts/setup.sh --tests): into policies/target/js/<name>.wasm.
js_out="$root/policies/target/js"
if [ -x "$root/.deps/cjs/node_modules/.bin/componentize-js" ]; then
    build_js() { # <kind> <app dir> <name>
        local out="$js_out/$3.wasm"
        if [ -f "$out" ] && [ -z "$(find "$2" "$root/guest-sdk/js" "$root/guest-sdk/wit" -newer "$out" -type f -not -path '*/node_modules/*' | head -1)" ]; then
            return
        fi
        "$root/guest-sdk/js/build.sh" "$1" "$2" "$out"
    }
    build_js dataset-transform "$root/policies/js/alpaca_to_chat" alpaca_to_chat
    build_js router "$root/policies/js/tenant_router" tenant_router
    build_js adapter-selector "$root/policies/js/adapter_by_tenant" adapter_by_tenant
    build_js dataset-transform "$root/policies/js/hostile" spin_or_hog
    ls -1 "$js_out"/*.wasm
else
    echo "build-policies: componentize-js not installed (scripts/setup.sh --tests): JavaScript policies not built" >&2
fi
ls -1 "$root/policies/target/$target/release/"*.wasm \
    "$root/policies/target/wasm32-wasip2/release/wasi_imports.wasm"
