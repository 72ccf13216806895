"""Drives a running mlxgate with the official `openai` Python package.

Usage: python3 tests/openai_sdk.py BASE_URL   (e.g. http://127.0.0.1:8080/v1)

Checks model listing, chat (whole and streamed), text completions and an
error surfacing as the SDK's exception; exits non-zero on the first failure.
Run by tests/openai_python_sdk.rs with PYTHONPATH=.deps/py.
"""

import sys

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) >= 1, f"no models listed: {ids}")
    model = ids[0]
    check(client.models.retrieve(model).owned_by == "mlxgate", "owned_by")

    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        max_tokens=5,
        temperature=0,
    )
    check(chat.object == "chat.completion", chat.object)
    check(chat.id.startswith("chatcmpl-"), chat.id)
    choice = chat.choices[0]
    check(choice.message.role == "assistant", choice.message.role)
    check(choice.message.content, "empty content")
    check(choice.finish_reason in ("stop", "length"), choice.finish_reason)
    check(chat.usage.completion_tokens <= 5, chat.usage)
    check(chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens, chat.usage)

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    check(chunks[0].choices[0].delta.role == "assistant", chunks[0])
    check(chunks[-1].usage is not None and chunks[-1].choices == [], chunks[-1])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(len(finish) == 1, f"finish reasons: {finish}")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text, "streamed nothing")

    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0)
    check(completion.object == "text_completion", completion.object)
    check(completion.choices[0].text, "empty completion")
    check(completion.usage.completion_tokens <= 4, completion.usage)

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=4, temperature=0, stream=True
        )
        if c.choices
    )
    check(streamed == completion.choices[0].text, f"{streamed!r} != {completion.choices[0].text!r}")

    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model did not raise")
    except openai.NotFoundError as e:
        check(e.code == "model_not_found", e)
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=5)
        raise AssertionError("temperature 5 did not raise")
    except openai.BadRequestError as e:
        check(e.param == "temperature", e)

    print(f"openai {openai.__version__}: all checks passed against {model}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: openai_sdk.py BASE_URL")
    try:
        main(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - report any failure as a non-zero exit
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
