#!/usr/bin/env bash
# Checks mlxgate's embeddings against sentence-transformers (the reference)
# on CPU torch: 200 varied texts (short, long up to and past the model's
# max length, unicode, code) through a running release server, cosine
# similarity >= 0.9999 for every text and the same top-5 nearest neighbours.
# sentence-transformers lives in a scratch venv (.deps/stenv, ~6 GB with
# torch's wheels), never a project dependency.
#
#   scripts/check-embeddings-against-sentence-transformers.sh
#   scripts/check-embeddings-against-sentence-transformers.sh --write-reference
#       (rewrites tests/data/minilm_reference.json, the vectors the tests use)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/embeddings-common.sh

if [ "${1:-}" = "--write-reference" ]; then
  "$venv/bin/python" scripts/embeddings_reference.py write-reference "$encoder" tests/data/minilm_reference.json
  exit
fi
start_gateway
"$venv/bin/python" scripts/embeddings_reference.py check "http://127.0.0.1:$port" "$encoder" "$encoder_id"
