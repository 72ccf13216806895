#!/usr/bin/env python3
"""The Python side of the dataset pipeline benchmark (scripts/bench-datasets.sh).

  dataset_pipeline.py generate OUT.parquet N   write N alpaca records (about 5% exact
                                               repeats, one in 1,000 without an
                                               instruction), deterministic
  dataset_pipeline.py run IN.parquet OUT_DIR   alpaca-to-chat + dedupe with Hugging Face
                                               `datasets`: Dataset.map with num_proc = cores
                                               (the same function as policies/alpaca-to-chat),
                                               then a filter keeping the first of each
                                               `messages` (one process: first-seen order needs
                                               one pass), written as JSONL; prints one JSON
                                               line with records, kept, seconds, peak RSS

The mlxgate side runs the same steps as a dataset job on the same Parquet file.
"""

import json
import os
import random
import resource
import sys
import time


def generate(path, n):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    words = [w.strip() for w in open(__file__).read().split() if w.isalpha()]
    vocab = sorted(set(words)) or ["word"]

    def sentence(k):
        return " ".join(rng.choice(vocab) for _ in range(k))

    rows = {"instruction": [], "input": [], "output": []}
    originals = []
    for i in range(n):
        if originals and rng.random() < 0.05:
            ins, inp, out = rng.choice(originals)
        else:
            ins = "" if i % 1000 == 999 else sentence(rng.randint(6, 16)) + "?"
            inp = sentence(rng.randint(4, 12)) if rng.random() < 0.4 else ""
            out = sentence(rng.randint(20, 60)) + "."
            if len(originals) < 10000:
                originals.append((ins, inp, out))
        rows["instruction"].append(ins)
        rows["input"].append(inp)
        rows["output"].append(out)
    pq.write_table(pa.table(rows), path, row_group_size=50_000, compression="snappy")


def to_chat(rec):
    """What policies/alpaca-to-chat does, record for record."""
    instruction = rec.get("instruction")
    if instruction is None or not instruction.strip():
        return {"messages": None, "error": "missing `instruction`"}
    output = rec.get("output")
    if output is None:
        return {"messages": None, "error": "missing `output`"}
    inp = (rec.get("input") or "").strip()
    user = f"{instruction}\n\n{inp}" if inp else instruction
    return {
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": output},
        ],
        "error": None,
    }


def run(path, out_dir):
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()

    cores = os.cpu_count() or 1
    started = time.perf_counter()
    ds = load_dataset("parquet", data_files=path, split="train")
    total = len(ds)
    ds = ds.map(to_chat, num_proc=cores, remove_columns=ds.column_names)
    ds = ds.filter(lambda r: r["error"] is None, num_proc=cores)
    seen = set()

    def first(rec):
        key = hash(json.dumps(rec["messages"], ensure_ascii=False))
        if key in seen:
            return False
        seen.add(key)
        return True

    ds = ds.filter(first)
    ds = ds.remove_columns(["error"])
    os.makedirs(out_dir, exist_ok=True)
    ds.to_json(os.path.join(out_dir, "train.jsonl"), lines=True, force_ascii=False)
    seconds = time.perf_counter() - started
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({
        "records": total,
        "kept": len(ds),
        "seconds": seconds,
        "records_per_sec": total / seconds,
        "peak_rss_mb": own / 1024,
        "largest_worker_rss_mb": children / 1024,
        "num_proc": cores,
    }))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "generate":
        generate(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
