#!/usr/bin/env bash
# Proxy throughput bench (benches/proxy_throughput.rs): gateway with and
# without a router policy vs nginx, all on loopback, load from wrk. The
# gateway is the `dist` build, as scripts/serve.sh runs it.
# Installs wrk and nginx-light when missing (Debian); nginx runs as the
# bench's own foreground process with a generated config, never as a service.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx-light)
if ((${#missing[@]})); then
    sudo=""
    [[ $(id -u) -eq 0 ]] || sudo=sudo
    $sudo apt-get install -y --no-install-recommends "${missing[@]}"
    # The package may start a system nginx; the bench does not use it.
    $sudo systemctl disable --now nginx 2>/dev/null || true
fi
scripts/build-policies.sh >/dev/null
# The gateway as scripts/serve.sh runs it: the `dist` profile (whole-program
# optimization; Cargo.toml says why). The bench itself builds as usual.
if [[ -z "${PROXY_THROUGHPUT_GATEWAY:-}" ]]; then
    cargo build --locked --profile dist -p mlxgate --bin mlxgate
    export PROXY_THROUGHPUT_GATEWAY="$root/target/dist/mlxgate"
fi
cargo bench -p mlxgate --bench proxy_throughput "$@"
