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
  fused      the decode matmul over q/k/v stacked, and over gate/up stacked
             in its gated form (silu(gate) * up in the same launch): what
             mlxgate runs with MLXGATE_STACK_PROJECTIONS=1

    matmul_probe.py [--shape 3b|8b|tiny] [--rows 1,8,32,128] [--layers N] [--steps 30]
                    [--variants matmul,stacked,gather,decode,fused] [--block-rows 4]
                    [--ops matmuls|full] [--columns 500] [--rope int|rows]

`--ops full` puts the rest of a decode step around the matmuls, as Python
mlx-lm builds it: RMS norms, RoPE on queries and keys (`--rope rows`: one
position per row from an array, as mlxgate's slab step passes them; `int`:
one shared position, as mlx-lm's), the new key and value written into a
cache of `--columns` columns, MLX's fused attention over it and the
residual adds; `--ops matmuls` (the default) puts a placeholder cheaper
than attention there. Comparing the two tells the GPU time of a step's
other ops at these shapes, apart from the matmuls. `tiny` is a two-layer
shape for checking the script on a CPU (variants matmul and stacked).

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

SHAPES = {"3b": (3072, 1024, 8192, 28), "8b": (4096, 1024, 14336, 32), "tiny": (512, 128, 1024, 2)}
HEAD_DIM = 128
OPS = {"full": False, "columns": 500, "rope": "rows"}  # set from the command line
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
        layer["norms"] = (mx.ones((HIDDEN,), dtype=mx.bfloat16), mx.ones((HIDDEN,), dtype=mx.bfloat16))
        out.append(layer)
        mx.eval(layer)
    return out


def step(x, layers, variant, caches=None):
    """One decode step of `x` ([rows, HIDDEN]); with `--ops full`, `caches`
    holds each layer's keys and values ([rows, kv heads, columns, 128]),
    the new ones written at the last column."""
    zero = mx.array([0], dtype=mx.uint32)

    def mm(a, w, gated=False):
        if variant == "gather":
            return mx.gather_mm(a[None], w.T[None], lhs_indices=zero, rhs_indices=zero)[0]
        if variant in ("decode", "fused"):
            (n, k), m, rows = w.shape, a.shape[0], DECODE["rows"]
            n = n // 2 if gated else n
            return DECODE["kernel"](inputs=[a, w], output_shapes=[(m, n)], output_dtypes=[a.dtype],
                                    grid=(256 * -(-n // rows), 1, 1), threadgroup=(256, 1, 1),
                                    template=[("T", a.dtype), ("M", m), ("K", k), ("N", n), ("ROWS", rows),
                                              ("GATED", int(gated))])[0]
        return a @ w.T

    stacked = variant in ("stacked", "fused")
    rows = x.shape[0]
    position = OPS["columns"] - 1
    offset = mx.full((rows,), position, dtype=mx.int32) if OPS["rope"] == "rows" else position

    def heads(y, n):
        return y.reshape(rows, 1, n // HEAD_DIM, HEAD_DIM).transpose(0, 2, 1, 3)

    def rope(y):
        return mx.fast.rope(y, HEAD_DIM, traditional=False, base=500000.0, scale=1.0, offset=offset)

    h = x
    for index, layer in enumerate(layers):
        hn = mx.fast.rms_norm(h, layer["norms"][0], 1e-5) if OPS["full"] else h
        if stacked:
            qkv = mm(hn, layer["qkv"])
            q, k, v = qkv[:, :HIDDEN], qkv[:, HIDDEN:HIDDEN + KV], qkv[:, HIDDEN + KV:]
        else:
            q, k, v = mm(hn, layer["q"]), mm(hn, layer["k"]), mm(hn, layer["v"])
        if OPS["full"]:
            q, k, v = rope(heads(q, HIDDEN)), rope(heads(k, KV)), heads(v, KV)
            keys, values = caches[index]
            keys[:, :, position:position + 1, :] = k
            values[:, :, position:position + 1, :] = v
            caches[index] = (keys, values)
            attended = mx.fast.scaled_dot_product_attention(q, keys, values, scale=HEAD_DIM ** -0.5)
            attended = attended.transpose(0, 2, 1, 3).reshape(rows, HIDDEN)
        else:
            attended = q + k.mean(axis=-1, keepdims=True) + v.mean(axis=-1, keepdims=True)
        h = h + mm(attended, layer["o"])
        hn = mx.fast.rms_norm(h, layer["norms"][1], 1e-5) if OPS["full"] else h
        if variant == "fused":
            gated = mm(hn, layer["gate_up"], gated=True)
        else:
            if stacked:
                gu = mm(hn, layer["gate_up"])
                g, u = gu[:, :FFN], gu[:, FFN:]
            else:
                g, u = mm(hn, layer["gate"]), mm(hn, layer["up"])
            gated = mx.sigmoid(g) * g * u
        h = h + mm(gated, layer["down"])
    return h


def new_caches(layers, rows):
    """Each layer's keys and values, `--columns` columns (`--ops full`)."""
    if not OPS["full"]:
        return None
    shape = (rows, KV // HEAD_DIM, OPS["columns"], HEAD_DIM)
    caches = [((mx.random.normal(shape) * 0.1).astype(mx.bfloat16),
               (mx.random.normal(shape) * 0.1).astype(mx.bfloat16)) for _ in layers]
    mx.eval(caches)
    return caches


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--layers", type=int)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="matmul,stacked,gather")
    p.add_argument("--block-rows", type=int, default=4)
    p.add_argument("--ops", choices=["matmuls", "full"], default="matmuls")
    p.add_argument("--columns", type=int, default=500)
    p.add_argument("--rope", choices=["rows", "int"], default="rows")
    a = p.parse_args()
    global HIDDEN, KV, FFN
    HIDDEN, KV, FFN, default_layers = SHAPES[a.shape]
    OPS.update(full=a.ops == "full", columns=a.columns, rope=a.rope)
    if "decode" in a.variants or "fused" in a.variants:
        DECODE.update(kernel=decode_kernel(), rows=a.block_rows)
    mx.random.seed(0)
    layers = weights(a.layers or default_layers)
    weight_bytes = sum(layer[name].nbytes for layer in layers for name in ("q", "k", "v", "o", "gate", "up", "down"))
    for rows in [int(r) for r in a.rows.split(",")]:
        for variant in a.variants.split(","):
            if variant in ("decode", "fused") and rows > 8:
                continue
            x = (mx.random.normal((rows, HIDDEN)) * 0.1).astype(mx.bfloat16)
            caches = new_caches(layers, rows)
            ref = step(x, layers[:1], "matmul", caches and caches[:1])
            got = step(x, layers[:1], variant, caches and caches[:1])
            diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
            for _ in range(3):
                mx.eval(step(x, layers, variant, caches))
            encode, periods = [], []
            h = x
            previous = None
            last = time.perf_counter()
            for _ in range(a.steps):
                started = time.perf_counter()
                nxt = step(h * 0.5, layers, variant, caches)
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
                "shape": a.shape, "rows": rows, "variant": variant, "ops": a.ops, "max_abs_diff_one_layer": diff,
                "encode_ms": round(statistics.median(encode) * 1e3, 3),
                "period_ms": round(statistics.median(periods[2:]) * 1e3, 3),
                "weights_tb_s": round(weight_bytes / statistics.median(periods[2:]) / 1e12, 3),
            }), flush=True)


if __name__ == "__main__":
    main()
