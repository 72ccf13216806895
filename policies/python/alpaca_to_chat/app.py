"""Alpaca to chat, in Python: the same policy as policies/alpaca-to-chat.

`{"instruction", "input", "output"}` records become
`{"messages": [{"role": "system"?}, {"role": "user"}, {"role": "assistant"}]}`;
the user turn is the instruction, then a blank line and the input when there
is one. Config `{"system": "..."}` adds a system turn. Records without an
instruction or an output, and malformed JSON, are errors.
"""

import json

from mlxgate_policy import error, keep

# The bindings may make a new DatasetTransform object for each call: state
# set by `init` lives in the module.
SYSTEM = None


class DatasetTransform:
    def init(self, config: str) -> None:
        global SYSTEM
        SYSTEM = json.loads(config).get("system") if config.strip() else None

    def transform(self, records):
        return [one(r) for r in records]


def one(text):
    try:
        rec = json.loads(text)
    except ValueError as e:
        return error(f"invalid JSON: {e}")
    if not isinstance(rec, dict):
        return error("invalid JSON: not an object")
    instruction = rec.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        return error("missing `instruction`")
    output = rec.get("output")
    if output is None:
        return error("missing `output`")
    inp = (rec.get("input") or "").strip()
    messages = [{"role": "system", "content": SYSTEM}] if SYSTEM else []
    messages.append({"role": "user", "content": f"{instruction}\n\n{inp}" if inp else instruction})
    messages.append({"role": "assistant", "content": output})
    return keep({"messages": messages})
