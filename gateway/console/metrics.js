// Metrics: /metrics polled every 2 s, parsed here, turned into rates and
// means from counter deltas, charted over the last minutes per model and
// per tenant. History lives at module level so it survives page switches.

import { useEffect, useMemo, useState } from 'preact/hooks';
import { fetchMetrics } from './api.js';
import { html, Card, ErrorBanner, fmtNum } from './ui.js';
import { LineChart } from './charts.js';

const POLL_MS = 2000;
const KEEP_S = 10 * 60;

/**
 * Parses Prometheus text exposition into samples
 * `{name, labels: {..}, value}`; comments and malformed lines are skipped.
 */
export function parseProm(text) {
  const out = [];
  for (const raw of text.split('\n')) {
    const line = raw.trim();
    if (!line || line.startsWith('#')) continue;
    let i = 0;
    while (i < line.length && /[A-Za-z0-9_:]/.test(line[i])) i++;
    const name = line.slice(0, i);
    if (!name) continue;
    const labels = {};
    if (line[i] === '{') {
      i++;
      for (;;) {
        while (line[i] === ' ' || line[i] === ',') i++;
        if (line[i] === '}') {
          i++;
          break;
        }
        const eq = line.indexOf('=', i);
        if (eq < 0) break;
        const key = line.slice(i, eq).trim();
        i = eq + 1;
        if (line[i] !== '"') break;
        i++;
        let val = '';
        while (i < line.length && line[i] !== '"') {
          if (line[i] === '\\' && i + 1 < line.length) {
            const c = line[i + 1];
            val += c === 'n' ? '\n' : c;
            i += 2;
          } else {
            val += line[i++];
          }
        }
        i++;
        labels[key] = val;
      }
    }
    const rest = line.slice(i).trim().split(/\s+/);
    const v = rest[0];
    const value = v === '+Inf' ? Infinity : v === '-Inf' ? -Infinity : Number(v);
    if (rest[0] === undefined || Number.isNaN(value)) continue;
    out.push({ name, labels, value });
  }
  return out;
}

/** Sums samples of `name` grouped by the value of `by` (or all together when `by` is null). */
function sumBy(samples, name, by, filter = () => true) {
  const m = new Map();
  for (const s of samples) {
    if (s.name !== name || !filter(s.labels)) continue;
    const k = by ? s.labels[by] ?? '' : 'all';
    m.set(k, (m.get(k) || 0) + s.value);
  }
  return m;
}

// Poll history, shared by every mount of the page: [{t, sums: {key: Map}}].
const history = [];
let poller = null;
const listeners = new Set();
let lastError = null;

/** The counters the charts need, summed per model and per tenant. */
function digest(samples) {
  return {
    http: sumBy(samples, 'mlxgate_http_requests_total', null),
    reqModel: sumBy(samples, 'mlxgate_requests_total', 'model'),
    reqTenant: sumBy(samples, 'mlxgate_requests_total', 'tenant'),
    latSumModel: sumBy(samples, 'mlxgate_request_latency_seconds_sum', 'model'),
    latCountModel: sumBy(samples, 'mlxgate_request_latency_seconds_count', 'model'),
    ttftSumModel: sumBy(samples, 'mlxgate_time_to_first_token_seconds_sum', 'model'),
    ttftCountModel: sumBy(samples, 'mlxgate_time_to_first_token_seconds_count', 'model'),
    httpSum: sumBy(samples, 'mlxgate_http_request_duration_seconds_sum', null),
    httpCount: sumBy(samples, 'mlxgate_http_request_duration_seconds_count', null),
    tokModel: sumBy(samples, 'mlxgate_tokens_total', 'model', (l) => l.kind === 'completion'),
    tokTenant: sumBy(samples, 'mlxgate_tokens_total', 'tenant', (l) => l.kind === 'completion'),
    promptTenant: sumBy(samples, 'mlxgate_tokens_total', 'tenant', (l) => l.kind === 'prompt'),
    inflight: sumBy(samples, 'mlxgate_model_sequences_in_flight', 'model'),
    waiting: sumBy(samples, 'mlxgate_model_queue_waiting', 'model'),
    policyCalls: sumBy(samples, 'mlxgate_policy_calls_total', 'policy'),
  };
}

