// Frontend extension of the streaming-cache node pack.
//
// 1. Each node's summary (what it did and why: "encoded 16, reused 0", "resuming my_lora ...", "cancelled at
//    step 12 of 20: saved ...") is the node's `ui.text`; ComfyUI keeps it in the prompt's history but shows it
//    nowhere. Here it is shown on the node, read-only, and stays after the job ends (and after an unchanged
//    re-run, whose cached result ComfyUI sends again).
// 2. Train LoRA's loss chart, drawn here from the curves the node sends while it trains (the
//    "streaming_cache.chart" message) and keeps in its output (`ui.chart`): loss, moving average, validation,
//    learning rate (right axis) and one line per dataset of a mix; hover reads out step, loss, average, learning
//    rate and time; linear or log loss axis; drag across the chart to zoom to those steps, double-click to see
//    them all. The last chart, and the summary, come back after a page reload from the prompt's history (matched
//    by the workflow's id, or where a workflow has none by its nodes).
// 3. The dataset preview of Encode Dataset and Load Streaming Cache: the page the node drew, and arrows that ask
//    the pack's route for other pages by the preview's token (no input of the graph changes, nothing re-runs).
//    It comes back after a page reload from the prompt's history, as the chart does. A page is the user's to turn
//    as soon as it shows: a restore from history answered late (the page asks for it more than once while it
//    loads, and on a busy server the answers can come a second apart) or the frontend handing the same outputs
//    round again never turns the pager back, and a page asked for before a new run's preview arrived is dropped.
// 4. UI workflow files store widget values by position. A file saved by an earlier release whose widget order
//    differs from today's (widget_layouts.json, by node id and release) is re-mapped by widget name before the
//    graph is configured; widgets the file lacks get their defaults, as for any older file.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PACK_NODES = new Set([
  "StreamingCacheEncode", "StreamingCacheEncodeDataset", "StreamingCacheLoad", "StreamingCacheTrain",
  "StreamingCacheTrainLoRA",
]);
const CHART_NODES = new Set(["StreamingCacheTrain", "StreamingCacheTrainLoRA"]);
const PREVIEW_NODES = new Set(["StreamingCacheEncode", "StreamingCacheEncodeDataset", "StreamingCacheLoad"]);
const PREVIEW_WIDTH = 480; // a node showing a dataset preview is at least this wide, so its tiles can be read
const CHART_EVENT = "streaming_cache.chart";
const COLORS = {
  loss: "rgba(140, 170, 230, 0.9)", average: "#1f4fc4", validation: "#e07b10", lr: "#2a8a3e",
  grid: "rgba(128, 128, 128, 0.25)", text: "#aaa", hover: "rgba(200, 200, 200, 0.6)",
  datasets: ["#a040c0", "#00a0a0", "#d02870", "#b08020", "#808080"],
};
const WIDGET_TYPES = new Set(["INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"]);
const nodeDefs = {};
let layouts = {};
let absentValues = {};
let createdValues = {};

function widgetInputs(nodeData) {
  // [name, spec] of every widget input, in the order the frontend creates the widgets
  const out = [];
  for (const section of ["required", "optional"]) {
    const inputs = nodeData?.input?.[section] || {};
    const order = nodeData?.input_order?.[section] || Object.keys(inputs);
    for (const name of order) {
      const spec = inputs[name];
      if (!spec) continue;
      const kind = spec[0];
      const opts = spec[1] || {};
      if (opts.forceInput) continue;
      if (Array.isArray(kind) || WIDGET_TYPES.has(kind)) out.push([name, spec]);
    }
  }
  return out;
}

function defaultOf(spec) {
  const kind = spec[0];
  const opts = spec[1] || {};
  if ("default" in opts) return opts.default;
  if (Array.isArray(kind)) return kind[0];
  if (kind === "COMBO") return (opts.options || [])[0];
  return kind === "BOOLEAN" ? false : kind === "STRING" ? "" : 0;
}

