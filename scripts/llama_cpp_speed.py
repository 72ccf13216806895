#!/usr/bin/env python3
"""llama.cpp speed on given prompt token ids, through llama-cpp-python.

Two modes, both greedy on the CPU with n_threads threads:

  llama_cpp_speed.py run --model M.gguf --spec spec.json
      spec: {"prompts": [[ids...], ...], "decode_prompt": [ids...],
             "decode_tokens": 64, "suppress": [eos ids...], "runs": 3}
      Prints one JSON object: per prompt the median prefill tokens/s, and the
      median decode tokens/s, with every run's figures.

  llama_cpp_speed.py serve --model M.gguf
      Reads one JSON command per line on stdin and answers one JSON line on
      stdout, so that a caller (benches/engine_vs_llama_cpp.rs) can interleave
      llama.cpp with its own runs:
        {"op": "prefill", "tokens": [...]}
        {"op": "decode", "prompt": [...], "n": 64, "suppress": [...]}
        {"op": "info"}

Prefill: the prompt is evaluated from an empty KV cache (Llama.reset() and
llama.cpp drops every cached position past n_tokens, so nothing is reused),
then the first token is picked from the last logits; tokens/s = prompt tokens
/ wall time of both, as mlxgate's "prompt tokens / time to first token".
Decode: after that, n-1 more tokens, each one llama_decode of one token plus
an argmax over the logits with `suppress` ids masked (end of sequence never
ends the run); tokens/s = (n-1) / their wall time, as mlxgate's
"(tokens-1) / (last token - first token)". llama.cpp's own perf counters
(prompt eval and eval ms) are reported next to the wall clock.

Token ids go in and out as ids: tokenization differences cannot matter.
"""

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np
import llama_cpp
from llama_cpp import Llama


def load(model, threads, ctx, batch):
    return Llama(
        model_path=model,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=ctx,
        n_batch=batch,
        n_ubatch=batch,
        n_gpu_layers=0,
        logits_all=False,
        verbose=False,
    )


def last_logits(llm):
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def pick(llm, suppress):
    logits = last_logits(llm)
    if suppress:
        logits = logits.copy()
        logits[suppress] = -np.inf
    return int(np.argmax(logits))


def perf(llm):
    """llama.cpp's own counters since the last reset, where this version has them."""
    try:
        data = llama_cpp.llama_perf_context(llm.ctx)
        return {
            "prompt_eval_ms": data.t_p_eval_ms,
            "prompt_eval_tokens": data.n_p_eval,
            "eval_ms": data.t_eval_ms,
            "eval_tokens": data.n_eval,
        }
    except (AttributeError, ctypes.ArgumentError):
        return None


def perf_reset(llm):
    try:
        llama_cpp.llama_perf_context_reset(llm.ctx)
    except (AttributeError, ctypes.ArgumentError):
        pass


def prefill(llm, tokens, suppress=()):
    llm.reset()
    perf_reset(llm)
    started = time.perf_counter()
    llm.eval(tokens)
    first = pick(llm, list(suppress))
    seconds = time.perf_counter() - started
    return {
        "tokens": len(tokens),
        "seconds": seconds,
        "tok_s": len(tokens) / seconds,
        "first": first,
        "perf": perf(llm),
    }


def decode(llm, prompt, n, suppress):
    pre = prefill(llm, prompt, suppress)
    ids = [pre["first"]]
    perf_reset(llm)
    started = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([ids[-1]])
        ids.append(pick(llm, list(suppress)))
    seconds = time.perf_counter() - started
    return {
        "prefill_seconds": pre["seconds"],
        "tokens": n,
        "seconds": seconds,
        "tok_s": (n - 1) / seconds,
        "ids": ids,
        "text": llm.detokenize(ids).decode("utf-8", errors="replace"),
        "perf": perf(llm),
    }


def info(llm, model):
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "model": model,
        "n_vocab": llm.n_vocab(),
        "n_ctx": llm.n_ctx(),
    }


def run(llm, args):
    with open(args.spec) as f:
        spec = json.load(f)
    runs = int(spec.get("runs", 3))
    suppress = spec.get("suppress", [])
    warm = spec.get("decode_prompt") or spec["prompts"][0]
    prefill(llm, warm[:16], suppress)
    out = {"info": info(llm, args.model), "prefill": [], "decode": None}
    for prompt in spec["prompts"]:
        results = [prefill(llm, prompt, suppress) for _ in range(runs)]
        out["prefill"].append(
            {
                "tokens": len(prompt),
                "median_tok_s": statistics.median(r["tok_s"] for r in results),
                "runs": results,
            }
        )
    if spec.get("decode_prompt"):
        n = int(spec.get("decode_tokens", 64))
        results = [decode(llm, spec["decode_prompt"], n, suppress) for _ in range(runs)]
        out["decode"] = {
            "tokens": n,
            "median_tok_s": statistics.median(r["tok_s"] for r in results),
            "runs": results,
        }
    json.dump(out, sys.stdout)
    print()


def serve(llm, args):
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "prefill":
                reply = prefill(llm, command["tokens"], command.get("suppress", []))
            elif op == "decode":
                reply = decode(llm, command["prompt"], int(command["n"]), command.get("suppress", []))
            elif op == "info":
                reply = info(llm, args.model)
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as error:  # reported to the caller, who decides
            reply = {"error": repr(error)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["run", "serve"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--spec", help="JSON spec file (run mode)")
    args = parser.parse_args()
    llm = load(args.model, args.threads, args.ctx, args.batch)
    if args.mode == "run":
        if not args.spec:
            parser.error("run needs --spec")
        run(llm, args)
    else:
        serve(llm, args)


if __name__ == "__main__":
    main()
