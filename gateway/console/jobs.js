// Jobs: the list (filtered, refreshed), submit forms that check what the
// API checks, and a job's page following its server-sent events live.

import { useEffect, useMemo, useRef, useState } from 'preact/hooks';
import { api, readSSE, ApiError } from './api.js';
import { html, Card, ErrorBanner, Field, Badge, Progress, fmtTime, fmtDuration, useInterval, useLoad, can } from './ui.js';
import { LineChart } from './charts.js';

const STATUSES = ['queued', 'running', 'done', 'failed', 'cancelled', 'zombie'];
const FINAL = new Set(['done', 'failed', 'cancelled', 'zombie']);

// Each kind's fields, with the API's own rules (gateway/src/jobs/kinds/*):
// `int`/`num` ranges, `req`uired, defaults shown as placeholders.
const F = {
  text: (name, o = {}) => ({ name, type: 'text', ...o }),
  int: (name, min, max, o = {}) => ({ name, type: 'int', min, max, ...o }),
  num: (name, min, max, o = {}) => ({ name, type: 'num', min, max, ...o }),
  bool: (name, o = {}) => ({ name, type: 'bool', ...o }),
  choice: (name, options, o = {}) => ({ name, type: 'choice', options, ...o }),
  json: (name, o = {}) => ({ name, type: 'json', ...o }),
};

const KINDS = {
  noop: {
    admin: false,
    help: 'Sleeps through steps, reporting each: a harmless way to try the runner.',
    fields: [F.int('steps', 0, 100000, { def: '5' }), F.int('delay_ms', 0, 600000, { def: '100' })],
  },
  dataset: {
    admin: true,
    help: 'JSONL (.gz, .zst), CSV or Parquet files through a pipeline of steps into train, valid, test and rejected files.',
    // One of `policy` (a single step) and `steps` is required.
    oneOf: ['policy', 'steps'],
    fields: [
      F.text('input', { req: true, wide: true, hint: 'a file, folder or glob under [jobs] allowed_paths' }),
      F.text('output_dir', { req: true, wide: true, hint: 'a folder under [jobs] allowed_paths' }),
      F.text('policy', { list: 'transforms', hint: 'one dataset-transform policy, or use steps' }),
      F.json('steps', {
        wide: true,
        array: true,
        hint: 'e.g. [{"policy": "alpaca"}, {"dedupe": ["messages"]}, {"filter_length": {"model": "…", "max_tokens": 2048}}]',
      }),
      F.choice('output_format', ['', 'jsonl', 'parquet'], { ph: 'jsonl', strings: true }),
      F.num('valid_ratio', 0, 0.99, { ph: '0' }),
      F.num('test_ratio', 0, 0.99, { ph: '0' }),
      F.bool('shuffle', { hint: 'seeded shuffle before the split' }),
      F.int('seed', 0, Number.MAX_SAFE_INTEGER, { ph: '0' }),
      F.int('batch_size', 1, 1024, { ph: '32' }),
      F.int('workers', 0, 64, { ph: '0: one per core' }),
      F.choice('bad_records', ['', 'fail', 'reject'], { ph: 'fail', strings: true }),
    ],
  },
  quantize: {
    admin: true,
    help: 'A f16/bf16/f32 safetensors model folder into an MLX 4- or 8-bit folder.',
    fields: [
      F.text('input', { req: true, wide: true, hint: 'a model folder with config.json' }),
      F.text('output_dir', { req: true, wide: true, hint: 'a new or empty folder' }),
      F.choice('bits', ['', '4', '8'], { ph: '4' }),
      F.choice('group_size', ['', '32', '64', '128'], { ph: '64' }),
      F.json('overrides', { wide: true, hint: 'optional, e.g. {"embed_tokens": {"bits": 8}}' }),
    ],
  },
  finetune: {
    admin: true,
    help: 'LoRA SFT on a frozen base model; streams train and validation loss.',
    fields: [
      F.text('model', { req: true, wide: true, hint: 'a .gguf file or a model folder' }),
      F.text('data', { req: true, wide: true, hint: 'a folder with train.jsonl (and valid.jsonl)' }),
      F.text('name', { hint: 'adapter name (default: the job id)' }),
      F.text('output_dir', { hint: 'optional; default: the first adapter store' }),
      F.bool('mount', { hint: 'mount when done' }),
      F.text('mount_model', { hint: 'served model to mount on' }),
      F.int('rank', 1, 512, { ph: '8' }),
      F.num('scale', 0, 10000, { ph: '20', exclusiveMin: true }),
      F.int('num_layers', 1, 1024, { ph: '16' }),
      F.num('learning_rate', 1e-9, 1, { ph: '1e-5' }),
      F.int('warmup_steps', 0, 1000000, { ph: '0' }),
      F.int('batch_size', 1, 1024, { ph: '4' }),
      F.int('max_seq_len', 2, 131072, { ph: '2048' }),
      F.int('iterations', 1, 10000000, { ph: '1000' }),
      F.int('val_interval', 0, 10000000, { ph: '200' }),
      F.int('report_interval', 1, 10000000, { ph: '10' }),
      F.int('checkpoint_interval', 0, 10000000, { ph: '100' }),
      F.int('seed', 0, Number.MAX_SAFE_INTEGER, { ph: '0' }),
      F.json('extra', { wide: true, hint: 'more settings as a JSON object (dropout, keys, weight_decay, …)' }),
    ],
  },
};

