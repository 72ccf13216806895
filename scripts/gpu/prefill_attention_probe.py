#!/usr/bin/env python3
"""Times a prompt's causal attention on the GPU (Python MLX on CUDA, on the
GPU machine), to see where prefill time goes and what a faster path is worth:

- `fast`: MLX's fused attention with a causal mask: cuDNN's where the
  process allows it (MLX_CUDA_USE_CUDNN_SDPA=1, MLX's default), else MLX's
  fallback of separate ops. `fast_first_ms` is its first call at that
  shape (cuDNN builds a plan per shape).
- `composed`: that fallback written out (scaled queries, a broadcast matmul
  per key/value head, `where` on a boolean causal mask, a precise softmax,
  a matmul); each step is also timed alone at the largest length.
- `composed_additive`: the same with an additive mask built once.

    prefill_attention_probe.py [--lengths 32,256,1024,1810,4096] [--layers 28]

Shapes are Llama-3.2-3B's (24 heads, 8 key/value heads, head_dim 128),
bfloat16, one sequence; each timing evaluates `--layers` attentions at once,
as a prefill does. Prints one JSON line per length, then one of the
fallback's steps.
"""
import argparse
import json
import math
import os
import time

import mlx.core as mx

HEADS, KV_HEADS, DIM = 24, 8, 128
REPEATS = HEADS // KV_HEADS


def timed(build, repeat=10):
    started = time.perf_counter()
    mx.eval(build())
    first = (time.perf_counter() - started) * 1e3
    for _ in range(2):
        mx.eval(build())
    started = time.perf_counter()
    for _ in range(repeat):
        mx.eval(build())
    return first, (time.perf_counter() - started) / repeat * 1e3


def causal_bool(length):
    rows = mx.arange(length)[:, None]
    return rows >= mx.arange(length)[None, :]


def scores_of(q, k, scale):
    q = (q * mx.array(scale, q.dtype)).reshape(1, KV_HEADS, REPEATS, q.shape[2], DIM)
    return q @ mx.expand_dims(k, 2).swapaxes(-1, -2)


def finish(scores, v):
    out = mx.softmax(scores, axis=-1, precise=True) @ mx.expand_dims(v, 2)
    return out.reshape(1, HEADS, -1, DIM)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="32,256,1024,1810,4096")
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    scale = 1 / math.sqrt(DIM)
    cudnn = os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1")
    lengths = [int(n) for n in args.lengths.split(",")]
    for length in lengths:
        mx.random.seed(length)
        layers = []
        for _ in range(args.layers):
            q = mx.random.normal((1, HEADS, length, DIM)).astype(mx.bfloat16)
            k = mx.random.normal((1, KV_HEADS, length, DIM)).astype(mx.bfloat16)
            v = mx.random.normal((1, KV_HEADS, length, DIM)).astype(mx.bfloat16)
            layers.append((q, k, v))
        mx.eval(layers)
        mask = causal_bool(length)
        additive = mx.where(mask, mx.array(0, mx.bfloat16), mx.array(-mx.inf, mx.bfloat16))
        mx.eval(mask, additive)
        minimum = mx.array(mx.finfo(mx.bfloat16).min, mx.bfloat16)

        def fast():
            return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
                    for q, k, v in layers]

        def composed():
            return [finish(mx.where(mask, scores_of(q, k, scale), minimum), v) for q, k, v in layers]

        def composed_additive():
            return [finish(scores_of(q, k, scale) + additive, v) for q, k, v in layers]

        want = composed()[0].astype(mx.float32)
        got = fast()[0].astype(mx.float32)
        fast_first, fast_ms = timed(fast)
        report = {
            "length": length, "layers": args.layers, "cudnn_allowed": cudnn,
            "fast_vs_composed_max_abs_diff": mx.abs(want - got).max().item(),
            "fast_first_ms": round(fast_first, 2), "fast_ms": round(fast_ms, 3),
            "composed_ms": round(timed(composed)[1], 3),
            "composed_additive_ms": round(timed(composed_additive)[1], 3),
        }
        print(json.dumps(report), flush=True)
    # The fallback's steps alone, at the largest length.
    q, k, v = layers[0]
    scores = scores_of(q, k, scale)
    masked = mx.where(mask, scores, minimum)
    weights = mx.softmax(masked, axis=-1, precise=True)
    mx.eval(scores, masked, weights)
    steps = {
        "length": lengths[-1], "steps_per_layer_ms": {
            "scores_matmul": round(timed(lambda: [scores_of(q, k, scale) for _ in range(args.layers)])[1] / args.layers, 3),
            "where_mask": round(timed(lambda: [mx.where(mask, scores, minimum) for _ in range(args.layers)])[1] / args.layers, 3),
            "softmax": round(timed(lambda: [mx.softmax(masked, axis=-1, precise=True) for _ in range(args.layers)])[1] / args.layers, 3),
            "values_matmul": round(timed(lambda: [weights @ mx.expand_dims(v, 2) for _ in range(args.layers)])[1] / args.layers, 3),
        }}
    print(json.dumps(steps), flush=True)


if __name__ == "__main__":
    main()
