"""mlxgate policies in Python.

A policy is a module with a class named after its world's export
(`DatasetTransform`, `Router` or `AdapterSelector`), built into a
WebAssembly component by componentize-py against mlxgate's WIT
(guest-sdk/wit) with `guest-sdk/python/build.sh`. This module hides the
wire details the generated bindings (`wit_world`) expose: it turns a
router's facts (whose strings arrive as byte spans of one text) into plain
strings, and builds outcomes and decisions.

    from mlxgate_policy import keep, error

    class DatasetTransform:
        def init(self, config): ...
        def transform(self, records): return [keep(...) or error("why") ...]

The bindings may make a new object of that class for each call, so state
set by `init` belongs in module globals, not on `self`.

Guests run sandboxed as Rust ones do: no WASI (the build stubs it out: no
files, clock, randomness or network), a memory cap, fuel and a deadline.
"""

import json
from dataclasses import dataclass
from typing import Dict, List, Optional


# ---------------------------------------------------------------- config

def parse_config(config: str, policy: str, fields=None) -> dict:
    """An `init`'s config as a JSON object ({} when empty). A config that is
    not JSON, or (when `fields` is given) has a field not among them,
    refuses the upload with a message naming `policy`."""
    from componentize_py_types import Err

    try:
        cfg = json.loads(config) if config.strip() else {}
    except ValueError as e:
        raise Err(f"{policy} config: {e}")
    if not isinstance(cfg, dict):
        raise Err(f"{policy} config: not a JSON object")
    unknown = sorted(set(cfg) - set(fields)) if fields is not None else []
    if unknown:
        raise Err(f"{policy} config: unknown field `{unknown[0]}`")
    return cfg


# ---------------------------------------------------------------- datasets

def keep(record) -> "object":
    """Keep the record: a dict (written as compact JSON) or JSON text."""
    from wit_world.exports import dataset_transform as dt

    if not isinstance(record, str):
        record = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    return dt.RecordOutcome_Keep(record)


def drop(reason: str) -> "object":
    """Leave the record out on purpose, saying why."""
    from wit_world.exports import dataset_transform as dt

    return dt.RecordOutcome_Drop(reason)


def error(reason: str) -> "object":
    """The record is invalid, saying why."""
    from wit_world.exports import dataset_transform as dt

    return dt.RecordOutcome_Error(reason)


# ---------------------------------------------------------------- routers

@dataclass
class Facts:
    """What a router knows of a request, as plain strings."""

    method: str
    path: str
    model: str
    headers: Dict[str, str]
    api_key_id: Optional[str]
    tenant: Optional[str]
    prompt_tokens: int
    max_tokens: Optional[int]
    streaming: bool


@dataclass
class Backend:
    name: str
    kind: str
    healthy: bool
    in_flight: int
    queue_depth: int


@dataclass
class Adapter:
    """A LoRA adapter mounted on a local base model."""

    id: str
    rank: int
    scale: float
    base_model: str


def _spans(raw):
    """Decodes spans (offset << 32 | length) of the facts' one text."""
    text = raw.text.encode("utf-8")

    def s(span: int) -> str:
        start, length = span >> 32, span & 0xFFFFFFFF
        return text[start:start + length].decode("utf-8", "replace")

    return s


def facts(raw, backends=()) -> "tuple[Facts, List[Backend]]":
    """A router's `route(facts, backends)` arguments as plain values."""
    s = _spans(raw)
    f = Facts(
        method=s(raw.method),
        path=s(raw.path),
        model=s(raw.model),
        headers={s(h.name): s(h.value) for h in raw.headers},
        api_key_id=s(raw.api_key_id) or None,
        tenant=s(raw.tenant) or None,
        prompt_tokens=raw.prompt_tokens,
        max_tokens=raw.max_tokens,
        streaming=raw.streaming,
    )
    bs = [
        Backend(s(b.name), b.kind.name.lower(), b.healthy, b.in_flight, b.queue_depth)
        for b in backends
    ]
    return f, bs


def adapters(raw, infos) -> "List[Adapter]":
    """An adapter selector's mounted adapters (`select(facts, adapters)`) as
    plain values; their strings are spans of the facts' text, so `raw` is
    the facts as passed."""
    s = _spans(raw)
    return [Adapter(s(a.id), a.rank, a.scale, s(a.base_model)) for a in infos]


def local(model: str):
    """Serve the request with the local model `model`."""
    from wit_world.exports import router

    return router.RouteDecision_Local(model)


def upstream(name: str, model: Optional[str] = None):
    """Send the request to the configured upstream `name` (optionally as `model`)."""
    from wit_world.exports import router

    return router.RouteDecision_Upstream(router.UpstreamTarget(name, model))


def reject(status: int, message: str):
    """Refuse the request with an HTTP status (400-599) and a message."""
    from wit_world.exports import router

    return router.RouteDecision_Reject(router.Rejection(status, message))


def set_priority(klass: int) -> None:
    """The request's priority class while it waits for a local model."""
    from wit_world.imports import request_control

    request_control.set_priority(klass)
