#!/usr/bin/env python3
"""Summarises the engine's step timings from a gateway log written with
MLXGATE_LOG_FORMAT=json and RUST_LOG=info,mlxgate::engine::steps=debug:
per kind of step (prefill chunk, slab decode step, decode step) and batch
size, the count and the median, p90 and mean of each timing field (a
rate over a window sees the mean), and how often MLX's buffer cache was
emptied. A decode step's `period_ms` is the time from the last step's
end to this one's (`between_ms`: the loop's other work) plus its own.
Then the decode steps of the largest batch that took 1.5x its median
period or more, each with the slab step inside it (its rows, where the
slab ended, the attention it used, its build/eval/read times).

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
    slab_before = None  # the slab event logged inside the decode step that follows
    emptied = []  # MLX's buffer cache emptied between steps: its size then, MB
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
        if kind == "buffer cache emptied":
            emptied.append(float(fields.get("cached_mb", 0)))
            continue
        size = fields.get("sequences", fields.get("tokens", 0))
        if kind == "slab decode step":
            slab_before = fields
        elif kind == "decode step":
            fields["slab"], slab_before = slab_before, None
        if kind == "decode step" and fields.get("between_ms") is not None:
            fields["period_ms"] = sum(
                float(fields.get(k, 0)) for k in ("between_ms", "forward_ms", "sample_ms", "keep_finished_ms")
            )
        groups[(kind, bucket(int(size)))].append(fields)
    for (kind, size), rows in sorted(groups.items()):
        timings = sorted({k for r in rows for k in r if k.endswith(("_ms", "_mb"))})
        parts = []
        for key in timings:
            values = sorted(float(r[key]) for r in rows if key in r)
            p90 = values[min(len(values) - 1, int(len(values) * 0.9))]
            mean = statistics.fmean(values)
            parts.append(f"{key} {statistics.median(values):.2f}/{p90:.2f}/{mean:.2f}")
        extra = ""
        if kind == "slab decode step":
            ahead = sum(1 for r in rows if r.get("ahead") in (True, "true"))
            kinds = collections.Counter(r.get("attend", "?") for r in rows)
            extra = " rows~%d ahead=%d %s" % (
                statistics.median(r["rows"] for r in rows),
                ahead,
                ",".join(f"{k}={n}" for k, n in sorted(kinds.items())),
            )
        print(f"{kind:18} size<={size:<5} n={len(rows):<6}{extra}  " + "  ".join(parts) + "  (median/p90/mean)")
    if emptied:
        print(f"buffer cache emptied {len(emptied)} times (median {statistics.median(emptied):.0f} MB)")
    # Decode steps of the largest batch whose period is 1.5x the median or
    # more: where the time went, with the slab step inside each.
    decode = [k for k in groups if k[0] == "decode step"]
    if decode:
        largest = [r for r in groups[max(decode, key=lambda k: k[1])] if "period_ms" in r]
        if largest:
            median = statistics.median(float(r["period_ms"]) for r in largest)
            slow = [r for r in largest if float(r["period_ms"]) >= 1.5 * median]
            print(f"decode steps of the largest batch at 1.5x its median period ({median:.2f} ms) or more: "
                  f"{len(slow)} of {len(largest)}, {sum(float(r['period_ms']) - median for r in slow):.0f} ms over the median")
            print("  period = between + forward [slab: rows end/columns attend, build/eval/read] + sample + keep")
            for r in sorted(slow, key=lambda r: float(r["period_ms"]), reverse=True)[:15]:
                slab = r.get("slab") or {}
                inside = ""
                if slab:
                    inside = (f" [{slab['rows']} {slab.get('end', '?')}/{slab['columns']} {slab.get('attend', '?')},"
                              f" {float(slab['build_ms']):.2f}/{float(slab['eval_ms']):.2f}/{float(slab['read_ms']):.2f}]")
                print(f"  {float(r['period_ms']):6.2f} = {float(r['between_ms']):.2f} + {float(r['forward_ms']):.2f}"
                      f"{inside} + {float(r['sample_ms']):.2f} + {float(r.get('keep_finished_ms', 0)):.2f}")


if __name__ == "__main__":
    main()
