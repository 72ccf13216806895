#!/usr/bin/env python3
"""Compares one decode step's graph in mlxgate with Python mlx-lm's, node
by node (each node a primitive: on a GPU a kernel launch or a view). The
step is mlxgate's GPU step (`MLXGATE_KERNELS=mlx MLXGATE_DECODE_SLAB=1`;
MLXGATE_STACK_PROJECTIONS as set by the caller) run here on the CPU, and mlx-lm's cached decode
of B sequences of one length (what scripts/gpu/bench_peers.py times). Both
use the same fast ops (RMS norm, RoPE, attention); on the CPU MLX expands
them into their fallbacks in both graphs alike.

    scripts/gpu/graph_nodes.py MLXGATE MODEL_DIR PYTHON [--rows 1,8]
    graph_nodes.py --count FILE.dot...     each file's nodes by primitive
    graph_nodes.py --mlx-lm MODEL_DIR OUT.dot ROWS
                                           mlx-lm's step of ROWS rows, with
                                           this Python (on a GPU: its graph
                                           there); prints its build in ms

MLXGATE is the binary, MODEL_DIR an mlx-community directory (`mlxgate
convert`), PYTHON one with mlx-lm 0.32.2 (scripts/bench-vs-mlx-lm.sh makes
.deps/refenv). Prints, per row count, the node totals, the median time to
build a step's graph (the host's share of a step before MLX runs it), and
every primitive whose count differs.
"""
import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request

from served import served

# mlx-lm's greedy step: B copies of a prompt prefilled, 22 decode steps
# taken, the eighth written (mlxgate writes its eighth greedy step of each
# width); prints the median time to build a step's graph (the host's share,
# before MLX runs it).
MLX_LM_STEP = r"""
import statistics, sys, time, mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
model, tok = load(sys.argv[1])
rows = int(sys.argv[3])
cache = make_prompt_cache(model)
y = mx.argmax(model(mx.array([tok.encode("Hi there")] * rows), cache=cache)[:, -1, :], axis=-1)
built = []
for step in range(1, 23):
    start = time.perf_counter()
    y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
    built.append((time.perf_counter() - start) * 1e3)
    if step == 8:
        mx.export_to_dot(sys.argv[2], y)
    mx.eval(y)
print(statistics.median(built))
"""


def nodes(dot):
    """Primitive name -> count: each node once (siblings share one)."""
    text = open(dot).read()
    return collections.Counter(dict(re.findall(r'\{ (\d+) \[label ="([^"]+)"', text)).values())


def chat(url, model, max_tokens):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi there"}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=600).read()


def mlxgate_steps(binary, model, rows, out):
    """Serves `model` with the GPU's step on the CPU and sends `rows` chats
    at once for each row count, so that each width's eighth greedy step is
    written."""
    env = dict(os.environ, MLXGATE_KERNELS="mlx", MLXGATE_DECODE_SLAB="1", MLXGATE_GRAPH_DOT=out,
               MLXGATE_LOG_FORMAT="json", RUST_LOG="info,mlxgate::engine::steps=debug")
    with served(binary, model, out, env) as (url, name):
        for n in rows:
            threads = [threading.Thread(target=chat, args=(url, name, 24)) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


def build_ms(log, rows):
    """The median graph build of mlxgate's slab steps of `rows` rows."""
    times = []
    for line in open(log, errors="replace"):
        if '"slab decode step"' in line:
            event = json.loads(line)
            if event.get("rows") == rows and "build_ms" in event:
                times.append(float(event["build_ms"]))
    return statistics.median(times) if times else float("nan")


def count(files):
    for f in files:
        found = nodes(f)
        top = ", ".join(f"{name} {n}" for name, n in found.most_common(12))
        print(f"{os.path.basename(f)}: {sum(found.values())} nodes: {top}")


def main():
    if sys.argv[1:2] == ["--count"]:
        return count(sys.argv[2:])
    if sys.argv[1:2] == ["--mlx-lm"]:
        return subprocess.run([sys.executable, "-c", MLX_LM_STEP, *sys.argv[2:5]], check=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mlxgate")
    p.add_argument("model")
    p.add_argument("python")
    p.add_argument("--rows", default="1,8")
    a = p.parse_args()
    rows = [int(n) for n in a.rows.split(",")]
    with tempfile.TemporaryDirectory() as out:
        mlxgate_steps(a.mlxgate, a.model, rows, out)
        for n in rows:
            ours = os.path.join(out, f"decode-{n}.dot")
            theirs = os.path.join(out, f"mlx-lm-{n}.dot")
            peer_ms = float(subprocess.run([a.python, "-c", MLX_LM_STEP, a.model, theirs, str(n)],
                                           check=True, capture_output=True, text=True).stdout.split()[-1])
            if not os.path.exists(ours):
                sys.exit(f"mlxgate wrote no step of {n} rows (did all {n} chats decode together?)")
            mine, peer = nodes(ours), nodes(theirs)
            print(f"{n} rows: mlxgate {sum(mine.values())} nodes, built in {build_ms(os.path.join(out, 'gateway.log'), n):.2f} ms;"
                  f" mlx-lm {sum(peer.values())} nodes, built in {peer_ms:.2f} ms (medians)")
            for name in sorted(mine.keys() | peer.keys(), key=lambda k: -(mine[k] + peer[k])):
                if mine[name] != peer[name]:
                    print(f"  {name:28} {mine[name]:6} {peer[name]:6}")


if __name__ == "__main__":
    main()
