#!/usr/bin/env python3
"""Checks and times one decode step's attention over a GPU batch's slab
(Python MLX on CUDA, on the GPU machine): mlxgate's two ragged kernel bodies
(read from mlx-sys/kernels/ragged_attention.cpp: a block per query head, a
block per key/value head) against MLX's masked attention over bucketed
columns (the fallback they replace) and MLX's fused vector attention where
every row starts at one column (the bound). Then the step's write of its
new key and value column: by MLX's slice update (a copy of the whole slab
while anything else holds it, as the step before does on CUDA) followed by
the per-key/value-head body, against that body writing the column itself.

    attention_probe.py [--rows 1,8,32,64,128] [--columns 384] [--layers 28]
                       [--candidate BODY.cu]

Shapes are Llama-3.2-3B's (24 heads, 8 key/value heads, head_dim 128),
bfloat16; each timing evaluates `--layers` attentions at once, as a step
does. Prints one JSON line per batch size: each body's largest difference
from the masked reference and the milliseconds of each variant.
`--candidate` adds a body laid out like the per-key/value-head one (a block
of 256 threads per key/value head and row).
"""
import argparse
import json
import math
import time

import mlx.core as mx
from kernel_source import body

HEADS, KV_HEADS, DIM = 24, 8, 128


def timed(build, repeat=20):
    for _ in range(3):
        mx.eval(build())
    started = time.perf_counter()
    for _ in range(repeat):
        mx.eval(build())
    return (time.perf_counter() - started) / repeat * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,32,64,128")
    parser.add_argument("--columns", type=int, default=384)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--candidate", help="a kernel body to time beside the one in use")
    args = parser.parse_args()

    def compiled(name, source):
        return mx.fast.cuda_kernel(name=name, input_names=["q", "k", "v", "starts", "end", "scale", "k_new", "v_new"],
                                   output_names=["out"], source=source, ensure_row_contiguous=False,
                                   header=body("ragged_attention.cpp", "write_column"))

    per_head = compiled("mlxgate_ragged_decode_attention", body("ragged_attention.cpp", "per_head"))
    per_kv_head = compiled("mlxgate_ragged_decode_attention_gqa", body("ragged_attention.cpp", "per_kv_head"))
    candidate = args.candidate and compiled("mlxgate_ragged_candidate", open(args.candidate).read())
    scale = 1 / math.sqrt(DIM)
    for rows in [int(r) for r in args.rows.split(",")]:
        capacity = args.columns + 256
        end = args.columns - 1
        mx.random.seed(rows)
        layers = []
        for _ in range(args.layers):
            k = mx.random.normal((rows, KV_HEADS, capacity, DIM)).astype(mx.bfloat16)
            v = mx.random.normal((rows, KV_HEADS, capacity, DIM)).astype(mx.bfloat16)
            q = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.bfloat16)
            layers.append((q, k, v))
        starts = mx.random.randint(0, end - 16, (rows,)).astype(mx.int32)
        mx.eval(layers, starts)
        span = -(-(end + 1) // 128) * 128
        columns = mx.arange(span)
        mask = (columns[None, :] >= starts[:, None]) & (columns[None, :] <= end)
        mask = mask.reshape(rows, 1, 1, span)
        end_a = mx.array([end], dtype=mx.int32)
        scale_a = mx.array([scale], dtype=mx.float32)

        def masked():
            return [mx.fast.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], scale=scale, mask=mask)
                    for q, k, v in layers]

        def attend(kernel, threads, blocks, q, k, v, new=None):
            """One layer's attention by `kernel`, `threads` a block, `blocks`
            blocks a row; with `new` (a key and a value column), written first."""
            flat = q.reshape(rows, HEADS * DIM)
            k_new, v_new = new if new else (flat, flat)
            return kernel(inputs=[flat, k, v, starts, end_a, scale_a, k_new, v_new],
                          output_shapes=[(rows, HEADS * DIM)], output_dtypes=[q.dtype],
                          grid=(threads * blocks, rows, 1), threadgroup=(threads, 1, 1),
                          template=[("T", q.dtype), ("D", DIM), ("GQA", HEADS // KV_HEADS),
                                    ("WRITE", int(new is not None))])[0]

        def launched(kernel, threads, blocks):
            """Every layer's attention by `kernel`."""
            return [attend(kernel, threads, blocks, q, k, v) for q, k, v in layers]

        bodies = {"per_head": lambda: launched(per_head, 128, HEADS),
                  "per_kv_head": lambda: launched(per_kv_head, 256, KV_HEADS)}
        if candidate:
            bodies["candidate"] = lambda: launched(candidate, 256, KV_HEADS)

        def unmasked():
            first = int(starts.min().item())
            return [mx.fast.scaled_dot_product_attention(q, k[:, :, first:end + 1], v[:, :, first:end + 1], scale=scale)
                    for q, k, v in layers]

        want = masked()[0].astype(mx.float32).reshape(rows, HEADS * DIM)
        report = {"rows": rows, "columns": args.columns, "layers": args.layers,
                  "masked_ms": round(timed(masked), 3), "unmasked_one_start_ms": round(timed(unmasked), 3)}
        for name, run in bodies.items():
            got = run()[0].astype(mx.float32)
            report[f"{name}_max_abs_diff_vs_masked"] = mx.abs(want - got).max().item()
            report[f"{name}_ms"] = round(timed(run), 3)
        # The step's new column, written by a slice update (copying the
        # slab, which `layers` holds) and then attended, or by the kernel.
        new = [(mx.random.normal((rows, KV_HEADS, 1, DIM)).astype(mx.bfloat16),
                mx.random.normal((rows, KV_HEADS, 1, DIM)).astype(mx.bfloat16)) for _ in layers]
        mx.eval(new)

        def slice_updated():
            out = []
            for (q, k, v), (k_new, v_new) in zip(layers, new):
                k = mx.slice_update(k, k_new, mx.array([end]), axes=(2,))
                v = mx.slice_update(v, v_new, mx.array([end]), axes=(2,))
                out.append(attend(per_kv_head, 256, KV_HEADS, q, k, v))
            return out

        def writing():
            return [attend(per_kv_head, 256, KV_HEADS, q, k, v, n) for (q, k, v), n in zip(layers, new)]

        want = slice_updated()[0].astype(mx.float32)
        got = writing()[0].astype(mx.float32)
        report["writing_max_abs_diff_vs_slice_update"] = mx.abs(want - got).max().item()
        report["slice_update_then_attend_ms"] = round(timed(slice_updated), 3)
        report["attend_writing_ms"] = round(timed(writing), 3)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