async function pollOnce() {
  try {
    const text = await fetchMetrics();
    const t = Date.now() / 1000;
    history.push({ t, d: digest(parseProm(text)) });
    while (history.length && history[0].t < t - KEEP_S) history.shift();
    lastError = null;
  } catch (err) {
    lastError = err;
  }
  for (const l of listeners) l();
}

function subscribe(fn) {
  listeners.add(fn);
  if (!poller) {
    pollOnce();
    poller = setInterval(pollOnce, POLL_MS);
  }
  return () => {
    listeners.delete(fn);
    if (!listeners.size && poller) {
      clearInterval(poller);
      poller = null;
    }
  };
}

/**
 * uPlot data of per-second rates of counter `key` (one series per label
 * value), from consecutive polls. A counter that went down (a restart)
 * counts from zero.
 */
function rateSeries(key, scale = 1) {
  const labels = [...new Set(history.flatMap((h) => [...h.d[key].keys()]))].sort();
  const xs = [];
  const ys = labels.map(() => []);
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1];
    const b = history[i];
    const dt = b.t - a.t;
    if (dt <= 0) continue;
    xs.push(b.t);
    labels.forEach((l, j) => {
      const vb = b.d[key].get(l);
      const va = a.d[key].get(l) ?? 0;
      ys[j].push(vb == null ? null : ((vb >= va ? vb - va : vb) / dt) * scale);
    });
  }
  return { labels, data: [xs, ...ys] };
}

/** Mean of a histogram over each poll interval: Δsum / Δcount (null when nothing was observed). */
function meanSeries(sumKey, countKey, scale = 1) {
  const labels = [...new Set(history.flatMap((h) => [...h.d[countKey].keys()]))].sort();
  const xs = [];
  const ys = labels.map(() => []);
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1];
    const b = history[i];
    xs.push(b.t);
    labels.forEach((l, j) => {
      const dc = (b.d[countKey].get(l) ?? 0) - (a.d[countKey].get(l) ?? 0);
      const ds = (b.d[sumKey].get(l) ?? 0) - (a.d[sumKey].get(l) ?? 0);
      ys[j].push(dc > 0 ? (ds / dc) * scale : null);
    });
  }
  return { labels, data: [xs, ...ys] };
}

function gaugeSeries(key) {
  const labels = [...new Set(history.flatMap((h) => [...h.d[key].keys()]))].sort();
  const xs = history.map((h) => h.t);
  const ys = labels.map((l) => history.map((h) => h.d[key].get(l) ?? null));
  return { labels, data: [xs, ...ys] };
}

/** Joins several series sets over the same x (the polls) into one chart. */
function join(...sets) {
  const withData = sets.filter((s) => s.labels.length);
  if (!withData.length) return { labels: [], data: [sets[0].data[0]] };
  return {
    labels: withData.flatMap((s) => s.labels.map((l) => (s.prefix ? `${s.prefix}${l}` : l))),
    data: [withData[0].data[0], ...withData.flatMap((s) => s.data.slice(1))],
  };
}

function Chart({ title, set, testid, unit, digits = 2, points = false }) {
  if (!set.labels.length) {
    return html`<div data-testid=${testid} data-points="0"><div class="chart-title">${title}</div>
      <div class="chart-empty">No such series on this gateway yet.</div></div>`;
  }
  return html`<${LineChart} title=${title} labels=${set.labels} data=${set.data} testid=${testid} points=${points}
    yFormat=${(v) => `${fmtNum(v, digits)}${unit ? ` ${unit}` : ''}`} />`;
}

