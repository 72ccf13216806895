// Policies: the uploaded Wasm components with their limits, bindings and
// call counters; upload (drop or pick a file), bind, unbind, delete; and a
// dry run of a dataset transform over pasted JSONL.

import { useRef, useState } from 'preact/hooks';
import { api } from './api.js';
import { html, Card, ErrorBanner, Field, Badge, Notice, fmtBytes, fmtNum, fmtTime, useInterval, useLoad } from './ui.js';

const KINDS = ['router', 'adapter-selector', 'dataset-transform'];
const BINDABLE = new Set(['router', 'adapter-selector']);

/** A policy's info with its metrics (GET /admin/policies/{name}), for each listed one. */
async function loadPolicies(signal) {
  const list = await api('/admin/policies', { signal });
  const detailed = await Promise.all(
    (list.data || []).map((p) =>
      api(`/admin/policies/${encodeURIComponent(p.name)}`, { signal }).catch(() => p),
    ),
  );
  return { policies: detailed, bindings: list.bindings || {} };
}

function failures(m, pick) {
  if (!m || !Array.isArray(m.failures)) return 0;
  return m.failures.filter(([kind]) => pick(kind)).reduce((n, [, c]) => n + c, 0);
}

function Limits({ l }) {
  if (!l) return '–';
  return html`<span class="small nowrap" title=${JSON.stringify(l)}>
    ${l.deadline_ms} ms · fuel ${l.fuel == null ? '∞' : fmtNum(l.fuel)} · ${fmtBytes(l.memory_bytes)} · ${l.warm_instances} warm</span>`;
}

function PolicyRow({ p, bindings, onAction, busy }) {
  const [confirm, setConfirm] = useState(false);
  const m = p.metrics;
  const bound = (p.bound_as || []).length > 0 || bindings[p.kind] === p.name;
  const timeouts = failures(m, (k) => k === 'timeout');
  const errors = failures(m, (k) => k !== 'timeout');
  return html`<tr data-testid="policy-row" data-name=${p.name} data-kind=${p.kind} data-bound=${bound ? 'true' : 'false'}>
    <td><b>${p.name}</b><div class="small muted mono" title=${p.sha256}>${p.interface}</div></td>
    <td>${p.kind}</td>
    <td class="num">${p.version}</td>
    <td>${bound ? html`<${Badge} value="bound" kind="ok" />` : html`<span class="muted">–</span>`}</td>
    <td>${p.on_error}</td>
    <td><${Limits} l=${p.limits} /></td>
    <td class="num" data-testid=${`policy-calls-${p.name}`} data-value=${m ? m.calls : ''}>${m ? fmtNum(m.calls) : '–'}</td>
    <td class="num" data-testid=${`policy-errors-${p.name}`}>${m ? fmtNum(errors) : '–'}</td>
    <td class="num" data-testid=${`policy-timeouts-${p.name}`}>${m ? fmtNum(timeouts) : '–'}</td>
    <td class="num" data-testid=${`policy-reused-${p.name}`}>${m ? fmtNum(m.decisions_reused) : '–'}</td>
    <td class="small nowrap" title=${`uploaded ${fmtTime(p.uploaded_at)}, sha256 ${p.sha256}`}>${fmtBytes(p.size_bytes)}</td>
    <td class="nowrap">
      ${BINDABLE.has(p.kind)
        ? bound
          ? html`<button disabled=${busy} onClick=${() => onAction('unbind', p)} data-testid=${`policy-unbind-${p.name}`}>Unbind</button>`
          : html`<button disabled=${busy} onClick=${() => onAction('bind', p)} data-testid=${`policy-bind-${p.name}`}>Bind</button>`
        : null}
      ${' '}
      ${confirm
        ? html`<button class="danger primary" disabled=${busy} onClick=${() => { setConfirm(false); onAction('delete', p); }}
            data-testid=${`policy-delete-confirm-${p.name}`}>Delete ${p.name}?</button>
            <button class="link" onClick=${() => setConfirm(false)}>keep</button>`
        : html`<button class="danger" disabled=${busy} onClick=${() => setConfirm(true)} data-testid=${`policy-delete-${p.name}`}>Delete</button>`}
    </td>
  </tr>`;
}