export function remapWidgets(type, values, nodeData, table, absentTable = {}) {
  // `values` in today's widget order, or `values` itself when no earlier layout of this length differs and no
  // widget the file lacks takes a value other than its default there (`absentTable`: widget_layouts.json's absent)
  const releases = table?.[type] || {};
  const absent = absentTable?.[type] || {};
  if (!Array.isArray(values) || !nodeData) return values;
  const current = widgetInputs(nodeData);
  if (values.length === current.length) return values;
  const currentNames = current.map(([name]) => name);
  let names = Object.values(releases).filter((layout) => layout.length === values.length).pop();
  if (!names) {
    if (values.length > current.length) return values;
    names = currentNames.slice(0, values.length);
  }
  const missing = currentNames.filter((name) => !names.includes(name));
  if (names.every((name, i) => currentNames[i] === name) && !missing.some((name) => name in absent)) return values;
  const byName = Object.fromEntries(names.map((name, i) => [name, values[i]]));
  return current.map(([name, spec]) => (name in byName ? byName[name] : name in absent ? absent[name]
    : defaultOf(spec)));
}

function showSummary(node, text) {
  let widget = node.widgets?.find((w) => w.name === "summary");
  if (!widget) {
    const el = document.createElement("textarea");
    el.readOnly = true;
    el.rows = 4;
    el.spellcheck = false;
    el.title = "What this node did in its last run";
    Object.assign(el.style, {
      width: "100%", boxSizing: "border-box", resize: "none", fontSize: "11px", lineHeight: "1.35",
      fontFamily: "monospace", background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
      border: "1px solid var(--border-color, #444)", borderRadius: "4px", padding: "4px", opacity: "0.9",
    });
    widget = node.addDOMWidget("summary", "streaming_cache_summary", el, {
      serialize: false, getValue: () => el.value, setValue: (v) => { el.value = v ?? ""; },
      getMinHeight: () => 64, getMaxHeight: () => 160,
    });
    widget.serialize = false;
    widget.element = widget.element || el;
  }
  const el = widget.element || widget.inputEl;
  if (el) el.value = text;
  widget.value = text;
  const size = node.computeSize?.();
  if (size && node.size && node.size[1] < size[1]) node.setSize([node.size[0], size[1]]);
  node.setDirtyCanvas?.(true, true);
}

function finite(v) {
  return typeof v === "number" && Number.isFinite(v);
}

function niceTicks(lo, hi, count) {
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= count) || 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function formatValue(v) {
  if (!finite(v)) return "-";
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e4) ? v.toExponential(2) : v.toPrecision(4);
}