export function MetricsPage() {
  const [tick, setTick] = useState(0);
  useEffect(() => subscribe(() => setTick((n) => n + 1)), []);

  const sets = useMemo(() => {
    const http = { ...rateSeries('http'), prefix: 'HTTP ' };
    http.labels = http.labels.map(() => 'all');
    const reqModel = { ...rateSeries('reqModel'), prefix: 'model ' };
    return {
      requests: join(http, reqModel),
      reqTenant: rateSeries('reqTenant'),
      latency: join(
        { ...meanSeries('latSumModel', 'latCountModel', 1000), prefix: 'e2e ' },
        { ...meanSeries('ttftSumModel', 'ttftCountModel', 1000), prefix: 'TTFT ' },
      ),
      httpLatency: meanSeries('httpSum', 'httpCount', 1000),
      tokModel: rateSeries('tokModel'),
      tokTenant: rateSeries('tokTenant'),
      promptTenant: rateSeries('promptTenant'),
      load: join({ ...gaugeSeries('inflight'), prefix: 'in flight ' }, { ...gaugeSeries('waiting'), prefix: 'waiting ' }),
      policy: rateSeries('policyCalls'),
    };
  }, [tick]);

  const last = history[history.length - 1];
  const totals = last
    ? [
        ['http', 'HTTP requests', [...last.d.http.values()].reduce((a, b) => a + b, 0)],
        ['inference', 'inference requests', [...last.d.reqModel.values()].reduce((a, b) => a + b, 0)],
        ['completion-tokens', 'completion tokens', [...last.d.tokModel.values()].reduce((a, b) => a + b, 0)],
        ['policy-calls', 'policy calls', [...last.d.policyCalls.values()].reduce((a, b) => a + b, 0)],
      ]
    : [];
  return html`<div>
    <div class="page-head"><h1>Metrics</h1><div class="grow"></div>
      <span class="small muted" data-testid="metrics-samples" data-count=${history.length}>
        ${history.length} polls every ${POLL_MS / 1000} s, last ${Math.round(KEEP_S / 60)} minutes kept</span></div>
    <${ErrorBanner} error=${lastError} />
    ${totals.length
      ? html`<div class="card row" data-testid="metrics-totals">${totals.map(([id, k, v]) => html`<div style="min-width: 150px" data-testid=${`metrics-total-${id}`} data-value=${v}>
          <div class="small muted">${k} (total)</div><div style="font-size: 18px; font-weight: 600">${fmtNum(v)}</div></div>`)}</div>`
      : null}
    <div class="grid2">
      <${Card}><${Chart} title="Requests / s (HTTP, and inference per model)" set=${sets.requests} testid="metrics-chart-requests" unit="/s" /></${Card}>
      <${Card}><${Chart} title="Inference requests / s per tenant" set=${sets.reqTenant} testid="metrics-chart-requests-tenant" unit="/s" /></${Card}>
      <${Card}><${Chart} title="Mean latency per model (end to end, time to first token)" set=${sets.latency} testid="metrics-chart-latency" unit="ms" digits=${0} points=${true} /></${Card}>
      <${Card}><${Chart} title="Mean HTTP request duration (all routes)" set=${sets.httpLatency} testid="metrics-chart-http-latency" unit="ms" digits=${1} /></${Card}>
      <${Card}><${Chart} title="Completion tokens / s per model" set=${sets.tokModel} testid="metrics-chart-tokens" unit="tok/s" digits=${1} /></${Card}>
      <${Card}><${Chart} title="Completion tokens / s per tenant" set=${sets.tokTenant} testid="metrics-chart-tokens-tenant" unit="tok/s" digits=${1} /></${Card}>
      <${Card}><${Chart} title="Prompt tokens / s per tenant" set=${sets.promptTenant} testid="metrics-chart-prompt-tenant" unit="tok/s" digits=${1} /></${Card}>
      <${Card}><${Chart} title="Sequences in flight and waiting per model" set=${sets.load} testid="metrics-chart-load" digits=${0} /></${Card}>
      <${Card}><${Chart} title="Policy calls / s" set=${sets.policy} testid="metrics-chart-policy" unit="/s" /></${Card}>
    </div>
  </div>`;
}
