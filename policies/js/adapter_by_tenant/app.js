// Adapter selection by tenant, in JavaScript: the same policy as
// policies/adapter-by-tenant.
//
// Each tenant gets its configured LoRA adapters, in order, among those
// mounted on the requested base model. Config:
// {"tenants": {"acme": ["acme-sql", "acme-tone"]}, "default": []}.
// Unknown tenant: `default` when set, otherwise no opinion (undefined).

import { adapters, facts } from './mlxgate-policy.js';

let config = {};

export const adapterSelector = {
  init(text) {
    const cfg = text.trim() ? JSON.parse(text) : {};
    const unknown = Object.keys(cfg).filter((k) => k !== 'tenants' && k !== 'default');
    if (unknown.length) throw `adapter-by-tenant config: unknown field \`${unknown[0]}\``;
    config = cfg;
  },
  select(raw, infos) {
    const { facts: f } = facts(raw);
    const wanted = (f.tenant && (config.tenants ?? {})[f.tenant]) ?? config.default;
    if (wanted === undefined) return undefined;
    const mounted = adapters(raw, infos);
    return wanted.filter((id) => mounted.some((a) => a.id === id && a.baseModel === f.model));
  },
};
