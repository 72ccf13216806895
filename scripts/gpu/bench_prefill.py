#!/usr/bin/env python3
"""Prefill speed of a running gateway: for each length, two chat requests
of that many prompt tokens (filled to the exact count through
`/v1/messages/count_tokens`, which counts the same chat template; "about"
where filler words would not land on it) with max_tokens 1, timed from send to
answer (every prompt's words differ, so no prompt cache helps). The second
is the figure; the first, at a length not seen before, is reported beside
it (a backend that plans per shape pays there). Beside the time from send
to answer, the gateway's own prefill (its `Server-Timing` header: from the
engine taking the request to its first token, no HTTP, template or
tokenizer), which is what a peer timing its model in-process measures.
Prints one line per length: {"prefill_tokens", "prefill_tok_s",
"server_prefill_tok_s", "first_tokens", "first_tok_s"}.

    bench_prefill.py URL [TOKENS[,TOKENS...]] [--wait-ready SECONDS]
"""
import json
import random
import sys
import time
import urllib.request


def chat(model, words):
    return {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(words)}]}


def counted(url, model, words):
    """The prompt tokens of a chat of `words`, as the gateway counts them."""
    req = urllib.request.Request(url + "/v1/messages/count_tokens", json.dumps(chat(model, words)).encode(),
                                 {"content-type": "application/json", "anthropic-version": "2023-06-01"})
    return json.load(urllib.request.urlopen(req, timeout=60))["input_tokens"]


def exactly(url, model, words, length):
    """`words` cut or filled with "the" (one token in SmolLM2's tokenizer,
    which the GPU machine's random models use too) so that the chat is
    `length` tokens, as near as a few recounts come."""
    words = list(words)
    for _ in range(4):
        n = counted(url, model, words)
        if n == length:
            break
        if n > length:
            words = words[:len(words) - (n - length)]
        else:
            words += ["the"] * (length - n)
    return words


def ask(url, model, words):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(chat(model, words)).encode(),
                                 {"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        r = json.load(resp)
        timing = resp.headers.get("server-timing", "")
    took = time.perf_counter() - t
    phases = dict(p.split(";dur=") for p in timing.split(", ") if ";dur=" in p)
    return r["usage"]["prompt_tokens"], took, float(phases.get("prefill", "nan")) / 1e3


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
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    if "--wait-ready" in args:
        at = args.index("--wait-ready")
        wait_ready(args[0], float(args[at + 1]))
        del args[at:at + 2]
    url = args[0]
    lengths = [int(n) for n in args[1].split(",")] if len(args) > 1 else [2048]
    model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
    rng = random.Random(1)
    vocab = "sea river stone light cloud green quiet number table window paper garden music winter summer city road".split()
    words = lambda n: [rng.choice(vocab) + str(rng.randint(0, 9)) for _ in range(n)]  # noqa: E731
    n, _, _ = ask(url, model, words(100))
    per_word = n / 100
    for length in lengths:
        first, first_took, _ = ask(url, model, exactly(url, model, words(int(length / per_word)), length))
        count, took, prefill = ask(url, model, exactly(url, model, words(int(length / per_word)), length))
        print(json.dumps({"peer": "mlxgate", "prefill_tokens": count, "prefill_tok_s": round(count / took, 0),
                          "server_prefill_tok_s": round(count / prefill, 0),
                          "first_tokens": first, "first_tok_s": round(first / first_took, 0)}), flush=True)


if __name__ == "__main__":
    main()
