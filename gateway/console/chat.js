// Chat playground: a streamed OpenAI chat completion with the gateway's own
// fields (adapter, prompt_cache), multi-turn, stoppable, with usage and
// speed, and the same request as curl or Python to take away.

import { useEffect, useMemo, useRef, useState } from 'preact/hooks';
import { api, postStream, readSSE, ApiError } from './api.js';
import { html, Card, ErrorBanner, Field, copyText, fmtNum } from './ui.js';

/** Models that answer chat: local ones saying so, and upstream ones (no capabilities listed). */
function chatModels(list) {
  return (list || []).filter((m) => !Array.isArray(m.capabilities) || m.capabilities.includes('chat.completions'));
}

/** Turns the form into the request body; `draft` is the not yet sent user turn. */
function buildBody(s, history, draft) {
  const messages = [];
  if (s.system.trim()) messages.push({ role: 'system', content: s.system });
  for (const m of history) {
    if (m.role === 'user' || (m.role === 'assistant' && !m.error)) messages.push({ role: m.role, content: m.content });
  }
  if (draft && draft.trim()) messages.push({ role: 'user', content: draft });
  const body = { model: s.model, messages };
  const num = (v) => (v === '' || v == null ? undefined : Number(v));
  if (num(s.temperature) !== undefined) body.temperature = num(s.temperature);
  if (num(s.top_p) !== undefined) body.top_p = num(s.top_p);
  if (num(s.max_tokens) !== undefined) body.max_tokens = num(s.max_tokens);
  if (num(s.seed) !== undefined) body.seed = num(s.seed);
  if (s.adapter) body.adapter = s.adapter;
  if (s.prompt_cache) body.prompt_cache = s.prompt_cache;
  if (s.ignore_eos) body.ignore_eos = true;
  body.stream = true;
  body.stream_options = { include_usage: true };
  return body;
}

function validate(s) {
  const errors = {};
  const check = (k, lo, hi, int) => {
    if (s[k] === '' || s[k] == null) return;
    const v = Number(s[k]);
    if (!Number.isFinite(v) || (int && !Number.isInteger(v)) || v < lo || v > hi) {
      errors[k] = `${int ? 'an integer' : 'a number'} in ${lo}..${hi}`;
    }
  };
  check('temperature', 0, 2, false);
  check('top_p', 0, 1, false);
  check('max_tokens', 1, 1000000, true);
  check('seed', 0, Number.MAX_SAFE_INTEGER, true);
  if (!s.model) errors.model = 'pick a model';
  return errors;
}