/** Checks one form like the API would; returns {config, errors}. */
export function formToConfig(kind, values) {
  const errors = {};
  let config = {};
  for (const f of KINDS[kind].fields) {
    const raw = values[f.name];
    const empty = raw === undefined || raw === '' || raw === false;
    if (empty) {
      if (f.req) errors[f.name] = `\`${f.name}\` is required`;
      continue;
    }
    if (f.type === 'text') config[f.name] = String(raw).trim();
    else if (f.type === 'bool') config[f.name] = true;
    else if (f.type === 'choice') config[f.name] = f.strings ? String(raw) : Number(raw);
    else if (f.type === 'int' || f.type === 'num') {
      const v = Number(raw);
      const range = `${f.min}..=${f.max}`;
      if (!Number.isFinite(v)) errors[f.name] = `\`${f.name}\` must be a number`;
      else if (f.type === 'int' && (!Number.isInteger(v) || v < 0)) errors[f.name] = `\`${f.name}\` must be a non-negative integer`;
      else if (v < f.min || v > f.max || (f.exclusiveMin && v <= f.min)) errors[f.name] = `\`${f.name}\` must be in ${range}`;
      else config[f.name] = v;
    } else if (f.type === 'json') {
      const what = f.array ? 'array' : 'object';
      try {
        const v = JSON.parse(raw);
        if (!v || typeof v !== 'object' || Array.isArray(v) !== !!f.array) throw new Error(`not an ${what}`);
        if (f.name === 'extra') config = { ...config, ...v };
        else config[f.name] = v;
      } catch (e) {
        errors[f.name] = `\`${f.name}\` must be a JSON ${what} (${e.message})`;
      }
    }
  }
  if (kind === 'dataset' && (config.valid_ratio ?? 0) + (config.test_ratio ?? 0) >= 1) {
    errors.test_ratio = '`valid_ratio` + `test_ratio` must be below 1 (the rest is train)';
  }
  const oneOf = KINDS[kind].oneOf;
  if (oneOf) {
    const set = oneOf.filter((name) => config[name] !== undefined);
    const [first, second] = oneOf;
    if (set.length === 0 && !errors[first] && !errors[second]) errors[first] = `set \`${first}\` or \`${second}\``;
    if (set.length > 1) errors[second] = `set \`${first}\` or \`${second}\`, not both`;
  }
  return { config, errors };
}

/** The form field a server `param` names (`config.policy` -> `policy`). */
function fieldOfParam(param) {
  return param ? String(param).replace(/^config\./, '') : null;
}

