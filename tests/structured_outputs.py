"""Structured outputs through the official `openai` Python package.

Usage: python3 tests/structured_outputs.py BASE_URL [SEEDS]
       (e.g. http://127.0.0.1:8080/v1 2)

Sends 30 JSON Schemas (nested objects, arrays, enums, anyOf, bounded
numbers, optional fields, string patterns) as `response_format`, each with
SEEDS seeds (default 1), whole and streamed, 8 requests at a time with
unconstrained requests mixed in, and checks every answer with the
`jsonschema` package; then the SDK's `parse()` and `stream()` helpers with a
Pydantic model, and `regex` / `lark` / `json_object` formats. Exits non-zero
on the first failure. Run by tests/openai_structured_outputs.rs with
PYTHONPATH=.deps/py.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, List, Literal, Optional

import jsonschema
import openai
import pydantic


def obj(properties, required=None, **extra):
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }
    schema.update(extra)
    return schema


STR = {"type": "string", "maxLength": 40}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}

# (what to ask for, schema)
SCHEMAS = [
    ("a person", obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city and its country", obj({"city": STR, "country": STR})),
    ("a yes or no answer to: is the sky blue?", obj({"answer": BOOL})),
    ("a temperature reading", obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60}})),
    ("a traffic light state", obj({"color": {"enum": ["red", "yellow", "green"]}})),
    ("a book", obj({"title": STR, "author": STR, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a list of three fruits", obj({"fruits": {"type": "array", "items": STR, "minItems": 3, "maxItems": 3}})),
    ("a point in 2D", obj({"x": NUM, "y": NUM})),
    ("a US zip code", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("an email contact", obj({"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}})),
    ("a product with an optional discount", obj({"name": STR, "price": {"type": "number", "minimum": 0}, "discount": {"type": "number", "minimum": 0, "maximum": 1}}, required=["name", "price"])),
    ("an address", obj({"street": STR, "number": {"type": "integer", "minimum": 1, "maximum": 9999}, "city": STR})),
    ("a user with an address", obj({"user": STR, "address": obj({"city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("a shape: a circle or a square", obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}}), obj({"kind": {"const": "square"}, "side": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}})]}})),
    ("an id that is a number or a string", obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100000}, {"type": "string", "maxLength": 12}]}})),
    ("a weekday", obj({"day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]}})),
    ("scores of two players", obj({"scores": {"type": "array", "items": obj({"player": STR, "score": {"type": "integer", "minimum": 0, "maximum": 100}}), "minItems": 2, "maxItems": 2}})),
    ("a date", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}})),
    ("a rating from 1 to 5 with a short comment", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": STR})),
    ("the tags of a blog post", obj({"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,10}$"}, "minItems": 1, "maxItems": 4}})),
    ("a matrix of two rows of two integers", obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}})),
    ("a flag and an optional note", obj({"flag": BOOL, "note": {"anyOf": [STR, {"type": "null"}]}})),
    ("a percentage", obj({"percent": {"type": "number", "minimum": 0, "maximum": 100}})),
    ("a hex color", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a version number", obj({"major": {"type": "integer", "minimum": 0, "maximum": 99}, "minor": {"type": "integer", "minimum": 0, "maximum": 99}, "patch": {"type": "integer", "minimum": 0, "maximum": 99}})),
    ("an order with items", obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999}, "items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}), "minItems": 1, "maxItems": 3}})),
    ("a status", obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}})),
    ("a nested config", obj({"server": obj({"host": STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}), "debug": BOOL})),
    ("an animal and its legs", {"$defs": {"animal": obj({"name": STR, "legs": {"type": "integer", "minimum": 0, "maximum": 8}})}, **obj({"animal": {"$ref": "#/$defs/animal"}})}),
    ("a list of numbers between 0 and 1", obj({"values": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 5}})),
]
assert len(SCHEMAS) == 30


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def request(client, model, what, schema, seed, stream):
    """One constrained answer, validated; returns its text."""
    args = dict(
        model=model,
        messages=[{"role": "user", "content": f"Answer in JSON with {what}."}],
        max_tokens=300,
        temperature=0.8,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    if stream:
        parts, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        text = "".join(parts)
    else:
        answer = client.chat.completions.create(**args)
        text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
    where = f"{what!r} seed {seed} stream {stream}: {text!r}"
    check(finish == "stop", f"finish_reason {finish} for {where}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"not JSON ({e}) for {where}")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"invalid ({e.message}) for {where}")
    return text


def free(client, model, seed):
    """An unconstrained request sharing the batch."""
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=40,
        temperature=0.8,
        seed=seed,
    )
    check(answer.choices[0].message.content, "empty free answer")


Short = Annotated[str, pydantic.Field(max_length=20)]


class Pet(pydantic.BaseModel):
    """Every string bounded: a 135M model sampling at temperature 1 writes
    strings of any length, and the answer must fit `max_tokens`."""

    name: Short
    kind: Literal["cat", "dog", "bird"]
    age: int = pydantic.Field(ge=0, le=30)
    toys: List[Short] = pydantic.Field(max_length=3)
    owner: Optional[Short] = None


def sdk_helpers(client, model):
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    parsed = client.chat.completions.parse(
        model=model, messages=messages, response_format=Pet, max_tokens=300, seed=3
    )
    pet = parsed.choices[0].message.parsed
    check(isinstance(pet, Pet), f"parse() gave {pet!r}")
    with client.chat.completions.stream(
        model=model, messages=messages, response_format=Pet, max_tokens=300, seed=3
    ) as s:
        final = s.get_final_completion()
    streamed = final.choices[0].message.parsed
    check(streamed == pet, f"stream() gave {streamed!r}, parse() {pet!r}")


def other_formats(client, model):
    def text(fmt, content="Say something."):
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=300,
            temperature=0.8,
            seed=5,
            response_format=fmt,
        )
        choice = answer.choices[0]
        check(choice.finish_reason == "stop", f"{fmt} stopped by {choice.finish_reason}: {choice.message.content!r}")
        return choice.message.content

    phone = text({"type": "regex", "regex": r"\(\d{3}\) \d{3}-\d{4}"}, "A phone number?")
    check(len(phone) == 14 and phone[0] == "(", f"regex gave {phone!r}")
    yes_no = text({"type": "lark", "lark": 'start: "yes" | "no"'}, "Is water wet?")
    check(yes_no in ("yes", "no"), f"lark gave {yes_no!r}")
    value = json.loads(text({"type": "json_object"}, "Give me a small JSON object."))
    check(isinstance(value, dict), f"json_object gave {value!r}")
    try:
        text({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
        raise AssertionError("a broken schema was accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == "response_format", f"error names {e.body}")


def main(base_url, seeds):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    jobs = [
        (what, schema, seed, stream)
        for seed in range(1, seeds + 1)
        for i, (what, schema) in enumerate(SCHEMAS)
        for stream in ((False, True) if seeds > 1 else ((i % 2) == 1,))
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(request, client, model, *job) for job in jobs]
        futures += [pool.submit(free, client, model, seed) for seed in range(4)]
        for f in futures:
            f.result()
    print(f"{len(jobs)} constrained answers valid")
    sdk_helpers(client, model)
    other_formats(client, model)
    print("all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
