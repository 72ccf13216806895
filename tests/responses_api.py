"""OpenAI's Responses API through the official `openai` Python package.

Usage: python3 tests/responses_api.py BASE_URL MODEL all
       python3 tests/responses_api.py BASE_URL MODEL store
       python3 tests/responses_api.py BASE_URL MODEL continue RESPONSE_ID

`all`: `responses.create(input=...)` gives `output_text` and usage; the
streamed events assemble to the same text (greedy); a function-tool round
trip through `previous_response_id`; `text.format` with a JSON Schema
validates; bad input is a 400/404 naming the field. `store` stores a
response and prints its id; `continue` (after a restart) continues it with
`previous_response_id`, reads it back with GET and deletes it. Run by
tests/responses_api.rs with PYTHONPATH=.deps/py.
"""

import json
import sys

import jsonschema
import openai

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def text_and_stream(client, model):
    args = dict(model=model, input="Name a colour.", instructions="Be brief.", max_output_tokens=30, temperature=0)
    whole = client.responses.create(**args)
    check(whole.object == "response" and whole.status in ("completed", "incomplete"), f"shape {whole!r}")
    check(whole.output_text, f"no output_text: {whole!r}")
    check(whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0, f"usage {whole.usage!r}")
    deltas, kinds = [], []
    for event in client.responses.create(stream=True, **args):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    check(kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), f"events {kinds}")
    check("".join(deltas) == whole.output_text, f"stream {''.join(deltas)!r} vs whole {whole.output_text!r}")
    check(final.output_text == whole.output_text, f"final {final.output_text!r}")
    with client.responses.stream(**args) as s:
        helper = s.get_final_response()
    check(helper.output_text == whole.output_text, f"stream helper {helper.output_text!r}")


def tool_round_trip(client, model):
    first = client.responses.create(
        model=model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather", f"output {first.output!r}")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with client.responses.stream(
        model=model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0,
    ) as s:
        streamed = s.get_final_response()
    scalls = [item for item in streamed.output if item.type == "function_call"]
    check([(c.name, json.loads(c.arguments)) for c in scalls] == [(c.name, json.loads(c.arguments)) for c in calls],
          f"streamed {scalls!r} vs {calls!r}")
    second = client.responses.create(
        model=model, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=60, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"}],
    )
    check(second.previous_response_id == first.id, f"previous {second.previous_response_id}")
    check(second.output_text and not [i for i in second.output if i.type == "function_call"], f"follow-up {second.output!r}")
    # The same turn sent whole, without a stored previous response.
    inline = client.responses.create(
        model=model, tools=[WEATHER], max_output_tokens=60, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"}],
    )
    check(inline.output_text == second.output_text, f"inline {inline.output_text!r} vs chained {second.output_text!r}")


def json_format(client, model):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}}, "required": ["colour"], "additionalProperties": False}
    r = client.responses.create(model=model, input="A colour as JSON.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def bad_input(client, model):
    def rejected(status, param, **args):
        try:
            client.responses.create(**{"model": model, "input": "hi", "max_output_tokens": 5, **args})
        except openai.APIStatusError as e:
            check(e.status_code == status, f"status {e.status_code}, expected {status}: {e.body}")
            got = e.body.get("param") if isinstance(e.body, dict) else None
            check(param is None or got == param, f"param {got!r}, expected {param!r}: {e.body}")
            return
        raise AssertionError(f"accepted: {args}")

    rejected(404, None, previous_response_id="resp_nope")
    rejected(400, "input[0].content[0].type", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    rejected(400, "input", input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    rejected(400, "tools[0].type", tools=[{"type": "web_search"}])
    rejected(400, "text.format.type", text={"format": {"type": "yaml"}})
    rejected(400, "max_output_tokens", max_output_tokens=0)
    rejected(400, "text.format", text={"format": {"type": "json_schema", "name": "x",
                                                  "schema": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}})
    # More text than the context holds: refused before any work.
    rejected(400, "input", input="lighthouse " * 60000)


def store(client, model):
    r = client.responses.create(model=model, input="Remember the word: lighthouse.", max_output_tokens=20, temperature=0)
    print(f"stored: {r.id}")


def continue_after_restart(client, model, rid):
    got = client.responses.retrieve(rid)
    check(got.id == rid and got.output_text, f"retrieve {got!r}")
    follow = client.responses.create(model=model, previous_response_id=rid, input="And once more?", max_output_tokens=20, temperature=0)
    check(follow.output_text and follow.usage.input_tokens > got.usage.input_tokens,
          f"continued with {follow.usage.input_tokens} input tokens, the first had {got.usage.input_tokens}")
    client.responses.delete(rid)
    try:
        client.responses.retrieve(rid)
    except openai.NotFoundError:
        return
    raise AssertionError("deleted response still readable")


def main(base_url, model, mode, *rest):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    if mode == "all":
        for step in (text_and_stream, tool_round_trip, json_format, bad_input):
            step(client, model)
            print(f"{step.__name__}: ok", flush=True)
    elif mode == "store":
        store(client, model)
    elif mode == "continue":
        continue_after_restart(client, model, rest[0])
    print("all checks passed")


if __name__ == "__main__":
    main(*sys.argv[1:])