function SubmitForm({ session, transforms, onSubmitted }) {
  const kinds = Object.keys(KINDS).filter((k) => !KINDS[k].admin || can(session, 'admin'));
  const [kind, setKind] = useState('noop');
  const [values, setValues] = useState({ noop: { steps: '5', delay_ms: '100' } });
  const [errors, setErrors] = useState({});
  const [serverError, setServerError] = useState(null);
  const [busy, setBusy] = useState(false);
  const v = values[kind] || {};
  const spec = KINDS[kind];

  function set(name, value) {
    setValues((all) => ({ ...all, [kind]: { ...(all[kind] || {}), [name]: value } }));
    setErrors((e) => ({ ...e, [name]: undefined }));
  }

  async function submit(e) {
    e.preventDefault();
    setServerError(null);
    const { config, errors: errs } = formToConfig(kind, v);
    setErrors(errs);
    if (Object.keys(errs).length) return;
    setBusy(true);
    try {
      const row = await api('/api/jobs', { method: 'POST', json: { kind, config } });
      onSubmitted(row);
    } catch (err) {
      setServerError(err);
      const field = fieldOfParam(err.param);
      if (field && spec.fields.some((f) => f.name === field)) setErrors({ [field]: err.message });
    } finally {
      setBusy(false);
    }
  }

  const input = (f) => {
    const testid = `job-field-${f.name}`;
    const val = v[f.name] ?? '';
    const common = { 'data-testid': testid, class: errors[f.name] ? 'invalid' : '' };
    let control;
    if (f.type === 'bool') {
      return html`<label class="check"><input type="checkbox" checked=${!!v[f.name]} data-testid=${testid}
        onChange=${(e) => set(f.name, e.currentTarget.checked)} /> ${f.name}${f.hint ? html` <span class="muted">(${f.hint})</span>` : null}</label>`;
    } else if (f.type === 'choice') {
      control = html`<select ...${common} value=${val} onChange=${(e) => set(f.name, e.currentTarget.value)}>
        ${f.options.map((o) => html`<option value=${o}>${o || `default (${f.ph})`}</option>`)}</select>`;
    } else if (f.type === 'json') {
      control = html`<textarea rows="2" ...${common} value=${val} placeholder=${f.array ? '[]' : '{}'} onInput=${(e) => set(f.name, e.currentTarget.value)}></textarea>`;
    } else {
      // Numbers are typed as text so that a wrong value reaches our check
      // (and its message) instead of the browser's silent constraint.
      control = html`<input type="text" inputmode=${f.type === 'text' ? undefined : 'decimal'}
        ...${common} value=${val} placeholder=${f.ph || f.def || ''} list=${f.list ? `list-${f.list}` : undefined}
        onInput=${(e) => set(f.name, e.currentTarget.value)} />`;
    }
    const label = `${f.name}${f.req ? ' *' : ''}${f.type === 'int' || f.type === 'num' ? ` (${f.min}–${f.max >= 1e9 ? '…' : f.max})` : ''}`;
    return html`<${Field} label=${label} error=${errors[f.name]} wide=${f.wide} hint=${f.hint} testid=${`job-field-error-${f.name}`}>${control}</${Field}>`;
  };

  return html`<${Card} title="Submit a job" testid="job-form">
    <div class="tabs">
      ${kinds.map((k) => html`<button type="button" class=${k === kind ? 'active' : ''} data-testid=${`job-kind-${k}`}
        onClick=${() => { setKind(k); setErrors({}); setServerError(null); }}>${k}</button>`)}
    </div>
    <p class="muted small">${spec.help}${spec.admin ? ' Needs the admin scope.' : ''}</p>
    <${ErrorBanner} error=${serverError} testid="job-form-error" />
    ${Object.keys(errors).some((k) => errors[k]) && !serverError
      ? html`<div class="banner error" data-testid="job-form-invalid"><div class="msg">Fix the marked fields: ${Object.entries(errors)
          .filter(([, e]) => e)
          .map(([, e]) => e)
          .join('; ')}</div></div>`
      : null}
    <form onSubmit=${submit} data-testid=${`job-form-${kind}`} novalidate>
      <datalist id="list-transforms">${transforms.map((t) => html`<option value=${t} />`)}</datalist>
      <div class="fields">${spec.fields.map(input)}</div>
      <div class="row" style="margin-top: 10px">
        <button class="primary" type="submit" disabled=${busy} data-testid="job-submit">${busy ? 'Submitting…' : `Submit ${kind} job`}</button>
      </div>
    </form>
  </${Card}>`;
}

