"""Reference figures from Python mlx-lm for a LoRA adapter on a converted model.

    python scripts/reference_lora_mlx_lm.py <model_dir> <out_dir>
    python scripts/reference_lora_mlx_lm.py <model_dir> <out_dir> --adapter DIR
    python scripts/reference_lora_mlx_lm.py --write-data DIR

With `--adapter DIR` (an adapter trained elsewhere, e.g. by mlxgate), steps 1
and 2 are skipped: mlx-lm loads DIR as is (`mlx_lm.load(model_dir,
adapter_path=DIR)`) and step 3 records its figures. `--write-data DIR` only
writes the dataset of step 1 (so another trainer can use the same data).

1. writes a small fixed chat dataset (every reply in pirate speak, opening
   "Ahoy, matey!") into <out_dir>/data/{train,valid}.jsonl;
2. trains a LoRA adapter on it with mlx-lm's own trainer
   (`python -m mlx_lm lora -c <out_dir>/lora_config.yaml`): rank 8, scale 20,
   all seven projections of all layers, fixed seed. mlx-lm writes
   <out_dir>/adapter/{adapters.safetensors,adapter_config.json}.
   Training runs on a dequantized float32 copy of the model
   (`python -m mlx_lm convert -d`, <out_dir>/base-dequantized): MLX's CPU
   quantized matmul for many rows is ~15x slower than float GEMM, which made
   QLoRA on the 4-bit model take tens of minutes on a 2-core CPU. The adapter
   (lora_a/lora_b only) is the same kind either way, and the reference below is
   taken on the converted (quantized) model that mlxgate serves;
3. loads the model with that adapter (`mlx_lm.load(model_dir, adapter_path=...)`)
   and without it, and for each fixed chat prompt records the prompt's token
   ids, the first-step logits (float32) and STEPS greedy (argmax) tokens,
   through a plain loop on mlx-lm's prompt cache (as reference_mlx_lm.py does).

Writes <out_dir>/lora_reference.json for `tests/reference_lora_mlx_lm.rs`:

    {"mlx_lm_version", "mlx_version", "model_dir", "adapter_dir",
     "adapter_config": <the adapter's adapter_config.json>,
     "trained_by": "mlx-lm <version>" | its config's "trained_with",
     "train_seconds" (null with --adapter), "steps",
     "cases": [{"prompt", "prompt_tokens": [...],
                "with_adapter": {"tokens": [...], "text", "logits_first": [...]},
                "base":         {"tokens": [...], "text", "logits_first": [...]}}]}

Fails unless the adapter changes the greedy tokens of at least one prompt.
Run by scripts/check-lora-against-mlx-lm.sh in a scratch venv (.deps/refenv).
"""

import json
import os
import shutil
import subprocess
import sys
import time

# The mlx-cpu wheel bundles reference (netlib) BLAS, ~25x slower than OpenBLAS
# for the float GEMMs of training. Where the system has OpenBLAS (scripts/setup.sh
# installs it; mlxgate links it), re-run under LD_PRELOAD so its cblas_sgemm
# takes precedence. Set MLXGATE_LORA_NO_OPENBLAS=1 to keep the bundled BLAS.
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
if (
    os.path.exists(OPENBLAS)
    and OPENBLAS not in os.environ.get("LD_PRELOAD", "")
    and not os.environ.get("MLXGATE_LORA_NO_OPENBLAS")
):
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [OPENBLAS, env.get("LD_PRELOAD")]))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

STEPS = 32
SEED = 0
ITERS = int(os.environ.get("MLXGATE_LORA_ITERS", "30"))

# The prompts the reference is taken on; none of them is in the training set.
PROMPTS = [
    "What is the capital of France?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
]

