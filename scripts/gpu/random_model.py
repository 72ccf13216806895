#!/usr/bin/env python3
"""Writes a random-weight model of a real model's shape in Hugging Face
layout (config.json, safetensors, tokenizer), with `transformers` on the GPU,
so mlxgate, Python mlx-lm and transformers load the same weights. Made where
it runs: an 8B model is 16 GB, too much to carry.

    random_model.py SHAPE OUT_DIR TOKENIZER_DIR [--dtype bfloat16] [--seed 0]

SHAPE: 0.5b (Qwen2.5-0.5B's), 3b (Llama-3.2-3B's), 8b (Llama-3.1-8B's). The
vocabulary is TOKENIZER_DIR's (tokenizer.json, tokenizer_config.json: SmolLM2's
49,152 tokens, written by `mlxgate convert`), so text round-trips; the
parameter count is the shape's less its embedding rows past 49,152.
"""
import argparse
import json
import os
import shutil
import time

SHAPES = {
    "0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                           rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5)),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("tokenizer")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = json.load(open(os.path.join(a.tokenizer, "tokenizer.json")))
    vocab = max(list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]) + 1
    model_type, kw = SHAPES[a.shape]
    config = AutoConfig.for_model(model_type, vocab_size=vocab, max_position_embeddings=8192,
                                  bos_token_id=1, eos_token_id=2, **kw)
    dtype = getattr(torch, a.dtype)
    start = time.time()
    torch.manual_seed(a.seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = sum(t.numel() for t in model.parameters())
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer, name), os.path.join(a.out, name))
    print(json.dumps({"shape": a.shape, "model_type": model_type, "parameters": params,
                      "dtype": a.dtype, "vocab": vocab, "seconds": round(time.time() - start, 1),
                      "dir": a.out}), flush=True)


if __name__ == "__main__":
    main()