export function JobsPage({ session }) {
  const [status, setStatus] = useState('');
  const [auto, setAuto] = useState(true);
  const [more, setMore] = useState([]);
  const [cursor, setCursor] = useState(null);
  const list = useLoad(async (signal) => {
    const q = new URLSearchParams({ limit: '50' });
    if (status) q.set('status', status);
    const r = await api(`/api/jobs?${q}`, { signal });
    setMore([]);
    setCursor(r.next_cursor || null);
    return r;
  }, [status]);
  useInterval(() => list.reload(), 2000, auto);
  const transforms = useLoad(async (signal) => {
    if (!can(session, 'admin')) return [];
    const r = await api('/admin/policies', { signal });
    return (r.data || []).filter((p) => p.kind === 'dataset-transform').map((p) => p.name);
  }, []);

  async function loadMore() {
    const q = new URLSearchParams({ limit: '50', cursor });
    if (status) q.set('status', status);
    try {
      const r = await api(`/api/jobs?${q}`);
      setMore((m) => [...m, ...(r.data || [])]);
      setCursor(r.next_cursor || null);
    } catch (err) {
      list.reload();
    }
  }

  const rows = [...((list.data && list.data.data) || []), ...more];
  return html`<div>
    <div class="page-head"><h1>Jobs</h1></div>
    <${SubmitForm} session=${session} transforms=${transforms.data || []}
      onSubmitted=${(row) => { location.hash = `#/jobs/${encodeURIComponent(row.id)}`; }} />
    <${Card} title="Jobs" testid="jobs-list" actions=${html`
      <select value=${status} onChange=${(e) => setStatus(e.currentTarget.value)} data-testid="jobs-status-filter">
        <option value="">all statuses</option>
        ${STATUSES.map((s) => html`<option value=${s}>${s}</option>`)}
      </select>
      <label class="check"><input type="checkbox" checked=${auto} onChange=${(e) => setAuto(e.currentTarget.checked)}
        data-testid="jobs-auto-refresh" /> auto-refresh</label>
      <button onClick=${() => list.reload()} data-testid="jobs-refresh">Refresh</button>`}>
      <${ErrorBanner} error=${list.error} />
      <div class="table-wrap"><table>
        <thead><tr><th>id</th><th>kind</th><th>status</th><th>progress</th><th>message</th><th>tenant</th><th>created</th><th>took</th></tr></thead>
        <tbody>
          ${rows.map((j) => html`<tr data-testid="job-row" data-id=${j.id} data-status=${j.status} data-kind=${j.kind}>
            <td class="mono"><a href=${`#/jobs/${encodeURIComponent(j.id)}`}>${j.id}</a></td>
            <td>${j.kind}</td>
            <td><${Badge} value=${j.status} /></td>
            <td><${Progress} value=${j.progress} status=${j.status} /></td>
            <td class="ellipsis" title=${j.error || j.message || ''}>${j.error || j.message || ''}</td>
            <td>${j.tenant || '–'}</td>
            <td class="nowrap">${fmtTime(j.created_at)}</td>
            <td class="nowrap">${fmtDuration(j.started_at, j.ended_at)}</td>
          </tr>`)}
        </tbody>
      </table></div>
      ${rows.length === 0 && !list.loading ? html`<div class="empty">No jobs${status ? ` with status ${status}` : ''}.</div>` : null}
      ${cursor ? html`<div class="row" style="margin-top: 8px"><button onClick=${loadMore}>Load more</button></div>` : null}
    </${Card}>
  </div>`;
}

/** One line of the event log. */
function eventText(e) {
  switch (e.type) {
    case 'started': return 'started';
    case 'log': return e.line;
    case 'stage': return `[${e.stage}] ${e.message || ''}${e.progress != null ? ` (${(e.progress * 100).toFixed(0)}%)` : ''}`;
    case 'metric': return e.message || `${e.kind} step ${e.step}${e.loss != null ? ` loss ${Number(e.loss).toFixed(4)}` : ''}`;
    case 'done': return `done${e.output_dir ? ` → ${e.output_dir}` : ''}${e.summary ? ` ${JSON.stringify(e.summary)}` : ''}`;
    case 'failed': return `failed: ${e.error}`;
    case 'cancelled': return `cancelled${e.message ? `: ${e.message}` : ''}`;
    default: return JSON.stringify(e);
  }
}

/**
 * Follows /api/jobs/{id}/events until a terminal event, resuming after the
 * last seen id when the connection drops (Last-Event-ID, as EventSource would).
 */
function useJobEvents(id, onEvent) {
  const [conn, setConn] = useState('connecting');
  const [error, setError] = useState(null);
  const cb = useRef(onEvent);
  cb.current = onEvent;
  useEffect(() => {
    const ctl = new AbortController();
    let last = null;
    let ended = false;
    (async () => {
      let failures = 0;
      while (!ended && !ctl.signal.aborted) {
        try {
          const headers = { accept: 'text/event-stream' };
          if (last != null) headers['last-event-id'] = String(last);
          const res = await api(`/api/jobs/${encodeURIComponent(id)}/events`, { headers, signal: ctl.signal, raw: true });
          setConn('live');
          setError(null);
          failures = 0;
          for await (const m of readSSE(res)) {
            let ev;
            try {
              ev = JSON.parse(m.data);
            } catch {
              continue;
            }
            if (m.id != null && m.id !== '') last = Number(m.id);
            cb.current(ev);
            if (ev.type === 'done' || ev.type === 'failed' || ev.type === 'cancelled') ended = true;
          }
        } catch (err) {
          if (ctl.signal.aborted || err.name === 'AbortError') return;
          if (err instanceof ApiError && err.status >= 400 && err.status < 500) {
            setError(err);
            setConn('closed');
            return;
          }
          failures++;
          setError(err);
        }
        if (!ended && !ctl.signal.aborted) {
          setConn('reconnecting');
          await new Promise((r) => setTimeout(r, Math.min(5000, 500 * 2 ** failures)));
        }
      }
      if (ended) setConn('ended');
    })();
    return () => ctl.abort();
  }, [id]);
  return { conn, error };
}

export function JobPage({ id }) {
  const [row, setRow] = useState(null);
  const [rowError, setRowError] = useState(null);
  const [events, setEvents] = useState([]);
  const [actionError, setActionError] = useState(null);
  const [cancelling, setCancelling] = useState(false);

  async function loadRow() {
    try {
      setRow(await api(`/api/jobs/${encodeURIComponent(id)}`));
      setRowError(null);
    } catch (err) {
      setRowError(err);
    }
  }
  useEffect(() => {
    loadRow();
  }, [id]);

  const { conn, error: streamError } = useJobEvents(id, (ev) => {
    setEvents((list) => (list.some((e) => e.seq === ev.seq) ? list : [...list, ev]));
    if (ev.type === 'started' || ev.type === 'done' || ev.type === 'failed' || ev.type === 'cancelled') loadRow();
  });
  const final = row && FINAL.has(row.status);
  useInterval(loadRow, 3000, !!row && !final);

  // Status and progress as the events tell them, ahead of the row's refresh.
  const live = useMemo(() => {
    let status = row ? row.status : 'queued';
    let progress = row ? row.progress : 0;
    let stage = row ? row.message : null;
    for (const e of events) {
      if (e.type === 'started' && status === 'queued') status = 'running';
      if (e.progress != null) progress = e.progress;
      if ((e.type === 'stage' || e.type === 'metric') && e.message) stage = e.message;
      if (e.type === 'done') { status = 'done'; progress = 1; }
      if (e.type === 'failed') status = e.status || 'failed';
      if (e.type === 'cancelled') status = 'cancelled';
    }
    if (row && FINAL.has(row.status)) status = row.status;
    return { status, progress, stage };
  }, [row, events]);

  const loss = useMemo(() => {
    const steps = new Map();
    for (const e of events) {
      if (e.type !== 'metric' || e.loss == null || (e.kind !== 'train' && e.kind !== 'val')) continue;
      const p = steps.get(e.step) || { train: null, val: null };
      p[e.kind] = e.loss;
      steps.set(e.step, p);
    }
    const xs = [...steps.keys()].sort((a, b) => a - b);
    return [xs, xs.map((x) => steps.get(x).train), xs.map((x) => steps.get(x).val)];
  }, [events]);
  const kind = row ? row.kind : null;

  async function cancel() {
    setCancelling(true);
    setActionError(null);
    try {
      setRow(await api(`/api/jobs/${encodeURIComponent(id)}`, { method: 'DELETE' }));
    } catch (err) {
      setActionError(err);
    } finally {
      setCancelling(false);
    }
  }

  const isFinal = FINAL.has(live.status);
  return html`<div data-testid="job-page" data-id=${id}>
    <div class="page-head">
      <a href="#/jobs">← Jobs</a>
      <h1 class="mono">${id}</h1>
      ${kind ? html`<span class="badge">${kind}</span>` : null}
      <span data-testid="job-status" data-status=${live.status}><${Badge} value=${live.status} /></span>
      <div class="grow"></div>
      <span class="small muted" data-testid="job-conn">events: ${conn}</span>
      <button class="danger" onClick=${cancel} disabled=${isFinal || cancelling || !row} data-testid="job-cancel">
        ${cancelling ? 'Cancelling…' : 'Cancel'}</button>
    </div>
    <${ErrorBanner} error=${rowError} />
    <${ErrorBanner} error=${actionError} onClose=${() => setActionError(null)} />
    ${streamError && !isFinal ? html`<${ErrorBanner} error=${streamError} testid="job-stream-error" />` : null}
    <${Card} title="Progress">
      <${Progress} value=${live.progress} status=${live.status} testid="job-progress" />
      <div class="row small" style="margin-top: 6px">
        <span data-testid="job-stage">${live.stage || ''}</span>
        <span class="muted">${(Number(live.progress || 0) * 100).toFixed(0)}%</span>
      </div>
      ${row && row.error ? html`<${ErrorBanner} error=${{ message: row.error }} testid="job-error" />` : null}
    </${Card}>
    ${kind === 'finetune' || loss[0].length
      ? html`<${Card} title="Loss">
          <${LineChart} testid="job-loss-chart" labels=${['train loss', 'val loss']} data=${loss} time=${false} points=${true}
            yFormat=${(v) => Number(v).toFixed(3)} />
        </${Card}>`
      : null}
    <div class="grid2">
      <${Card} title=${`Events (${events.length})`}>
        <div class="events" data-testid="job-events">
          ${events.length === 0 ? html`<div class="muted">No events yet.</div>` : null}
          ${events.map((e) => html`<div class=${`event ${e.type}`} data-testid="job-event" data-type=${e.type}>
            <span class="t">#${e.seq}</span>
            <span class="t">${e.ts ? new Date(e.ts * 1000).toLocaleTimeString([], { hour12: false }) : ''}</span>
            <span>${e.type}</span>
            <span>${eventText(e)}</span>
          </div>`)}
        </div>
      </${Card}>
      <${Card} title="Job">
        ${row
          ? html`<dl class="kv" data-testid="job-row-details">
              <dt>kind</dt><dd>${row.kind}</dd>
              <dt>status</dt><dd>${row.status}</dd>
              <dt>tenant</dt><dd>${row.tenant || '–'}</dd>
              <dt>submitted by</dt><dd>${row.submitted_by || '–'}</dd>
              <dt>created</dt><dd>${fmtTime(row.created_at)}</dd>
              <dt>started</dt><dd>${fmtTime(row.started_at)}</dd>
              <dt>ended</dt><dd>${fmtTime(row.ended_at)}</dd>
              <dt>output</dt><dd class="mono">${row.output_path || '–'}</dd>
              <dt>log</dt><dd class="mono">${row.log_path}</dd>
              <dt>config</dt><dd><pre class="snippet">${JSON.stringify(row.config, null, 2)}</pre></dd>
              ${row.summary ? html`<dt>summary</dt><dd><pre class="snippet" data-testid="job-summary">${JSON.stringify(row.summary, null, 2)}</pre></dd>` : null}
            </dl>`
          : html`<div class="muted">Loading…</div>`}
      </${Card}>
    </div>
  </div>`;
}
