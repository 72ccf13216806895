"""Anthropic's Messages API through the official `anthropic` Python package.

Usage: python3 tests/anthropic_messages.py BASE_URL MODEL
       (e.g. http://127.0.0.1:8080/v1 SmolLM2-135M-Instruct)

`messages.create` gives text content and usage; `messages.stream` gives
Anthropic's event grammar and a final message equal to the whole one
(greedy); a tool round trip (`tool_use`, then `tool_result`), streamed too;
`count_tokens` equals the prompt's input tokens; bad input is a 400 in
Anthropic's error shape. Run by tests/anthropic_messages.rs with
PYTHONPATH=.deps/py.
"""

import sys

import anthropic
import jsonschema
import pydantic

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# This SDK no longer has sampling arguments; the API still takes them.
GREEDY = {"temperature": 0}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def text_and_usage(client, model):
    args = dict(model=model, max_tokens=40, extra_body=GREEDY, system="Be brief.",
                messages=[{"role": "user", "content": "Name a colour."}])
    message = client.messages.create(**args)
    check(message.type == "message" and message.role == "assistant", f"shape {message!r}")
    check(message.content and message.content[0].type == "text" and message.content[0].text, f"content {message.content!r}")
    check(message.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {message.stop_reason}")
    u = message.usage
    check(u.output_tokens > 0, f"usage {u!r}")
    counted = client.messages.count_tokens(model=model, system=args["system"], messages=args["messages"])
    total = u.input_tokens + (u.cache_read_input_tokens or 0)
    check(counted.input_tokens == total, f"count_tokens {counted.input_tokens} vs usage {total}")
    return args, message


def stop_sequence(client, model, whole):
    """A stop sequence from the greedy answer ends it there and is named."""
    words = whole.content[0].text.split()
    check(len(words) >= 2, f"answer too short to cut: {whole.content!r}")
    cut = words[1]
    for stream in (False, True):
        args = dict(model=model, max_tokens=40, extra_body=GREEDY, system="Be brief.",
                    messages=[{"role": "user", "content": "Name a colour."}], stop_sequences=[cut])
        if stream:
            with client.messages.stream(**args) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**args)
        check(message.stop_reason == "stop_sequence" and message.stop_sequence == cut,
              f"stream {stream}: {message.stop_reason} {message.stop_sequence!r}, cut at {cut!r}")
        text = "".join(b.text for b in message.content if b.type == "text")
        check(cut not in text, f"stop sequence in the text: {text!r}")


def streamed_matches_whole(client, args, whole):
    kinds = []
    with client.messages.stream(**args) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    check(kinds[0] == "message_start", f"first event {kinds[:3]}")
    check(kinds[-1] == "message_stop", f"last event {kinds[-3:]}")
    check("message_delta" in kinds and "content_block_start" in kinds and "content_block_stop" in kinds, f"events {kinds}")
    check(kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta"), f"order {kinds}")
    check([b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content],
          f"stream {final.content!r} vs whole {whole.content!r}")
    check(final.stop_reason == whole.stop_reason, f"stop {final.stop_reason} vs {whole.stop_reason}")
    check(final.usage.output_tokens == whole.usage.output_tokens, f"usage {final.usage!r} vs {whole.usage!r}")


def tool_round_trip(client, model):
    args = dict(model=model, max_tokens=100, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"})
    message = client.messages.create(**args)
    uses = [b for b in message.content if b.type == "tool_use"]
    check(len(uses) == 1 and uses[0].name == "get_weather", f"tool_use {message.content!r}")
    check(uses[0].id.startswith("toolu_"), f"id {uses[0].id}")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    check(message.stop_reason == "tool_use", f"stop_reason {message.stop_reason}")
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    check([(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses], f"stream {streamed!r} vs {uses!r}")
    follow = client.messages.create(
        model=model, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
        messages=ASK + [
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C and sunny"}]},
        ],
    )
    check(all(b.type == "text" for b in follow.content) and follow.content, f"follow-up {follow.content!r}")
    any_call = client.messages.create(**{**args, "tool_choice": {"type": "any"}})
    check(any(b.type == "tool_use" for b in any_call.content), f"any gave {any_call.content!r}")


class Colour(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    warm: bool


def structured_output(client, model):
    """`messages.parse(output_format=...)`: constrained to the schema."""
    parsed = client.messages.parse(
        model=model, max_tokens=80, output_format=Colour, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Describe a colour as JSON."}],
    )
    check(isinstance(parsed.parsed_output, Colour), f"parsed {parsed.parsed_output!r} from {parsed.content!r}")


def bad_input(client, model):
    def rejected(status, **args):
        try:
            client.messages.create(**{"model": model, "max_tokens": 10, "messages": ASK, **args})
        except anthropic.APIStatusError as e:
            check(e.status_code == status, f"status {e.status_code}, expected {status}: {e.body}")
            check(e.body["type"] == "error" and e.body["error"]["type"] and e.body["error"]["message"], f"shape {e.body}")
            return e.body["error"]
        raise AssertionError(f"accepted: {args}")

    def raw_without_max_tokens():
        try:
            client.post("/v1/messages", body={"model": model, "messages": ASK}, cast_to=object)
        except anthropic.BadRequestError as e:
            check("max_tokens" in e.body["error"]["message"], f"message {e.body}")
            return
        raise AssertionError("accepted without max_tokens")

    raw_without_max_tokens()
    err = rejected(400, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    check(err["type"] == "invalid_request_error", f"{err}")
    rejected(400, messages=ASK + [{"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_missing", "content": "x"}]}])
    rejected(400, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_tide"})
    rejected(400, extra_body={"temperature": 1.5})
    err = rejected(400, output_config={"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}})
    check("output_config.format" in err["message"], f"{err}")
    # More text than the context holds: refused before any work.
    err = rejected(400, messages=[{"role": "user", "content": "lighthouse " * 60000}])
    check("context" in err["message"], f"{err}")
    err = rejected(404, model="no-such-model")
    check(err["type"] == "not_found_error", f"{err}")


def main(base_url, model):
    # The SDK appends /v1/messages itself.
    base_url = base_url.removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    args, whole = text_and_usage(client, model)
    print("text_and_usage: ok", flush=True)
    streamed_matches_whole(client, args, whole)
    print("streamed_matches_whole: ok", flush=True)
    stop_sequence(client, model, whole)
    print("stop_sequence: ok", flush=True)
    tool_round_trip(client, model)
    print("tool_round_trip: ok", flush=True)
    structured_output(client, model)
    print("structured_output: ok", flush=True)
    bad_input(client, model)
    print("bad_input: ok", flush=True)
    print("all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
