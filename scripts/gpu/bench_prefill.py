#!/usr/bin/env python3
"""Prefill speed of a running gateway: one chat request of about TOKENS
prompt tokens with max_tokens 1, timed from send to answer (after one
warm-up of the same length; every prompt's words differ, so no prompt cache
helps). Prints {"prefill_tokens", "prefill_tok_s"}.

    bench_prefill.py URL [TOKENS] [--wait-ready SECONDS]
"""
import json
import random
import sys
import time
import urllib.request


def ask(url, model, words):
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(words)}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t = time.perf_counter()
    r = json.load(urllib.request.urlopen(req, timeout=600))
    return r["usage"]["prompt_tokens"], time.perf_counter() - t


def wait_ready(url, seconds):
    """Polls /readyz until the model is loaded (or the time is up)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=5).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url} was not ready after {seconds} s")
        time.sleep(0.5)


def main():
    args = sys.argv[1:]
    if "--wait-ready" in args:
        at = args.index("--wait-ready")
        wait_ready(args[0], float(args[at + 1]))
        del args[at:at + 2]
    url = args[0]
    tokens = int(args[1]) if len(args) > 1 else 2048
    model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
    rng = random.Random(1)
    vocab = "sea river stone light cloud green quiet number table window paper garden music winter summer city road".split()
    words = lambda n: [rng.choice(vocab) + str(rng.randint(0, 9)) for _ in range(n)]  # noqa: E731
    n, _ = ask(url, model, words(100))
    per_word = n / 100
    count, took = ask(url, model, words(int(tokens / per_word)))
    count, took = ask(url, model, words(int(tokens / per_word)))
    print(json.dumps({"peer": "mlxgate", "prefill_tokens": count, "prefill_tok_s": round(count / took, 0)}))


if __name__ == "__main__":
    main()
