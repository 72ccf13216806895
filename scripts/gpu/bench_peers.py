#!/usr/bin/env python3
"""Decode and prefill speed of a model directory under Hugging Face
transformers (PyTorch, `generate`) or Python mlx-lm, measured the way
scripts/gpu/bench.sh measures mlxgate: B sequences of a 32-token prompt
decoding NEW greedy tokens together (decode tok/s = B x (NEW - 1) / the time
of tokens 2..NEW; NEW is 64 unless --new says), and one 2,048-token prompt
prefilled alone.

`mlx-lm` is mlx-lm's model in a bare loop: every step launched before the
last is read, no token ever read back. `mlx-lm-batch` is its serving
engine (`BatchGenerator`, what `mlx_lm.server` and `batch_generate` run):
B prompts of 24-40 tokens (lengths differ, as served chats do), each
step's tokens read back; decode tok/s over the steps in which all B
decode, as serve_load.py's `batch` scenario measures a server.

    bench_peers.py transformers|mlx-lm|mlx-lm-batch MODEL_DIR [--batches 1,8,32,128] [--new 64] [--dtype bfloat16]

Prints one JSON object per measurement.
"""
import argparse
import json
import time

PROMPT, PREFILL = 32, 2048


def transformers_bench(a):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype), device_map="cuda").eval()
    vocab = model.config.vocab_size

    def gen(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    g = torch.Generator().manual_seed(0)
    for b in a.batches:
        ids = torch.randint(3, vocab, (b, PROMPT), generator=g).cuda()
        gen(ids, 4)
        first, full = gen(ids, 1), gen(ids, a.new)
        yield {"peer": "transformers", "batch": b, "decode_tok_s": round(b * (a.new - 1) / (full - first), 1)}
    ids = torch.randint(3, vocab, (1, PREFILL), generator=g).cuda()
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
    yield {"peer": "transformers", "prefill_tokens": PREFILL, "prefill_tok_s": round(PREFILL / (time.perf_counter() - t), 0)}


def mlx_lm_bench(a):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(a.model)
    model.set_dtype(getattr(mx, a.dtype))
    vocab = model.args.vocab_size
    mx.random.seed(0)

    def run(b, steps):
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(3, vocab, (b, PROMPT))
        tok = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.eval(tok)
        t = time.perf_counter()
        for _ in range(steps):
            tok = mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.async_eval(tok)
        mx.eval(tok)
        return time.perf_counter() - t

    for b in a.batches:
        run(b, 4)
        yield {"peer": "mlx-lm", "batch": b, "decode_tok_s": round(b * (a.new - 1) / run(b, a.new - 1), 1)}
    ids = mx.random.randint(3, vocab, (1, PREFILL))
    for _ in range(2):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        mx.eval(model(ids, cache=cache))
        took = time.perf_counter() - t
    yield {"peer": "mlx-lm", "prefill_tokens": PREFILL, "prefill_tok_s": round(PREFILL / took, 0)}


def mlx_lm_batch_bench(a):
    import random

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(a.model)
    model.set_dtype(getattr(mx, a.dtype))
    vocab = model.args.vocab_size
    rng = random.Random(0)

    def run(b, new):
        gen = BatchGenerator(model, max_tokens=new, completion_batch_size=b, prefill_batch_size=b)
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 41))] for _ in range(b)]
        gen.insert(prompts, [new] * b)
        full = []  # when a step gave all B a token and none finished
        while responses := gen.next_generated():
            if len(responses) == b and all(r.finish_reason is None for r in responses):
                full.append(time.perf_counter())
            elif full:
                break
        gen.close()
        return b * (len(full) - 1) / (full[-1] - full[0])

    for b in a.batches:
        run(b, 8)
        yield {"peer": "mlx-lm-batch", "batch": b, "decode_tok_s": round(run(b, a.new), 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peer", choices=["transformers", "mlx-lm", "mlx-lm-batch"])
    p.add_argument("model")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--new", type=int, default=64, help="tokens each sequence decodes (default 64)")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    a.batches = [int(b) for b in a.batches.split(",")]
    bench = {"transformers": transformers_bench, "mlx-lm": mlx_lm_bench, "mlx-lm-batch": mlx_lm_batch_bench}[a.peer]
    for row in bench(a):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
