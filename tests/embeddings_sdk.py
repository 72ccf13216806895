"""Drives a running mlxgate's /v1/embeddings with the official `openai` package.

Usage: python3 tests/embeddings_sdk.py BASE_URL MODEL

Checks one string, a batch of 64, token-id input, the SDK's default
(base64 on the wire, decoded by the SDK) against `encoding_format="float"`,
usage, and a bad input surfacing as the SDK's BadRequestError. Run by
tests/embeddings.rs with PYTHONPATH=.deps/py.
"""

import math
import sys

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main(base_url, model):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    one = client.embeddings.create(model=model, input="hello world", encoding_format="float")
    vector = one.data[0].embedding
    check(len(vector) == 384, f"dimensions {len(vector)}")
    check(abs(math.sqrt(sum(x * x for x in vector)) - 1) < 1e-5, "unit length")
    check(one.usage.prompt_tokens == 4 and one.usage.total_tokens == 4, f"usage {one.usage}")
    check(one.model == model, one.model)

    # Without encoding_format the SDK asks for base64 and decodes it itself.
    default = client.embeddings.create(model=model, input="hello world")
    check(default.data[0].embedding == vector, "base64 decodes to the same floats")

    ids = client.embeddings.create(model=model, input=[7592, 2088], encoding_format="float")
    check(ids.data[0].embedding == vector, "token ids embed as their text")

    texts = [f"document {i} about {'cats' if i % 2 else 'finance'}" for i in range(64)]
    batch = client.embeddings.create(model=model, input=texts)
    check(len(batch.data) == 64, f"{len(batch.data)} vectors")
    check([d.index for d in batch.data] == list(range(64)), "indices in order")
    cats = [d.embedding for d in batch.data[1::2]]
    finance = [d.embedding for d in batch.data[0::2]]
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    check(dot(cats[0], cats[1]) > dot(cats[0], finance[0]), "like texts are closer")

    try:
        client.embeddings.create(model=model, input="")
        check(False, "an empty string was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "empty" in str(e), str(e))
    print("all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
