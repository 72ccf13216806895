#!/usr/bin/env bash
# Dataset pipeline benchmark: alpaca-to-chat + dedupe over 1,000,000 alpaca
# records read from one Parquet file, written as JSONL: mlxgate's `dataset`
# job (the release build, steps [{"policy": alpaca-to-chat}, {"dedupe":
# ["messages"]}], one worker per core) against Hugging Face `datasets`
# (Dataset.map with num_proc = cores, the same function in Python, then a
# first-seen filter), on the same file, one after the other. Prints
# records/s and peak RSS of each and checks both kept the same records.
#
#   DATASET_BENCH_RECORDS=1000000      records to generate
#   DATASET_BENCH_DIR=/tmp/mlxgate-dataset-bench   scratch folder (input kept between runs)
#
# Python `datasets` goes into a scratch venv, .deps/dsenv (about 300 MB).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
n=${DATASET_BENCH_RECORDS:-1000000}
work=${DATASET_BENCH_DIR:-/tmp/mlxgate-dataset-bench}
py=.deps/dsenv/bin/python
if ! "$py" -c "import datasets" 2>/dev/null; then
    echo "==> venv: installing datasets==5.2.0 into .deps/dsenv"
    python3 -m venv .deps/dsenv
    .deps/dsenv/bin/pip install -q --disable-pip-version-check "datasets==5.2.0"
fi
scripts/build-policies.sh >/dev/null
cargo build --release --locked -q -p mlxgate --bin mlxgate
mkdir -p "$work"
input="$work/alpaca-$n.parquet"
if [ ! -f "$input" ]; then
    echo "==> generating $n records into $input"
    "$py" benches/dataset_pipeline.py generate "$input" "$n"
fi
ls -l "$input"

echo "==> mlxgate: dataset job"
key=dataset-bench-admin-key
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
rm -rf "$work/data" "$work/mlxgate-out"
printf '[jobs]\nallowed_paths = ["%s"]\n' "$work" > "$work/gateway.toml"
MLXGATE_ADMIN_KEY=$key target/release/mlxgate serve -c "$work/gateway.toml" -p "$port" \
    -m "$work/no-model.gguf" --data-dir "$work/data" 2> "$work/gateway.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
url="http://127.0.0.1:$port"
for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null && break; sleep 0.1; done
auth=(-H "authorization: Bearer $key")
curl -sf "${auth[@]}" -X PUT --data-binary @policies/target/wasm32-unknown-unknown/release/alpaca_to_chat.wasm \
    "$url/admin/policies/alpaca?kind=dataset-transform" >/dev/null
start=$(date +%s.%N)
id=$(curl -sf "${auth[@]}" -H 'content-type: application/json' "$url/api/jobs" -d "{\"kind\": \"dataset\", \"config\": {
    \"input\": \"$input\", \"output_dir\": \"$work/mlxgate-out\",
    \"steps\": [{\"policy\": \"alpaca\"}, {\"dedupe\": [\"messages\"]}]}}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
while :; do
    row=$(curl -sf "${auth[@]}" "$url/api/jobs/$id")
    status=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["status"])' "$row")
    [ "$status" = queued ] || [ "$status" = running ] || break
    sleep 0.2
done
end=$(date +%s.%N)
rss_kb=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
kill $pid; trap - EXIT
[ "$status" = done ] || { echo "the job ended $status: $row" >&2; exit 1; }
mlx=$(python3 -c '
import json, sys
row = json.loads(sys.argv[1]); s = row["summary"]; secs = float(sys.argv[3]) - float(sys.argv[2])
print(json.dumps({"records": s["records"], "kept": s["kept"], "seconds": secs,
                  "records_per_sec": s["records"] / secs, "peak_rss_mb": int(sys.argv[4]) / 1024}))' \
    "$row" "$start" "$end" "$rss_kb")
echo "$mlx"

echo "==> Python datasets: Dataset.map, num_proc = $(nproc)"
rm -rf "$work/hf-out" "$work/hf-cache"
hf=$(HF_DATASETS_CACHE="$work/hf-cache" HF_HUB_OFFLINE=1 "$py" benches/dataset_pipeline.py run "$input" "$work/hf-out" | tail -1)
echo "$hf"
rm -rf "$work/hf-cache"

python3 - "$mlx" "$hf" "$work" <<'EOF'
import json, sys
m, h, work = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
mine = sum(1 for _ in open(f"{work}/mlxgate-out/train.jsonl"))
theirs = sum(1 for _ in open(f"{work}/hf-out/train.jsonl"))
print()
print(f"| | records | kept | seconds | records/s | peak RSS |")
print(f"| --- | --- | --- | --- | --- | --- |")
print(f"| mlxgate dataset job | {m['records']} | {m['kept']} | {m['seconds']:.1f} | {m['records_per_sec']:.0f} | {m['peak_rss_mb']:.0f} MB (the gateway process) |")
print(f"| Python datasets, num_proc={h['num_proc']} | {h['records']} | {h['kept']} | {h['seconds']:.1f} | {h['records_per_sec']:.0f} | {h['peak_rss_mb']:.0f} MB main + {h['largest_worker_rss_mb']:.0f} MB largest worker |")
print(f"\nratio (records/s): {m['records_per_sec'] / h['records_per_sec']:.2f}x; goal >= 2x")
assert m["kept"] == h["kept"] == mine == theirs, f"kept differs: {m['kept']} / {h['kept']} / files {mine} / {theirs}"
print("both kept the same number of records")
EOF