function shellQuote(s) {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

function curlOf(body) {
  return [
    `curl -sN ${location.origin}/v1/chat/completions \\`,
    `  -H "Authorization: Bearer $MLXGATE_API_KEY" \\`,
    `  -H 'Content-Type: application/json' \\`,
    `  -d ${shellQuote(JSON.stringify(body, null, 2))}`,
  ].join('\n');
}

/** Python literal of a JSON value (True/False/None). */
function py(v, indent = '') {
  if (v === null || v === undefined) return 'None';
  if (v === true) return 'True';
  if (v === false) return 'False';
  if (typeof v === 'number') return String(v);
  if (typeof v === 'string') return JSON.stringify(v);
  const inner = `${indent}    `;
  if (Array.isArray(v)) {
    if (!v.length) return '[]';
    return `[\n${v.map((x) => inner + py(x, inner)).join(',\n')},\n${indent}]`;
  }
  const keys = Object.keys(v);
  if (!keys.length) return '{}';
  return `{${keys.map((k) => `${JSON.stringify(k)}: ${py(v[k], indent)}`).join(', ')}}`;
}

function pythonOf(body) {
  const { model, messages, stream, stream_options, adapter, prompt_cache, ignore_eos, ...params } = body;
  const extra = {};
  if (adapter) extra.adapter = adapter;
  if (prompt_cache) extra.prompt_cache = prompt_cache;
  if (ignore_eos) extra.ignore_eos = true;
  const lines = [
    'import os',
    'from openai import OpenAI',
    '',
    `client = OpenAI(base_url=${JSON.stringify(`${location.origin}/v1`)}, api_key=os.environ["MLXGATE_API_KEY"])`,
    'stream = client.chat.completions.create(',
    `    model=${JSON.stringify(model)},`,
    `    messages=${py(messages, '    ')},`,
    ...Object.entries(params).map(([k, v]) => `    ${k}=${py(v)},`),
    ...(Object.keys(extra).length ? [`    extra_body=${py(extra)},`] : []),
    '    stream=True,',
    '    stream_options={"include_usage": True},',
    ')',
    'for chunk in stream:',
    '    if chunk.choices and chunk.choices[0].delta.content:',
    '        print(chunk.choices[0].delta.content, end="", flush=True)',
    '    if chunk.usage:',
    '        print("\\n", chunk.usage)',
  ];
  return lines.join('\n');
}

function Message({ m, last }) {
  const cls = `turn ${m.role}${m.streaming ? ' streaming' : ''}`;
  const testid = m.role === 'assistant' ? 'chat-msg-assistant' : 'chat-msg-user';
  return html`<div class=${cls} data-testid=${testid} data-streaming=${m.streaming ? 'true' : 'false'}
      data-stopped=${m.stopped ? 'true' : 'false'} data-chunks=${m.chunks || 0} data-last=${last ? 'true' : 'false'}>
    <div class="role"><span>${m.role}</span>
      ${m.model ? html`<span>${m.model}${m.adapter ? ` + ${m.adapter}` : ''}</span>` : null}
      ${m.stopped ? html`<span class="badge warn" data-testid="chat-stopped">stopped</span>` : null}
      ${m.finish ? html`<span class="badge">${m.finish}</span>` : null}
    </div>
    <div class="text" data-testid=${m.role === 'assistant' ? 'chat-answer-text' : null}>${m.content}</div>
    ${m.error ? html`<${ErrorBanner} error=${m.error} testid="chat-error" />` : null}
    ${m.stats ? html`<div class="usage" data-testid="chat-usage">${m.stats}</div>` : null}
  </div>`;
}

export function ChatPage() {
  const [models, setModels] = useState([]);
  const [adapters, setAdapters] = useState([]);
  const [caches, setCaches] = useState([]);
  const [loadError, setLoadError] = useState(null);
  const [s, setS] = useState({
    model: '',
    adapter: '',
    prompt_cache: '',
    system: '',
    temperature: '0.7',
    top_p: '',
    max_tokens: '256',
    seed: '',
    ignore_eos: false,
  });
  const [draft, setDraft] = useState('');
  const [history, setHistory] = useState([]);
  const [busy, setBusy] = useState(false);
  const [snippet, setSnippet] = useState(null);
  const ctl = useRef(null);
  const convo = useRef(null);

  async function loadLists() {
    try {
      const [m, a, c] = await Promise.all([
        api('/v1/models'),
        api('/v1/adapters').catch(() => ({ data: [] })),
        api('/v1/prompt_caches').catch(() => ({ data: [] })),
      ]);
      const cm = chatModels(m.data);
      setModels(cm);
      setAdapters(a.data || []);
      setCaches(c.data || []);
      setS((x) => (x.model && cm.some((mm) => mm.id === x.model) ? x : { ...x, model: cm[0] ? cm[0].id : '' }));
      setLoadError(null);
    } catch (err) {
      setLoadError(err);
    }
  }

  useEffect(() => {
    loadLists();
    return () => ctl.current && ctl.current.abort();
  }, []);

  useEffect(() => {
    if (convo.current) convo.current.scrollTop = convo.current.scrollHeight;
  }, [history]);

  const errors = useMemo(() => validate(s), [s]);
  const set = (k) => (e) => {
    const t = e.currentTarget;
    setS((x) => ({ ...x, [k]: t.type === 'checkbox' ? t.checked : t.value }));
  };
  const modelAdapters = adapters.filter((a) => a.model === s.model);
  const modelCaches = caches.filter((c) => !c.model || c.model === s.model);

  function update(idx, patch) {
    setHistory((h) => h.map((m, i) => (i === idx ? { ...m, ...patch } : m)));
  }

  async function send() {
    if (busy || !draft.trim() || Object.keys(errors).length) return;
    const body = buildBody(s, history, draft);
    const base = [...history, { role: 'user', content: draft }];
    const idx = base.length;
    setHistory([...base, { role: 'assistant', content: '', streaming: true, chunks: 0, model: s.model, adapter: s.adapter }]);
    setDraft('');
    setBusy(true);
    const c = new AbortController();
    ctl.current = c;
    const t0 = performance.now();
    let tFirst = null;
    let text = '';
    let chunks = 0;
    let usage = null;
    let finish = null;
    const stats = () => {
      const t1 = performance.now();
      const parts = [];
      if (usage) {
        parts.push(`prompt ${fmtNum(usage.prompt_tokens)} tokens`);
        const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
        if (cached) parts.push(`${fmtNum(cached)} cached`);
        parts.push(`completion ${fmtNum(usage.completion_tokens)} tokens`);
      } else {
        parts.push(`${chunks} chunks`);
      }
      if (tFirst != null) parts.push(`TTFT ${fmtNum(tFirst - t0)} ms`);
      const n = usage ? usage.completion_tokens : chunks;
      // Decode speed: tokens after the first over the time after the first.
      const decodeS = tFirst != null ? (t1 - tFirst) / 1000 : 0;
      const tps = n > 1 && decodeS > 0 ? (n - 1) / decodeS : n / Math.max(1e-3, (t1 - t0) / 1000);
      parts.push(`${fmtNum(tps, 1)} tok/s`);
      parts.push(`${fmtNum((t1 - t0) / 1000, 2)} s`);
      return parts.join(' · ');
    };
    try {
      const res = await postStream('/v1/chat/completions', body, { signal: c.signal });
      for await (const ev of readSSE(res)) {
        if (ev.data === '[DONE]') break;
        let chunk;
        try {
          chunk = JSON.parse(ev.data);
        } catch {
          continue;
        }
        if (chunk.error) throw new ApiError(200, chunk.error.message || 'stream error', chunk.error);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (choice) {
          if (choice.finish_reason) finish = choice.finish_reason;
          const d = choice.delta && choice.delta.content;
          if (d) {
            if (tFirst == null) tFirst = performance.now();
            text += d;
            chunks++;
            update(idx, { content: text, chunks });
          }
        }
      }
      update(idx, { content: text, chunks, streaming: false, finish, stats: stats(), usage });
    } catch (err) {
      if (err.name === 'AbortError') {
        update(idx, { content: text, chunks, streaming: false, stopped: true, stats: stats() });
      } else {
        update(idx, { content: text, chunks, streaming: false, error: err });
      }
    } finally {
      ctl.current = null;
      setBusy(false);
    }
  }

  function stop() {
    if (ctl.current) ctl.current.abort();
  }

  async function showSnippet(kind) {
    const body = buildBody(s, history, draft);
    const text = kind === 'curl' ? curlOf(body) : pythonOf(body);
    const copied = await copyText(text);
    setSnippet({ kind, text, copied });
  }

  const sel = (k, testid, options, label, hint) => html`<${Field} label=${label} error=${errors[k]} wide hint=${hint}>
    <select value=${s[k]} onChange=${set(k)} data-testid=${testid} class=${errors[k] ? 'invalid' : ''}>${options}</select>
  </${Field}>`;
  const num = (k, label, step, testid) => html`<${Field} label=${label} error=${errors[k]} testid=${`${testid}-error`}>
    <input type="number" step=${step} value=${s[k]} onInput=${set(k)} data-testid=${testid} class=${errors[k] ? 'invalid' : ''} />
  </${Field}>`;

  return html`<div>
    <div class="page-head"><h1>Chat playground</h1><div class="grow"></div>
      <button onClick=${loadLists} data-testid="chat-reload">Reload lists</button>
      <button onClick=${() => setHistory([])} disabled=${busy} data-testid="chat-clear">New conversation</button>
    </div>
    <${ErrorBanner} error=${loadError} />
    <div class="chat">
      <${Card} title="Request" class="settings">
        <div class="fields">
          ${sel('model', 'chat-model', [
            models.length ? null : html`<option value="">no chat model is loaded</option>`,
            ...models.map((m) => html`<option value=${m.id}>${m.id}${m.owned_by && m.owned_by !== 'mlxgate' ? ` (${m.owned_by})` : ''}</option>`),
          ], 'Model')}
          ${sel('adapter', 'chat-adapter', [
            html`<option value="">default (adapter selector decides)</option>`,
            html`<option value="none">none (base model)</option>`,
            ...modelAdapters.map((a) => html`<option value=${a.id}>${a.id} (rank ${a.rank})</option>`),
          ], 'Adapter')}
          ${sel('prompt_cache', 'chat-cache', [
            html`<option value="">none</option>`,
            ...modelCaches.map((c) => html`<option value=${c.name}>${c.name} (${fmtNum(c.tokens)} tokens)</option>`),
          ], 'Prompt cache')}
          <${Field} label="System prompt" wide>
            <textarea rows="3" value=${s.system} onInput=${set('system')} data-testid="chat-system"
              placeholder="You are a helpful assistant."></textarea>
          </${Field}>
          ${num('temperature', 'temperature', '0.1', 'chat-temperature')}
          ${num('top_p', 'top_p', '0.05', 'chat-top-p')}
          ${num('max_tokens', 'max_tokens', '1', 'chat-max-tokens')}
          ${num('seed', 'seed', '1', 'chat-seed')}
          <label class="check wide"><input type="checkbox" checked=${s.ignore_eos} onChange=${set('ignore_eos')}
            data-testid="chat-ignore-eos" /> ignore EOS (always decode max_tokens)</label>
        </div>
        <div class="row" style="margin-top: 10px">
          <button onClick=${() => showSnippet('curl')} data-testid="copy-curl">Copy as curl</button>
          <button onClick=${() => showSnippet('python')} data-testid="copy-python">Copy as Python</button>
        </div>
      </${Card}>
      <${Card} title="Conversation">
        <div class="conversation" ref=${convo} data-testid="chat-messages">
          ${history.length === 0 ? html`<div class="empty">Send a message to start. Enter sends, Shift+Enter adds a line.</div>` : null}
          ${history.map((m, i) => html`<${Message} m=${m} last=${i === history.length - 1} />`)}
        </div>
        <div class="composer">
          <textarea rows="3" value=${draft} data-testid="chat-input" placeholder="Your message"
            onInput=${(e) => setDraft(e.currentTarget.value)}
            onKeyDown=${(e) => {
              if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
                e.preventDefault();
                send();
              }
            }}></textarea>
          ${busy
            ? html`<button class="danger primary" onClick=${stop} data-testid="chat-stop">Stop</button>`
            : html`<button class="primary" onClick=${send} data-testid="chat-send"
                disabled=${!draft.trim() || Object.keys(errors).length > 0}>Send</button>`}
        </div>
      </${Card}>
    </div>
    ${snippet
      ? html`<${Card} title=${snippet.kind === 'curl' ? 'The request as curl' : 'The request in Python (openai SDK)'}
          actions=${html`<span class="small muted" data-testid="snippet-status">${snippet.copied ? 'Copied to the clipboard.' : 'Select and copy.'}</span>
            <button class="link" onClick=${() => setSnippet(null)} aria-label="Close">✕</button>`}>
          <pre class="snippet" data-testid="chat-snippet" data-kind=${snippet.kind}>${snippet.text}</pre>
        </${Card}>`
      : null}
  </div>`;
}
