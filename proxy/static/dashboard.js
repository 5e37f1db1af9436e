// The polyinfer dashboard: reads GET stats/history and draws every card of the page.
// Query parameters: window=300|3600 (seconds), pct=p50|p90|p99, key=<API key> (moved to
// this tab's sessionStorage and out of the address bar at once).
"use strict";

const KEY_STORE = "polyinfer.api_key";
const REFRESH_MS = { 300: 2000, 3600: 10000 };
const params = new URLSearchParams(location.search);
const view = { window: Number(params.get("window")) === 3600 ? 3600 : 300,
               pct: ["p50", "p90", "p99"].includes(params.get("pct")) ? params.get("pct") : "p90" };
let timer = null;

const fmt = {
  rate: v => v === undefined || v === null ? "–" : v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2),
  count: v => v === undefined || v === null ? "–" : (Math.round(v * 10) / 10).toString(),
  seconds: v => v === undefined || v === null ? "–" : v >= 1 ? v.toFixed(2) + " s" : (v * 1e3).toPrecision(3) + " ms",
  share: v => v === undefined || v === null ? "–" : Math.round(v * 100) + "%",
  factor: v => v === undefined || v === null ? "–" : v.toFixed(2) + "×",
};

// {name: values} -> chart series of one kind (worker, domain, status...).
function perName(table, kind, extra) {
  return Object.entries(table || {}).map(([name, values]) =>
    ({ name, kind, values, label: name + ((extra && extra.suffix) || ""), dash: extra && extra.dash }));
}

function latency(table, kind) {
  return Object.entries(table || {}).map(([name, p]) => ({ name, kind, values: p[view.pct] }));
}

const CHARTS = {
  requests: { series: d => perName(d.series.requests_per_s, "worker"), fmt: fmt.rate },
  errors: { series: d => perName(d.series.errors_per_s, "worker"), fmt: fmt.rate },
  refused: { series: d => perName(d.series.refused_per_s, "status"), fmt: fmt.rate },
  load: { series: d => [...perName(d.series.outstanding, "worker"),
                        ...perName(d.series.running, "worker", { dash: true, suffix: " running" })],
          fmt: fmt.count },
  ttft_worker: { series: d => latency(d.series.ttft_s.worker, "worker"), fmt: fmt.seconds },
  ttft_domain: { series: d => latency(d.series.ttft_s.domain, "domain"), fmt: fmt.seconds },
  tpot_worker: { series: d => latency(d.series.tpot_s.worker, "worker"), fmt: fmt.seconds },
  tpot_domain: { series: d => latency(d.series.tpot_s.domain, "domain"), fmt: fmt.seconds },
  depth: { series: d => perName(d.series.spec_depth, "domain"), fmt: fmt.count },
  acceptance: { series: d => perName(d.series.acceptance, "domain"), fmt: fmt.share },
  // RMS log error as the factor it stands for: exp(0.26) = 1.3x, a typical miss of ~30%
  prediction_error: { series: d => perName(d.series.prediction_error, "latency").map(s =>
    ({ ...s, values: s.values.map(v => v === null ? null : Math.exp(v)) })), fmt: fmt.factor, refLine: 1 },
};

// The optimizer's events as the timeline draws them, and as markers on every time chart.
const EVENT_SYMBOLS = {
  campaign: { glyph: "▶", color: "#4e79a7", what: "campaign started" },
  campaign_done: { glyph: "◆", color: "#9aa3ad", what: "campaign ended" },
  promoted: { glyph: "▲", color: "#2e9e47", what: "promoted" },
  rolled_back: { glyph: "▼", color: "#d62728", what: "rolled back" },
  refused: { glyph: "✕", color: "#f28e2b", what: "promotion refused" },
};

function eventSymbol(e) {
  const s = EVENT_SYMBOLS[e.kind] || { glyph: "•", color: "#666", what: e.kind };
  const gain = typeof e.gain === "number" ? ` gain ${(e.gain * 100).toFixed(1)}%` : "";
  const status = e.status ? ` (${e.status})` : "";
  const reason = e.reason ? ` ${e.reason}` : "";
  return { ...s, label: `${Charts.clock(e.ts, true)} ${s.what}${status}: ${e.campaign}${gain}${reason}` };
}

function card(name) { return document.querySelector(`[data-chart="${name}"]`); }

