// The live dashboard: polls /dashboard/data every second and updates the page in place.
// Plain JavaScript, no dependencies; the line charts are drawn on <canvas> below.
"use strict";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 5000;
const WINDOW_TEXT = { 60: "over the last minute", 300: "over the last 5 minutes",
                      900: "over the last 15 minutes" };

const state = {
  window: 300,      // seconds, the selected window
  data: null,       // the last answer of /dashboard/data
  timer: null,
};

const $ = (sel) => document.querySelector(sel);
const tile = (id) => document.querySelector(`[data-testid="tile-${id}"]`);

// ---- formatting ------------------------------------------------------------------------

const dash = "—";

function fmtNumber(x, digits = 0) {
  if (x === null || x === undefined || !Number.isFinite(x)) return dash;
  return x.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

function fmtRate(x) {
  if (x === null || x === undefined) return dash;
  return fmtNumber(x, x < 10 ? 1 : 0);
}

function fmtPercent(x) {
  if (x === null || x === undefined) return dash;
  return `${fmtNumber(100 * x, 1)}%`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return dash;
  if (s < 0.001) return `${fmtNumber(s * 1000, 2)} ms`;
  if (s < 1) return `${fmtNumber(s * 1000, s < 0.1 ? 1 : 0)} ms`;
  if (s < 100) return `${fmtNumber(s, 2)} s`;
  return `${fmtNumber(s, 0)} s`;
}

function fmtClock(t, withSeconds = true) {
  const d = new Date(t * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}` + (withSeconds ? `:${pad(d.getSeconds())}` : "");
}

// ---- tiles -----------------------------------------------------------------------------

// One tile: its main value (text, with an optional unit), a raw number for tests and
// scripts (data-value), and an optional line under it.
function setTile(id, value, raw, { unit = "", sub } = {}) {
  const el = tile(id);
  const v = el.querySelector(".value");
  v.textContent = value;
  if (unit && value !== dash) {
    const small = document.createElement("small");
    small.textContent = unit;
    v.append(small);
  }
  el.dataset.value = raw === null || raw === undefined ? "" : String(raw);
  el.dataset.empty = String(value === dash);
  if (sub !== undefined) el.querySelector(".sub").textContent = sub;
}

function renderTiles(d) {
  const g = d.gauges;
  setTile("running", fmtNumber(g.running), g.running);
  setTile("waiting", fmtNumber(g.waiting), g.waiting);
  setTile("kv", fmtPercent(g.kv_cache_usage), g.kv_cache_usage);
  const meter = tile("kv").querySelector(".meter");
  const kv = g.kv_cache_usage || 0;
  meter.firstElementChild.style.width = `${Math.min(100, 100 * kv)}%`;
  meter.dataset.level = kv >= 0.95 ? "full" : kv >= 0.8 ? "high" : "ok";

  const pc = d.prefix_cache;
  setTile("prefix-hit", fmtPercent(pc.hit_rate), pc.hit_rate, {
    sub: pc.queries ? `${fmtNumber(pc.hits)} of ${fmtNumber(pc.queries)} tokens` : "no lookups yet" });

  const tp = d.throughput;
  setTile("gen-tps", fmtRate(tp.generation_tokens_per_s), tp.generation_tokens_per_s,
    { unit: "tok/s", sub: `${fmtNumber(tp.generation_tokens)} tokens generated` });
  tile("gen-tps").dataset.tokens = String(tp.generation_tokens);
  setTile("prompt-tps", fmtRate(tp.prompt_tokens_per_s), tp.prompt_tokens_per_s,
    { unit: "tok/s", sub: `${fmtNumber(tp.prompt_tokens)} prompt tokens` });

  for (const [key, id] of [["ttft", "ttft"], ["itl", "itl"], ["e2e", "e2e"]]) {
    for (const q of ["p50", "p90", "p99"]) {
      if (tile(`${id}-${q}`)) setTile(`${id}-${q}`, fmtSeconds(d.latency[key][q]), d.latency[key][q]);
    }
  }

  const finished = d.requests_finished;
  const total = Object.values(finished).reduce((a, b) => a + b, 0);
  const parts = Object.entries(finished).filter(([, n]) => n > 0)
    .map(([reason, n]) => `${fmtNumber(n)} ${reason}`);
  setTile("finished", fmtNumber(total), total, { sub: parts.length ? parts.join(" · ") : "none yet" });

  const pre = d.preemptions;
  setTile("preemptions", fmtNumber(pre.window), pre.window, { sub: `${fmtNumber(pre.total)} since start` });

  const spec = d.spec_decode;
  const specTile = tile("spec-accept");
  specTile.hidden = spec === null;
  if (spec !== null) {
    setTile("spec-accept", fmtPercent(spec.acceptance_rate), spec.acceptance_rate, {
      sub: spec.mean_acceptance_length === null ? "no drafts yet"
        : `mean length ${fmtNumber(spec.mean_acceptance_length, 2)} tokens` });
  }
}

// ---- charts ----------------------------------------------------------------------------

// Each chart: its canvas, its lines (a series key and a colour variable), how a value
// reads in the legend and on the axis (given the grid step), and a fixed top if any.
const stepDigits = (step) => (Number.isInteger(step) ? 0 : step < 0.1 ? 2 : 1);
const CHARTS = [
  { id: "plot-tokens", lines: [["generation_tokens_per_s", "--c1"], ["prompt_tokens_per_s", "--c2"]],
    format: fmtRate, axis: (v, step) => fmtNumber(v, stepDigits(step)) },
  { id: "plot-requests", lines: [["running", "--c1"], ["waiting", "--c3"]],
    format: (v) => fmtNumber(v), axis: (v) => fmtNumber(v), integer: true },
  { id: "plot-kv", lines: [["kv_cache_usage", "--c4"]], format: fmtPercent,
    axis: (v) => `${fmtNumber(100 * v)}%`, max: 1 },
];

// A round step for four grid rows reaching at least top: 1, 2, 2.5 or 5 x 10^n
// (whole numbers only where the values are counts).
function gridStep(top, integer) {
  const raw = Math.max(top, 1e-9) / 4;
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) {
    const step = m * p;
    if (step >= raw - 1e-12 && (!integer || Number.isInteger(step))) return step;
  }
  return 10 * p;
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// A chart's frame: the canvas sized for the screen, the plot area inside its margins,
// and the maps from time and value to pixels.
function chartFrame(canvas, t0, t1, top) {
  const rect = canvas.getBoundingClientRect();
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(rect.width * dpr);
  canvas.height = Math.round(rect.height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.font = "11px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
  const left = 46, right = rect.width - 8, topY = 8, bottom = rect.height - 20;
  return {
    ctx, left, right, top: topY, bottom,
    x: (t) => left + ((t - t0) / (t1 - t0)) * (right - left),
    y: (v) => bottom - (v / top) * (bottom - topY),
  };
}

function drawGrid(f, spec, step) {
  const { ctx } = f;
  ctx.lineWidth = 1;
  ctx.fillStyle = cssVar("--muted");
  ctx.strokeStyle = cssVar("--grid");
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  for (let i = 0; i <= 4; i++) {
    const yy = Math.round(f.y(i * step)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(f.left, yy);
    ctx.lineTo(f.right, yy);
    ctx.stroke();
    ctx.fillText(spec.axis(i * step, step), f.left - 6, yy);
  }
}

// Clock labels at a round step giving at most six across the span.
function drawTimeTicks(f, t0, t1) {
  const tick = [2, 5, 10, 15, 30, 60, 120, 180, 300, 600].find((s) => (t1 - t0) / s <= 6) || 900;
  f.ctx.textAlign = "center";
  f.ctx.textBaseline = "top";
  for (let t = Math.ceil(t0 / tick) * tick; t <= t1; t += tick) {
    const xx = f.x(t);
    if (xx >= f.left + 14 && xx <= f.right - 14) f.ctx.fillText(fmtClock(t, tick < 60), xx, f.bottom + 5);
  }
}

// One line, a dot on its newest point, and (for a chart's first line) a light area under it.
function drawLine(f, times, values, color, area) {
  const { ctx } = f;
  const trace = () => {
    ctx.beginPath();
    times.forEach((t, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, f.x(t), f.y(values[i])));
  };
  if (area && times.length > 1) {
    trace();
    ctx.lineTo(f.x(times[times.length - 1]), f.y(0));
    ctx.lineTo(f.x(times[0]), f.y(0));
    ctx.closePath();
    ctx.globalAlpha = 0.12;
    ctx.fillStyle = color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
  trace();
  ctx.strokeStyle = color;
  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  ctx.stroke();
  const last = times.length - 1;
  ctx.beginPath();
  ctx.arc(f.x(times[last]), f.y(values[last]), 2.5, 0, 2 * Math.PI);
  ctx.fillStyle = color;
  ctx.fill();
}

function drawChart(spec, series, t0, t1) {
  const canvas = document.getElementById(spec.id);
  canvas.dataset.points = String(series.t.length);
  if (canvas.getBoundingClientRect().width === 0) return;
  let top = 0;
  for (const [key] of spec.lines) for (const v of series[key]) if (v > top) top = v;
  const step = spec.max ? spec.max / 4 : gridStep(Math.max(top * 1.05, spec.integer ? 4 : 1),
                                                   spec.integer);
  const f = chartFrame(canvas, t0, t1, 4 * step);
  drawGrid(f, spec, step);
  drawTimeTicks(f, t0, t1);
  if (series.t.length === 0) {
    f.ctx.textAlign = "center";
    f.ctx.textBaseline = "middle";
    f.ctx.fillText("waiting for data…", (f.left + f.right) / 2, (f.top + f.bottom) / 2);
    return;
  }
  f.ctx.save();
  f.ctx.beginPath();
  f.ctx.rect(f.left, f.top - 2, f.right - f.left, f.bottom - f.top + 4);
  f.ctx.clip();
  spec.lines.forEach(([key, colorVar], n) => drawLine(f, series.t, series[key], cssVar(colorVar), n === 0));
  f.ctx.restore();
}

function renderCharts() {
  const d = state.data;
  if (d === null) return;
  // the selected window, or less while the server's history is shorter (10 s at least)
  const t1 = d.now, t0 = d.now - Math.min(state.window, Math.max(d.window_s, 10));
  for (const spec of CHARTS) drawChart(spec, d.series, t0, t1);
  for (const el of document.querySelectorAll("[data-latest]")) {
    const values = d.series[el.dataset.latest];
    const v = values.length ? values[values.length - 1] : null;
    const spec = CHARTS.find((c) => c.lines.some(([key]) => key === el.dataset.latest));
    el.textContent = spec.format(v);
  }
}

// ---- polling ---------------------------------------------------------------------------

function showBanner(message) {
  const banner = $("#banner");
  if (message === null) {
    banner.hidden = true;
    banner.textContent = "";
    return;
  }
  if (banner.textContent !== message) banner.textContent = message;
  banner.hidden = false;
}

function setLive(kind, text) {
  $("#live").dataset.state = kind;
  $("#live-text").textContent = text;
}

async function fetchJson(url) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  try {
    const r = await fetch(url, { signal: controller.signal, cache: "no-store" });
    let body = null;
    try { body = await r.json(); } catch { /* not JSON: the status says enough */ }
    return { status: r.status, ok: r.ok, body };
  } finally {
    clearTimeout(timer);
  }
}

function failureMessage(status, body) {
  const said = body && body.error && body.error.message;
  if (status === 404) {
    return "Metrics are disabled on this server (--disable-metrics), so the dashboard has " +
      "nothing to show. Restart the server without that flag to see them.";
  }
  return `The server answered ${status} for the dashboard's data${said ? `: ${said}` : ""}. Retrying…`;
}

async function poll() {
  const window_s = state.window;
  try {
    const r = await fetchJson(`/dashboard/data?window=${window_s}`);
    if (!r.ok || r.body === null) {
      showBanner(failureMessage(r.status, r.body));
      setLive("down", "No data");
    } else if (window_s === state.window) {  // a reply for a window since changed is dropped
      state.data = r.body;
      showBanner(null);
      setLive("live", `Live · ${fmtClock(r.body.now)}`);
      document.getElementById("main").dataset.window = String(window_s);
      renderWindowText(r.body.window_s);
      renderTiles(r.body);
      renderCharts();
      renderModel(r.body.model);
    }
  } catch {
    showBanner("Cannot reach the server: it may have stopped. Retrying every second…");
    setLive("down", "Disconnected");
  }
  schedule();
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, POLL_MS);
}

