// Line charts on uPlot (loaded as a classic script: the global `uPlot`).
// The wrapper carries what uPlot last drew (data-drawn-points, counted in
// uPlot's own draw hook), so tests and operators can tell an empty chart
// from one with data.

import { useEffect, useRef } from 'preact/hooks';
import { html } from './ui.js';

const PALETTE = ['#2f6feb', '#e36209', '#1a7f37', '#8250df', '#cf222e', '#0598bc', '#bf8700', '#6e7781'];

function cssVar(name, fallback) {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

/** Non-null y values across every series of uPlot data. */
export function countPoints(data) {
  let n = 0;
  for (let s = 1; s < data.length; s++) {
    for (const y of data[s]) if (y != null && Number.isFinite(y)) n++;
  }
  return n;
}

/**
 * `labels`: one name per y series; `data`: [xs, ys1, ys2, ...] (xs sorted).
 * `time`: x in Unix seconds (metrics) or plain numbers (steps).
 */
export function LineChart({ title, labels, data, height = 200, time = true, testid, yFormat, points = false }) {
  const box = useRef(null);
  const plot = useRef(null);
  const key = labels.join('\u0000');

  // (Re)create the plot when its series change; uPlot cannot add series in place.
  useEffect(() => {
    const el = box.current;
    if (!el || typeof uPlot === 'undefined') return undefined;
    const fg = cssVar('--muted', '#666');
    const grid = cssVar('--grid', 'rgba(0,0,0,0.1)');
    const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    let draws = 0;
    const opts = {
      width: Math.max(200, el.clientWidth || 400),
      height,
      scales: { x: { time } },
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      axes: [
        { ...axis },
        // Tick labels stay uPlot's own (compact); units are in the title and legend.
        { ...axis, size: 52 },
      ],
      series: [
        { label: time ? 'time' : 'step' },
        ...labels.map((label, i) => ({
          label,
          stroke: PALETTE[i % PALETTE.length],
          width: 1.6,
          spanGaps: true,
          points: { show: points, size: 4 },
          value: yFormat ? (u, v) => (v == null ? '–' : yFormat(v)) : undefined,
        })),
      ],
      hooks: {
        draw: [
          (u) => {
            draws++;
            const host = el.parentElement || el;
            host.dataset.draws = String(draws);
            host.dataset.drawnPoints = String(countPoints(u.data));
          },
        ],
      },
    };
    plot.current = new uPlot(opts, data, el);
    const ro = new ResizeObserver(() => {
      if (plot.current && el.clientWidth) plot.current.setSize({ width: el.clientWidth, height });
    });
    ro.observe(el);
    return () => {
      ro.disconnect();
      if (plot.current) plot.current.destroy();
      plot.current = null;
    };
  }, [key, height, time]);

  // New data on the same series: setData redraws (and rescales).
  useEffect(() => {
    if (plot.current) plot.current.setData(data);
  }, [data]);

  const n = countPoints(data);
  let max = null;
  for (let s = 1; s < data.length; s++) for (const y of data[s]) if (y != null && (max == null || y > max)) max = y;
  return html`<div data-testid=${testid} data-points=${n} data-max=${max == null ? '' : max}>
    ${title ? html`<div class="chart-title">${title}</div>` : null}
    <div class="chart" ref=${box}></div>
    ${n === 0 ? html`<div class="chart-empty">No data points yet.</div>` : null}
  </div>`;
}