function draw(doc) {
  const range = { start: doc.end_s - doc.window_s, end: doc.end_s };
  const opt = doc.optimizer || {};
  const markerList = (opt.events || []).filter(e => e.kind !== "campaign_done")
    .map(e => ({ ts: e.ts, kind: e.kind, label: eventSymbol(e).label }));
  for (const [name, chart] of Object.entries(CHARTS)) {
    const c = card(name);
    const series = chart.series(doc);
    Charts.legend(c.querySelector(".legend"), series);
    Charts.timeSeries(c.querySelector("svg"), { t: doc.t, step: doc.step_s, range, series, fmt: chart.fmt,
                                                refLine: chart.refLine, markerList });
  }
  drawRouting(doc.routing);
  drawOptimizer(opt, doc, range);
  drawWorkers(doc.now.workers);
  const meta = document.getElementById("meta");
  meta.textContent = `policy ${doc.now.policy} · in flight ${doc.now.in_flight} · ` +
    `requests ${doc.now.requests_total} · step ${doc.step_s} s · updated ${Charts.clock(doc.end_s, true)}`;
  document.body.dataset.updated = String(doc.end_s);
}

function drawRouting(routing) {
  const domains = Object.keys(routing.matrix).sort();
  const workers = [...new Set(domains.flatMap(d => Object.keys(routing.matrix[d])))].sort();
  const reasonsOf = (d, w) => Object.entries((routing.reasons[d] || {})[w] || {})
    .sort((a, b) => b[1] - a[1]).map(([r, n]) => `${r} ${n}`).join(", ");
  Charts.heatmap(card("routing").querySelector("svg"), {
    rows: domains, cols: workers, count: (d, w) => routing.matrix[d][w] || 0,
    title: (d, w) => `${d} → ${w}: ${routing.matrix[d][w] || 0} requests` +
      (reasonsOf(d, w) ? ` (${reasonsOf(d, w)})` : ""),
  });
  const byWorker = {};
  for (const d of domains)
    for (const [w, reasons] of Object.entries(routing.reasons[d] || {}))
      for (const [r, n] of Object.entries(reasons)) {
        byWorker[w] = byWorker[w] || {};
        byWorker[w][r] = (byWorker[w][r] || 0) + n;
      }
  document.getElementById("reasons").textContent = "decision reasons: " + (Object.entries(byWorker)
    .map(([w, rs]) => `${w}: ` + Object.entries(rs).sort((a, b) => b[1] - a[1]).map(([r, n]) => `${r} ${n}`).join(", "))
    .join(" · ") || "none");
}

function drawOptimizer(opt, doc, range) {
  const c = card("optimizer");
  const note = document.getElementById("optimizer-note");
  const svg = c.querySelector("svg");
  if (!opt.enabled) {
    note.textContent = "The optimizer is off (polyinfer serve --optimize turns it on).";
    Charts.timeline(svg, { range, t: doc.t, step: doc.step_s, states: [], bars: {}, events: [], symbol: eventSymbol });
    Charts.legend(c.querySelector(".legend"), []);
    drawCandidates(null);
    return;
  }
  const live = opt.live || {};
  const perHour = Object.entries(live.experiments_per_hour || {}).map(([t, n]) => `${t} ${n}/h`).join(", ");
  note.textContent = `state: ${live.state || "not started"}` + (live.campaign ? ` · campaign ${live.campaign}` : "") +
    (live.fast_budget ? ` · ${live.fast_experiments}/${live.fast_budget} fast experiments` : "") +
    (perHour ? ` · ${perHour}` : "") + (live.last_error ? ` · last error: ${live.last_error}` : "") +
    (opt.board_error ? ` · board: ${opt.board_error}` : "");
  Charts.timeline(svg, { range, t: doc.t, step: doc.step_s, states: opt.states || [], bars: opt.experiments || {},
                         events: opt.events || [], symbol: eventSymbol });
  const kinds = [...new Set((opt.events || []).map(e => e.kind))];
  Charts.legend(c.querySelector(".legend"), [
    ...Object.keys(opt.experiments || {}).map(name => ({ name, kind: "tier", label: name + " experiments" })),
    ...kinds.map(k => ({ name: k, color: eventSymbol({ kind: k }).color, label: (EVENT_SYMBOLS[k] || { glyph: "•" }).glyph + " " + eventSymbol({ kind: k }).what })),
  ]);
  drawCandidates(opt.candidates);
}

