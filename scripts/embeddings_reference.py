"""mlxgate's /v1/embeddings against sentence-transformers on CPU torch.

  check URL MODEL_DIR MODEL_ID        parity: 200 varied texts, cosine >= 0.9999
                                      each, and the same top-5 neighbours
  write-reference MODEL_DIR OUT       the vectors tests/embeddings.rs compares to
  bench URL MODEL_DIR MODEL_ID THREADS CHAT_MODEL
                                      texts/s at batch 1 and 32, both sides; chat
                                      decode speed alone and while embedding

Run by scripts/check-embeddings-against-sentence-transformers.sh and
scripts/bench-embeddings.sh inside their scratch venv (never a project
dependency). Both sides see the same texts; sentence-transformers cuts
inputs at the model's max_seq_length silently, mlxgate when asked
(`truncate: true`).
"""

import json
import random
import sys
import time
import urllib.request

import numpy as np

TOPICS = {
    "cooking": ["simmer the tomato sauce for twenty minutes", "knead the bread dough until smooth",
                "a pinch of salt brings out the sweetness", "roast the vegetables at high heat"],
    "finance": ["quarterly revenue grew by eight percent", "the central bank raised interest rates",
                "bond yields fell after the report", "the company announced a share buyback"],
    "space": ["the probe entered orbit around Jupiter", "astronomers found a new exoplanet",
              "the rocket's second stage separated cleanly", "a solar flare disrupted radio signals"],
    "sport": ["the striker scored in the final minute", "she won the marathon in record time",
              "the team lost on penalties", "the coach changed tactics at half time"],
}
UNICODE = ["Ünïcödé façade naïve café", "日本語のテキストを埋め込む", "中文句子的向量表示",
           "Привет, как дела?", "مرحبا بالعالم", "emoji 😀🚀🔥 and text", "Ελληνικά γράμματα",
           "한국어 문장입니다", "ñandú pingüino cigüeña", "tab\tseparated\tvalues"]
CODE = ["def add(a, b):\n    return a + b", "fn main() { println!(\"hi\"); }",
        "SELECT id, name FROM users WHERE age > 30;", "for (int i = 0; i < n; i++) { sum += a[i]; }",
        "const x = await fetch(url).then(r => r.json());", "<div class=\"box\">Hello</div>",
        "import numpy as np\nnp.zeros((3, 4))", "git commit -m 'fix: handle empty input'"]


def texts_200():
    """Short, medium, long (up to and past the max length), unicode, code."""
    rng = random.Random(7)
    sentences = [s for group in TOPICS.values() for s in group]
    out = []
    for topic, group in TOPICS.items():
        out += group
        out += [f"{topic}: {s}." for s in group]
    out += UNICODE + CODE
    out += ["a", "OK", "42", "Hello, world!", "   spaced   out   "]
    while len(out) < 200:
        n = rng.choice([2, 5, 10, 20, 40, 60])
        out.append(" ".join(rng.choice(sentences) for _ in range(n)) + ".")
    return out[:200]


def post(url, body):
    req = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def ours(url, model, texts, batch):
    vectors = []
    for i in range(0, len(texts), batch):
        answer = post(url, {"model": model, "input": texts[i:i + batch], "truncate": True})
        vectors += [d["embedding"] for d in answer["data"]]
    return np.array(vectors, dtype=np.float64)


def reference_model(model_dir, threads=None):
    import torch
    from sentence_transformers import SentenceTransformer
    if threads:
        torch.set_num_threads(threads)
    return SentenceTransformer(model_dir, device="cpu")


def top5(vectors):
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    scores = unit @ unit.T
    np.fill_diagonal(scores, -np.inf)
    return np.argsort(-scores, axis=1)[:, :5], scores


