// dtralloc dashboard: hand-written canvas views over columns the page
// carries inline (page.py). Nothing is fetched; the columns are gzip'd and
// base64'd in <script> elements and decoded by the browser's own
// DecompressionStream. Sizes inside are in the history's unit (512 bytes)
// unless said otherwise; everything shown is in bytes with binary units.
"use strict";
(function () {
  const T0 = performance.now();
  const api = (window.dtrallocDashboard = { timings: {}, version: 1 });
  const $ = (id) => document.getElementById(id);
  const DPR = Math.max(1, Math.min(2, window.devicePixelRatio || 1));
  const COLORS = {
    alloc: "#3b6fd8", evictable: "#f29d38", free: "#c9e7c1", pending: "#f4d35e", waste: "#d9467a",
    reserved: "#8aa4d6", budget: "#c62828", largest: "#2e7d32", freeLine: "#7cb342", frag: "#6a1b9a",
    segment: "#eceff3", evict: "#f29d38", remat: "#2e9d8f", segAlloc: "#78909c", oom: "#c62828",
    cursor: "#111827", window: "#111827",
    phase: { forward: "rgba(59,111,216,0.07)", backward: "rgba(142,68,173,0.08)", optimizer: "rgba(46,125,50,0.09)" },
    phaseBlock: { forward: [59, 111, 216], backward: [142, 68, 173], optimizer: [46, 125, 50], before: [96, 125, 139] },
  };

  // ------------------------------------------------------------ formatting
  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  function unitOf(bytes) {
    let u = 0;
    let v = Math.abs(bytes);
    while (v >= 1024 && u < UNITS.length - 1) { v /= 1024; u++; }
    return u;
  }
  function fmtIn(bytes, u) {
    if (u === 0) return Math.round(bytes).toLocaleString("en-US") + " B";
    return (bytes / Math.pow(1024, u)).toFixed(2) + " " + UNITS[u];
  }
  function fmtBytes(bytes) {
    if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return "–";
    return fmtIn(bytes, unitOf(bytes));
  }
  // Parts of a total in the total's unit, rounded so that the shown parts add
  // up to the shown total (largest remainder).
  function fmtParts(total, parts) {
    const u = unitOf(total);
    const scale = u === 0 ? 1 : Math.pow(1024, u) / 100;  // hundredths of the unit
    const shownTotal = Math.round(total / scale);
    const raw = parts.map((p) => p / scale);
    const floor = raw.map(Math.floor);
    let left = shownTotal - floor.reduce((a, b) => a + b, 0);
    const order = raw.map((r, i) => [r - floor[i], i]).sort((a, b) => b[0] - a[0]);
    for (let k = 0; k < order.length && left > 0; k++, left--) floor[order[k][1]]++;
    const show = (h) => (u === 0 ? Math.round(h).toLocaleString("en-US") + " B" : (h / 100).toFixed(2) + " " + UNITS[u]);
    return { total: show(shownTotal), parts: floor.map(show) };
  }
  const fmtInt = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
  const fmtPct = (v) => (v * 100).toFixed(1) + "%";
  function hexAdd(hex, delta) {
    return "0x" + (BigInt(hex) + BigInt(Math.round(delta))).toString(16);
  }
  function esc(s) {
    return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  }

  // ------------------------------------------------------------ decoding
  // The columns' gzip streams as ASCII text, 7 bits per character (page.py,
  // text7): each character one 7-bit value of the bytes (big-endian), but
  // DEL followed by the digit k stands for the value TEXT7_ESCAPED[k].
  const TEXT7_ESCAPED = [0, 13, 60, 127];
  function text7decode(s) {
    const len = s.length;
    const out = new Uint8Array(Math.floor((len * 7) / 8));  // escapes make it a little less
    let acc = 0, bits = 0, o = 0;
    for (let i = 0; i < len; i++) {
      let v = s.charCodeAt(i);
      if (v === 127) v = TEXT7_ESCAPED[s.charCodeAt(++i) - 48];
      acc = (acc << 7) | v;  // at most 7 + 7 bits are ever waiting
      bits += 7;
      if (bits >= 8) { bits -= 8; out[o++] = acc >> bits; acc &= (1 << bits) - 1; }
    }
    return out.subarray(0, o);
  }
  async function gunzip(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  const TYPES = { u8: [Uint8Array, 1], i8: [Int8Array, 1], u16: [Uint16Array, 2], i16: [Int16Array, 2],
                  u32: [Uint32Array, 4], i32: [Int32Array, 4], f64: [Float64Array, 8] };
  function typed(ref, bytes) {
    const [Ctor, size] = TYPES[ref.t];
    let buf = bytes;
    if (size > 1) {  // undo the byte shuffle
      const n = ref.n;
      buf = new Uint8Array(n * size);
      for (let b = 0; b < size; b++) {
        const base = b * n;
        for (let i = 0, j = b; i < n; i++, j += size) buf[j] = bytes[base + i];
      }
    }
    const a = new Ctor(buf.buffer, buf.byteOffset, ref.n);
    if (!ref.d) return a;
    // Steps -> values, summed exactly (doubles) into the values' type.
    const out = ref.a ? new TYPES[ref.a][0](ref.n) : a;
    for (let i = 0, s = 0; i < a.length; i++) { s += a[i]; out[i] = s; }
    return out;
  }
  async function decodeAll(meta) {
    const refs = [];
    const walk = (o) => {
      if (o && typeof o === "object") {
        if (typeof o.b === "number" && typeof o.t === "string") refs.push(o);
        else for (const k in o) walk(o[k]);
      }
    };
    walk(meta.runs);
    await Promise.all(refs.map(async (ref) => {
      const el = $("dtralloc-blob-" + ref.b);
      ref.array = typed(ref, await gunzip(text7decode(el.textContent)));
    }));
  }
  // A column, or one stored as runs (page.py, _add_runs) expanded.
  const col = (ref) => {
    if (!ref) return null;
    if (!ref.runs) return ref.array;
    if (!ref.array) {
      const at = ref.runs.at.array, v = ref.runs.v.array;
      ref.array = new TYPES[ref.runs.t][0](ref.n);
      for (let k = 0; k < at.length; k++) ref.array.fill(v[k], at[k], k + 1 < at.length ? at[k + 1] : ref.n);
    }
    return ref.array;
  };

  // ------------------------------------------------------------ runs
  function prepareRun(m, index) {
    const run = { index, meta: m, label: m.label, kind: m.kind, n: m.n_x, domain: m.domain, figures: m.figures };
    run.byOp = m.x_kind === "op";  // a replay or a live session: x is an op, with names and phases
    run.phases = m.phases || [];
    if (m.op_names) {
      const idx = col(m.op_names.idx);
      run.opName = (x) => (x >= 0 && x < idx.length ? m.op_names.table[idx[x]] : "");
    } else run.opName = () => "";
    run.phaseAt = (x) => {
      for (const p of run.phases) if (x >= p[0] && x < p[1]) return p[2];
      return "";
    };
    const S = {};
    if (m.series) for (const k in m.series) S[k] = { a: col(m.series[k]), u: 1 };
    const h = m.history;
    if (h) prepareHistory(run, h, S);
    if (!S.free && S.reserved) {
      const free = new Float64Array(run.n);
      for (let x = 0; x < run.n; x++) free[x] = S.reserved.a[x] - S.allocated.a[x] - (S.pending ? S.pending.a[x] * S.pending.u : 0);
      S.free = { a: free, u: 1 };
    }
    run.S = S;
    // NaN where a run has no sample (after an OOM): not drawn, shown as "–".
    run.val = (k, x) => (!S[k] ? 0 : x >= 0 && x < S[k].a.length ? S[k].a[x] * S[k].u : NaN);
    if (m.evlog) {
      const e = {};
      for (const k in m.evlog) e[k] = col(m.evlog[k]);
      run.ev = e;
    }
    run.marks = markPositions(run);
    return run;
  }

  function prepareHistory(run, h, S) {
    const n = h.n;
    const B = {};
    for (const k in h.blocks) B[k] = col(h.blocks[k]);
    const L = B.start.length;
    B.size = h.unit < 512 ? new Float64Array(L) : new Uint32Array(L); B.waste = new Float64Array(L);  // from the table of (size, waste) pairs
    for (let i = 0; i < L; i++) { B.size[i] = B.kind_size[B.kind[i]]; B.waste[i] = B.kind_waste[B.kind[i]]; }
    // Addresses from their references (page.py, address_refs): 2d = where
    // block i - d starts, 2d + 1 = where it ends, 0 = the next raw address.
    B.y = h.compact > 0xffffffff ? new Float64Array(L) : new Uint32Array(L);
    for (let i = 0, r = 0; i < L; i++) {
      const c = B.y_ref[i];
      if (c === 0) B.y[i] = B.y_raw[r++];
      else { const j = i - Math.floor(c / 2); B.y[i] = c % 2 ? B.y[j] + B.size[j] : B.y[j]; }
    }
    // Absolute ends (the columns hold lifetimes).
    const req = new Int32Array(L), done = new Int32Array(L);
    for (let i = 0; i < L; i++) { req[i] = B.start[i] + B.req[i]; done[i] = req[i] + B.done[i]; }
    B.reqAt = req; B.doneAt = done;
    const G = {};
    for (const k in h.segments) G[k] = col(h.segments[k]);
    run.hist = { n, unit: h.unit, B, G, L, compact: h.compact, ranges: h.ranges, streams: h.streams, labels: h.labels,
                 oom: h.oom, op: h.op ? col(h.op) : null, time: h.time ? col(h.time) : null, t0: h.t0 || 0 };
    const xEvent = h.x_event ? col(h.x_event) : null;
    run.hist.xEvent = xEvent;
    // Event -> x: the first x whose sample point comes after the event.
    run.evToX = xEvent
      ? (e) => { let lo = 0, hi = xEvent.length; while (lo < hi) { const mid = (lo + hi) >> 1; if (xEvent[mid] > e) hi = mid; else lo = mid + 1; } return lo; }
      : (e) => Math.max(0, Math.min(e, run.n));
    // x -> the event after which its state is sampled (-1: before all).
    run.evAt = xEvent ? (x) => xEvent[x] - 1 : (x) => x;
    if (!xEvent) {  // a snapshot: per-event totals from the lifetimes (in units)
      const big = h.unit < 512;
      const mk = (len) => (big ? new Float64Array(len) : new Int32Array(len));
      const dA = mk(n + 1), dP = mk(n + 1), dR = mk(n + 1);
      let a0 = 0, p0 = 0, r0 = 0;
      for (let i = 0; i < L; i++) {
        const s = B.start[i], q = req[i], d = done[i], z = B.size[i];
        if (s < 0) a0 += z; else dA[s] += z;
        if (q < 0) { a0 -= z; p0 += z; } else if (q < n) { dA[q] -= z; dP[q] += z; }
        if (d < 0) p0 -= z; else if (d < n) dP[d] -= z;
      }
      for (let i = 0; i < G.start.length; i++) {
        const s = G.start[i], e = G.end[i], z = G.size[i];
        if (s < 0) r0 += z; else dR[s] += z;
        if (e < n) dR[e] -= z;
      }
      const A = mk(n), P = mk(n), R = mk(n);
      let a = a0, p = p0, r = r0;
      for (let e = 0; e < n; e++) { a += dA[e]; p += dP[e]; r += dR[e]; A[e] = a; P[e] = p; R[e] = r; }
      const largest = col(h.largest);
      S.allocated = { a: A, u: h.unit }; S.pending = { a: P, u: h.unit }; S.reserved = { a: R, u: h.unit };
      S.largest_free = { a: largest, u: h.largest_unit };
      const free = big ? new Float64Array(n) : new Int32Array(n);
      for (let e = 0; e < n; e++) free[e] = R[e] - A[e] - P[e];
      S.free = { a: free, u: h.unit };
    }
    // Each block's visible x range: [x0, x1) allocated, [x1, x2) pending.
    const X0 = new Int32Array(L), X1 = new Int32Array(L), X2 = new Int32Array(L);
    for (let i = 0; i < L; i++) {
      X0[i] = B.start[i] < 0 ? 0 : run.evToX(B.start[i]);
      X1[i] = req[i] >= n ? run.n : run.evToX(req[i]);
      X2[i] = done[i] >= n ? run.n : run.evToX(done[i]);
    }
    B.X0 = X0; B.X1 = X1; B.X2 = X2;
    const GX0 = new Int32Array(G.start.length), GX1 = new Int32Array(G.start.length);
    for (let i = 0; i < G.start.length; i++) {
      GX0[i] = G.start[i] < 0 ? 0 : run.evToX(G.start[i]);
      GX1[i] = G.end[i] >= n ? run.n : run.evToX(G.end[i]);
    }
    G.X0 = GX0; G.X1 = GX1;
  }

  // Where the markers go: evictions, remats, segment events, OOMs (x values).
  function markPositions(run) {
    const m = { evict: [], remat: [], segAlloc: [], segFree: [], oom: [], calls: [] };
    if (run.ev) {
      const { op, kind } = run.ev;
      for (let i = 0; i < op.length; i++) {
        if (kind[i] === 1) m.evict.push(op[i]);
        else if (kind[i] === 2) m.remat.push(op[i]);
        else m.calls.push(op[i]);
      }
    }
    const H = run.hist;
    if (H) {
      for (let i = 0; i < H.G.start.length; i++) {
        if (H.G.start[i] >= 0) m.segAlloc.push(run.evToX(H.G.start[i]));
        if (H.G.end[i] < H.n) m.segFree.push(run.evToX(H.G.end[i]));
      }
      for (const o of H.oom) m.oom.push(run.evToX(o[0]));
    }
    if (run.figures.oom_op !== null && run.figures.oom_op !== undefined && !H) m.oom.push(Math.max(0, run.figures.oom_op));
    const all = new Set([...m.calls, ...m.evict, ...m.segAlloc, ...m.segFree, ...m.oom]);
    m.sorted = Array.from(all).sort((a, b) => a - b);
    return m;
  }

  // ------------------------------------------------------------ state
  const state = { runs: [], sel: 0, cursor: {}, view: {}, selBlock: -1, alive: null };
  const run = () => state.runs[state.sel];
  const cursorOf = (r) => {
    const x = state.cursor[r.domain];
    return x === undefined ? 0 : Math.max(0, Math.min(r.n - 1, x));
  };
  const viewOf = (r) => state.view[r.domain] || (state.view[r.domain] = { x0: 0, x1: r.n });

  // ------------------------------------------------------------ canvases
  // Canvas sizes are measured once per layout change (measure()): reading a
  // size forces a layout of the page, which would cost the cursor tens of ms.
  function measure() {
    document.querySelectorAll("canvas").forEach((c) => {
      const r = c.getBoundingClientRect();
      c._w = Math.max(10, Math.round(r.width * DPR));
      c._h = Math.max(10, Math.round(r.height * DPR));
    });
  }
  function canvasSize(c) {
    if (c._w === undefined) measure();
    if (c.width !== c._w || c.height !== c._h) { c.width = c._w; c.height = c._h; }
    const ctx = c.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    return ctx;
  }
  const PAD = { l: 70, r: 56, t: 8, b: 34 };
  function plotBox(c) {
    return { l: PAD.l * DPR, r: c.width - PAD.r * DPR, t: PAD.t * DPR, b: c.height - PAD.b * DPR };
  }
  function xToPx(box, v, x) { return box.l + ((x - v.x0) / (v.x1 - v.x0)) * (box.r - box.l); }
  function pxToX(box, v, px) { return v.x0 + ((px - box.l) / (box.r - box.l)) * (v.x1 - v.x0); }

  // Per device-pixel column: the max (and min) of f(x) over the xs it covers.
  function envelope(r, box, v, f) {
    const W = Math.max(1, Math.floor(box.r - box.l));
    const max = new Float64Array(W), min = new Float64Array(W);
    const dx = (v.x1 - v.x0) / W;
    for (let c = 0; c < W; c++) {
      let a = Math.floor(v.x0 + c * dx);
      let b = Math.max(a + 1, Math.floor(v.x0 + (c + 1) * dx));
      a = Math.max(0, a); b = Math.min(r.n, b);
      let hi = -Infinity, lo = Infinity;
      for (let x = a; x < b; x++) { const y = f(x); if (y > hi) hi = y; if (y < lo) lo = y; }
      max[c] = hi; min[c] = lo;
    }
    return { max, min, W };
  }

  // A tick step of 1, 2 or 5 times a power of two of a binary unit (bytes),
  // or of ten (ratios).
  function niceStep(maxV, bytes) {
    const raw = maxV / 4;
    if (!bytes) {
      const p = Math.pow(10, Math.floor(Math.log10(raw)));
      return [1, 2, 5, 10].map((k) => k * p).find((s) => s >= raw);
    }
    let step = 1;
    while (step * 2 <= raw) step *= 2;
    return step * 2 <= raw * 1.5 ? step * 2 : step;
  }
  function drawAxesY(ctx, box, maxV, fmt, side) {
    ctx.fillStyle = "#667085";
    ctx.font = `${11 * DPR}px system-ui, sans-serif`;
    ctx.textAlign = side === "right" ? "left" : "right";
    ctx.textBaseline = "middle";
    ctx.strokeStyle = "rgba(0,0,0,0.06)";
    ctx.lineWidth = 1;
    const step = niceStep(maxV, fmt === fmtBytes);
    for (let v = 0; v <= maxV; v += step) {
      const y = box.b - (v / maxV) * (box.b - box.t);
      if (side !== "right") { ctx.beginPath(); ctx.moveTo(box.l, y); ctx.lineTo(box.r, y); ctx.stroke(); }
      ctx.fillText(fmt(v), side === "right" ? box.r + 6 * DPR : box.l - 6 * DPR, y);
    }
  }
  function drawAxisX(ctx, box, v, r) {
    ctx.fillStyle = "#667085";
    ctx.font = `${11 * DPR}px system-ui, sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const span = v.x1 - v.x0;
    const step = Math.pow(10, Math.floor(Math.log10(Math.max(1, span / 6))));
    const nice = [1, 2, 5, 10].map((k) => k * step).find((s) => span / s <= 8) || step * 10;
    for (let x = Math.ceil(v.x0 / nice) * nice; x <= v.x1; x += nice) {
      ctx.fillText(fmtInt(x), xToPx(box, v, x), box.b + 12 * DPR);
    }
    ctx.textAlign = "left";
    ctx.fillText(r.byOp ? "op" : "event", box.r + 6 * DPR, box.b + 12 * DPR);
  }
  function drawPhases(ctx, box, v, r) {
    ctx.font = `${10 * DPR}px system-ui, sans-serif`;
    ctx.textBaseline = "top";
    ctx.textAlign = "left";
    for (const [a, b, name] of r.phases) {
      const x0 = Math.max(box.l, xToPx(box, v, a)), x1 = Math.min(box.r, xToPx(box, v, b));
      if (x1 <= x0) continue;
      ctx.fillStyle = COLORS.phase[name] || "rgba(0,0,0,0.04)";
      ctx.fillRect(x0, box.t, x1 - x0, box.b - box.t);
      ctx.fillStyle = "#8a94a6";
      if (x1 - x0 > 60 * DPR) ctx.fillText(name, x0 + 4 * DPR, box.t + 2 * DPR);
    }
  }
  function budgetOf(r) { const b = r.figures.budget_bytes; return typeof b === "number" ? b : null; }

  // ------------------------------------------------------------ timeline
  const cache = {};
  function drawTimeline() {
    const r = run(), c = $("timeline"), ctx = canvasSize(c), box = plotBox(c), v = viewOf(r);
    ctx.clearRect(0, 0, c.width, c.height);
    drawPhases(ctx, box, v, r);
    const evictable = (x) => r.val("evictable", x);
    const layers = [
      ["allocated, not evictable", COLORS.alloc, (x) => r.val("allocated", x) - evictable(x)],
      ["evictable", COLORS.evictable, (x) => r.val("allocated", x)],
      ["pending free", COLORS.pending, (x) => r.val("allocated", x) + r.val("pending", x)],
      ["cached free", COLORS.free, (x) => r.val("reserved", x)],
    ];
    const envs = layers.map((l) => envelope(r, box, v, l[2]));
    const budget = budgetOf(r);
    let maxV = Math.max(1, r.figures.peak_reserved_bytes || 0, ...envs[3].max.filter(isFinite));
    if (budget) maxV = Math.max(maxV, budget);
    maxV *= 1.05;
    const yOf = (val) => box.b - (val / maxV) * (box.b - box.t);
    for (let k = layers.length - 1; k >= 0; k--) {
      ctx.fillStyle = layers[k][1];
      const env = envs[k];
      for (let cx = 0; cx < env.W; cx++) {
        const top = env.max[cx];
        if (!isFinite(top) || top <= 0) continue;
        const y = yOf(top);
        ctx.fillRect(box.l + cx, y, 1, box.b - y);
      }
    }
    if (budget) {
      ctx.strokeStyle = COLORS.budget; ctx.lineWidth = 1.5 * DPR; ctx.setLineDash([6 * DPR, 4 * DPR]);
      ctx.beginPath(); ctx.moveTo(box.l, yOf(budget)); ctx.lineTo(box.r, yOf(budget)); ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = COLORS.budget; ctx.textAlign = "right"; ctx.textBaseline = "bottom";
      ctx.fillText("budget " + fmtBytes(budget), box.r - 4 * DPR, yOf(budget) - 2 * DPR);
    }
    drawAxesY(ctx, box, maxV, fmtBytes);
    drawAxisX(ctx, box, v, r);
    drawMarks(ctx, box, v, r);
    $("legend-timeline").innerHTML = legend([["allocated", COLORS.alloc], ...(r.S.evictable ? [["evictable", COLORS.evictable]] : []),
      ...(r.S.pending ? [["pending free", COLORS.pending]] : []), ["cached free", COLORS.free], ["budget", COLORS.budget],
      ["eviction", COLORS.evict], ["remat", COLORS.remat], ["segment alloc/release", COLORS.segAlloc], ["OOM", COLORS.oom]]);
  }
  function legend(items) {
    return items.map(([n, c]) => `<span><i style="background:${c}"></i>${esc(n)}</span>`).join("");
  }
  function drawMarks(ctx, box, v, r) {
    const band = 6 * DPR, y0 = box.b + 1;
    const tick = (xs, color, y, h) => {
      ctx.fillStyle = color;
      for (const x of xs) {
        if (x < v.x0 || x >= v.x1) continue;
        ctx.fillRect(Math.floor(xToPx(box, v, x + 0.5)), y, Math.max(1, DPR), h);
      }
    };
    tick(r.marks.segAlloc, COLORS.segAlloc, y0, band / 2);
    tick(r.marks.segFree, COLORS.segAlloc, y0 + band / 2, band / 2);
    tick(r.marks.evict, COLORS.evict, box.t, band);
    tick(r.marks.remat, COLORS.remat, box.t + band, band);
    ctx.fillStyle = COLORS.oom;
    for (const x of r.marks.oom) {
      if (x < v.x0 || x >= v.x1) continue;
      ctx.fillRect(Math.floor(xToPx(box, v, x + 0.5)) - DPR, box.t, 2 * DPR, box.b - box.t);
    }
  }

  function drawFrag() {
    const r = run(), c = $("frag"), ctx = canvasSize(c), box = plotBox(c), v = viewOf(r);
    ctx.clearRect(0, 0, c.width, c.height);
    drawPhases(ctx, box, v, r);
    const largest = envelope(r, box, v, (x) => r.val("largest_free", x));
    const free = envelope(r, box, v, (x) => r.val("free", x));
    const ratio = envelope(r, box, v, (x) => { const f = r.val("free", x); return f > 0 ? 1 - r.val("largest_free", x) / f : 0; });
    const maxV = Math.max(1, ...free.max.filter(isFinite)) * 1.05;
    const line = (env, color, scale, width) => {
      ctx.strokeStyle = color; ctx.lineWidth = width * DPR; ctx.beginPath();
      let started = false;
      for (let cx = 0; cx < env.W; cx++) {
        const val = env.max[cx];
        if (!isFinite(val)) { started = false; continue; }
        const y = box.b - (val / scale) * (box.b - box.t);
        if (!started) { ctx.moveTo(box.l + cx, y); started = true; } else ctx.lineTo(box.l + cx, y);
      }
      ctx.stroke();
    };
    line(free, COLORS.freeLine, maxV, 1.2);
    line(largest, COLORS.largest, maxV, 1.6);
    line(ratio, COLORS.frag, 1.05, 1);
    drawAxesY(ctx, box, maxV, fmtBytes);
    drawAxesY(ctx, box, 1.05, (x) => x.toFixed(2), "right");
    drawAxisX(ctx, box, v, r);
    $("legend-frag").innerHTML = legend([["largest free block", COLORS.largest], ["cached free", COLORS.freeLine],
      ["1 − largest/free", COLORS.frag]]);
  }

  // ------------------------------------------------------------ address x time
  function drawAddrTime() {
    const r = run(), c = $("addrtime"), ctx = canvasSize(c), box = plotBox(c), v = viewOf(r);
    ctx.clearRect(0, 0, c.width, c.height);
    const H = r.hist;
    if (!H || !H.compact) {
      ctx.fillStyle = "#667085"; ctx.font = `${12 * DPR}px system-ui`; ctx.fillText("no allocator history in this run", box.l + 10, box.t + 20 * DPR);
      return;
    }
    const W = Math.floor(box.r - box.l), Hh = Math.floor(box.b - box.t);
    const img = ctx.createImageData(W, Hh);
    const px = new Uint32Array(img.data.buffer);
    px.fill(0xffffffff);
    const sx = W / (v.x1 - v.x0), sy = Hh / H.compact;
    const rgba = (rgb, a) => ((a << 24) | (rgb[2] << 16) | (rgb[1] << 8) | rgb[0]) >>> 0;
    const fill = (x0, x1, y0, y1, color) => {
      let a = Math.floor((x0 - v.x0) * sx), b = Math.ceil((x1 - v.x0) * sx);
      if (b <= 0 || a >= W) return;
      a = Math.max(0, a); b = Math.min(W, Math.max(b, a + 1));
      let ya = Math.floor(y0 * sy), yb = Math.ceil(y1 * sy);
      ya = Math.max(0, Math.min(Hh - 1, ya)); yb = Math.min(Hh, Math.max(yb, ya + 1));
      for (let y = ya; y < yb; y++) px.fill(color, y * W + a, y * W + b);
    };
    const segColor = rgba([236, 239, 243], 255);
    const G = H.G;
    for (let i = 0; i < G.start.length; i++) fill(G.X0[i], G.X1[i], G.y[i], G.y[i] + G.size[i], segColor);
    const B = H.B;
    const pend = rgba([244, 211, 94], 255);
    const phaseColor = {};
    for (const k in COLORS.phaseBlock) phaseColor[k] = rgba(COLORS.phaseBlock[k], 255);
    const plain = rgba([59, 111, 216], 255);
    const byPhase = r.byOp && H.op;
    for (let i = 0; i < B.start.length; i++) {
      if (B.X2[i] <= v.x0 || B.X0[i] >= v.x1) continue;
      let color = plain;
      if (byPhase) color = B.start[i] < 0 ? phaseColor.before : phaseColor[r.phaseAt(H.op[B.start[i]])] || plain;
      const y0 = B.y[i], y1 = y0 + B.size[i];
      if (B.X1[i] > B.X0[i]) fill(B.X0[i], B.X1[i], y0, y1, color);
      if (B.X2[i] > B.X1[i]) fill(B.X1[i], B.X2[i], y0, y1, pend);
    }
    ctx.putImageData(img, box.l, box.t);
    // Evicted intervals: from an eviction to the value's remat (or the end).
    if (r.ev) {
      const { op, kind, value, addr, bytes } = r.ev;
      const back = new Map();
      ctx.save();
      ctx.beginPath(); ctx.rect(box.l, box.t, W, Hh); ctx.clip();
      ctx.strokeStyle = "rgba(242,157,56,0.9)"; ctx.lineWidth = DPR;
      for (let i = op.length - 1; i >= 0; i--) {
        if (kind[i] === 2) back.set(value[i], op[i]);
        else if (kind[i] === 1) {
          const until = back.has(value[i]) ? back.get(value[i]) : r.n;
          const y = compactOf(H, addr[i]);
          if (y < 0) continue;
          const x0 = box.l + (op[i] - v.x0) * sx, x1 = box.l + (until - v.x0) * sx;
          const y0 = box.t + y * sy, y1 = box.t + (y + bytes[i] / H.unit) * sy;
          hatch(ctx, x0, Math.max(x1, x0 + 2 * DPR), y0, Math.max(y1, y0 + 2 * DPR));
        }
      }
      ctx.restore();
    }
    ctx.fillStyle = "#667085"; ctx.font = `${11 * DPR}px system-ui`; ctx.textAlign = "right"; ctx.textBaseline = "top";
    ctx.fillText("low", box.l - 6 * DPR, box.t);
    ctx.textBaseline = "bottom";
    ctx.fillText("high addr.", box.l - 6 * DPR, box.b);
    drawAxisX(ctx, box, v, r);
    for (const x of r.marks.oom) {
      if (x < v.x0 || x >= v.x1) continue;
      ctx.fillStyle = COLORS.oom; ctx.fillRect(Math.floor(xToPx(box, v, x + 0.5)) - DPR, box.t, 2 * DPR, box.b - box.t);
    }
  }
  function hatch(ctx, x0, x1, y0, y1) {
    ctx.strokeRect(x0, y0, x1 - x0, y1 - y0);
    ctx.beginPath();
    const step = 5 * DPR;
    for (let k = x0 - (y1 - y0); k < x1; k += step) {
      const a = Math.max(x0, k), b = Math.min(x1, k + (y1 - y0));
      if (b <= a) continue;
      ctx.moveTo(a, y1 - (a - k)); ctx.lineTo(b, y1 - (b - k));
    }
    ctx.stroke();
  }
  // Absolute address (a number) -> compact offset in units, -1 when outside.
  function compactOf(H, addr) {
    for (const [lo, hi, off] of H.rangesNum || (H.rangesNum = H.ranges.map(([a, b, o]) => [Number(BigInt(a)), Number(BigInt(b)), o]))) {
      if (addr >= lo && addr < hi) return off + (addr - lo) / H.unit;
    }
    return -1;
  }
  function addressOf(H, y) {
    for (const [lo, hi, off] of H.ranges) {
      const span = (Number(BigInt(hi) - BigInt(lo))) / H.unit;
      if (y >= off && y < off + span) return hexAdd(lo, (y - off) * H.unit);
    }
    return "?";
  }

  // ------------------------------------------------------------ the cursor
  // Blocks and segments alive after event e, in address order.
  function aliveAt(r, x) {
    const H = r.hist;
    if (!H) return null;
    const e = r.evAt(x);
    const B = H.B, G = H.G;
    const blocks = [];
    for (let i = 0; i < B.start.length; i++) if (B.start[i] <= e && e < B.doneAt[i]) blocks.push(i);
    blocks.sort((a, b) => B.y[a] - B.y[b]);
    const segs = [];
    for (let i = 0; i < G.start.length; i++) if (G.start[i] <= e && e < G.end[i]) segs.push(i);
    segs.sort((a, b) => G.y[a] - G.y[b]);
    let allocated = 0, requested = 0, pending = 0, reserved = 0, nAlloc = 0;
    for (const i of blocks) {
      const z = B.size[i] * H.unit;
      if (e < B.reqAt[i]) { allocated += z; requested += z - B.waste[i]; nAlloc++; } else pending += z;
    }
    for (const i of segs) reserved += G.size[i] * H.unit;
    return { e, blocks, segs, allocated, requested, pending, reserved, nAlloc };
  }

  function drawAddrMap() {
    const r = run(), c = $("addrmap"), ctx = canvasSize(c);
    ctx.clearRect(0, 0, c.width, c.height);
    const A = state.alive, H = r.hist;
    state.ribbon = null;
    if (!A || !A.segs.length) {
      ctx.fillStyle = "#667085"; ctx.font = `${12 * DPR}px system-ui`;
      ctx.fillText(H ? "no segments at this moment" : "no allocator history in this run", 10 * DPR, 20 * DPR);
      $("map-caption").textContent = "";
      return;
    }
    const rowH = Math.max(6, Math.round(12 * DPR)), gap = Math.max(1, Math.round(DPR));
    const W = c.width, rows = Math.max(1, Math.floor(c.height / (rowH + gap)));
    const P = W * rows;
    const total = A.reserved / H.unit;
    const per = total / P;  // units per ribbon position
    // bytes per position of: requested, waste, pending, evicted-window, free
    const acc = [new Float64Array(P), new Float64Array(P), new Float64Array(P), new Float64Array(P)];
    const B = H.B, G = H.G;
    const add = (layer, a, b) => {  // [a, b) in ribbon units
      let p = Math.floor(a / per);
      const pe = Math.min(P - 1, Math.floor((b - 1e-9) / per));
      for (; p <= pe; p++) {
        const lo = Math.max(a, p * per), hi = Math.min(b, (p + 1) * per);
        if (hi > lo) acc[layer][p] += hi - lo;
      }
    };
    // Lay segments end to end in address order; map each one's compact y to ribbon offset.
    const segAt = [];
    let off = 0;
    for (const i of A.segs) { segAt.push([G.y[i], G.y[i] + G.size[i], off]); off += G.size[i]; }
    const toRibbon = (y) => {
      let lo = 0, hi = segAt.length - 1;
      while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (segAt[mid][0] <= y) lo = mid; else hi = mid - 1; }
      const s = segAt[lo];
      return y >= s[0] && y < s[1] ? s[2] + (y - s[0]) : -1;
    };
    const placed = [];
    for (const i of A.blocks) {
      const o = toRibbon(B.y[i]);
      if (o < 0) continue;
      const z = B.size[i];
      placed.push([i, o, o + z]);
      if (A.e < B.reqAt[i]) {
        const w = B.waste[i] / H.unit;
        add(0, o, o + z - w);
        if (w > 0) add(1, o + z - w, o + z);
      } else add(2, o, o + z);
    }
    state.ribbon = { per, rows, rowH, gap, W, placed, segAt, toRibbon };
    const img = ctx.createImageData(W, c.height);
    const data = img.data;
    const cols = [[59, 111, 216], [217, 70, 122], [244, 211, 94]];
    const freeC = [201, 231, 193];
    for (let p = 0; p < P; p++) {
      const row = Math.floor(p / W), x = p % W;
      let rr = 0, gg = 0, bb = 0, used = 0;
      for (let k = 0; k < 3; k++) {
        const f = acc[k][p] / per;
        if (f > 0) { rr += cols[k][0] * f; gg += cols[k][1] * f; bb += cols[k][2] * f; used += f; }
      }
      const pos = p * per;
      if (pos >= total) { rr = 255; gg = 255; bb = 255; used = 1; }
      const fr = Math.max(0, 1 - used);
      rr += freeC[0] * fr; gg += freeC[1] * fr; bb += freeC[2] * fr;
      for (let y = row * (rowH + gap); y < row * (rowH + gap) + rowH; y++) {
        const o = (y * W + x) * 4;
        data[o] = rr; data[o + 1] = gg; data[o + 2] = bb; data[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    const posXY = (o) => { const p = o / per; const row = Math.floor(p / W); return [p - row * W, row * (rowH + gap)]; };
    const outline = (a, b, color, dash) => {  // ribbon range [a, b)
      ctx.strokeStyle = color; ctx.lineWidth = 1.5 * DPR; ctx.setLineDash(dash || []);
      let s = a;
      while (s < b) {
        const [x, y] = posXY(s);
        const rowEnd = (Math.floor(s / per / W) + 1) * W * per;
        const e = Math.min(b, rowEnd);
        const w = Math.max(2, (e - s) / per);
        ctx.strokeRect(x + 0.5, y + 0.5, w, rowH - 1);
        s = e;
      }
      ctx.setLineDash([]);
    };
    // Segment starts.
    ctx.fillStyle = "rgba(17,24,39,0.85)";
    for (const [, , o] of segAt) { const [x, y] = posXY(o); ctx.fillRect(Math.floor(x), y, Math.max(1, DPR), rowH); }
    // The evictor's choice at this op: its window, and the victims.
    const x = cursorOf(r);
    const notes = [];
    if (r.ev) {
      const { op, kind, addr, bytes, window_addr, window_bytes, plan, score } = r.ev;
      for (let i = 0; i < op.length; i++) {
        if (op[i] !== x) continue;
        if (kind[i] === 0 && window_bytes[i] > 0) {
          const y = compactOf(H, window_addr[i]);
          const o = y >= 0 ? toRibbon(y) : -1;
          if (o >= 0) outline(o, o + window_bytes[i] / H.unit, COLORS.window);
          notes.push(`evictor: ${["no plan", "window", "segment release", "single tensor"][plan[i]] || "plan " + plan[i]} for ${fmtBytes(bytes[i])}` +
                     (window_bytes[i] > 0 ? `, ${fmtBytes(window_bytes[i])} at ${"0x" + window_addr[i].toString(16)}` : "") +
                     `, cost/byte ${score[i].toPrecision(3)}`);
        } else if (kind[i] === 1) {
          const y = compactOf(H, addr[i]);
          const o = y >= 0 ? toRibbon(y) : -1;
          if (o >= 0) outline(o, o + bytes[i] / H.unit, COLORS.evictable, [4 * DPR, 3 * DPR]);
        }
      }
    }
    if (state.selBlock >= 0) {
      const hit = placed.find((p) => p[0] === state.selBlock);
      if (hit) outline(hit[1], hit[2], COLORS.sel);
    }
    $("map-caption").textContent = `${A.segs.length} segments, ${A.nAlloc} allocated blocks; one pixel = ${fmtBytes(per * H.unit)}` +
      (notes.length ? " · " + notes.join(" · ") : "");
    $("legend-map").innerHTML = legend([["requested", COLORS.alloc], ["rounding waste", COLORS.waste], ["pending free", COLORS.pending],
      ["cached free", COLORS.free], ["evictor's window", COLORS.window], ["evicted", COLORS.evictable]]);
  }

  function madeBy(r, i) {
    const H = r.hist, B = H.B;
    const s = B.start[i];
    if (s < 0) return "before the history";
    if (B.label && H.labels.length && B.label[i]) return H.labels[B.label[i]];
    if (H.op && r.byOp) {
      const op = H.op[s];
      return op < 0 ? "before the first op" : `op ${op} ${r.opName(op)} (${r.phaseAt(op)})`;
    }
    if (H.op && H.op[s] >= 0) return `op ${H.op[s]}`;
    return `event ${fmtInt(s)}`;
  }

  // The tensor table shows every allocated block, but only the rows in view
  // exist (a window of WINDOW_ROWS under a spacer): a cursor move replaces
  // their text and creates no elements, whatever the number of blocks.
  const ROW_PX = 22, WINDOW_ROWS = 24;
  function tensorRows() {
    const body = $("tensors").tBodies[0];
    if (body.rows.length !== WINDOW_ROWS + 2) {
      body.innerHTML = "<tr class=\"spacer\"><td colspan=\"7\"></td></tr>" +
        "<tr><td></td><td></td><td></td><td></td><td></td><td class=\"made\"></td><td></td></tr>".repeat(WINDOW_ROWS) +
        "<tr class=\"spacer\"><td colspan=\"7\"></td></tr>";
      $("tensor-box").addEventListener("scroll", () => requestAnimationFrame(fillTensorWindow));
    }
    return body.rows;
  }
  function drawTensors() {
    const r = run(), A = state.alive, H = r.hist;
    const live = A ? A.blocks.filter((i) => A.e < H.B.reqAt[i]) : [];
    if (A) {
      const B = H.B;
      live.sort((a, b) => B.size[b] - B.size[a] || B.y[a] - B.y[b]);
    }
    state.tensorList = live;
    fillTensorWindow();
    $("tensor-caption").textContent = !A ? "(no history)" : `${live.length} allocated blocks, largest first`;
  }
  function fillTensorWindow() {
    const r = run(), H = r.hist, rows = tensorRows(), live = state.tensorList || [];
    const first = Math.max(0, Math.min(Math.floor($("tensor-box").scrollTop / ROW_PX) - 2, live.length - WINDOW_ROWS));
    rows[0].style.height = first * ROW_PX + "px";
    rows[rows.length - 1].style.height = Math.max(0, live.length - first - WINDOW_ROWS) * ROW_PX + "px";
    for (let k = 0; k < WINDOW_ROWS; k++) {
      const tr = rows[k + 1], n = first + k;
      if (n >= live.length) { if (!tr.hidden) tr.hidden = true; continue; }
      const i = live[n], B = H.B, size = B.size[i] * H.unit, waste = B.waste[i];
      const cells = tr.cells;
      const text = [String(n + 1), addressOf(H, B.y[i]), fmtBytes(size - waste), fmtBytes(size), fmtBytes(waste),
                    madeBy(r, i), (r.byOp ? "op " : "event ") + fmtInt(B.X0[i])];
      for (let c = 0; c < 7; c++) if (cells[c].textContent !== text[c]) cells[c].textContent = text[c];
      tr.hidden = false;
      tr.dataset.block = i;
      tr.classList.toggle("selected", i === state.selBlock);
    }
  }

  function readoutRow(key, label, bytes, shown, cls, extra) {
    return `<tr data-key="${key}"${cls ? ` class="${cls}"` : ""}><td class="key">${label}</td>` +
      `<td class="val" data-bytes="${bytes}">${shown}</td><td class="sub">${extra || ""}</td></tr>`;
  }
  function drawReadout() {
    const r = run(), x = cursorOf(r), A = state.alive;
    const reserved = r.val("reserved", x), allocated = r.val("allocated", x), free = r.val("free", x);
    const largest = r.val("largest_free", x), pending = r.val("pending", x), evictable = r.val("evictable", x);
    const top = fmtParts(reserved, [allocated, pending, free]);
    let rows = "";
    const where = r.byOp
      ? `op ${fmtInt(x)} / ${fmtInt(r.n)} · ${esc(r.opName(x))} · ${r.phaseAt(x)}`
      : `event ${fmtInt(x)} / ${fmtInt(r.n)}` + (r.hist && r.hist.time ? ` · t = ${((r.hist.time[x]) / 1000).toFixed(1)} ms` : "") +
        (r.hist && r.hist.op && r.hist.op[x] >= 0 ? ` · op ${r.hist.op[x]}` : "");
    rows += `<tr data-key="x" data-x="${x}"><td class="key">at</td><td colspan="2">${where}</td></tr>`;
    rows += readoutRow("reserved", "reserved", reserved, top.total, "total");
    rows += readoutRow("allocated", "&nbsp;allocated", allocated, top.parts[0], "", fmtBytes(allocated));
    if (A && r.hist) {
      const sub = fmtParts(A.allocated, [A.requested, A.allocated - A.requested]);
      rows += readoutRow("requested", "&nbsp;&nbsp;requested", A.requested, sub.parts[0], "", fmtBytes(A.requested));
      rows += readoutRow("waste", "&nbsp;&nbsp;rounding waste", A.allocated - A.requested, sub.parts[1], "", fmtBytes(A.allocated - A.requested));
    }
    if (r.S.pending) rows += readoutRow("pending", "&nbsp;pending free", pending, top.parts[1], "", fmtBytes(pending));
    rows += readoutRow("free", "&nbsp;cached free", free, top.parts[2], "", fmtBytes(free));
    rows += readoutRow("largest_free", "&nbsp;&nbsp;largest free block", largest, fmtBytes(largest));
    rows += `<tr data-key="fragmentation" data-value="${free > 0 ? 1 - largest / free : 0}"><td class="key">external fragmentation</td>` +
      `<td class="val">${free > 0 ? (1 - largest / free).toFixed(3) : "0"}</td><td class="sub">1 − largest/free</td></tr>`;
    if (r.S.evictable) rows += readoutRow("evictable", "evictable", evictable, fmtBytes(evictable), "", "part of allocated");
    const budget = budgetOf(r);
    if (budget) rows += readoutRow("budget", "budget", budget, fmtBytes(budget), "", "headroom " + fmtBytes(budget - reserved));
    if (A) {
      rows += readoutRow("map_reserved", "map: reserved", A.reserved, fmtBytes(A.reserved), "", `${A.segs.length} segments`);
      rows += readoutRow("map_allocated", "map: allocated", A.allocated, fmtBytes(A.allocated), "", `${A.nAlloc} blocks`);
    }
    $("readout").innerHTML = rows;
    // The other runs of this domain at the same x.
    const same = state.runs.filter((o) => o.domain === r.domain);
    if (same.length > 1) {
      let t = "<thead><tr><th>same x in</th><th>reserved</th><th>allocated</th><th>evictable</th><th>largest free</th><th>frag.</th></tr></thead><tbody>";
      for (const o of same) {
        const f = o.val("free", x), l = o.val("largest_free", x);
        t += `<tr data-compare-run="${o.index}"${o === r ? ' class="current"' : ""}><td>${esc(o.label)}</td><td>${fmtBytes(o.val("reserved", x))}</td>` +
          `<td>${fmtBytes(o.val("allocated", x))}</td><td>${o.S.evictable ? fmtBytes(o.val("evictable", x)) : "–"}</td>` +
          `<td>${fmtBytes(l)}</td><td>${f > 0 ? (1 - l / f).toFixed(2) : "0"}</td></tr>`;
      }
      $("compare").innerHTML = t + "</tbody>";
    } else $("compare").innerHTML = "";
  }

  // Cursor lines are 1-pixel elements moved by a transform: moving the
  // cursor repaints no canvas.
  function placeLine(line, left, top, height) {
    line.style.display = "block";
    line.style.top = top + "px";
    line.style.height = height + "px";
    line.style.transform = `translateX(${left}px)`;
  }
  function drawCursorLines() {
    const r = run(), x = cursorOf(r), v = viewOf(r);
    for (const id of ["timeline", "frag", "addrtime"]) {
      const base = $(id), line = $(id + "-over").firstElementChild;
      const box = plotBox(base);
      if (x < v.x0 || x >= v.x1) { line.style.display = "none"; continue; }
      placeLine(line, Math.floor(xToPx(box, v, x + 0.5)) / DPR, box.t / DPR, (box.b - box.t) / DPR);
    }
    document.querySelectorAll("#runs td.mini canvas").forEach((cv) => {
      const o = state.runs[+cv.dataset.run], line = cv.nextElementSibling;
      if (o.domain !== r.domain) { line.style.display = "none"; return; }
      placeLine(line, ((x + 0.5) / o.n) * (cv._w / DPR), 1, cv._h / DPR - 2);
    });
  }

  // ------------------------------------------------------------ runs table, headline, sweep
  function drawMini(cv) {
    const r = state.runs[+cv.dataset.run];
    const ctx = canvasSize(cv);
    const box = { l: 0, r: cv.width, t: 1, b: cv.height - 1 };
    const v = { x0: 0, x1: r.n };
    const res = envelope(r, box, v, (x) => r.val("reserved", x));
    const al = envelope(r, box, v, (x) => r.val("allocated", x));
    const scale = Math.max(1, ...state.runs.filter((o) => o.domain === r.domain).map((o) => Math.max(o.figures.peak_reserved_bytes || 0, budgetOf(o) || 0))) * 1.05;
    for (const [env, color] of [[res, COLORS.free], [al, COLORS.alloc]]) {
      ctx.fillStyle = color;
      for (let c = 0; c < env.W; c++) {
        if (!isFinite(env.max[c])) continue;
        const y = box.b - (env.max[c] / scale) * (box.b - box.t);
        ctx.fillRect(c, y, 1, box.b - y);
      }
    }
    const b = budgetOf(r);
    if (b) { ctx.fillStyle = COLORS.budget; ctx.fillRect(0, Math.floor(box.b - (b / scale) * (box.b - box.t)), cv.width, DPR); }
  }
  function buildRunsTable() {
    document.querySelectorAll("#runs tr.run-row").forEach((tr) => {
      const r = state.runs[+tr.dataset.run], f = r.figures;
      const budget = budgetOf(r);
      const frac = budget && f.no_eviction_peak_reserved_bytes ? ` (${(budget / f.no_eviction_peak_reserved_bytes).toFixed(2)})` : "";
      const result = f.feasible ? "ok" : `<span class="bad">OOM${f.oom_op !== null && f.oom_op !== undefined ? " at op " + f.oom_op : ""}${f.ooms > 1 ? " ×" + f.ooms : ""}</span>`;
      tr.innerHTML = `<td class="run-label">${esc(r.label)}</td><td>${f.policy || "–"}</td><td>${budget ? fmtBytes(budget) + frac : "none"}</td>` +
        `<td>${fmtBytes(f.peak_reserved_bytes)}</td><td>${fmtBytes(f.peak_allocated_bytes)}</td><td>${fmtInt(f.evictions)}</td>` +
        `<td>${fmtInt(f.remats)}</td><td>${r.byOp ? fmtPct(f.compute_overhead) : "–"}</td><td>${result}</td>` +
        `<td class="mini"><canvas data-run="${r.index}"></canvas><div class="cursor-line"></div></td>`;
      tr.addEventListener("click", () => select(r.index));
    });
    document.querySelectorAll("#runs td.mini canvas").forEach(drawMini);
  }
  function card(k, v, s, bad) {
    return `<div class="card${bad ? " bad" : ""}" data-card="${esc(k)}"><div class="k">${esc(k)}</div><div class="v">${v}</div><div class="s">${s || ""}</div></div>`;
  }
  function drawHeadline() {
    const r = run(), f = r.figures;
    const budget = budgetOf(r);
    let h = card("peak reserved", fmtBytes(f.peak_reserved_bytes), r.byOp ? "" : "over the history") +
      card("peak allocated", fmtBytes(f.peak_allocated_bytes), f.peak_reserved_bytes ? `${((100 * f.peak_allocated_bytes) / f.peak_reserved_bytes).toFixed(1)}% of reserved` : "") +
      card("budget", budget ? fmtBytes(budget) : "none", budget && f.no_eviction_peak_reserved_bytes ? `${(budget / f.no_eviction_peak_reserved_bytes).toFixed(2)} of the no-eviction peak` : "");
    if (r.kind === "replay") {
      const mfb = f.min_feasible_budget;
      h += card("min feasible budget", mfb === null || mfb === undefined ? "–" : (mfb * 100).toFixed(0) + "%",
                mfb && f.no_eviction_peak_reserved_bytes ? fmtBytes(mfb * f.no_eviction_peak_reserved_bytes) + " for " + f.policy : "of the no-eviction peak");
    }
    h += card("OOMs", fmtInt(f.ooms), f.oom_op !== null && f.oom_op !== undefined ? `at op ${f.oom_op}` : "", f.ooms > 0);
    if (r.byOp) {
      h += card("evictions", fmtInt(f.evictions), "") + card("remats", fmtInt(f.remats), "") +
        card("compute overhead", fmtPct(f.compute_overhead), "recompute / one pass");
    } else h += card("events", fmtInt(f.events), f.anomalies ? `${f.anomalies} do not add up` : "");
    $("headline").innerHTML = h;
    $("run-title").textContent = r.label;
    document.querySelectorAll("#runs tr.run-row").forEach((tr) => tr.classList.toggle("selected", +tr.dataset.run === state.sel));
  }
  function drawSweep() {
    const sw = meta.sweep;
    if (!sw || !sw.policies || !Object.keys(sw.policies).length) return;
    const c = $("sweep");
    if ($("sweep-section").hidden) { $("sweep-section").hidden = false; measure(); }
    const ctx = canvasSize(c), box = plotBox(c);
    ctx.clearRect(0, 0, c.width, c.height);
    const pts = Object.entries(sw.policies);
    let maxO = 0.05;
    for (const [, list] of pts) for (const p of list) if (p.feasible) maxO = Math.max(maxO, p.compute_overhead);
    maxO *= 1.1;
    let minF = 1;
    for (const [, list] of pts) for (const p of list) minF = Math.min(minF, p.fraction);
    minF = Math.max(0, Math.floor(minF * 10) / 10 - 0.05);
    const X = (f) => box.l + ((f - minF) / (1.02 - minF)) * (box.r - box.l);
    const Y = (o) => box.b - (o / maxO) * (box.b - box.t);
    drawAxesY(ctx, box, maxO, (v) => (v * 100).toFixed(0) + "%");
    ctx.fillStyle = "#667085"; ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (let f = Math.ceil(minF * 10) / 10; f <= 1.0001; f += 0.1) ctx.fillText(f.toFixed(1), X(f), box.b + 10 * DPR);
    ctx.textAlign = "right"; ctx.fillText("budget / no-eviction peak →", box.r, box.b + 10 * DPR + 12 * DPR);
    const palette = ["#3b6fd8", "#d9467a", "#2e9d8f", "#f29d38", "#6a1b9a", "#546e7a", "#8d6e63", "#c0ca33", "#00838f", "#5d4037"];
    let leg = [];
    pts.forEach(([policy, list], k) => {
      const color = palette[k % palette.length];
      leg.push([policy, color]);
      const sorted = list.slice().sort((a, b) => a.fraction - b.fraction);
      ctx.strokeStyle = color; ctx.lineWidth = 1.5 * DPR; ctx.beginPath();
      let started = false;
      for (const p of sorted) {
        if (!p.feasible) { started = false; continue; }
        if (!started) { ctx.moveTo(X(p.fraction), Y(p.compute_overhead)); started = true; } else ctx.lineTo(X(p.fraction), Y(p.compute_overhead));
      }
      ctx.stroke();
      for (const p of sorted) {
        ctx.fillStyle = color; ctx.strokeStyle = color;
        if (p.feasible) { ctx.beginPath(); ctx.arc(X(p.fraction), Y(p.compute_overhead), 3 * DPR, 0, 7); ctx.fill(); }
        else { const x = X(p.fraction), y = box.t + 8 * DPR, d = 4 * DPR; ctx.beginPath(); ctx.moveTo(x - d, y - d); ctx.lineTo(x + d, y + d); ctx.moveTo(x + d, y - d); ctx.lineTo(x - d, y + d); ctx.stroke(); }
      }
      const mf = sw.min_feasible && sw.min_feasible[policy];
      if (mf) { ctx.setLineDash([3 * DPR, 3 * DPR]); ctx.beginPath(); ctx.moveTo(X(mf), box.t); ctx.lineTo(X(mf), box.b); ctx.stroke(); ctx.setLineDash([]); }
    });
    $("sweep-caption").innerHTML = legend(leg) + " · dots: feasible replays, ×: OOM, dashed: min feasible budget" +
      (sw.no_eviction_peak_reserved_bytes ? ` · no-eviction peak ${fmtBytes(sw.no_eviction_peak_reserved_bytes)}` : "");
  }

  // ------------------------------------------------------------ interaction
  function setCursor(x) {
    const t = performance.now();
    const r = run();
    state.cursor[r.domain] = Math.max(0, Math.min(r.n - 1, Math.round(x)));
    const parts = api.timings.cursor_parts = {};
    let t1 = performance.now();
    const lap = (name) => { const now = performance.now(); parts[name] = now - t1; t1 = now; };
    state.alive = aliveAt(r, cursorOf(r)); lap("alive");
    drawCursorLines(); lap("lines");  // canvases first, the DOM after: no forced layout in between
    drawAddrMap(); lap("map");
    drawReadout(); lap("readout");
    drawTensors(); lap("tensors");
    const ms = performance.now() - t;
    api.timings.last_cursor_ms = ms;
    return ms;
  }
  function redrawAll() {
    drawHeadline();
    drawTimeline();
    drawFrag();
    drawAddrTime();
    setCursor(cursorOf(run()));
  }
  function select(i) {
    state.sel = i;
    state.selBlock = -1;
    const notes = [];
    for (const r of state.runs) for (const n of r.meta.notes || []) notes.push(`${r.label}: ${n}`);
    $("notes").innerHTML = notes.map((n) => `<li>${esc(n)}</li>`).join("");
    redrawAll();
  }
  function wire(id) {
    const over = $(id + "-over");
    let drag = null;
    const xAt = (ev) => {
      const rect = over.getBoundingClientRect();
      return pxToX(plotBox($(id)), viewOf(run()), (ev.clientX - rect.left) * DPR);
    };
    over.addEventListener("mousedown", (ev) => { drag = { x: ev.clientX, v: { ...viewOf(run()) }, moved: false }; });
    window.addEventListener("mousemove", (ev) => {
      if (!drag) return;
      if (Math.abs(ev.clientX - drag.x) > 3) drag.moved = true;
      if (!drag.moved) return;
      const r = run(), box = plotBox($(id));
      const dx = ((ev.clientX - drag.x) * DPR * (drag.v.x1 - drag.v.x0)) / (box.r - box.l);
      const span = drag.v.x1 - drag.v.x0;
      const x0 = Math.max(0, Math.min(r.n - span, drag.v.x0 - dx));
      state.view[r.domain] = { x0, x1: x0 + span };
      scheduleViews();
    });
    window.addEventListener("mouseup", (ev) => {
      if (drag && !drag.moved && over.contains(ev.target)) setCursor(Math.floor(xAt(ev)));
      drag = null;
    });
    over.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      const r = run(), v = viewOf(r), at = xAt(ev);
      const k = ev.deltaY > 0 ? 1.25 : 0.8;
      let span = Math.max(8, Math.min(r.n, (v.x1 - v.x0) * k));
      let x0 = at - (at - v.x0) * (span / (v.x1 - v.x0));
      x0 = Math.max(0, Math.min(r.n - span, x0));
      state.view[r.domain] = { x0, x1: x0 + span };
      scheduleViews();
    }, { passive: false });
    over.addEventListener("dblclick", () => { state.view[run().domain] = { x0: 0, x1: run().n }; scheduleViews(); });
    over.addEventListener("mousemove", (ev) => hoverChart(id, ev));
    over.addEventListener("mouseleave", () => ($("tooltip").hidden = true));
  }
  let pendingViews = false;
  function scheduleViews() {
    if (pendingViews) return;
    pendingViews = true;
    requestAnimationFrame(() => { pendingViews = false; drawTimeline(); drawFrag(); drawAddrTime(); drawCursorLines(); });
  }
  function tooltip(ev, text) {
    const t = $("tooltip");
    t.textContent = text;
    t.hidden = false;
    t.style.left = Math.min(window.innerWidth - 430, ev.clientX + 14) + "px";
    t.style.top = ev.clientY + 14 + "px";
  }
  function hoverChart(id, ev) {
    const r = run(), base = $(id), box = plotBox(base), rect = base.getBoundingClientRect();
    const x = Math.floor(pxToX(box, viewOf(r), (ev.clientX - rect.left) * DPR));
    if (x < 0 || x >= r.n) { $("tooltip").hidden = true; return; }
    let text = (r.byOp ? `op ${x} ${r.opName(x)} (${r.phaseAt(x)})` : `event ${fmtInt(x)}`) +
      `\nreserved ${fmtBytes(r.val("reserved", x))}\nallocated ${fmtBytes(r.val("allocated", x))}` +
      (r.S.evictable ? `\nevictable ${fmtBytes(r.val("evictable", x))}` : "") +
      `\ncached free ${fmtBytes(r.val("free", x))}, largest ${fmtBytes(r.val("largest_free", x))}`;
    if (id === "addrtime" && r.hist) {
      const H = r.hist, y = (((ev.clientY - rect.top) * DPR - box.t) / (box.b - box.t)) * H.compact;
      const B = H.B;
      for (let i = 0; i < B.start.length; i++) {
        if (B.X0[i] <= x && x < B.X2[i] && B.y[i] <= y && y < B.y[i] + B.size[i]) {
          text = `${addressOf(H, B.y[i])}: ${fmtBytes(B.size[i] * H.unit - B.waste[i])} (block ${fmtBytes(B.size[i] * H.unit)})\nmade by ${madeBy(r, i)}\n` +
            `alive ${r.byOp ? "ops" : "events"} ${fmtInt(B.X0[i])}–${fmtInt(B.X2[i])}` + (x >= B.X1[i] ? " (pending free)" : "");
          break;
        }
      }
    }
    tooltip(ev, text);
  }
  function wireMap() {
    const over = $("addrmap-over");
    const blockAt = (ev) => {
      const R = state.ribbon;
      if (!R) return -1;
      const rect = over.getBoundingClientRect();
      const px = (ev.clientX - rect.left) * DPR, py = (ev.clientY - rect.top) * DPR;
      const row = Math.floor(py / (R.rowH + R.gap));
      const o = (row * R.W + px) * R.per;
      for (const [i, a, b] of R.placed) if (o >= a && o < b) return i;
      return -1;
    };
    over.addEventListener("mousemove", (ev) => {
      const r = run(), i = blockAt(ev);
      if (i < 0) { $("tooltip").hidden = true; return; }
      const H = r.hist, B = H.B, z = B.size[i] * H.unit;
      const pend = state.alive && state.alive.e >= B.reqAt[i];
      tooltip(ev, `${addressOf(H, B.y[i])}${pend ? " (pending free)" : ""}\nrequested ${fmtBytes(z - B.waste[i])}, block ${fmtBytes(z)}, waste ${fmtBytes(B.waste[i])}\nmade by ${madeBy(r, i)}`);
    });
    over.addEventListener("mouseleave", () => ($("tooltip").hidden = true));
    over.addEventListener("click", (ev) => { state.selBlock = blockAt(ev); drawAddrMap(); drawTensors(); });
    $("tensors").addEventListener("click", (ev) => {
      const tr = ev.target.closest("tr[data-block]");
      if (!tr) return;
      state.selBlock = +tr.dataset.block;
      drawAddrMap(); drawTensors();
    });
  }
  function jump(dir) {
    const r = run(), x = cursorOf(r), s = r.marks.sorted;
    let target = null;
    if (dir > 0) target = s.find((m) => m > x);
    else for (const m of s) if (m < x) target = m;
    if (target !== null && target !== undefined) setCursor(target);
  }

  // ------------------------------------------------------------ start
  const meta = JSON.parse($("dtralloc-meta").textContent);
  api.meta = meta;
  api.setCursor = (x) => setCursor(x);
  api.select = (i) => select(i);
  // A cursor move as the user sees it: until the frame after it was painted.
  api.setCursorPainted = (x) => new Promise((resolve) => {
    const t = performance.now();
    setCursor(x);
    requestAnimationFrame(() => setTimeout(() => resolve(performance.now() - t), 0));
  });
  api.cursor = () => cursorOf(run());
  // For the tests of the columns' coding (tests/test_dashboard_codec.py):
  // the decoder, and run i's blocks as the views read them.
  api.text7decode = (s) => Array.from(text7decode(s));
  api.blocks = (i) => {
    const H = state.runs[i].hist;
    if (!H) return null;
    const B = H.B, out = { unit: H.unit };
    for (const k of ["start", "reqAt", "doneAt", "y", "size", "waste"]) out[k] = Array.from(B[k]);
    const h = state.runs[i].meta.history, S = state.runs[i].S;
    out.largest_free = Array.from(S.largest_free.a, (v) => v * S.largest_free.u);
    out.op = H.op ? Array.from(H.op) : null;
    out.time = H.time ? Array.from(H.time, (t) => t + H.t0) : null;
    out.coding = { largest: h.largest.runs ? "runs" : "dense", op: h.op && (h.op.runs ? "runs" : "dense") };
    return out;
  };
  api.readout = () => {
    const out = {};
    document.querySelectorAll("#readout [data-key]").forEach((tr) => {
      const v = tr.querySelector("[data-bytes]");
      if (v) out[tr.dataset.key] = Number(v.dataset.bytes);
      else if (tr.dataset.value !== undefined) out[tr.dataset.key] = Number(tr.dataset.value);
      else if (tr.dataset.x !== undefined) out[tr.dataset.key] = Number(tr.dataset.x);
    });
    return out;
  };
  api.ready = (async () => {
    try {
      $("source").textContent = meta.source ? "from " + meta.source : "";
      await decodeAll(meta);
      api.timings.decode_ms = performance.now() - T0;
      state.runs = meta.runs.map(prepareRun);
      api.timings.prepare_ms = performance.now() - T0;
      for (const r of state.runs) {  // the cursor starts at the peak of reserved
        if (state.cursor[r.domain] !== undefined) continue;
        let best = 0, bx = 0;
        for (let x = 0; x < r.n; x++) { const v = r.val("reserved", x); if (v > best) { best = v; bx = x; } }
        state.cursor[r.domain] = bx;
      }
      buildRunsTable();
      ["timeline", "frag", "addrtime"].forEach(wire);
      wireMap();
      $("zoom-reset").addEventListener("click", () => { state.view[run().domain] = { x0: 0, x1: run().n }; scheduleViews(); });
      $("prev-mark").addEventListener("click", () => jump(-1));
      $("next-mark").addEventListener("click", () => jump(1));
      window.addEventListener("keydown", (ev) => {
        const step = ev.shiftKey ? 10 : 1;
        if (ev.key === "ArrowRight") setCursor(cursorOf(run()) + step);
        else if (ev.key === "ArrowLeft") setCursor(cursorOf(run()) - step);
        else if (ev.key === "]") jump(1);
        else if (ev.key === "[") jump(-1);
        else if (ev.key === "Home") setCursor(0);
        else if (ev.key === "End") setCursor(run().n - 1);
        else return;
        ev.preventDefault();
      });
      let resize = null;
      window.addEventListener("resize", () => { clearTimeout(resize); resize = setTimeout(() => { document.querySelectorAll("#runs td.mini canvas").forEach(drawMini); redrawAll(); drawSweep(); }, 150); });
      select(0);
      drawSweep();
      api.timings.first_render_ms = performance.now();  // since navigation start
      api.timings.render_ms = performance.now() - T0;
      $("status").textContent = `${state.runs.length} run${state.runs.length > 1 ? "s" : ""} · dtralloc ${meta.version} · ${meta.generated}`;
      document.body.dataset.ready = "1";
    } catch (err) {
      $("status").textContent = "error: " + err;
      document.body.dataset.ready = "error";
      throw err;
    }
  })();
})();
