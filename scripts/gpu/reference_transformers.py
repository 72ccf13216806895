#!/usr/bin/env python3
"""Reference figures from Hugging Face transformers (PyTorch, CUDA, float32,
no TF32) for a model directory, in the shape tests/reference_mlx_lm.rs reads:
the prompt's token ids, the first-step logits and STEPS greedy tokens (with
each step's margin between the best and second-best logit, which says how
close a step was to choosing otherwise).

    reference_transformers.py MODEL_DIR OUT.json [STEPS]
"""
import json
import os
import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

PROMPT = "<|im_start|>user\nWrite one sentence about the sea, then list three colours.<|im_end|>\n<|im_start|>assistant\n"


def main(model_dir, out_path, steps=32):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    greedy, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda"), use_cache=True)
        first = logits = out.logits[0, -1].float()
        past = out.past_key_values
        for _ in range(steps):
            top = torch.topk(logits, 2)
            greedy.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            out = model(torch.tensor([[greedy[-1]]], device="cuda"), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
    json.dump({"model_dir": os.path.abspath(model_dir), "prompt_tokens": ids,
               "first_logits": first.tolist(), "greedy_tokens": greedy, "margins": margins,
               "greedy_text": tok.decode(greedy)}, open(out_path, "w"))
    print(f"transformers: {len(ids)} prompt tokens, {steps} greedy tokens, smallest margin {min(margins):.3e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 32)
