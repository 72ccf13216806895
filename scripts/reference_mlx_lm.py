"""Reference figures from Python mlx-lm for a converted model directory.

Writes JSON: the prompt's token ids, the first-step logits (float32) and 64
greedy (argmax) tokens, for `tests/reference_mlx_lm.rs` to compare against
mlxgate's engine. Run by scripts/check-against-mlx-lm.sh in a scratch venv.
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

PROMPT = "Write one sentence about the sea, then list three colours."
STEPS = 64


def main(model_dir: str, out_path: str) -> None:
    model, tokenizer = load(model_dir)
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )
    else:  # base models: the prompt as plain text
        prompt = tokenizer.encode(PROMPT)
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt, add_special_tokens=False)
    prompt = [int(t) for t in prompt]

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    first = logits
    greedy = []
    for _ in range(STEPS):
        token = int(mx.argmax(logits).item())
        greedy.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)

    with open(out_path, "w") as out:
        json.dump(
            {
                "model_dir": model_dir,
                "prompt_tokens": prompt,
                "first_logits": first.tolist(),
                "greedy_tokens": greedy,
                "greedy_text": tokenizer.decode(greedy),
            },
            out,
        )
    print(f"mlx-lm: {len(prompt)} prompt tokens, greedy: {tokenizer.decode(greedy)!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
