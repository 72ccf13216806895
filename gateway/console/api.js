// The console's only door to the gateway: fetch with the key, the API's
// error shape turned into one exception type, and server-sent events read
// from a fetch body (EventSource cannot send an Authorization header).

const KEY_STORE = 'mlxgate.console.key';

/** The API key of this tab (sessionStorage: gone when the tab closes). */
export function getKey() {
  try {
    return sessionStorage.getItem(KEY_STORE) || '';
  } catch {
    return '';
  }
}

export function setKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
  } catch {
    // Storage disabled: the key lives only as long as the page.
  }
}

/** An API refusal or a network failure, with the gateway's own words. */
export class ApiError extends Error {
  constructor(status, message, { type = null, code = null, param = null } = {}) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = param;
  }
}

/** Builds an ApiError from an error answer: OpenAI's shape, Anthropic's, or text. */
export async function errorFrom(res) {
  let text = '';
  try {
    text = await res.text();
  } catch {
    // The body broke off: the status is all there is.
  }
  let body = null;
  try {
    body = JSON.parse(text);
  } catch {
    // Not JSON (a proxy's page, plain text): shown as it is.
  }
  const e = body && typeof body === 'object' ? body.error : null;
  if (e && typeof e === 'object') {
    return new ApiError(res.status, e.message || `HTTP ${res.status}`, e);
  }
  if (typeof e === 'string') return new ApiError(res.status, e);
  const msg = text.trim() ? text.trim().slice(0, 500) : `HTTP ${res.status} ${res.statusText}`;
  return new ApiError(res.status, msg);
}

/**
 * One API call. `json` is sent as a JSON body, `body` as it is. Answers
 * JSON (or text, or the Response itself with `raw`); throws ApiError.
 * `key` overrides the stored key (sign-in checks a key before storing it).
 */
export async function api(path, { method = 'GET', json, body, headers = {}, signal, key, raw = false } = {}) {
  const h = { accept: 'application/json', ...headers };
  const k = key === undefined ? getKey() : key;
  if (k) h.authorization = `Bearer ${k}`;
  if (json !== undefined) {
    h['content-type'] = 'application/json';
    body = JSON.stringify(json);
  }
  let res;
  try {
    res = await fetch(path, { method, headers: h, body, signal, cache: 'no-store' });
  } catch (err) {
    if (err && err.name === 'AbortError') throw err;
    throw new ApiError(0, `The gateway could not be reached (${err && err.message ? err.message : err}).`);
  }
  if (!res.ok) {
    const e = await errorFrom(res);
    // A key that stopped working mid-session (revoked, server restarted
    // with other keys): the app signs out and says why.
    if (res.status === 401 && key === undefined && k) {
      window.dispatchEvent(new CustomEvent('mlxgate:unauthorized', { detail: e.message }));
    }
    throw e;
  }
  if (raw) return res;
  const ct = res.headers.get('content-type') || '';
  return ct.includes('json') ? res.json() : res.text();
}

/**
 * Reads server-sent events from a fetch Response, yielding
 * `{id, event, data}` per message; comments (keep-alives) are skipped.
 * Follows the WHATWG parsing rules for the fields the gateway uses.
 */
export async function* readSSE(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  let msg = { id: null, event: 'message', data: [] };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.search(/\r\n|\r|\n/)) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + (buf[nl] === '\r' && buf[nl + 1] === '\n' ? 2 : 1));
        if (line === '') {
          if (msg.data.length) yield { id: msg.id, event: msg.event, data: msg.data.join('\n') };
          msg = { id: msg.id, event: 'message', data: [] };
          continue;
        }
        if (line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val.startsWith(' ')) val = val.slice(1);
        if (field === 'data') msg.data.push(val);
        else if (field === 'id') msg.id = val;
        else if (field === 'event') msg.event = val;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

/** A POST whose answer is an SSE stream (chat with `stream: true`). */
export async function postStream(path, json, { signal } = {}) {
  return api(path, {
    method: 'POST',
    json,
    signal,
    raw: true,
    headers: { accept: 'text/event-stream' },
  });
}

/** Prometheus text from /metrics (the admin key lets non-loopback clients scrape). */
export function fetchMetrics(signal) {
  return api('/metrics', { headers: { accept: 'text/plain' }, signal });
}