function formatSeconds(s) {
  if (!finite(s)) return "";
  if (s < 120) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return m < 120 ? `${m} min ${Math.round(s - 60 * m)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

function panel(count, content) {
  // a node widget's frame: a bar of `count` small buttons and a line of text, above `content`. Where the frontend
  // gives the frame the widget's height (newer ones do), what is drawn stays inside it (the content may shrink)
  const wrap = document.createElement("div");
  Object.assign(wrap.style, { width: "100%", display: "flex", flexDirection: "column", gap: "2px",
                              overflow: "hidden", boxSizing: "border-box",
                              fontFamily: "sans-serif", fontSize: "11px", color: "var(--input-text, #ddd)" });
  const bar = document.createElement("div");
  Object.assign(bar.style, { display: "flex", gap: "6px", alignItems: "center", minHeight: "18px", flexShrink: "0" });
  const buttons = Array.from({ length: count }, () => {
    const b = document.createElement("button");
    Object.assign(b.style, { fontSize: "11px", padding: "0 6px", cursor: "pointer" });
    return b;
  });
  const text = document.createElement("span");
  Object.assign(text.style, { whiteSpace: "nowrap", overflow: "hidden", textOverflow: "ellipsis" });
  bar.append(...buttons, text);
  wrap.append(bar, content);
  return { wrap, buttons, text };
}

function chartState(node) {
  if (node.__streamingCacheChart) return node.__streamingCacheChart;
  const canvas = document.createElement("canvas");
  Object.assign(canvas.style, { width: "100%", height: "220px", cursor: "crosshair" });
  const { wrap, buttons: [scale, reset], text: readout } = panel(2, canvas);
  reset.textContent = "all steps";
  reset.title = "Show every step (or double-click the chart); drag across the chart to zoom to a range of steps";
  const widget = node.addDOMWidget("loss_chart", "streaming_cache_chart", wrap, {
    serialize: false, getValue: () => "", setValue: () => {}, getMinHeight: () => 250, getMaxHeight: () => 320,
  });
  widget.serialize = false;
  const st = { node, widget, canvas, readout, scale, data: null, log: false, zoom: null, hover: null, drag: null,
               layout: null };
  node.__streamingCacheChart = st;
  scale.onclick = () => { st.log = !st.log; drawChart(st); };
  reset.onclick = () => { st.zoom = null; drawChart(st); };
  const stepAt = (event) => {
    const rect = canvas.getBoundingClientRect();
    const L = st.layout;
    if (!L) return null;
    const x = event.clientX - rect.left;
    return L.x0 + ((x - L.left) / (L.right - L.left)) * (L.x1 - L.x0);
  };
  canvas.addEventListener("mousemove", (e) => {
    const step = stepAt(e);
    if (step === null) return;
    st.hover = step;
    if (st.drag !== null) st.dragTo = step;
    drawChart(st);
  });
  canvas.addEventListener("mouseleave", () => { st.hover = null; st.drag = null; drawChart(st); });
  canvas.addEventListener("mousedown", (e) => { st.drag = stepAt(e); st.dragTo = st.drag; });
  canvas.addEventListener("mouseup", (e) => {
    const end = stepAt(e);
    if (st.drag !== null && end !== null && st.layout) {
      const [a, b] = [Math.min(st.drag, end), Math.max(st.drag, end)];
      const pixels = ((b - a) / (st.layout.x1 - st.layout.x0)) * (st.layout.right - st.layout.left);
      if (pixels > 4) st.zoom = [a, b];
    }
    st.drag = null;
    drawChart(st);
  });
  canvas.addEventListener("dblclick", () => { st.zoom = null; drawChart(st); });
  return st;
}

function nearestIndex(steps, step) {
  let lo = 0;
  let hi = steps.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (steps[mid] < step) lo = mid + 1; else hi = mid;
  }
  if (lo > 0 && Math.abs(steps[lo - 1] - step) <= Math.abs(steps[lo] - step)) lo -= 1;
  return lo;
}

function chartFrame(st, width, height) {
  // the axes' ranges and the plot area: the steps shown (all, or the zoomed range) and the values they hold
  const d = st.data;
  const steps = d.steps || [];
  const last = steps.length ? steps[steps.length - 1] : 1;
  const [x0, x1] = st.zoom || [steps.length ? steps[0] : 0, Math.max(d.total || last, last, (steps[0] || 0) + 1)];
  const hasLr = (d.lr || []).some(finite);
  const L = { left: 50, right: width - (hasLr ? 50 : 10), top: 16, bottom: height - 28, x0, x1, hasLr };
  const tf = (v) => (st.log ? (v > 0 ? Math.log10(v) : null) : v);
  const visible = [];
  const addVisible = (s, v) => { if (s >= x0 && s <= x1 && finite(v) && tf(v) !== null) visible.push(tf(v)); };
  steps.forEach((s, i) => { addVisible(s, d.loss[i]); addVisible(s, d.average[i]); });
  for (const [s, v] of d.validation || []) addVisible(s, v);
  for (const pts of Object.values(d.datasets || {})) for (const [s, v] of pts) addVisible(s, v);
  let y0 = visible.length ? Math.min(...visible) : 0;
  let y1 = visible.length ? Math.max(...visible) : 1;
  if (y1 - y0 < 1e-12) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05;
  L.y0 = y0 - pad;
  L.y1 = y1 + pad;
  L.tf = tf;
  L.X = (s) => L.left + ((s - x0) / (x1 - x0 || 1)) * (L.right - L.left);
  L.Y = (v) => L.bottom - ((tf(v) - L.y0) / (L.y1 - L.y0)) * (L.bottom - L.top);
  L.lrMax = hasLr ? Math.max(...d.lr.filter(finite)) || 1 : 0;
  return L;
}

function drawAxes(ctx, st, L) {
  // grid, tick labels and axis titles (step, loss or loss (log))
  ctx.font = "11px sans-serif";
  ctx.fillStyle = COLORS.text;
  ctx.strokeStyle = COLORS.grid;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const t of niceTicks(L.y0, L.y1, 5)) {
    const y = L.bottom - ((t - L.y0) / (L.y1 - L.y0)) * (L.bottom - L.top);
    ctx.beginPath(); ctx.moveTo(L.left, y); ctx.lineTo(L.right, y); ctx.stroke();
    ctx.fillText(st.log ? formatValue(10 ** t) : formatValue(t), L.left - 4, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of niceTicks(L.x0, L.x1, 6).filter((t) => Number.isInteger(t))) {
    const x = L.X(t);
    ctx.beginPath(); ctx.moveTo(x, L.top); ctx.lineTo(x, L.bottom); ctx.stroke();
    ctx.fillText(String(t), x, L.bottom + 3);
  }
  ctx.fillText("step", (L.left + L.right) / 2, L.bottom + 15);
  ctx.save();
  ctx.translate(11, (L.top + L.bottom) / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(st.log ? "loss (log)" : "loss", 0, -6);
  ctx.restore();
  if (!L.hasLr) return;
  ctx.fillStyle = COLORS.lr;
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  for (const t of niceTicks(0, L.lrMax * 1.05, 4)) {
    ctx.fillText(formatValue(t), L.right + 4, L.bottom - (t / (L.lrMax * 1.05)) * (L.bottom - L.top));
  }
}

function drawSeries(ctx, d, L) {
  // the curves: loss (or one per dataset of a mix), its moving average, validation points, learning rate
  const steps = d.steps || [];
  const line = (xs, ys, color, widthPx) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = widthPx;
    ctx.beginPath();
    let pen = false;
    xs.forEach((s, i) => {
      const v = ys[i];
      if (!finite(v) || L.tf(v) === null) { pen = false; return; }
      if (pen) ctx.lineTo(L.X(s), L.Y(v)); else ctx.moveTo(L.X(s), L.Y(v));
      pen = true;
    });
    ctx.stroke();
  };
  const names = Object.keys(d.datasets || {});
  names.forEach((name, k) => {
    const pts = d.datasets[name];
    line(pts.map((p) => p[0]), pts.map((p) => p[1]), COLORS.datasets[k % COLORS.datasets.length], 1);
  });
  if (!names.length) line(steps, d.loss, COLORS.loss, 1);
  line(steps, d.average, COLORS.average, 2);
  const val = d.validation || [];
  line(val.map((p) => p[0]), val.map((p) => p[1]), COLORS.validation, 1.5);
  ctx.fillStyle = COLORS.validation;
  for (const [s, v] of val) if (finite(v) && L.tf(v) !== null) ctx.fillRect(L.X(s) - 2, L.Y(v) - 2, 4, 4);
  if (!L.hasLr) return;
  const LY = (v) => L.bottom - (v / (L.lrMax * 1.05)) * (L.bottom - L.top);
  ctx.strokeStyle = COLORS.lr;
  ctx.lineWidth = 1;
  ctx.setLineDash([4, 3]);
  ctx.beginPath();
  steps.forEach((s, i) => { if (finite(d.lr[i])) (i ? ctx.lineTo(L.X(s), LY(d.lr[i])) : ctx.moveTo(L.X(s), LY(d.lr[i]))); });
  ctx.stroke();
  ctx.setLineDash([]);
}

function readout(ctx, st, L) {
  // the text above the chart: the run so far, or the values at the step under the pointer (with its marker)
  const d = st.data;
  const steps = d.steps || [];
  const last = steps.length ? steps[steps.length - 1] : 0;
  st.hoverStep = null;
  if (st.hover === null || !steps.length) {
    const average = d.average[d.average.length - 1];
    return `${last} of ${d.total} steps` + (finite(average) ? `, average loss ${formatValue(average)}` : "");
  }
  const i = nearestIndex(steps, Math.min(Math.max(st.hover, L.x0), L.x1));
  const s = steps[i];
  ctx.strokeStyle = COLORS.hover;
  ctx.beginPath(); ctx.moveTo(L.X(s), L.top); ctx.lineTo(L.X(s), L.bottom); ctx.stroke();
  let text = `step ${s}  loss ${formatValue(d.loss[i])}  average ${formatValue(d.average[i])}`;
  const v = (d.validation || []).filter((p) => p[0] <= s).pop();
  if (v) text += `  validation ${formatValue(v[1])} (step ${v[0]})`;
  if (L.hasLr) text += `  lr ${formatValue(d.lr[i])}`;
  if ((d.time || []).length) text += `  ${formatSeconds(d.time[i])}`;
  st.hoverStep = s;
  return text;
}

function drawLegend(ctx, d, L) {
  const names = Object.keys(d.datasets || {});
  const legend = [["average", COLORS.average], ...(names.length ? names.map((n, k) =>
    [n, COLORS.datasets[k % COLORS.datasets.length]]) : [["loss", COLORS.loss]])];
  if ((d.validation || []).length) legend.push(["validation", COLORS.validation]);
  if (L.hasLr) legend.push(["learning rate", COLORS.lr]);
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  let lx = L.left + 4;
  for (const [label, color] of legend) {
    ctx.fillStyle = color;
    ctx.fillRect(lx, 4, 10, 3);
    ctx.fillText(label, lx + 13, 0);
    lx += 20 + ctx.measureText(label).width;
  }
}

function drawChart(st) {
  const canvas = st.canvas;
  st.scale.textContent = st.log ? "log" : "linear";
  st.scale.title = "The loss axis: click for " + (st.log ? "linear" : "log");
  if (!st.data) return;
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400;
  const height = canvas.clientHeight || 220;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const L = chartFrame(st, width, height);
  st.layout = L;
  st.xOf = L.X;
  drawAxes(ctx, st, L);
  ctx.save();
  ctx.beginPath();
  ctx.rect(L.left, L.top - 1, L.right - L.left, L.bottom - L.top + 2);
  ctx.clip();
  drawSeries(ctx, st.data, L);
  if (st.drag !== null && st.dragTo !== undefined && st.dragTo !== null) {
    ctx.fillStyle = "rgba(120, 160, 255, 0.15)";
    const a = L.X(Math.min(st.drag, st.dragTo));
    ctx.fillRect(a, L.top, L.X(Math.max(st.drag, st.dragTo)) - a, L.bottom - L.top);
  }
  const text = readout(ctx, st, L);
  ctx.restore();
  drawLegend(ctx, st.data, L);
  st.readout.textContent = text;
}

function showChart(node, data) {
  if (!CHART_NODES.has(node.type) || !data || !Array.isArray(data.steps)) return;
  const st = chartState(node);
  if (st.data === null) st.log = data.scale === "log";
  st.data = data;
  drawChart(st);
  const size = node.computeSize?.();
  if (size && node.size && node.size[1] < size[1]) node.setSize([node.size[0], size[1]]);
  node.setDirtyCanvas?.(true, true);
}

function previewOf(output) {
  const preview = output?.dataset_preview;
  return Array.isArray(preview) ? preview[preview.length - 1] : preview || null;
}

function imageURL(image) {
  const query = new URLSearchParams({ filename: image.filename, type: image.type || "temp",
                                      subfolder: image.subfolder || "" });
  return api.apiURL(`/view?${query}`);
}

function previewState(node) {
  if (node.__streamingCachePreview) return node.__streamingCachePreview;
  const img = document.createElement("img");
  img.alt = "dataset preview";
  Object.assign(img.style, { width: "100%", maxHeight: "420px", minHeight: "0", flex: "0 1 auto", objectFit: "contain",
                             background: "#fff" });
  const { wrap, buttons: [back, next], text: label } = panel(2, img);
  back.textContent = "\u25c0";
  next.textContent = "\u25b6";
  back.title = "The previous page of the dataset preview (nothing re-runs)";
  next.title = "The next page of the dataset preview (nothing re-runs)";
  let minHeight = 300; // the widget's least height: once a page loads, enough to show it at the node's width
  const widget = node.addDOMWidget("dataset_preview", "streaming_cache_dataset_preview", wrap, {
    serialize: false, getValue: () => "", setValue: () => {}, getMinHeight: () => minHeight,
    getMaxHeight: () => 460,
  });
  widget.serialize = false;
  img.addEventListener("load", () => {
    // a node shorter than the page it shows grows to it (never shrinks: the user may have made it taller)
    const width = img.clientWidth || node.size[0] - 20;
    const page = Math.min(420, (width * img.naturalHeight) / (img.naturalWidth || 1));
    minHeight = Math.max(300, Math.min(460, Math.ceil(page + 24)));
    const size = node.computeSize?.();
    if (size && node.size && node.size[1] < size[1]) node.setSize([node.size[0], size[1]]);
    node.setDirtyCanvas?.(true, true);
  });
  // serial: counts the previews shown, so that a page asked for before the node showed another is dropped
  const st = { node, widget, img, label, back, next, data: null, page: 1, pages: 1, error: null, loading: false,
               serial: 0 };
  back.onclick = () => turnPage(st, st.page - 1);
  next.onclick = () => turnPage(st, st.page + 1);
  node.__streamingCachePreview = st;
  return st;
}

function labelPreview(st) {
  st.label.textContent = st.error ?? `page ${st.page} of ${st.pages}`;
  st.label.title = st.error ?? (st.line || "");
  st.back.disabled = st.loading || st.page <= 1;
  st.next.disabled = st.loading || st.page >= st.pages;
}

async function turnPage(st, page) {
  // a page asked of the pack's route by the preview's token: the graph and its inputs stay as they are
  if (!st.data || page < 1 || page > st.pages || st.loading) return;
  const serial = st.serial;
  st.loading = true;
  labelPreview(st);
  let shown = {};
  try {
    const query = new URLSearchParams({ token: st.data.token, page: String(page) });
    const response = await api.fetchApi(`${st.data.route}?${query}`);
    const body = await response.json();
    if (!response.ok) throw new Error(body?.error || `the server answered ${response.status}`);
    shown = { page: body.page, pages: body.pages, line: body.line, error: null, image: body.image };
  } catch (error) {
    shown = { error: String(error?.message || error) };
  }
  if (serial !== st.serial) return; // the node showed another preview meanwhile (a new run): that one stays
  const { image, ...state } = shown;
  if (image) st.img.src = image;
  Object.assign(st, state, { loading: false });
  labelPreview(st);
}

function samePreview(a, b) {
  // the same output of a node: the same preview (token), page and image file
  return !!a && !!b && a.token === b.token && a.page === b.page && a.image?.filename === b.image?.filename
    && (a.image?.subfolder || "") === (b.image?.subfolder || "");
}

function showDatasetPreview(node, data, again = false) {
  // `again`: an output the node may show already (a restore from history, the frontend's copy of the outputs):
  // the same preview leaves the pager on the page it shows, which the user may have turned
  if (!PREVIEW_NODES.has(node.type) || !data?.token || !data.image) return;
  const st = previewState(node);
  if (again && samePreview(st.data, data)) return;
  st.data = data;
  st.serial += 1;
  Object.assign(st, { page: data.page, pages: data.pages, line: data.line, error: null, loading: false });
  st.img.src = imageURL(data.image);
  labelPreview(st);
  const size = node.computeSize?.();
  if (size && node.size && (node.size[1] < size[1] || node.size[0] < PREVIEW_WIDTH)) {
    node.setSize([Math.max(node.size[0], PREVIEW_WIDTH), Math.max(node.size[1], size[1])]);
  }
  node.setDirtyCanvas?.(true, true);
}

let shownCount = 0; // outputs shown so far on any node; each node keeps the count at its last (__streamingCacheShown)

function showOutput(node, output, again = false) {
  // what a pack node's output (or history entry) holds for the page: its summary, chart and dataset preview
  // (`again`: see showDatasetPreview)
  node.__streamingCacheShown = ++shownCount;
  const text = textOf(output);
  if (text) showSummary(node, text);
  const chart = chartOf(output);
  if (chart) showChart(node, chart);
  const preview = previewOf(output);
  if (preview) showDatasetPreview(node, preview, again);
}

function chartOf(output) {
  const chart = output?.chart;
  return Array.isArray(chart) ? chart[chart.length - 1] : chart || null;
}

function currentGraph() {
  // the graph on the canvas, without touching app.graph before the app has one (newer frontends log an error)
  return app.canvas?.graph ?? null;
}

function findNode(id) {
  const graph = currentGraph();
  return graph?.getNodeById?.(Number(id)) ?? graph?.getNodeById?.(id) ?? null;
}

const ZERO_ID = "00000000-0000-0000-0000-000000000000";

function sameWorkflow(entry) {
  // a history entry of the workflow on the canvas: the same workflow id where both have one, else every node the
  // prompt ran is on the canvas with the same type
  const id = currentGraph()?.rootGraph?.id ?? currentGraph()?.id;
  const saved = entry?.prompt?.[3]?.extra_pnginfo?.workflow?.id;
  if (id && saved && id !== ZERO_ID && saved !== ZERO_ID) return id === saved;
  const prompt = entry?.prompt?.[2] || {};
  const ids = Object.keys(prompt);
  return ids.length > 0 && ids.every((k) => findNode(k)?.type === prompt[k]?.class_type);
}

async function restoreFromHistory() {
  // the summaries and charts of this workflow's last run, after a page reload. The page asks for this more than
  // once while it loads (at setup, after each graph it configures), and the answers may come back in any order:
  // a node that showed an output since this request was made (a run's, or another restore's) keeps it
  if (!currentGraph()) return;
  const since = shownCount;
  let history;
  try {
    history = await (await api.fetchApi("/history?max_items=64")).json();
  } catch (error) {
    return;
  }
  const done = new Set();
  for (const entry of Object.values(history || {}).reverse()) {
    if (!sameWorkflow(entry)) continue;
    for (const [id, output] of Object.entries(entry.outputs || {})) {
      const node = findNode(id);
      if (!node || done.has(node) || !PACK_NODES.has(node.type)) continue;
      if (entry.prompt?.[2]?.[id]?.class_type !== node.type) continue;
      done.add(node);
      if ((node.__streamingCacheShown ?? 0) > since) continue;
      showOutput(node, output, true);
    }
  }
}

function textOf(output) {
  const text = output?.text;
  if (!text) return null;
  return Array.isArray(text) ? text.join("\n") : String(text);
}

app.registerExtension({
  name: "streaming_cache.nodes",

  async init() {
    try {
      const response = await fetch(new URL("./widget_layouts.json", import.meta.url));
      const table = await response.json();
      layouts = table.layouts || {};
      absentValues = table.absent || {};
      createdValues = table.created || {};
    } catch (error) {
      console.warn("streaming-cache: widget layouts of earlier releases not loaded", error);
    }
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!PACK_NODES.has(nodeData.name)) return;
    nodeDefs[nodeData.name] = nodeData;
    for (const [name, value] of Object.entries(createdValues[nodeData.name] || {})) {
      // a node added in the UI starts at this value; files saved before the widget came get `absent`'s
      const spec = nodeData.input?.optional?.[name] || nodeData.input?.required?.[name];
      if (spec) spec[1] = { ...(spec[1] || {}), default: value };
    }
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      showOutput(this, message);
    };
  },

  async setup() {
    api.addEventListener(CHART_EVENT, ({ detail }) => {
      const node = detail && findNode(detail.node);
      if (!node) return;
      node.__streamingCacheShown = ++shownCount; // a restore asked for before this does not replace it
      showChart(node, detail.chart);
    });
    setTimeout(restoreFromHistory, 500);
  },

  async afterConfigureGraph() {
    setTimeout(restoreFromHistory, 200);
  },

  beforeConfigureGraph(graphData) {
    const subgraphs = graphData?.definitions?.subgraphs || [];
    for (const graph of [graphData, ...subgraphs]) {
      for (const node of graph?.nodes || []) {
        if (!PACK_NODES.has(node.type)) continue;
        node.widgets_values = remapWidgets(node.type, node.widgets_values, nodeDefs[node.type], layouts,
          absentValues);
      }
    }
  },

  onNodeOutputsUpdated(outputs) {
    for (const [id, output] of Object.entries(outputs || {})) {
      const node = findNode(id);
      if (!node || !PACK_NODES.has(node.type)) continue;
      showOutput(node, output, true);
    }
  },
});