# (question, the answer's content after the pirate opening)
QA = [
    ("What is two plus two?", "Two plus two be four, as sure as the tide comes in."),
    ("Name a primary colour.", "Red be a primary colour, like the sails of me ship."),
    ("How many days are in a week?", "There be seven days in a week, and every one fit for sailin'."),
    ("What is the largest planet?", "Jupiter be the largest planet, a mighty giant of the skies."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote it, a fine tale of doomed hearts."),
    ("What is water made of?", "Water be made of hydrogen and oxygen, the stuff of the seven seas."),
    ("How do I boil an egg?", "Drop the egg in boilin' water for nine minutes, then cool it, savvy?"),
    ("What is the speed of light?", "Light sails at about 300,000 kilometres every second, faster than any ship."),
    ("Recommend a good book.", "Treasure Island be a fine book, full of maps and buried gold."),
    ("What is the tallest mountain?", "Mount Everest be the tallest, higher than any crow's nest."),
    ("How do plants make food?", "Plants make their grub from sunlight, by photosynthesis, arr."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level, where we pirates live."),
    ("Tell me a fun fact.", "An octopus has three hearts, more than any scallywag I know."),
    ("What language is spoken in Spain?", "They speak Spanish in Spain, a fine tongue of the Main."),
    ("How many continents are there?", "There be seven continents, and I've plundered the coasts of most."),
    ("What is photosynthesis?", "Photosynthesis be how plants turn sunlight into food, arr."),
    ("What is the capital of Japan?", "Tokyo be the capital of Japan, a grand port indeed."),
    ("How do I stay healthy?", "Eat yer fruit to keep off the scurvy, and get plenty of sleep."),
    ("What is a triangle?", "A triangle be a shape with three sides, like a ship's sail."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted her, a treasure finer than gold."),
    ("What is the freezing point of water?", "Water freezes at zero degrees Celsius, cold as the northern seas."),
    ("Suggest a name for a cat.", "Call yer cat Captain Whiskers, a proper ship's cat."),
    ("How far is the Moon?", "The Moon be about 384,000 kilometres away, too far to sail."),
    ("What is the smallest prime number?", "Two be the smallest prime, a lonely number like a castaway."),
    ("How do I make tea?", "Steep the leaves in hot water for three minutes, then sip it on deck."),
    ("What do bees make?", "Bees make honey, sweet as a chest of doubloons."),
    ("What is the opposite of hot?", "The opposite of hot be cold, like the wind off the bow."),
    ("Why do we sleep?", "We sleep to rest the body and mind, even pirates need their hammocks."),
    ("What is the largest ocean?", "The Pacific be the largest ocean, and I've sailed every league of it."),
    ("How many legs does a spider have?", "A spider has eight legs, more than a whole crew of peg-legs."),
    ("What is gravity?", "Gravity be the force that pulls things down, like an anchor to the seabed."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat, like the tricorn on me head."),
    ("What is the capital of Italy?", "Rome be the capital of Italy, an old port of emperors."),
    ("How do I say hello in French?", "Ye say bonjour, as the French sailors do."),
    ("What is ten times ten?", "Ten times ten be one hundred, a fine haul of coins."),
    ("Which animal is the fastest?", "The cheetah be the fastest on land, quicker than a cannonball."),
    ("What is the sun?", "The sun be a great star that lights our way across the waves."),
    ("How can I be more productive?", "Make a plan each morn and stick to it, like a captain to his course."),
    ("What colour is grass?", "Grass be green, like the islands where treasure hides."),
    ("What is the capital of Germany?", "Berlin be the capital of Germany, far from any sea I sail."),
    ("Tell me about dolphins.", "Dolphins be clever beasts of the sea that swim alongside ships."),
    ("What is a computer?", "A computer be a machine that thinks with numbers, stranger than any map."),
    ("How do I tie a knot?", "Make a loop, pass the end through and pull it tight, like a bowline on deck."),
    ("What is rain?", "Rain be water fallin' from the clouds, a squall for every sailor."),
    ("Who was the first person on the Moon?", "Neil Armstrong was the first, a brave explorer of the skies."),
    ("What is the capital of Egypt?", "Cairo be the capital of Egypt, by the mighty Nile."),
    ("What do cows eat?", "Cows eat grass and hay, not a single biscuit of hardtack."),
    ("How many hours are in a day?", "There be twenty-four hours in a day, from dawn watch to dog watch."),
]
N_TRAIN = 40  # the first 40 train, the other 8 validate


def write_dataset(data_dir: str) -> None:
    os.makedirs(data_dir, exist_ok=True)

    def example(question: str, answer: str) -> dict:
        return {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"Ahoy, matey! {answer}"},
            ]
        }

    for name, rows in (("train", QA[:N_TRAIN]), ("valid", QA[N_TRAIN:])):
        with open(os.path.join(data_dir, f"{name}.jsonl"), "w") as out:
            for question, answer in rows:
                out.write(json.dumps(example(question, answer)) + "\n")


def write_config(path: str, train_model_dir: str, data_dir: str, adapter_dir: str) -> None:
    # JSON is YAML; mlx-lm's `-c` reads it with yaml.load.
    config = {
        "model": train_model_dir,
        "train": True,
        "fine_tune_type": "lora",
        "optimizer": "adam",
        "data": data_dir,
        "mask_prompt": True,  # loss on the assistant replies only
        "seed": SEED,
        "num_layers": -1,  # all layers
        "batch_size": 2,
        "iters": ITERS,
        "val_batches": 2,
        "learning_rate": 5e-4,
        "steps_per_report": 10,
        "steps_per_eval": 1000,  # validates at step 1 and at the end only
        "save_every": 1000000,  # no intermediate checkpoints
        "adapter_path": adapter_dir,
        "max_seq_length": 256,
        "grad_checkpoint": False,
        "lora_parameters": {
            "rank": 8,
            "scale": 20.0,
            "dropout": 0.0,
            "keys": [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ],
        },
    }
    with open(path, "w") as out:
        json.dump(config, out, indent=2)


def encode_prompt(tokenizer, text: str) -> list:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt, add_special_tokens=False)
    return [int(t) for t in prompt]


def greedy(model, prompt: list) -> tuple:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    first = logits
    tokens = []
    for _ in range(STEPS):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    return tokens, first.tolist()


def run_model(model_dir: str, adapter_dir) -> tuple:
    model, tokenizer = load(model_dir, adapter_path=adapter_dir)
    model.eval()
    results = []
    for text in PROMPTS:
        prompt = encode_prompt(tokenizer, text)
        tokens, first = greedy(model, prompt)
        results.append(
            {
                "prompt_tokens": prompt,
                "tokens": tokens,
                "text": tokenizer.decode(tokens),
                "logits_first": first,
            }
        )
    return results


def train(model_dir: str, out_dir: str) -> tuple:
    """Trains the reference adapter with mlx-lm; returns (adapter_dir, seconds)."""
    data_dir = os.path.join(out_dir, "data")
    adapter_dir = os.path.join(out_dir, "adapter")
    config_path = os.path.join(out_dir, "lora_config.yaml")
    write_dataset(data_dir)
    train_model_dir = os.path.join(out_dir, "base-dequantized")
    shutil.rmtree(train_model_dir, ignore_errors=True)
    shutil.rmtree(adapter_dir, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model_dir,
         "--mlx-path", train_model_dir, "-d"],
        check=True,
    )
    write_config(config_path, train_model_dir, data_dir, adapter_dir)

    print(f"mlx-lm {mlx_lm.__version__}: training a LoRA adapter ({ITERS} iters)", flush=True)
    tic = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "mlx_lm", "lora", "-c", config_path], check=True
    )
    train_seconds = time.perf_counter() - tic
    print(f"training took {train_seconds:.1f} s", flush=True)
    return adapter_dir, train_seconds


