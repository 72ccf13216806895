// Small shared pieces: the htm binding, banners, cards, formatting and the
// hooks every page uses to load and poll.

import { h } from 'preact';
import { useCallback, useEffect, useRef, useState } from 'preact/hooks';
import htm from 'htm';

export const html = htm.bind(h);

/** The API's message, with its code and param when it has them. */
export function ErrorBanner({ error, onClose, testid = 'error-banner' }) {
  if (!error) return null;
  const meta = [
    error.status ? `HTTP ${error.status}` : null,
    error.code ? `code: ${error.code}` : null,
    error.param ? `param: ${error.param}` : null,
  ].filter(Boolean);
  return html`<div class="banner error" role="alert" data-testid=${testid}>
    <div class="msg">
      <div data-testid=${`${testid}-message`}>${error.message || String(error)}</div>
      ${meta.length ? html`<div class="meta">${meta.join(' · ')}</div>` : null}
    </div>
    ${onClose ? html`<button class="link" onClick=${onClose} aria-label="Dismiss">✕</button>` : null}
  </div>`;
}

export function Notice({ kind = 'info', children, testid }) {
  return html`<div class=${`banner ${kind}`} data-testid=${testid}><div class="msg">${children}</div></div>`;
}

export function Card({ title, actions, children, testid, class: cls = '' }) {
  return html`<section class=${`card ${cls}`} data-testid=${testid}>
    ${title || actions ? html`<header><h2>${title}</h2>${actions}</header>` : null}
    ${children}
  </section>`;
}

export function Badge({ value, kind }) {
  return html`<span class=${`badge ${kind || value || ''}`}>${value}</span>`;
}

export function Progress({ value, status, testid }) {
  const pct = Math.max(0, Math.min(1, Number(value) || 0)) * 100;
  return html`<div class=${`progress ${status || ''}`} data-testid=${testid} data-progress=${pct.toFixed(1)}
      role="progressbar" aria-valuenow=${pct.toFixed(0)} aria-valuemin="0" aria-valuemax="100">
    <div style=${`width: ${pct}%`}></div>
  </div>`;
}

/** A labelled form control with its error under it. */
export function Field({ label, error, children, wide, testid, hint }) {
  return html`<label class=${`field ${wide ? 'wide' : ''}`}>
    <span class="name">${label}</span>
    ${children}
    ${hint && !error ? html`<span class="small">${hint}</span>` : null}
    ${error ? html`<span class="field-error" data-testid=${testid}>${error}</span>` : null}
  </label>`;
}

export function fmtBytes(n) {
  if (n == null || Number.isNaN(Number(n))) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = Number(n);
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function fmtNum(n, digits = 0) {
  if (n == null || !Number.isFinite(Number(n))) return '–';
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

export function fmtTime(t) {
  if (t == null || t === '') return '–';
  const d = typeof t === 'number' ? new Date(t * 1000) : new Date(t);
  return Number.isNaN(d.getTime()) ? String(t) : d.toLocaleString();
}

/** Seconds between two RFC 3339 times (or now), as "1m 05s". */
export function fmtDuration(from, to) {
  if (!from) return '–';
  const ms = (to ? new Date(to) : new Date()) - new Date(from);
  if (!Number.isFinite(ms) || ms < 0) return '–';
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, '0')}s`;
  return `${Math.floor(m / 60)}h ${String(m % 60).padStart(2, '0')}m`;
}

/** Calls `fn` every `ms` while mounted (and `enabled`); the latest `fn` is used. */
export function useInterval(fn, ms, enabled = true) {
  const saved = useRef(fn);
  saved.current = fn;
  useEffect(() => {
    if (!enabled || !ms) return undefined;
    const t = setInterval(() => saved.current(), ms);
    return () => clearInterval(t);
  }, [ms, enabled]);
}

/**
 * Loads with `fn` (given an AbortSignal) when `deps` change; `reload()`
 * loads again, keeping the old data on screen meanwhile. A failed reload
 * keeps the data and shows the error.
 */
export function useLoad(fn, deps = []) {
  const [state, setState] = useState({ data: null, error: null, loading: true });
  const saved = useRef(fn);
  saved.current = fn;
  const ctl = useRef(null);
  const reload = useCallback(async () => {
    if (ctl.current) ctl.current.abort();
    const c = new AbortController();
    ctl.current = c;
    setState((s) => ({ ...s, loading: true }));
    try {
      const data = await saved.current(c.signal);
      if (!c.signal.aborted) setState({ data, error: null, loading: false });
    } catch (error) {
      if (!c.signal.aborted && error.name !== 'AbortError') setState((s) => ({ ...s, error, loading: false }));
    }
  }, []);
  useEffect(() => {
    reload();
    return () => ctl.current && ctl.current.abort();
  }, deps);
  return { ...state, reload };
}

/** Copies text; falls back to a hidden textarea where the Clipboard API is refused. */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const ta = document.createElement('textarea');
    ta.value = text;
    ta.setAttribute('readonly', '');
    ta.style.position = 'fixed';
    ta.style.opacity = '0';
    document.body.appendChild(ta);
    ta.select();
    let ok = false;
    try {
      ok = document.execCommand('copy');
    } catch {
      ok = false;
    }
    ta.remove();
    return ok;
  }
}

/** Whether a session may use a scope. */
export function can(session, scope) {
  return !!session && Array.isArray(session.scopes) && session.scopes.includes(scope);
}
