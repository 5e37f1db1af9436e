// Small SVG charts for the polyinfer dashboard: time series, a heat map, an event timeline.
// Plain JS, no dependencies. Every chart draws into an <svg> with a fixed viewBox (it
// scales with its box) and sets data-points on it: how many values it drew, so a test
// (and a person with the inspector open) can tell an empty chart from a drawn one.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 560, H = 170;
  const M = { left: 48, right: 10, top: 8, bottom: 20 };
  const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                   "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
  const colors = new Map();  // "kind:name" -> colour, stable for the page's lifetime

  function colorFor(kind, name) {
    const key = kind + ":" + name;
    if (!colors.has(key)) {
      const used = [...colors.keys()].filter(k => k.startsWith(kind + ":")).length;
      colors.set(key, PALETTE[used % PALETTE.length]);
    }
    return colors.get(key);
  }

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }

  function text(parent, x, y, s, attrs) {
    const t = el("text", { x, y, ...attrs }, parent);
    t.textContent = s;
    return t;
  }

  function reset(svg, height) {
    svg.replaceChildren();
    svg.setAttribute("viewBox", `0 0 ${W} ${height || H}`);
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
  }

  // A "nice" upper bound and tick step for values up to max (1, 2 or 5 times a power of 10).
  function niceScale(max, numTicks) {
    if (!(max > 0)) max = 1;
    const raw = max / numTicks;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(f => f * mag).find(s => s >= raw);
    return { max: step * Math.ceil(max / step), step };
  }

  function clock(ts, withSeconds) {
    const d = new Date(ts * 1000);
    const pad = n => String(n).padStart(2, "0");
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + (withSeconds ? ":" + pad(d.getSeconds()) : "");
  }

  // The time axis every chart shares: [start, end] unix seconds onto the plot's width.
  function timeAxis(svg, range, height) {
    const x = ts => M.left + (ts - range.start) / (range.end - range.start) * (W - M.left - M.right);
    const span = range.end - range.start;
    const tick = [10, 30, 60, 120, 300, 600, 900, 1800].find(s => span / s <= 6) || 3600;
    const g = el("g", { class: "axis x" }, svg);
    for (let ts = Math.ceil(range.start / tick) * tick; ts <= range.end; ts += tick) {
      el("line", { x1: x(ts), x2: x(ts), y1: M.top, y2: height - M.bottom, class: "grid" }, g);
      text(g, x(ts), height - 6, clock(ts, tick < 60), { "text-anchor": "middle" });
    }
    return x;
  }

  function markers(svg, x, range, list, height) {
    for (const m of list || []) {
      if (m.ts < range.start || m.ts > range.end) continue;
      const line = el("line", { x1: x(m.ts), x2: x(m.ts), y1: M.top, y2: height - M.bottom,
                                class: "marker " + m.kind }, svg);
      el("title", {}, line).textContent = m.label;
    }
  }

  function empty(svg, height, message) {
    text(svg, W / 2, (height || H) / 2, message || "no data in this window",
         { "text-anchor": "middle", class: "empty" });
    svg.dataset.points = "0";
    svg.dataset.series = "0";
  }

  // series: [{name, kind, values: [number|null], dash}] on points t (each step_s long,
  // drawn at their middle); fmt formats a y value. Gaps (null) break the line; a value
  // with no neighbour is drawn as a dot.
  function timeSeries(svg, { t, step, range, series, fmt, refLine, markerList }) {
    reset(svg);
    const x = timeAxis(svg, range, H);
    const drawn = series.filter(s => s.values.some(v => v !== null && v !== undefined));
    if (!drawn.length) { empty(svg); markers(svg, x, range, markerList, H); return; }
    const max = Math.max(refLine || 0, ...drawn.flatMap(s => s.values.filter(v => v !== null)));
    const scale = niceScale(max, 4);
    const y = v => H - M.bottom - v / scale.max * (H - M.top - M.bottom);
    const g = el("g", { class: "axis y" }, svg);
    for (let v = 0; v <= scale.max + scale.step / 2; v += scale.step) {
      el("line", { x1: M.left, x2: W - M.right, y1: y(v), y2: y(v), class: "grid" }, g);
      text(g, M.left - 4, y(v) + 3, fmt(v), { "text-anchor": "end" });
    }
    if (refLine) el("line", { x1: M.left, x2: W - M.right, y1: y(refLine), y2: y(refLine), class: "ref" }, svg);
    markers(svg, x, range, markerList, H);
    let points = 0;
    for (const s of drawn) {
      const color = colorFor(s.kind, s.name);
      let d = "", prev = null;
      const dots = [];
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) { prev = null; return; }
        const px = x(t[i] + step / 2).toFixed(1), py = y(v).toFixed(1);
        const next = s.values[i + 1];
        if (prev === null && (next === null || next === undefined)) dots.push([px, py]);
        d += (prev === null ? "M" : "L") + px + " " + py + " ";
        prev = v;
        points++;
      });
      const path = el("path", { d: d.trim(), class: "series", stroke: color,
                                "stroke-dasharray": s.dash ? "4 3" : "none", "data-name": s.name }, svg);
      const last = s.values.filter(v => v !== null && v !== undefined).pop();
      el("title", {}, path).textContent = `${s.label || s.name}: ${fmt(last)} (latest)`;
      for (const [px, py] of dots) el("circle", { cx: px, cy: py, r: 2, fill: color, class: "dot" }, svg);
    }
    svg.dataset.points = String(points);
    svg.dataset.series = String(drawn.length);
  }

  // rows x cols counts; each cell shaded by its share of the row (where a domain's
  // requests went), labelled with its count; title(r, c) is the hover text.
  function heatmap(svg, { rows, cols, count, title }) {
    const cellH = 22, top = 22, left = 104;
    const height = top + rows.length * cellH + 6;
    reset(svg, height);
    if (!rows.length || !cols.length) { empty(svg, height, "no routed requests in this window"); return; }
    const cellW = (W - left - 10) / cols.length;
    cols.forEach((c, j) => text(svg, left + (j + 0.5) * cellW, 15, c, { "text-anchor": "middle", class: "col" }));
    let cells = 0;
    rows.forEach((r, i) => {
      const total = cols.reduce((sum, c) => sum + count(r, c), 0);
      text(svg, left - 6, top + (i + 0.65) * cellH, r, { "text-anchor": "end" });
      cols.forEach((c, j) => {
        const n = count(r, c);
        const share = total ? n / total : 0;
        const rect = el("rect", { x: left + j * cellW + 1, y: top + i * cellH + 1, width: cellW - 2,
                                  height: cellH - 2, class: "cell", "data-count": n,
                                  fill: `rgba(78, 121, 167, ${n ? 0.12 + 0.88 * share : 0.03})` }, svg);
        el("title", {}, rect).textContent = title(r, c);
        if (n) {
          cells++;
          text(svg, left + (j + 0.5) * cellW, top + (i + 0.68) * cellH, `${n} (${Math.round(share * 100)}%)`,
               { "text-anchor": "middle", class: share > 0.55 ? "on-dark" : "" });
        }
      });
    });
    svg.dataset.points = String(cells);
    svg.dataset.series = String(rows.length);
  }

  // Lanes on the shared time axis: states (spans), bars (counts per point, stacked by
  // name), events (symbols). Returns nothing; sets data-points to spans + bars + events.
  function timeline(svg, { range, t, step, states, bars, events, symbol }) {
    const height = 150, lane = { state: [10, 34], bars: [42, 100], events: [108, 126] };
    reset(svg, height);
    const x = timeAxis(svg, range, height);
    let points = 0;
    states.forEach(([ts, state], i) => {
      const x0 = x(Math.max(ts, range.start));
      const x1 = x(i + 1 < states.length ? states[i + 1][0] : range.end);
      const rect = el("rect", { x: x0, y: lane.state[0], width: Math.max(x1 - x0, 1),
                                height: lane.state[1] - lane.state[0], class: "state",
                                fill: colorFor("state", state) }, svg);
      el("title", {}, rect).textContent = `${state} from ${clock(ts, true)}`;
      if (x1 - x0 > 7 * state.length) text(svg, x0 + 3, lane.state[1] - 8, state, { class: "on-dark" });
      points++;
    });
    const names = Object.keys(bars);
    const totals = t.map((_, i) => names.reduce((s, n) => s + bars[n][i], 0));
    const scale = niceScale(Math.max(1, ...totals), 2);
    const barH = v => v / scale.max * (lane.bars[1] - lane.bars[0]);
    text(svg, M.left - 4, lane.bars[0] + 6, String(scale.max), { "text-anchor": "end" });
    text(svg, M.left - 4, lane.bars[1], "0", { "text-anchor": "end" });
    t.forEach((ts, i) => {
      let base = lane.bars[1];
      for (const n of names) {
        const v = bars[n][i];
        if (!v) continue;
        const w = Math.max(x(ts + step) - x(ts) - 1, 1), h = barH(v);
        const rect = el("rect", { x: x(ts), y: base - h, width: w, height: h, class: "bar",
                                  fill: colorFor("tier", n) }, svg);
        el("title", {}, rect).textContent = `${v} ${n} experiment(s) from ${clock(ts, true)}`;
        base -= h;
        points++;
      }
    });
    for (const e of events) {
      if (e.ts < range.start || e.ts > range.end) continue;
      const s = symbol(e);
      const mark = text(svg, x(e.ts), lane.events[1], s.glyph, { "text-anchor": "middle", class: "event " + e.kind,
                                                                 fill: s.color });
      el("title", {}, mark).textContent = s.label;
      points++;
    }
    text(svg, 4, lane.state[1] - 8, "state", { class: "lane" });
    text(svg, 4, (lane.bars[0] + lane.bars[1]) / 2, "exps", { class: "lane" });
    text(svg, 4, lane.events[1] - 4, "events", { class: "lane" });
    svg.dataset.points = String(points);
    svg.dataset.series = String(names.length + (states.length ? 1 : 0) + (events.length ? 1 : 0));
  }

  // A legend: [{name, kind, dash}] as coloured swatches in a <div>.
  function legend(div, items) {
    div.replaceChildren();
    for (const it of items) {
      const span = document.createElement("span");
      span.className = "key";
      const sw = document.createElement("i");
      sw.style.borderColor = it.color || colorFor(it.kind, it.name);
      if (it.dash) sw.style.borderStyle = "dashed";
      span.append(sw, it.label || it.name);
      div.appendChild(span);
    }
  }

  return { timeSeries, heatmap, timeline, legend, colorFor, clock };
})();
