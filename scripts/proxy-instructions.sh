#!/usr/bin/env bash
# Instructions the gateway spends per proxied request, counted by callgrind:
# a figure the machine's noise does not touch, for comparing two builds.
#
#   scripts/proxy-instructions.sh [GATEWAY_BINARY ...]
#
# Each binary (default: target/release/mlxgate) serves `POST
# /v1/chat/completions` with no policy bound, forwarding to an nginx
# `return 200` upstream on loopback. Under `valgrind --tool=callgrind
# --instr-atstart=no` it takes `wrk -t1 -c4` for 5 s of warm-up, then 10 s
# with instrumentation on. Printed: requests served while instrumented,
# the inclusive instructions of the per-connection task (the future
# `http::serve_connection` spawns; `http::run`'s in older builds) per request, and the whole
# process's instructions per request. Needs valgrind, wrk, nginx-light (apt).
# PROXY_INSTRUCTIONS_KEEP=DIR keeps each binary's callgrind dump there
# (DIR/<n>.callgrind, in argument order) for `callgrind_annotate`.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in valgrind callgrind_control callgrind_annotate wrk nginx; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install valgrind wrk nginx-light)" >&2; exit 2; }
done
[ $# -gt 0 ] || set -- target/release/mlxgate
work=$(mktemp -d)
cleanup() {
  [ -f "$work/nginx/nginx.pid" ] && kill "$(cat "$work/nginx/nginx.pid")" 2>/dev/null || true
  [ -n "${gw:-}" ] && kill "$gw" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 600); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on $1" >&2; exit 1
}

up=$(free_port)
mkdir -p "$work/nginx"
cat > "$work/nginx/nginx.conf" <<EOF
daemon on; worker_processes 1; pid $work/nginx/nginx.pid; error_log $work/nginx/error.log warn;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path $work/nginx/body;
  server { listen 127.0.0.1:$up;
    location / { default_type application/json; return 200 '{"id":"x","object":"chat.completion","choices":[]}'; } } }
EOF
nginx -p "$work/nginx" -c "$work/nginx/nginx.conf"
wait_port "$up"

key=bench-infer-key
hash=$(printf %s "$key" | sha256sum | cut -d' ' -f1)
cat > "$work/gateway.toml" <<EOF
[[keys]]
id = "bench"
tenant = "bench"
scopes = ["infer"]
sha256 = "$hash"

[[upstreams]]
name = "up"
base_url = "http://127.0.0.1:$up/v1"
models = ["bench-model"]
EOF
cat > "$work/post.lua" <<EOF
wrk.method = "POST"
wrk.body = '{"model":"bench-model","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer $key"
EOF

printf '%-40s %10s %16s %16s\n' binary requests "task instr/req" "process instr/req"
for bin in "$@"; do
  port=$(free_port)
  out="$work/callgrind.out"
  rm -f "$out"
  RUST_LOG=warn valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" \
    "$bin" serve --config "$work/gateway.toml" --port "$port" --data-dir "$work/data" \
    --model "$work/no-model.gguf" > "$work/gateway.log" 2>&1 &
  gw=$!
  wait_port "$port"
  url="http://127.0.0.1:$port/v1/chat/completions"
  wrk -t1 -c4 -d5s -s "$work/post.lua" "$url" > /dev/null
  callgrind_control -i on "$gw" > /dev/null 2>&1
  requests=$(wrk -t1 -c4 -d10s -s "$work/post.lua" "$url" | awk '/requests in/ {print $1}')
  callgrind_control -i off "$gw" > /dev/null 2>&1
  callgrind_control -d "$gw" > /dev/null 2>&1
  kill "$gw"; wait "$gw" 2>/dev/null || true
  gw=
  # The dump taken while instrumented (callgrind.out.1), not the one
  # written at exit.
  dump=$(ls "$out".* | head -1)
  task=$(callgrind_annotate --inclusive=yes --threshold=100 "$dump" 2>/dev/null \
    | grep -E 'mlxgate::http::(run::\{\{closure\}\}|serve_connection)::\{\{closure\}\}(::\{\{closure\}\})?( |$)' \
    | head -1 | awk '{gsub(",", "", $1); print $1}' || true)
  total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  if [ -n "${PROXY_INSTRUCTIONS_KEEP:-}" ]; then
    mkdir -p "$PROXY_INSTRUCTIONS_KEEP"
    n=$(( ${n:-0} + 1 ))
    cp "$dump" "$PROXY_INSTRUCTIONS_KEEP/$n.callgrind"
  fi
  printf '%-40s %10s %16s %16s\n' "$bin" "$requests" \
    "$(( ${task:-0} / requests ))" "$(( ${total:-0} / requests ))"
done