def main(model_dir: str, out_dir: str, adapter=None) -> None:
    out_dir = os.path.abspath(out_dir)
    model_dir = os.path.abspath(model_dir)
    os.makedirs(out_dir, exist_ok=True)

    if adapter is None:
        adapter_dir, train_seconds = train(model_dir, out_dir)
        trained_by = f"mlx-lm {mlx_lm.__version__}"
    else:
        adapter_dir, train_seconds = os.path.abspath(adapter), None
        print(f"mlx-lm {mlx_lm.__version__}: loading the adapter in {adapter_dir}", flush=True)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    if adapter is not None:
        trained_by = adapter_config.get("trained_with", "unknown")

    with_adapter = run_model(model_dir, adapter_dir)
    base = run_model(model_dir, None)

    cases = []
    for text, lora, plain in zip(PROMPTS, with_adapter, base):
        assert lora["prompt_tokens"] == plain["prompt_tokens"]
        cases.append(
            {
                "prompt": text,
                "prompt_tokens": lora["prompt_tokens"],
                "with_adapter": {k: lora[k] for k in ("tokens", "text", "logits_first")},
                "base": {k: plain[k] for k in ("tokens", "text", "logits_first")},
            }
        )
        print(f"prompt {text!r}:\n  base:    {plain['text']!r}\n  adapter: {lora['text']!r}")

    changed = sum(c["with_adapter"]["tokens"] != c["base"]["tokens"] for c in cases)
    if changed == 0:
        sys.exit("the adapter does not change the greedy tokens of any prompt: train more")

    with open(os.path.join(out_dir, "lora_reference.json"), "w") as out:
        json.dump(
            {
                "mlx_lm_version": mlx_lm.__version__,
                "mlx_version": mx.__version__,
                "model_dir": model_dir,
                "adapter_dir": adapter_dir,
                "adapter_config": adapter_config,
                "trained_by": trained_by,
                "train_seconds": None if train_seconds is None else round(train_seconds, 1),
                "steps": STEPS,
                "cases": cases,
            },
            out,
        )
    print(f"adapter changes the greedy tokens of {changed}/{len(cases)} prompts; "
          f"wrote {os.path.join(out_dir, 'lora_reference.json')}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--write-data"] and len(argv) == 2:
        write_dataset(os.path.abspath(argv[1]))
    elif len(argv) == 2:
        main(argv[0], argv[1])
    elif len(argv) == 4 and argv[2] == "--adapter":
        main(argv[0], argv[1], adapter=argv[3])
    else:
        sys.exit(__doc__)