function drawCandidates(cands) {
  const note = document.getElementById("candidates-note");
  const rows = (cands && cands.top) || [];
  note.textContent = cands ? `campaign ${cands.campaign}: ` +
    Object.entries(cands.counts).map(([s, n]) => `${n} ${s}`).join(", ") : "no campaign on the board yet";
  const tiers = (cands && cands.tiers) || [];
  fillTable("candidates", ["status", "agent", "predicted", ...tiers, "knobs"], rows.map(r => [
    r.status, r.agent, r.predicted === null ? "–" : r.predicted.toFixed(1),
    ...tiers.map(t => r.values[t] === undefined ? "–" : r.values[t].toFixed(1)),
    typeof r.key === "object" ? Object.entries(r.key).map(([k, v]) => `${k}=${v}`).join(" ") : String(r.key),
  ]), { knobs: true });
}

function drawWorkers(workers) {
  fillTable("workers", ["name", "backend", "healthy", "breaker", "outstanding", "running", "waiting",
                        "kv cache", "spec", "restarts", "url"],
    workers.map(w => [w.name, w.backend, w.healthy ? "yes" : "NO", w.breaker, w.outstanding_requests, w.running,
                      w.waiting, fmt.share(w.kv_cache_usage), w.spec_method || "–", w.restarts ?? "–", w.url]));
}

function fillTable(id, header, rows, opts) {
  const table = document.getElementById(id);
  table.replaceChildren();
  const head = table.insertRow();
  for (const h of header) { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); }
  for (const r of rows) {
    const tr = table.insertRow();
    r.forEach((v, i) => {
      const td = tr.insertCell();
      td.textContent = v === null || v === undefined ? "–" : String(v);
      if (opts && opts.knobs && i === r.length - 1) td.className = "knobs";
      if (v === "NO") td.className = "bad";
    });
  }
  table.dataset.rows = String(rows.length);
}

// -- fetching, with the API key when the proxy wants one --------------------------------

function takeKeyFromUrl() {
  const key = params.get("key");
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  params.delete("key");
  const rest = params.toString();
  window.history.replaceState(null, "", location.pathname + (rest ? "?" + rest : ""));
}

async function refresh() {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.Authorization = "Bearer " + key;
  let resp;
  try {
    resp = await fetch(`stats/history?window=${view.window}`, { headers, cache: "no-store" });
  } catch (e) {
    document.getElementById("meta").textContent = "cannot reach the proxy: " + e;
    return;
  }
  if (resp.status === 401) {
    askForKey(key ? "that key was refused" : "");
    return;
  }
  if (!resp.ok) {
    document.getElementById("meta").textContent = `stats/history answered ${resp.status}`;
    return;
  }
  document.getElementById("key-form").classList.remove("shown");
  draw(await resp.json());
}

function askForKey(error) {
  document.getElementById("key-form").classList.add("shown");
  document.getElementById("key-error").textContent = error;
  document.getElementById("meta").textContent = "waiting for an API key";
  document.body.dataset.auth = "wanted";
}

function setView(change) {
  Object.assign(view, change);
  const p = new URLSearchParams({ window: view.window, pct: view.pct });
  window.history.replaceState(null, "", location.pathname + "?" + p);
  for (const b of document.querySelectorAll("[data-window]")) b.classList.toggle("on", Number(b.dataset.window) === view.window);
  for (const b of document.querySelectorAll("[data-pct]")) b.classList.toggle("on", b.dataset.pct === view.pct);
  for (const s of document.querySelectorAll(".pct")) s.textContent = view.pct;
  clearInterval(timer);
  timer = setInterval(refresh, REFRESH_MS[view.window]);
  refresh();
}

takeKeyFromUrl();
document.getElementById("key-form").addEventListener("submit", e => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORE, document.getElementById("key-input").value.trim());
  refresh();
});
for (const b of document.querySelectorAll("[data-window]")) b.addEventListener("click", () => setView({ window: Number(b.dataset.window) }));
for (const b of document.querySelectorAll("[data-pct]")) b.addEventListener("click", () => setView({ pct: b.dataset.pct }));
setView({});
