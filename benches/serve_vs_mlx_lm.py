"""mlxgate vs Python mlx_lm.server on the same converted model, same run.

Measures, over HTTP with streaming chat completions (greedy, end-of-sequence
suppressed so both decode the same number of tokens):
  * time to first token (TTFT) for a short and a long prompt,
  * decode tokens/s after the first token,
and prints medians and the mlxgate / mlx-lm ratios. Servers run one at a time
so they never compete for the 2 cores; the order alternates per round.

Run through scripts/bench-vs-mlx-lm.sh (sets up the scratch venv and model).
"""

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

ROUNDS = 3
DECODE_TOKENS = 48
SHORT = "Tell me about the sea."
LONG = "The history of the lighthouse is long and full of storms. " * 25


def wait_ready(base, proc, ready_path, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(base + ready_path, timeout=1).read()
            return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("server did not become ready")


def stream_chat(base, model, prompt, max_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # SmolLM2's <|endoftext|> and <|im_end|>: decode exactly max_tokens.
        "logit_bias": {"0": -100, "2": -100},
    }
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    first = None
    chunks = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - started
    total = time.perf_counter() - started
    return first, total, chunks


def measure(name, command, base, model):
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # mlxgate answers /readyz once its model has loaded; mlx_lm.server
        # loads before it listens.
        wait_ready(base, proc, "/readyz" if name == "mlxgate" else "/v1/models")
        stream_chat(base, model, "Warm up.", 4)
        ttft_short, _, _ = stream_chat(base, model, SHORT, 1)
        ttft_long, _, _ = stream_chat(base, model, LONG, 1)
        first, total, chunks = stream_chat(base, model, SHORT, DECODE_TOKENS)
        decode = (chunks - 1) / (total - first)
        return {"ttft_short": ttft_short, "ttft_long": ttft_long, "decode": decode}
    finally:
        proc.terminate()
        proc.wait()


def main():
    mlxgate, venv_python, model_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    runs = {"mlxgate": [], "mlx-lm": []}
    for round_ in range(ROUNDS):
        servers = [
            ("mlxgate", [mlxgate, "serve", "--model", model_dir, "--port", "18431"],
             "http://127.0.0.1:18431", "SmolLM2-135M-Instruct-mlx"),
            ("mlx-lm", [venv_python, "-m", "mlx_lm.server", "--model", model_dir, "--port", "18432"],
             "http://127.0.0.1:18432", model_dir),
        ]
        if round_ % 2:
            servers.reverse()
        for name, command, base, model in servers:
            result = measure(name, command, base, model)
            runs[name].append(result)
            print(f"round {round_ + 1} {name}: {result}", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for key, label, higher_better in [
        ("decode", "decode tok/s", True),
        ("ttft_short", "TTFT short prompt (s)", False),
        ("ttft_long", "TTFT long prompt (s)", False),
    ]:
        a, b = med["mlxgate"][key], med["mlx-lm"][key]
        print(f"{label:24} mlxgate {a:8.3f}   mlx-lm {b:8.3f}   ratio {a / b:5.2f}x")


if __name__ == "__main__":
    main()
