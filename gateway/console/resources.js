// Resources: what the gateway serves right now: models (with their queues
// from /readyz), adapters mounted and in the stores, named prompt caches
// and, for admins, the upstreams' health.

import { useState } from 'preact/hooks';
import { api } from './api.js';
import { html, Card, ErrorBanner, Badge, Notice, fmtBytes, fmtNum, fmtTime, useInterval, useLoad, can } from './ui.js';

/** /readyz answers 503 while a model loads; its message is then the status. */
async function readiness(signal) {
  try {
    return { ok: true, body: await api('/readyz', { signal, key: '' }) };
  } catch (err) {
    if (err.name === 'AbortError') throw err;
    return { ok: false, message: err.message };
  }
}

function Models({ models, ready }) {
  const queues = (ready && ready.ok && ready.body.queues) || {};
  return html`<${Card} title="Models" testid="models">
    ${ready && !ready.ok ? html`<${Notice} kind="info">Not ready: ${ready.message}</${Notice}>` : null}
    <div class="table-wrap"><table>
      <thead><tr><th>id</th><th>status</th><th>served by</th><th>capabilities</th><th class="num">queue</th><th>created</th></tr></thead>
      <tbody>${models.map((m) => {
        const local = m.owned_by === 'mlxgate';
        const q = queues[m.id];
        return html`<tr data-testid="model-row" data-id=${m.id}>
          <td><b>${m.id}</b>${m.dimensions ? html` <span class="small muted">${m.dimensions} dims</span>` : null}</td>
          <td><${Badge} value=${local ? 'ready' : 'upstream'} /></td>
          <td>${local ? 'local' : m.owned_by}</td>
          <td>${(m.capabilities || ['(as the upstream serves)']).map((c) => html`<span class="badge">${c}</span> `)}</td>
          <td class="num">${q ? `${q.waiting} / ${q.max_queued}` : '–'}</td>
          <td class="small">${m.created ? fmtTime(m.created) : '–'}</td>
        </tr>`;
      })}</tbody>
    </table></div>
    ${models.length === 0 ? html`<div class="empty">No model is ready.</div>` : null}
  </${Card}>`;
}

function Adapters({ mounted, available, models, admin, onChange }) {
  const [busy, setBusy] = useState(null);
  const [error, setError] = useState(null);
  const [notice, setNotice] = useState(null);
  const [target, setTarget] = useState({});
  const localModels = models.filter((m) => m.owned_by === 'mlxgate' && (m.capabilities || []).includes('chat.completions'));

  async function act(what, a) {
    setBusy(a.id);
    setError(null);
    setNotice(null);
    try {
      if (what === 'unmount') {
        await api(`/v1/adapters/${encodeURIComponent(a.id)}`, { method: 'DELETE' });
        setNotice(`Unmounted ${a.id}.`);
      } else {
        const t = target[a.id] || {};
        const body = { id: (t.id || a.id).trim(), path: a.path };
        const model = t.model || (a.base_model && localModels.find((m) => m.id === a.base_model) ? a.base_model : '');
        if (model) body.model = model;
        const r = await api('/v1/adapters', { method: 'POST', json: body });
        setNotice(`Mounted ${r.id} on ${r.model} in ${fmtNum(r.mount_ms, 1)} ms.`);
      }
    } catch (err) {
      setError(err);
    } finally {
      setBusy(null);
      onChange();
    }
  }

  const setT = (id, k, v) => setTarget((t) => ({ ...t, [id]: { ...(t[id] || {}), [k]: v } }));
  return html`<${Card} title="LoRA adapters" testid="adapters">
    <${ErrorBanner} error=${error} onClose=${() => setError(null)} testid="adapter-error" />
    ${notice ? html`<${Notice} kind="ok" testid="adapter-notice">${notice}</${Notice}>` : null}
    <h3>Mounted</h3>
    <div class="table-wrap"><table>
      <thead><tr><th>id</th><th>model</th><th>format</th><th class="num">rank</th><th class="num">scale</th><th>path</th><th class="num">size</th><th></th></tr></thead>
      <tbody>${mounted.map((a) => html`<tr data-testid="adapter-row" data-id=${a.id}>
        <td><b>${a.id}</b></td><td>${a.model}</td><td>${a.format}</td><td class="num">${a.rank}</td><td class="num">${fmtNum(a.scale, 2)}</td>
        <td class="mono small ellipsis" title=${a.path}>${a.store != null ? `store ${a.store}: ` : ''}${a.path}</td>
        <td class="num">${fmtBytes(a.size_bytes)}</td>
        <td>${admin ? html`<button class="danger" disabled=${busy === a.id} onClick=${() => act('unmount', a)}
          data-testid=${`adapter-unmount-${a.id}`}>Unmount</button>` : null}</td>
      </tr>`)}</tbody>
    </table></div>
    ${mounted.length === 0 ? html`<div class="empty">No adapter is mounted.</div>` : null}
    <h3 style="margin-top: 12px">In the stores</h3>
    <div class="table-wrap"><table>
      <thead><tr><th>directory</th><th>format</th><th class="num">rank</th><th>base model</th><th>state</th>${admin ? html`<th>mount as</th><th>on model</th><th></th>` : null}</tr></thead>
      <tbody>${available.map((a) => html`<tr data-testid="available-row" data-id=${a.id}>
        <td><b>${a.id}</b><div class="mono small muted ellipsis" title=${a.path}>${a.path}</div></td>
        <td>${a.format}</td><td class="num">${a.rank}</td>
        <td class="small ellipsis" title=${a.base_model || ''}>${a.base_model || '–'}</td>
        <td>${a.mounted ? html`<${Badge} value="mounted" kind="ok" />` : html`<span class="muted">not mounted</span>`}</td>
        ${admin
          ? html`<td><input size="12" value=${(target[a.id] || {}).id ?? a.id} onInput=${(e) => setT(a.id, 'id', e.currentTarget.value)}
                data-testid=${`available-id-${a.id}`} /></td>
              <td><select value=${(target[a.id] || {}).model || ''} onChange=${(e) => setT(a.id, 'model', e.currentTarget.value)}>
                <option value="">default</option>${localModels.map((m) => html`<option value=${m.id}>${m.id}</option>`)}</select></td>
              <td><button disabled=${busy === a.id} onClick=${() => act('mount', a)} data-testid=${`available-mount-${a.id}`}>Mount</button></td>`
          : null}
      </tr>`)}</tbody>
    </table></div>
    ${available.length === 0 ? html`<div class="empty">The adapter stores hold no adapter.</div>` : null}
  </${Card}>`;
}