// The served model's name, as /metrics labels it (open without the API key).
function renderModel(name) {
  const el = $("#model-name");
  const text = name || "model unknown";
  if (el.textContent !== text) {
    el.textContent = text;
    el.title = name ? `Served model: ${name}` : "";
  }
}

// The sections' "over the last ..." words, with how much history there is while that is
// less than the window (a server that just started).
function renderWindowText(covered) {
  let text = WINDOW_TEXT[state.window] || `over the last ${state.window} s`;
  if (covered !== null && covered < state.window - 2) {
    text += ` (${covered < 120 ? `${Math.round(covered)} s` : `${Math.round(covered / 60)} min`}` +
      " of history so far)";
  }
  for (const el of document.querySelectorAll("[data-window-text]")) {
    if (el.textContent !== text) el.textContent = text;
  }
}

function selectWindow(seconds) {
  state.window = seconds;
  renderWindowText(null);
  clearTimeout(state.timer);
  poll();
}

function start() {
  for (const input of document.querySelectorAll('input[name="window"]')) {
    input.addEventListener("change", () => { if (input.checked) selectWindow(Number(input.value)); });
  }
  const checked = document.querySelector('input[name="window"]:checked');
  state.window = Number(checked ? checked.value : 300);
  new ResizeObserver(() => renderCharts()).observe(document.querySelector(".plots"));
  window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", renderCharts);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
  poll();
}

start();
