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
#   DATASET_BENCH_LARGE_GB=5           instead: bounded memory, the same
#       pipeline over one JSONL shard and over this many GiB of shards
#       (needs about twice that on disk: input and output); peak RSS of both
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

# Runs one dataset job on a fresh gateway: mlxgate_job INPUT OUT_DIR STEPS.
# Prints {records, kept, seconds, records_per_sec, peak_rss_mb}; the peak
# RSS is the gateway's VmHWM, which holds everything the job kept resident.
mlxgate_job() {
    local input=$1 out=$2 steps=$3 key=dataset-bench-admin-key port pid url id row status start end rss_kb
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    rm -rf "$work/data" "$out"
    printf '[jobs]\nallowed_paths = ["%s"]\n' "$work" > "$work/gateway.toml"
    MLXGATE_ADMIN_KEY=$key target/release/mlxgate serve -c "$work/gateway.toml" -p "$port" \
        -m "$work/no-model.gguf" --data-dir "$work/data" 2> "$work/gateway.log" &
    pid=$!
    trap "kill $pid 2>/dev/null || true" EXIT
    url="http://127.0.0.1:$port"
    for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null && break; sleep 0.1; done
    local auth=(-H "authorization: Bearer $key")
    curl -sf "${auth[@]}" -X PUT --data-binary @policies/target/wasm32-unknown-unknown/release/alpaca_to_chat.wasm \
        "$url/admin/policies/alpaca?kind=dataset-transform" >/dev/null
    start=$(date +%s.%N)
    id=$(curl -sf "${auth[@]}" -H 'content-type: application/json' "$url/api/jobs" -d "{\"kind\": \"dataset\", \"config\": {
        \"input\": \"$input\", \"output_dir\": \"$out\", \"steps\": $steps}}" |
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
    python3 -c '
import json, sys
row = json.loads(sys.argv[1]); s = row["summary"]; secs = float(sys.argv[3]) - float(sys.argv[2])
print(json.dumps({"records": s["records"], "kept": s["kept"], "seconds": secs,
                  "records_per_sec": s["records"] / secs, "peak_rss_mb": int(sys.argv[4]) / 1024}))' \
        "$row" "$start" "$end" "$rss_kb"
}
pipeline='[{"policy": "alpaca"}, {"dedupe": ["messages"]}]'

if [ -n "${DATASET_BENCH_LARGE_GB:-}" ]; then
    # Bounded memory: the same pipeline over one shard and over
    # DATASET_BENCH_LARGE_GB GiB of shards (each the records above as JSONL,
    # with an `id` first so every shard's bytes differ); the peak RSS must not
    # grow with the input: the dedupe set holds the distinct kept records
    # (the same ones in every shard), everything else is streamed.
    shards="$work/jsonl-shards"
    base="$work/alpaca-$n.jsonl"
    [ -f "$base" ] || "$py" -c '
import json, sys, pyarrow.parquet as pq
with open(sys.argv[2], "w") as f:
    for batch in pq.ParquetFile(sys.argv[1]).iter_batches(50_000):
        for r in batch.to_pylist():
            f.write(json.dumps(r, ensure_ascii=False) + "\n")' "$input" "$base"
    want=$((DATASET_BENCH_LARGE_GB * 1024 * 1024 * 1024))
    count=$(( (want + $(stat -c %s "$base") - 1) / $(stat -c %s "$base") ))
    if [ "$(ls "$shards" 2>/dev/null | wc -l)" != "$count" ]; then
        echo "==> writing $count shards of $(stat -c %s "$base") bytes into $shards"
        rm -rf "$shards"; mkdir -p "$shards"
        for k in $(seq -w 1 "$count"); do
            awk -v k="$k" '{ printf "{\"id\":\"%s-%d\",%s\n", k, NR, substr($0, 2) }' "$base" > "$shards/part-$k.jsonl"
        done
    fi
    du -sh "$shards"
    echo "==> one shard"
    one=$(mlxgate_job "$(ls -d "$shards"/* | head -1)" "$work/mlxgate-out" "$pipeline")
    echo "$one"
    echo "==> all $count shards"
    all=$(mlxgate_job "$shards" "$work/mlxgate-out" "$pipeline")
    echo "$all"
    rm -rf "$work/mlxgate-out"
    python3 - "$one" "$all" "$(du -sb "$shards" | cut -f1)" <<'EOF'
import json, sys
one, all_, size = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
print(f"| input | records | kept | seconds | records/s | peak RSS |")
print(f"| --- | --- | --- | --- | --- | --- |")
print(f"| one shard | {one['records']} | {one['kept']} | {one['seconds']:.1f} | {one['records_per_sec']:.0f} | {one['peak_rss_mb']:.0f} MB |")
print(f"| {size / 2**30:.2f} GiB, all shards | {all_['records']} | {all_['kept']} | {all_['seconds']:.1f} | {all_['records_per_sec']:.0f} | {all_['peak_rss_mb']:.0f} MB |")
assert all_["kept"] == one["kept"], "every shard holds the same records: the kept count must not change"
print(f"peak RSS {all_['peak_rss_mb'] / one['peak_rss_mb']:.2f}x for {all_['records'] / one['records']:.0f}x the input")
EOF
    exit 0
fi

echo "==> mlxgate: dataset job"
mlx=$(mlxgate_job "$input" "$work/mlxgate-out" "$pipeline")
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