def check(url, model_dir, model_id):
    texts = texts_200()
    st = reference_model(model_dir)
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in texts]
    ref = st.encode(texts, batch_size=32).astype(np.float64)
    got = ours(url, model_id, texts, 32)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    worst = int(np.argmin(cos))
    print(f"texts: {len(texts)}, tokens {min(lengths)}..{max(lengths)} "
          f"({sum(n > st.max_seq_length for n in lengths)} past max_seq_length {st.max_seq_length})")
    print(f"cosine to sentence-transformers: min {cos.min():.8f} (text {worst}), mean {cos.mean():.8f}")
    # Neighbours among the 200 texts; a pair whose scores differ by under
    # 1e-5 on the reference side may swap places, so those are reported apart.
    ours_top, _ = top5(got)
    ref_top, ref_scores = top5(ref)
    differ = [i for i in range(len(texts)) if list(ours_top[i]) != list(ref_top[i])]
    ties = [i for i in differ
            if set(ours_top[i]) == set(ref_top[i])
            or abs(np.sort(ref_scores[i])[-5] - np.sort(ref_scores[i])[-6]) < 1e-5]
    print(f"top-5 neighbours: identical for {len(texts) - len(differ)}/{len(texts)} texts"
          f" ({len(ties)} of the rest only reorder near-ties)")
    ok = cos.min() >= 0.9999 and len(differ) == len(ties)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def write_reference(model_dir, out):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "fn main() { println!(\"héllo, wörld\"); } // 日本語"]
    st = reference_model(model_dir)
    import sentence_transformers
    vectors = st.encode(texts)
    ids = st.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    json.dump({"source": f"sentence-transformers {sentence_transformers.__version__}, all-MiniLM-L6-v2 "
                         "(scripts/check-embeddings-against-sentence-transformers.sh --write-reference)",
               "texts": texts, "embeddings": [[round(float(x), 7) for x in row] for row in vectors],
               "hello_world_ids": ids}, open(out, "w"))
    print(f"wrote {out}")
    return 0


def rate(run, count, seconds):
    """Texts per second of `run` (embeds `count` texts), repeated for `seconds`."""
    run()  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        done += count
    return done / (time.perf_counter() - start)


def chat_speed(url, chat_model, tokens=128):
    """Decode tok/s of one greedy chat answer of `tokens` tokens."""
    body = {"model": chat_model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.load(r)
    return answer["usage"]["completion_tokens"] / (time.perf_counter() - start)


def chat_under_load(url, model_id, chat_model, texts):
    """Chat decode speed alone, then while a client embeds batches of 32 nonstop."""
    import threading
    alone = sorted(chat_speed(url, chat_model) for _ in range(3))[1]
    stop = threading.Event()
    embedded = [0]

    def load():
        while not stop.is_set():
            post(url, {"model": model_id, "input": texts[:32], "truncate": True})
            embedded[0] += 32
    worker = threading.Thread(target=load)
    worker.start()
    time.sleep(1)
    start = time.perf_counter()
    loaded = sorted(chat_speed(url, chat_model) for _ in range(3))[1]
    embed_rate = embedded[0] / (time.perf_counter() - start + 1)
    stop.set()
    worker.join()
    print(f"chat decode: {alone:.1f} tok/s alone, {loaded:.1f} tok/s while embedding "
          f"(~{embed_rate:.0f} texts/s) = {loaded / alone:.2f}x", flush=True)
    return alone, loaded


def bench(url, model_dir, model_id, threads, chat_model, seconds=10.0):
    texts = texts_200()
    random.Random(11).shuffle(texts)
    st = reference_model(model_dir, threads)
    results = {}
    for batch in (1, 32):
        chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)][:max(1, 64 // batch)]
        cursor = {"st": 0, "gw": 0}

        def next_chunk(side):
            chunk = chunks[cursor[side] % len(chunks)]
            cursor[side] += 1
            return chunk
        count = len(chunks[0])
        st_rate = rate(lambda: st.encode(next_chunk("st"), batch_size=batch), count, seconds)
        gw_rate = rate(lambda: post(url, {"model": model_id, "input": next_chunk("gw"), "truncate": True}),
                       count, seconds)
        results[batch] = (gw_rate, st_rate)
        print(f"batch {batch:>2}: mlxgate {gw_rate:8.1f} texts/s   sentence-transformers "
              f"({threads} threads) {st_rate:8.1f} texts/s   ratio {gw_rate / st_rate:.2f}x", flush=True)
    alone, loaded = chat_under_load(url, model_id, chat_model, texts)
    summary = {f"batch_{b}": {"mlxgate": g, "sentence_transformers": s} for b, (g, s) in results.items()}
    summary["chat_decode_tok_s"] = {"alone": alone, "while_embedding": loaded}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "check":
        sys.exit(check(*args))
    if mode == "write-reference":
        sys.exit(write_reference(*args))
    if mode == "bench":
        sys.exit(bench(args[0], args[1], args[2], int(args[3]), args[4]))
    sys.exit(f"unknown mode {mode}; see the docstring")