function Caches({ caches, onChange }) {
  const [error, setError] = useState(null);
  const [confirm, setConfirm] = useState(null);
  async function remove(name) {
    setConfirm(null);
    setError(null);
    try {
      await api(`/v1/prompt_caches/${encodeURIComponent(name)}`, { method: 'DELETE' });
    } catch (err) {
      setError(err);
    }
    onChange();
  }
  const total = caches.reduce((n, c) => n + (c.bytes || 0), 0);
  return html`<${Card} title=${`Prompt caches (${caches.length}, ${fmtBytes(total)})`} testid="caches">
    <${ErrorBanner} error=${error} onClose=${() => setError(null)} />
    <div class="table-wrap"><table>
      <thead><tr><th>name</th><th>model</th><th>adapters</th><th class="num">tokens</th><th class="num">size</th><th>owner</th><th>created</th><th></th></tr></thead>
      <tbody>${caches.map((c) => html`<tr data-testid="cache-row" data-name=${c.name}>
        <td><b>${c.name}</b>${c.auto ? html` <span class="badge">auto</span>` : null}</td>
        <td>${c.model}</td><td>${(c.adapters || []).join(' + ') || '–'}</td>
        <td class="num">${fmtNum(c.tokens)}</td><td class="num">${fmtBytes(c.bytes)}</td>
        <td>${c.owner || '–'}</td><td class="small">${fmtTime(c.created)}</td>
        <td>${confirm === c.name
          ? html`<button class="danger primary" onClick=${() => remove(c.name)}>Delete ${c.name}?</button>`
          : html`<button class="danger" onClick=${() => setConfirm(c.name)}>Delete</button>`}</td>
      </tr>`)}</tbody>
    </table></div>
    ${caches.length === 0 ? html`<div class="empty">No prompt cache files.</div>` : null}
  </${Card}>`;
}

function Upstreams({ upstreams }) {
  return html`<${Card} title="Upstreams" testid="upstreams">
    <div class="table-wrap"><table>
      <thead><tr><th>name</th><th>health</th><th>circuit</th><th class="num">in flight</th><th class="num">latency</th><th>last error</th></tr></thead>
      <tbody>${upstreams.map((u) => html`<tr data-testid="upstream-row" data-name=${u.name}>
        <td><b>${u.name}</b></td>
        <td><${Badge} value=${u.healthy ? 'healthy' : 'unhealthy'} /></td>
        <td><${Badge} value=${u.circuit} /></td>
        <td class="num">${u.in_flight}</td>
        <td class="num">${u.latency_ms != null ? `${fmtNum(u.latency_ms, 1)} ms` : '–'}</td>
        <td class="small" style="color: var(--bad)">${u.last_error || ''}</td>
      </tr>`)}</tbody>
    </table></div>
    ${upstreams.length === 0 ? html`<div class="empty">No upstreams are configured.</div>` : null}
  </${Card}>`;
}

export function ResourcesPage({ session }) {
  const admin = can(session, 'admin');
  const res = useLoad(async (signal) => {
    const soft = (p) => p.catch((err) => (err.name === 'AbortError' ? Promise.reject(err) : { error: err, data: [] }));
    const [models, ready, mounted, available, caches, upstreams] = await Promise.all([
      api('/v1/models', { signal }),
      readiness(signal),
      soft(api('/v1/adapters', { signal })),
      soft(api('/v1/adapters/available', { signal })),
      soft(api('/v1/prompt_caches', { signal })),
      admin ? soft(api('/admin/upstreams', { signal })) : Promise.resolve(null),
    ]);
    return { models, ready, mounted, available, caches, upstreams };
  }, []);
  useInterval(() => res.reload(), 5000);
  const d = res.data;
  const partial = d ? [d.mounted, d.available, d.caches, d.upstreams].find((x) => x && x.error) : null;
  return html`<div>
    <div class="page-head"><h1>Resources</h1><div class="grow"></div>
      <button onClick=${() => res.reload()} data-testid="resources-refresh">Refresh</button></div>
    <${ErrorBanner} error=${res.error || (partial && partial.error)} />
    ${d
      ? html`<${Models} models=${d.models.data || []} ready=${d.ready} />
        <${Adapters} mounted=${d.mounted.data || []} available=${d.available.data || []} models=${d.models.data || []}
          admin=${admin} onChange=${() => res.reload()} />
        <div class="grid2">
          <${Caches} caches=${d.caches.data || []} onChange=${() => res.reload()} />
          ${d.upstreams ? html`<${Upstreams} upstreams=${d.upstreams.data || []} />` : null}
        </div>`
      : !res.error ? html`<div class="muted">Loading…</div>` : null}
  </div>`;
}
