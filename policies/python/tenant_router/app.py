"""Tenant router, in Python: the same policy as policies/tenant-router.

Sends each tenant to its own local model or upstream and enforces a
per-tenant deny list of requested models. The tenant comes from the API key;
only when the key has none is the configured header consulted. Config:

    {"header": "x-tenant",
     "tenants": {"acme": {"local": "llama-3-8b", "deny": ["gpt-4o"], "priority": 1},
                 "globex": {"upstream": "openai", "model": "gpt-4o-mini"}},
     "unknown": "reject"}

`unknown` is "reject" (403) or "pass" (serve the requested model locally).
"""

from componentize_py_types import Err
from mlxgate_policy import facts, local, parse_config, reject, set_priority, upstream
from wit_world.imports.types import FactSet


# The bindings may make a new Router object for each call: the config set
# by `init` lives in the module.
CONFIG = {}


class Router:
    def init(self, config: str) -> None:
        global CONFIG
        cfg = parse_config(config, "tenant-router")
        for name, t in cfg.get("tenants", {}).items():
            if "local" in t and "upstream" in t:
                raise Err(f"tenant `{name}`: set `local` or `upstream`, not both")
        CONFIG = cfg

    def route(self, raw, backends):
        f, _ = facts(raw)
        name = f.tenant or f.headers.get(CONFIG.get("header", "x-tenant"))
        t = CONFIG.get("tenants", {}).get(name)
        if t is None:
            unknown = CONFIG.get("unknown", "reject")
            return local(f.model) if unknown == "pass" else reject(403, "unknown tenant")
        if f.model in t.get("deny", []):
            return reject(403, f"model `{f.model}` is not allowed for this tenant")
        if t.get("priority"):
            set_priority(t["priority"])
        if "local" in t:
            return local(t["local"])
        if "upstream" in t:
            return upstream(t["upstream"], t.get("model"))
        return local(f.model)

    def decision_inputs(self):
        # Decisions follow from the tenant (key or header) and the model alone.
        return FactSet.TENANT | FactSet.HEADERS | FactSet.MODEL
