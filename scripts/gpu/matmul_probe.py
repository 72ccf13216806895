#!/usr/bin/env python3
"""Where a batched decode step's time goes on MLX's CUDA backend: the host
(building and encoding the graph) or the GPU, for the matmuls of a
Llama-3.2-3B- or 3.1-8B-shaped step (28 or 32 layers of q, k, v, o, gate,
up and down projections, bfloat16) done several ways (Python MLX on the
GPU machine):

  matmul     `x @ W.T`: MLX runs a row's step as its own matrix-vector
             kernel and more rows through cuBLASLt, whose every call MLX
             prepares afresh (descriptors, an algorithm query, a capture)
  stacked    the same with q/k/v and gate/up each one matmul (4 a layer)
  gather     `gather_mm` of one matrix: MLX's own tensor-core GEMM kernel,
             launched directly
  decode     mlxgate's decode matmul kernel (read from
             mlx-sys/kernels/decode_matmul.cpp; up to 8 rows), blocks of
             `--block-rows` weight rows

    matmul_probe.py [--shape 3b|8b] [--rows 1,8,32,128] [--layers N] [--steps 30]
                    [--variants matmul,stacked,gather,decode] [--block-rows 4]

Prints one JSON line per variant and row count: the median milliseconds
the host spends encoding a step (`async_eval` returning), the median
period of steps launched one ahead, as a decode loop runs them, and the
weight bytes read per second at that period.
"""
import argparse
import json
import statistics
import time

import mlx.core as mx
from kernel_source import body

SHAPES = {"3b": (3072, 1024, 8192, 28), "8b": (4096, 1024, 14336, 32)}
HIDDEN, KV, FFN = SHAPES["3b"][:3]
DECODE = {}  # the decode kernel and its block rows, when that variant runs


def decode_kernel():
    """mlxgate's decode matmul, its body read from mlx-sys/kernels/decode_matmul.cpp."""
    return mx.fast.cuda_kernel(name="mlxgate_decode_matmul", input_names=["x", "w"], output_names=["out"],
                               source=body("decode_matmul.cpp", "decode_matmul"), ensure_row_contiguous=True)


def weights(layers):
    def w(n, k):
        return (mx.random.normal((n, k)) * 0.01).astype(mx.bfloat16)

    out = []
    for _ in range(layers):
        layer = dict(q=w(HIDDEN, HIDDEN), k=w(KV, HIDDEN), v=w(KV, HIDDEN), o=w(HIDDEN, HIDDEN),
                     gate=w(FFN, HIDDEN), up=w(FFN, HIDDEN), down=w(HIDDEN, FFN))
        layer["qkv"] = mx.concatenate([layer["q"], layer["k"], layer["v"]], axis=0)
        layer["gate_up"] = mx.concatenate([layer["gate"], layer["up"]], axis=0)
        out.append(layer)
        mx.eval(layer)
    return out


def step(x, layers, variant):
    zero = mx.array([0], dtype=mx.uint32)

    def mm(a, w):
        if variant == "gather":
            return mx.gather_mm(a[None], w.T[None], lhs_indices=zero, rhs_indices=zero)[0]
        if variant == "decode":
            (n, k), m, rows = w.shape, a.shape[0], DECODE["rows"]
            return DECODE["kernel"](inputs=[a, w], output_shapes=[(m, n)], output_dtypes=[a.dtype],
                                    grid=(256 * -(-n // rows), 1, 1), threadgroup=(256, 1, 1),
                                    template=[("T", a.dtype), ("M", m), ("K", k), ("N", n), ("ROWS", rows)])[0]
        return a @ w.T

    h = x
    for layer in layers:
        if variant == "stacked":
            qkv = mm(h, layer["qkv"])
            q, k, v = qkv[:, :HIDDEN], qkv[:, HIDDEN:HIDDEN + KV], qkv[:, HIDDEN + KV:]
        else:
            q, k, v = mm(h, layer["q"]), mm(h, layer["k"]), mm(h, layer["v"])
        attended = q + k.mean(axis=-1, keepdims=True) + v.mean(axis=-1, keepdims=True)
        h = h + mm(attended, layer["o"])
        if variant == "stacked":
            gu = mm(h, layer["gate_up"])
            g, u = gu[:, :FFN], gu[:, FFN:]
        else:
            g, u = mm(h, layer["gate"]), mm(h, layer["up"])
        h = h + mm(mx.sigmoid(g) * g * u, layer["down"])
    return h


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--layers", type=int)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="matmul,stacked,gather")
    p.add_argument("--block-rows", type=int, default=4)
    a = p.parse_args()
    global HIDDEN, KV, FFN
    HIDDEN, KV, FFN, default_layers = SHAPES[a.shape]
    if "decode" in a.variants:
        DECODE.update(kernel=decode_kernel(), rows=a.block_rows)
    mx.random.seed(0)
    layers = weights(a.layers or default_layers)
    weight_bytes = sum(layer[name].nbytes for layer in layers for name in ("q", "k", "v", "o", "gate", "up", "down"))
    for rows in [int(r) for r in a.rows.split(",")]:
        for variant in a.variants.split(","):
            if variant == "decode" and rows > 8:
                continue
            x = (mx.random.normal((rows, HIDDEN)) * 0.1).astype(mx.bfloat16)
            ref = step(x, layers[:1], "matmul")
            got = step(x, layers[:1], variant)
            diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
            for _ in range(3):
                mx.eval(step(x, layers, variant))
            encode, periods = [], []
            h = x
            previous = None
            last = time.perf_counter()
            for _ in range(a.steps):
                started = time.perf_counter()
                nxt = step(h * 0.5, layers, variant)
                mx.async_eval(nxt)
                encode.append(time.perf_counter() - started)
                if previous is not None:
                    mx.eval(previous)
                now = time.perf_counter()
                periods.append(now - last)
                last = now
                previous, h = nxt, nxt
            mx.eval(previous)
            print(json.dumps({
                "shape": a.shape, "rows": rows, "variant": variant, "max_abs_diff_one_layer": diff,
                "encode_ms": round(statistics.median(encode) * 1e3, 3),
                "period_ms": round(statistics.median(periods[2:]) * 1e3, 3),
                "weights_tb_s": round(weight_bytes / statistics.median(periods[2:]) / 1e12, 3),
            }), flush=True)


if __name__ == "__main__":
    main()
