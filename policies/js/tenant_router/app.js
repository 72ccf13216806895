// Tenant router, in JavaScript: the same policy as policies/tenant-router.
//
// Sends each tenant to its own local model or upstream and enforces a
// per-tenant deny list of requested models. The tenant comes from the API
// key; only when the key has none is the configured header consulted.
// Config: {"header": "x-tenant", "tenants": {"acme": {"local": "llama-3-8b",
// "deny": ["gpt-4o"], "priority": 1}, "globex": {"upstream": "openai",
// "model": "gpt-4o-mini"}}, "unknown": "reject"}; `unknown` is "reject"
// (403) or "pass" (serve the requested model locally).

import { setPriority } from 'mlxgate:policy/request-control@0.3.3';
import { facts, local, reject, upstream } from './mlxgate-policy.js';

let config = {};

export const router = {
  init(text) {
    const cfg = text.trim() ? JSON.parse(text) : {};
    for (const [name, t] of Object.entries(cfg.tenants ?? {})) {
      if ('local' in t && 'upstream' in t) {
        throw `tenant \`${name}\`: set \`local\` or \`upstream\`, not both`;
      }
    }
    config = cfg;
  },
  route(raw, backends) {
    const { facts: f } = facts(raw, backends);
    const t = (config.tenants ?? {})[f.tenant ?? f.headers[config.header ?? 'x-tenant']];
    if (t === undefined) {
      return (config.unknown ?? 'reject') === 'pass' ? local(f.model) : reject(403, 'unknown tenant');
    }
    if ((t.deny ?? []).includes(f.model)) {
      return reject(403, `model \`${f.model}\` is not allowed for this tenant`);
    }
    if (t.priority) setPriority(t.priority);
    if (t.local) return local(t.local);
    if (t.upstream) return upstream(t.upstream, t.model);
    return local(f.model);
  },
  // Decisions follow from the tenant (key or header) and the model alone.
  decisionInputs() {
    return { tenant: true, headers: true, model: true };
  },
};
