"""Adapter selection by tenant, in Python: the same policy as
policies/adapter-by-tenant.

Each tenant gets its configured LoRA adapters, in order, among those mounted
on the requested base model. Config:

    {"tenants": {"acme": ["acme-sql", "acme-tone"]}, "default": []}

Unknown tenant: `default` when set, otherwise no opinion (None).
"""

from mlxgate_policy import adapters, facts, parse_config

# The bindings may make a new AdapterSelector object for each call: the
# config set by `init` lives in the module.
CONFIG = {}


class AdapterSelector:
    def init(self, config: str) -> None:
        global CONFIG
        CONFIG = parse_config(config, "adapter-by-tenant", {"tenants", "default"})

    def select(self, raw, infos):
        f, _ = facts(raw)
        wanted = CONFIG.get("tenants", {}).get(f.tenant) if f.tenant else None
        if wanted is None:
            wanted = CONFIG.get("default")
        if wanted is None:
            return None
        mounted = {(a.id, a.base_model) for a in adapters(raw, infos)}
        return [w for w in wanted if (w, f.model) in mounted]
