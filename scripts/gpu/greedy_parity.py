#!/usr/bin/env python3
"""Greedy answers of one model for six reference prompts, from a gateway
started here: written as goldens (on the CPU) or checked against them (on
a GPU).

    greedy_parity.py record MLXGATE MODEL GOLDENS.json
    greedy_parity.py check  MLXGATE MODEL GOLDENS.json [OUT.json]

MLXGATE is the binary, MODEL a GGUF file or model folder. Each prompt is sent
as one chat turn with temperature 0 and max_tokens 32; the check compares the
text and token count of every answer and exits 1 on any difference, printing
where the answers part.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from served import served

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a GPU is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "def fibonacci(n):",
]
MAX_TOKENS = 32


def answers(binary, model):
    data = tempfile.mkdtemp(prefix="mlxgate-parity-")
    with served(binary, model, data) as (url, name):
        out = []
        for prompt in PROMPTS:
            body = {
                "model": name,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
            }
            req = urllib.request.Request(
                url + "/v1/chat/completions", json.dumps(body).encode(),
                {"content-type": "application/json"},
            )
            start = time.time()
            try:
                r = json.load(urllib.request.urlopen(req, timeout=300))
            except urllib.error.HTTPError as e:
                sys.exit(f"{prompt!r}: HTTP {e.code}: {e.read().decode()}")
            out.append({
                "prompt": prompt,
                "text": r["choices"][0]["message"]["content"],
                "completion_tokens": r["usage"]["completion_tokens"],
                "seconds": round(time.time() - start, 3),
            })
        doctor = subprocess.run([binary, "doctor", "-m", os.path.abspath(model)],
                                capture_output=True, text=True)
        return {"doctor": doctor.stdout + doctor.stderr, "answers": out}


def main():
    if len(sys.argv) < 5 or sys.argv[1] not in ("record", "check"):
        sys.exit(__doc__)
    mode, binary, model, goldens = sys.argv[1:5]
    got = answers(binary, model)
    print(got["doctor"])
    if mode == "record":
        json.dump({"model": os.path.basename(model), "answers": got["answers"]},
                  open(goldens, "w"), indent=1, ensure_ascii=False)
        print(f"wrote {goldens}")
        return
    if len(sys.argv) > 5:
        json.dump(got, open(sys.argv[5], "w"), indent=1, ensure_ascii=False)
    want = json.load(open(goldens))["answers"]
    same = 0
    for w, g in zip(want, got["answers"]):
        if (w["text"], w["completion_tokens"]) == (g["text"], g["completion_tokens"]):
            same += 1
            print(f"same   {g['seconds']:6.2f}s  {w['prompt']!r}")
        else:
            n = next((i for i, (a, b) in enumerate(zip(w["text"], g["text"])) if a != b),
                     min(len(w["text"]), len(g["text"])))
            print(f"DIFFER {g['seconds']:6.2f}s  {w['prompt']!r}: from character {n}\n"
                  f"  golden: {w['text']!r}\n  here:   {g['text']!r}")
    print(f"{same} of {len(want)} answers identical to the goldens")
    sys.exit(0 if same == len(want) else 1)


if __name__ == "__main__":
    main()