function Upload({ onUploaded }) {
  const [file, setFile] = useState(null);
  const [name, setName] = useState('');
  const [kind, setKind] = useState('router');
  const [onError, setOnError] = useState('fail_open');
  const [config, setConfig] = useState('');
  const [query, setQuery] = useState('');
  const [over, setOver] = useState(false);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const [done, setDone] = useState(null);
  const fileInput = useRef(null);

  function pick(f) {
    if (!f) return;
    setFile(f);
    setDone(null);
    setError(null);
    // A name from the file (alias_router.wasm -> alias-router) unless one was typed.
    if (!name) setName(f.name.replace(/\.wasm$/i, '').replace(/[^A-Za-z0-9_.-]+/g, '-').replace(/_/g, '-'));
  }

  async function upload(e) {
    e.preventDefault();
    setError(null);
    setDone(null);
    if (!file) return setError({ message: 'Choose a component file (.wasm) first.' });
    if (!name.trim()) return setError({ message: 'Give the policy a name.' });
    const q = new URLSearchParams({ kind, on_error: onError });
    if (config.trim()) q.set('config', config.trim());
    // Extra options as a query string (deadline_ms=50&fuel=1000000...), passed through.
    for (const [k, v] of new URLSearchParams(query.trim().replace(/^[?&]/, ''))) q.set(k, v);
    setBusy(true);
    try {
      const bytes = await file.arrayBuffer();
      const info = await api(`/admin/policies/${encodeURIComponent(name.trim())}?${q}`, {
        method: 'PUT',
        body: bytes,
        headers: { 'content-type': 'application/wasm' },
      });
      setDone(info);
      onUploaded(info);
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  }

  return html`<${Card} title="Upload a component" testid="policy-upload">
    <form class="stack" onSubmit=${upload}>
      <div class=${`dropzone ${over ? 'over' : ''}`} data-testid="policy-dropzone"
        onDragOver=${(e) => { e.preventDefault(); setOver(true); }}
        onDragLeave=${() => setOver(false)}
        onDrop=${(e) => { e.preventDefault(); setOver(false); pick(e.dataTransfer.files[0]); }}>
        ${file ? html`<b data-testid="policy-file-name">${file.name}</b> (${fmtBytes(file.size)})` : 'Drop a .wasm component here, or '}
        <button type="button" class="link" onClick=${() => fileInput.current.click()}>${file ? 'choose another' : 'choose a file'}</button>
        <input type="file" accept=".wasm,application/wasm" ref=${fileInput} style="display: none" data-testid="policy-file"
          onChange=${(e) => pick(e.currentTarget.files[0])} />
      </div>
      <div class="fields">
        <${Field} label="name"><input value=${name} onInput=${(e) => setName(e.currentTarget.value)} data-testid="policy-name" /></${Field}>
        <${Field} label="kind"><select value=${kind} onChange=${(e) => setKind(e.currentTarget.value)} data-testid="policy-kind">
          ${KINDS.map((k) => html`<option value=${k}>${k}</option>`)}</select></${Field}>
        <${Field} label="on_error"><select value=${onError} onChange=${(e) => setOnError(e.currentTarget.value)} data-testid="policy-on-error">
          <option value="fail_open">fail_open (default route)</option><option value="fail_closed">fail_closed (503)</option></select></${Field}>
        <${Field} label="config (passed to the guest's init)" wide>
          <textarea rows="2" value=${config} onInput=${(e) => setConfig(e.currentTarget.value)} data-testid="policy-config"
            placeholder='e.g. {"unknown": "pass"}'></textarea></${Field}>
        <${Field} label="more options (query string)" wide hint="deadline_ms, fuel, memory_mb, warm_instances, max_output_bytes">
          <input value=${query} onInput=${(e) => setQuery(e.currentTarget.value)} data-testid="policy-query" placeholder="deadline_ms=20&fuel=5000000" /></${Field}>
      </div>
      <${ErrorBanner} error=${error} testid="policy-upload-error" />
      ${done ? html`<${Notice} kind="ok" testid="policy-upload-result">Uploaded <b>${done.name}</b> version ${done.version}
        (${done.kind}, ${done.interface}, ${fmtBytes(done.size_bytes)}).</${Notice}>` : null}
      <div class="row"><button class="primary" type="submit" disabled=${busy} data-testid="policy-upload-submit">${busy ? 'Uploading…' : 'Upload'}</button></div>
    </form>
  </${Card}>`;
}

function DryRun({ transforms }) {
  const [policy, setPolicy] = useState('');
  const [text, setText] = useState('');
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const [result, setResult] = useState(null);
  const chosen = policy || transforms[0] || '';

  async function run(e) {
    e.preventDefault();
    setError(null);
    setResult(null);
    const lines = text.split('\n').map((l) => l.trim()).filter(Boolean);
    const records = [];
    for (let i = 0; i < lines.length; i++) {
      try {
        records.push(JSON.parse(lines[i]));
      } catch (err) {
        return setError({ message: `Line ${i + 1} is not JSON: ${err.message}`, param: 'records' });
      }
    }
    if (!chosen) return setError({ message: 'Upload a dataset-transform policy first.' });
    if (!records.length) return setError({ message: 'Paste at least one JSONL record.' });
    if (records.length > 100) return setError({ message: `At most 100 records per dry run (got ${records.length}).` });
    setBusy(true);
    try {
      const r = await api('/api/datasets/preview', { method: 'POST', json: { transform: chosen, records } });
      setResult({ ...r, inputs: records });
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  }

  return html`<${Card} title="Dataset transform dry run" testid="dryrun">
    <form class="stack" onSubmit=${run}>
      <div class="fields">
        <${Field} label="policy"><select value=${chosen} onChange=${(e) => setPolicy(e.currentTarget.value)} data-testid="dryrun-policy">
          ${transforms.length ? transforms.map((t) => html`<option value=${t}>${t}</option>`) : html`<option value="">no dataset-transform policy</option>`}
        </select></${Field}>
        <${Field} label="records (JSONL, one per line, at most 100)" wide>
          <textarea rows="6" value=${text} onInput=${(e) => setText(e.currentTarget.value)} data-testid="dryrun-input"
            placeholder='{"instruction": "Say hi", "input": "", "output": "Hi!"}'></textarea></${Field}>
      </div>
      <${ErrorBanner} error=${error} testid="dryrun-error" />
      <div class="row"><button class="primary" type="submit" disabled=${busy} data-testid="dryrun-run">${busy ? 'Running…' : 'Dry run'}</button>
        ${result ? html`<span data-testid="dryrun-counts" class="small">
          <${Badge} value=${`keep ${result.counts.keep}`} kind="keep" /> <${Badge} value=${`drop ${result.counts.drop}`} kind="drop" />
          <${Badge} value=${`error ${result.counts.error}`} kind="error" /></span>` : null}
      </div>
    </form>
    ${result
      ? html`<div class="table-wrap" style="margin-top: 10px"><table data-testid="dryrun-results">
          <thead><tr><th>#</th><th>outcome</th><th>input</th><th>output / reason</th></tr></thead>
          <tbody>${result.results.map((r) => html`<tr data-testid="dryrun-row" data-index=${r.index} data-outcome=${r.outcome}>
            <td class="num">${r.index + 1}</td>
            <td><${Badge} value=${r.outcome} /></td>
            <td class="mono small ellipsis" title=${JSON.stringify(result.inputs[r.index])}>${JSON.stringify(result.inputs[r.index])}</td>
            <td class="mono small">${r.output != null ? JSON.stringify(r.output) : ''}${r.reason ? html`<div class="field-error">${r.reason}</div>` : null}</td>
          </tr>`)}</tbody>
        </table></div>`
      : null}
  </${Card}>`;
}

export function PoliciesPage() {
  const list = useLoad(loadPolicies, []);
  const [busy, setBusy] = useState(false);
  const [actionError, setActionError] = useState(null);
  const [notice, setNotice] = useState(null);
  useInterval(() => list.reload(), 3000);

  async function onAction(what, p) {
    setBusy(true);
    setActionError(null);
    setNotice(null);
    try {
      if (what === 'bind' || what === 'unbind') {
        await api(`/admin/bindings/${p.kind}`, { method: 'PUT', json: { policy: what === 'bind' ? p.name : null } });
        setNotice(what === 'bind' ? `${p.name} is now the ${p.kind}.` : `No ${p.kind} is bound now.`);
      } else if (what === 'delete') {
        await api(`/admin/policies/${encodeURIComponent(p.name)}`, { method: 'DELETE' });
        setNotice(`Deleted ${p.name}.`);
      }
    } catch (err) {
      setActionError(err);
    } finally {
      setBusy(false);
      list.reload();
    }
  }

  const data = list.data || { policies: [], bindings: {} };
  const transforms = data.policies.filter((p) => p.kind === 'dataset-transform').map((p) => p.name);
  return html`<div>
    <div class="page-head"><h1>Policies</h1><div class="grow"></div>
      <span class="small muted">router: <b data-testid="binding-router">${data.bindings.router || 'none'}</b>
        · adapter-selector: <b data-testid="binding-adapter-selector">${data.bindings['adapter-selector'] || 'none'}</b></span>
      <button onClick=${() => list.reload()} data-testid="policies-refresh">Refresh</button></div>
    <${ErrorBanner} error=${list.error} />
    <${ErrorBanner} error=${actionError} onClose=${() => setActionError(null)} testid="policy-action-error" />
    ${notice ? html`<${Notice} kind="ok" testid="policy-notice">${notice}</${Notice}>` : null}
    <${Card} title="Policies" testid="policies-list">
      <div class="table-wrap"><table>
        <thead><tr><th>name</th><th>kind</th><th class="num">version</th><th>bound</th><th>on_error</th><th>limits</th>
          <th class="num">calls</th><th class="num">errors</th><th class="num">timeouts</th><th class="num">reused</th><th>size</th><th></th></tr></thead>
        <tbody>${data.policies.map((p) => html`<${PolicyRow} key=${p.name} p=${p} bindings=${data.bindings} onAction=${onAction} busy=${busy} />`)}</tbody>
      </table></div>
      ${data.policies.length === 0 && !list.loading ? html`<div class="empty">No policies uploaded yet.</div>` : null}
    </${Card}>
    <div class="grid2">
      <${Upload} onUploaded=${() => list.reload()} />
      <${DryRun} transforms=${transforms} />
    </div>
  </div>`;
}
