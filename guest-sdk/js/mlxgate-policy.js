// mlxgate policies in JavaScript: helpers over the WIT types that
// componentize-js maps to plain values. A policy is an ES module exporting
// the object of its kind (`datasetTransform`, `router` or
// `adapterSelector`), built into a component by guest-sdk/js/build.sh.
//
// Guests run sandboxed as Rust ones do: the build disables every WASI
// feature (no stdio, clock, randomness or network), and the gateway adds a
// memory cap, fuel and a deadline.

// ------------------------------------------------------------- datasets

/** Keep the record: an object (written as JSON) or JSON text. */
export function keep(record) {
  return { tag: 'keep', val: typeof record === 'string' ? record : JSON.stringify(record) };
}

/** Leave the record out on purpose, saying why. */
export function drop(reason) {
  return { tag: 'drop', val: String(reason) };
}

/** The record is invalid, saying why. */
export function error(reason) {
  return { tag: 'error', val: String(reason) };
}

// ------------------------------------------------------------- routers

const utf8 = new TextEncoder();
const text = new TextDecoder();

/**
 * A router's `route(facts, backends)` arguments as plain values: the facts'
 * strings arrive as byte spans (offset << 32 | length, BigInt) of one text.
 */
export function facts(raw, backends = []) {
  const s = spans(raw);
  const headers = {};
  for (const h of raw.headers) headers[s(h.name)] = s(h.value);
  return {
    facts: {
      method: s(raw.method),
      path: s(raw.path),
      model: s(raw.model),
      headers,
      apiKeyId: s(raw.apiKeyId) || null,
      tenant: s(raw.tenant) || null,
      promptTokens: raw.promptTokens,
      maxTokens: raw.maxTokens ?? null,
      streaming: raw.streaming,
    },
    backends: backends.map((b) => ({
      name: s(b.name),
      kind: b.kind,
      healthy: b.healthy,
      inFlight: b.inFlight,
      queueDepth: b.queueDepth,
    })),
  };
}

/**
 * An adapter selector's mounted adapters (`select(facts, adapters)`) as
 * plain values `{id, rank, scale, baseModel}`; their strings are spans of
 * the facts' text, so `raw` is the facts as passed.
 */
export function adapters(raw, infos) {
  const s = spans(raw);
  return infos.map((a) => ({ id: s(a.id), rank: a.rank, scale: a.scale, baseModel: s(a.baseModel) }));
}

/** Decodes spans (offset << 32 | length, BigInt) of the facts' one text. */
function spans(raw) {
  const bytes = utf8.encode(raw.text);
  return (span) => {
    const start = Number(BigInt(span) >> 32n);
    const length = Number(BigInt(span) & 0xffffffffn);
    return text.decode(bytes.subarray(start, start + length));
  };
}

/** Serve the request with the local model `model`. */
export function local(model) {
  return { tag: 'local', val: model };
}

/** Send the request to the configured upstream `name` (optionally as `model`). */
export function upstream(name, model) {
  return { tag: 'upstream', val: { name, model } };
}

/** Refuse the request with an HTTP status (400-599) and a message. */
export function reject(status, message) {
  return { tag: 'reject', val: { status, message } };
}
