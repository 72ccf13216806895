#!/usr/bin/env python3
"""Summarises the engine's step timings from a gateway log written with
MLXGATE_LOG_FORMAT=json and RUST_LOG=info,mlxgate::engine::steps=debug:
per kind of step (prefill chunk, slab decode step, decode step) and batch
size, the count and the median and p90 of each timing field.

    steps_summary.py GATEWAY_LOG
"""
import collections
import json
import statistics
import sys


def bucket(n):
    """Batch sizes grouped in powers of two (1, 2, 4, ... ), prefill chunks by tokens."""
    b = 1
    while b < n:
        b *= 2
    return b


def main():
    groups = collections.defaultdict(list)
    for line in open(sys.argv[1], errors="replace"):
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("target") != "mlxgate::engine::steps":
            continue
        # Flattened (MLXGATE_LOG_FORMAT=json) or nested under "fields".
        fields = dict(event.get("fields", event))
        kind = fields.pop("message", "?")
        size = fields.get("sequences", fields.get("tokens", 0))
        groups[(kind, bucket(int(size)))].append(fields)
    for (kind, size), rows in sorted(groups.items()):
        timings = sorted({k for r in rows for k, v in r.items() if k.endswith(("_ms", "_mb"))})
        parts = []
        for key in timings:
            values = sorted(float(r[key]) for r in rows if key in r)
            p90 = values[min(len(values) - 1, int(len(values) * 0.9))]
            parts.append(f"{key} {statistics.median(values):.2f}/{p90:.2f}")
        extra = ""
        if kind == "slab decode step":
            ahead = sum(1 for r in rows if r.get("ahead") in (True, "true"))
            extra = " rows~%d ahead=%d" % (statistics.median(r["rows"] for r in rows), ahead)
        print(f"{kind:18} size<={size:<5} n={len(rows):<6}{extra}  " + "  ".join(parts) + "  (median/p90)")


if __name__ == "__main__":
    main()
