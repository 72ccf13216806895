#!/usr/bin/env bash
# Embedding throughput, mlxgate against sentence-transformers on CPU torch
# with the same thread count, in one run: texts/s at batch 1 and batch 32
# (the same shuffled mix of the 200 parity texts on both sides; mlxgate over
# HTTP, sentence-transformers in-process), then the chat model's decode
# speed alone and while a client embeds batches of 32 nonstop.
#
#   scripts/bench-embeddings.sh          # EMBED_BENCH_THREADS (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/embeddings-common.sh
start_gateway
"$venv/bin/python" scripts/embeddings_reference.py bench "http://127.0.0.1:$port" "$encoder" "$encoder_id" \
  "${EMBED_BENCH_THREADS:-2}" "$chat_id"
