// Frontend extension of the streaming-cache node pack.
//
// 1. Each node's summary (what it did and why: "encoded 16, reused 0", "resuming my_lora ...", "cancelled at
//    step 12 of 20: saved ...") is the node's `ui.text`; ComfyUI keeps it in the prompt's history but shows it
//    nowhere. Here it is shown on the node, read-only, and stays after the job ends (and after an unchanged
//    re-run, whose cached result ComfyUI sends again).
// 2. UI workflow files store widget values by position. A file saved by an earlier release whose widget order
//    differs from today's (widget_layouts.json, by node id and release) is re-mapped by widget name before the
//    graph is configured; widgets the file lacks get their defaults, as for any older file.
import { app } from "../../scripts/app.js";

const PACK_NODES = new Set([
  "StreamingCacheEncode", "StreamingCacheEncodeDataset", "StreamingCacheLoad", "StreamingCacheTrain",
  "StreamingCacheTrainLoRA",
]);
const WIDGET_TYPES = new Set(["INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"]);
const nodeDefs = {};
let layouts = {};

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

export function remapWidgets(type, values, nodeData, table) {
  // `values` in today's widget order, or `values` itself when no earlier layout of this length differs
  const releases = table?.[type];
  if (!releases || !Array.isArray(values) || !nodeData) return values;
  const current = widgetInputs(nodeData);
  if (values.length === current.length) return values;
  const names = Object.values(releases).filter((layout) => layout.length === values.length).pop();
  if (!names) return values;
  const currentNames = current.map(([name]) => name);
  if (names.every((name, i) => currentNames[i] === name)) return values;
  const byName = Object.fromEntries(names.map((name, i) => [name, values[i]]));
  return current.map(([name, spec]) => (name in byName ? byName[name] : defaultOf(spec)));
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
      layouts = (await response.json()).layouts || {};
    } catch (error) {
      console.warn("streaming-cache: widget layouts of earlier releases not loaded", error);
    }
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!PACK_NODES.has(nodeData.name)) return;
    nodeDefs[nodeData.name] = nodeData;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = textOf(message);
      if (text) showSummary(this, text);
    };
  },

  beforeConfigureGraph(graphData) {
    const subgraphs = graphData?.definitions?.subgraphs || [];
    for (const graph of [graphData, ...subgraphs]) {
      for (const node of graph?.nodes || []) {
        if (!PACK_NODES.has(node.type)) continue;
        node.widgets_values = remapWidgets(node.type, node.widgets_values, nodeDefs[node.type], layouts);
      }
    }
  },

  onNodeOutputsUpdated(outputs) {
    for (const [id, output] of Object.entries(outputs || {})) {
      const node = app.graph?.getNodeById?.(Number(id)) ?? app.graph?.getNodeById?.(id);
      const text = textOf(output);
      if (node && PACK_NODES.has(node.type) && text) showSummary(node, text);
    }
  },
});
