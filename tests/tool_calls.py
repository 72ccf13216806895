"""Tool calling through the official `openai` Python package.

Usage: python3 tests/tool_calls.py BASE_URL MODEL
       (e.g. http://127.0.0.1:8080/v1 SmolLM2-135M-Instruct)

Against a weather-style tool: `required` and a named tool always give a
call whose JSON arguments parse and validate (`jsonschema`), alone, with
parallel calls, with n=2 and 8 at a time beside free requests; `auto` gives
text or valid calls; `none` gives text; a follow-up turn carrying the call
and a `tool` message gives text; the SDK's stream helper reassembles
streamed `delta.tool_calls` into the same call as the whole answer; a
Pydantic tool (`openai.pydantic_function_tool`) parses with `parse()`; bad
tools, choices, tool messages and `n` are 400s naming the field. Run by
tests/openai_tool_calls.rs with PYTHONPATH=.deps/py.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Za-z_/]{1,30}$"}},
    "required": ["timezone"],
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME_PARAMS},
}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def valid_calls(message, where, names=("get_weather", "get_time")):
    """Every call names a listed tool and its arguments validate; returns
    them as (name, arguments) pairs."""
    calls = message.tool_calls or []
    check(calls, f"no tool calls for {where}: {message!r}")
    out = []
    for call in calls:
        check(call.type == "function" and call.id.startswith("call_"), f"call shape {call!r} for {where}")
        name = call.function.name
        check(name in names, f"called {name!r} for {where}")
        try:
            args = json.loads(call.function.arguments)
        except json.JSONDecodeError as e:
            raise AssertionError(f"arguments not JSON ({e}) for {where}: {call.function.arguments!r}")
        try:
            jsonschema.validate(args, SCHEMAS[name])
        except jsonschema.ValidationError as e:
            raise AssertionError(f"arguments invalid ({e.message}) for {where}: {args!r}")
        out.append((name, args))
    return out


def create(client, model, **args):
    base = dict(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=0)
    base.update(args)
    return client.chat.completions.create(**base)


def forced_calls(client, model):
    # `required`, one call: a valid call and finish_reason tool_calls.
    answer = create(client, model, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    valid_calls(choice.message, "required")
    check(len(choice.message.tool_calls) == 1, f"one call asked, got {choice.message.tool_calls!r}")
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
    check(choice.message.content is None, f"content beside calls: {choice.message.content!r}")
    # A named tool: exactly that one.
    named = create(client, model, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = valid_calls(named.choices[0].message, "named get_time", names=("get_time",))
    check(len(calls) == 1, f"named tool called {len(calls)} times")
    # Parallel calls allowed, sampled, n=2: each choice's calls all valid.
    both = create(client, model, tool_choice="required", n=2, temperature=0.9, seed=7)
    check(len(both.choices) == 2, "n=2 gave one choice")
    for c in both.choices:
        valid_calls(c.message, f"n=2 choice {c.index}")


def auto_and_none(client, model):
    auto = create(client, model).choices[0]
    if auto.message.tool_calls:
        valid_calls(auto.message, "auto")
        check(auto.finish_reason in ("tool_calls", "length"), f"auto finish {auto.finish_reason}")
    else:
        check(auto.message.content, f"auto gave neither text nor calls: {auto!r}")
    none = create(client, model, tool_choice="none").choices[0]
    check(not none.message.tool_calls, f"tool_choice none made calls: {none.message.tool_calls!r}")
    check(none.message.content, "tool_choice none gave no text")
    check(none.finish_reason in ("stop", "length"), f"none finish {none.finish_reason}")


def follow_up(client, model):
    """The call and its result in the history: the model answers in text."""
    first = create(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
    ]
    answer = create(client, model, messages=messages, tool_choice="auto").choices[0]
    check(not answer.message.tool_calls, f"follow-up made calls: {answer.message.tool_calls!r}")
    check(answer.message.content and answer.finish_reason in ("stop", "length"), f"follow-up: {answer!r}")


def streamed_matches_whole(client, model):
    args = dict(tool_choice="required", parallel_tool_calls=False)
    whole = create(client, model, **args).choices[0].message.tool_calls
    with client.chat.completions.stream(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=0, **args
    ) as s:
        final = s.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    check(final.choices[0].finish_reason == "tool_calls", f"stream finish {final.choices[0].finish_reason}")
    pairs = lambda calls: [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    check(pairs(streamed) == pairs(whole), f"stream gave {pairs(streamed)}, whole {pairs(whole)}")
    # The raw chunks: the head (id, name) before the arguments, by index.
    heads, arguments = {}, {}
    for chunk in create(client, model, stream=True, **args):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.id:
                    check(d.index not in heads, f"second head for call {d.index}")
                    heads[d.index] = (d.id, d.function.name)
                check(d.index in heads, f"arguments before the head of call {d.index}")
                arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    check(sorted(heads) == list(range(len(whole))), f"stream call indexes {sorted(heads)}")
    check(json.loads(arguments[0]) == json.loads(whole[0].function.arguments), "raw stream arguments differ")


class GetWeather(pydantic.BaseModel):
    """Get the current weather in a city."""

    city: str = pydantic.Field(max_length=40)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def pydantic_tool(client, model):
    parsed = client.chat.completions.parse(
        model=model,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    call = parsed.choices[0].message.tool_calls[0]
    check(isinstance(call.function.parsed_arguments, GetWeather), f"parsed {call.function.parsed_arguments!r}")


def under_load(client, model):
    def one(i):
        if i % 3 == 2:
            free = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=40, seed=i
            )
            check(free.choices[0].message.content, "empty free answer")
        else:
            answer = create(client, model, tool_choice="required", temperature=0.9, seed=i, stream=False)
            valid_calls(answer.choices[0].message, f"concurrent request {i}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(16)))


def bad_input(client, model):
    def rejected(param, **args):
        try:
            create(client, model, **args)
        except openai.BadRequestError as e:
            got = e.body.get("param") if isinstance(e.body, dict) else None
            check(got == param, f"400 names {got!r}, expected {param!r}: {e.body}")
            return
        raise AssertionError(f"accepted: {args}")

    rejected("tool_choice.function.name", tool_choice={"type": "function", "function": {"name": "get_tide"}})
    rejected("tool_choice", tool_choice="sometimes")
    rejected("tools[0].function.name", tools=[{"type": "function", "function": {"name": "get weather"}}])
    rejected("tools", tool_choice="required",
             tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}])
    rejected("messages[1].tool_call_id",
             messages=ASK + [{"role": "tool", "tool_call_id": "call_missing", "content": "sunny"}])
    rejected("n", n=9, tool_choice="required")


def main(base_url, model):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    for step in (forced_calls, auto_and_none, follow_up, streamed_matches_whole, pydantic_tool, under_load, bad_input):
        step(client, model)
        print(f"{step.__name__}: ok", flush=True)
    print("all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
