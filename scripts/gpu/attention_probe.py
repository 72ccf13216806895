#!/usr/bin/env python3
"""Checks and times one decode step's attention over a GPU batch's slab
(Python MLX on CUDA, on the GPU machine): mlxgate's two ragged kernel bodies
(read from mlx-sys/kernels/ragged_attention.cpp: a block per query head, a
block per key/value head) against MLX's masked attention over bucketed
columns (the fallback they replace) and MLX's fused vector attention where
every row starts at one column (the bound).

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
        return mx.fast.cuda_kernel(name=name, input_names=["q", "k", "v", "starts", "end", "scale"],
                                   output_names=["out"], source=source, ensure_row_contiguous=False)

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

        def launched(kernel, threads, blocks):
            """Every layer's attention by `kernel`, `threads` a block, `blocks` blocks a row."""
            return [kernel(inputs=[q.reshape(rows, HEADS * DIM), k, v, starts, end_a, scale_a],
                           output_shapes=[(rows, HEADS * DIM)], output_dtypes=[q.dtype],
                           grid=(threads * blocks, rows, 1), threadgroup=(threads, 1, 1),
                           template=[("T", q.dtype), ("D", DIM), ("GQA", HEADS // KV_HEADS)])[0]
                    for q, k, v in layers]

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
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
