"""The pack in the frontend that ships with a ComfyUI (or another given one), as a user meets it; prints one JSON line.

    python frontend_check.py COMFYUI_PATH WORKDIR ARTIFACTS_DIR [FRONTEND_ROOT]      (with ComfyUI's Python)

Installs the pack the way users do (a folder in ``custom_nodes``), starts ComfyUI's real server (with the frontend
at FRONTEND_ROOT when given: a newer release than the ComfyUI ships), and drives headless Chromium (see
``browser.py``):

- the template browser lists the pack's workflows with their thumbnails, and no request fails;
- each example loads with every node type known, every widget value kept, and converts to the same API prompt as
  the headless runner's conversion; an example of a family newer than this ComfyUI loads with that family's node
  types missing, and only those;
- the example workflows of every earlier release (``tests/fixtures/releases``) load with their widget values where
  today's nodes have them, and convert to a prompt that holds every input that release's own runner exported;
- each of the pack's nodes (a new one, at the default zoom) fits a 1000 px high screen;
- the first example, with its checkpoint switched to a tiny random-weight one, runs from the Run button to the end; the nodes then show what they did, and still do after the same workflow is queued again;
- the previews example runs too, and Train LoRA's loss chart shows while it trains and afterwards: hover, log
  scale, zoom, and the chart and summary back after a page reload;
- Load Streaming Cache's dataset preview turns to its second page at a mouse click on its arrow (on the screen,
  through the browser's input events) without changing the graph or queueing anything, and is back after a page
  reload, where a click as soon as it shows turns the page and a restore from history answered later leaves it so.

Each part runs on its own (``check_examples``): one that fails is reported with its message, and the others run.
Screenshots go to ARTIFACTS_DIR.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable

from browser import Browser, BrowserError
from demo_assets import CKPT, tiny_checkpoint, write_dataset

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

PACK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACK_NAME = "comfyui-streaming-cache"
EXAMPLES = headless.EXAMPLES
FOLDER_EXAMPLE, PREVIEWS_EXAMPLE = headless.EXAMPLES_RENAMED["encode_and_train"], \
    headless.EXAMPLES_RENAMED["train_with_previews"]
RELEASES = os.path.join(PACK, "tests", "fixtures", "releases")
SCREEN_HEIGHT = 1000


def comfyui_version(comfyui: str) -> str:
    """The version ComfyUI's ``comfyui_version.py`` states ("unknown" without one)."""
    try:
        with open(os.path.join(comfyui, "comfyui_version.py"), encoding="utf-8") as f:
            return f.read().split("__version__ =", 1)[1].strip().split()[0].strip("\"'")
    except (OSError, IndexError):
        return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, data: bytes | None = None) -> object:
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30) as r:
        body = r.read()
    return json.loads(body) if body else None


def prepare(comfyui: str, base: str) -> dict:
    """The pack in custom_nodes, a tiny checkpoint and a sample dataset; returns the node classes (for the
    headless runner's UI-to-API conversion, compared with the frontend's)."""
    os.makedirs(os.path.join(base, "custom_nodes"), exist_ok=True)
    link = os.path.join(base, "custom_nodes", PACK_NAME)
    if not os.path.exists(link):
        os.symlink(PACK, link)
    headless.boot(comfyui, ["--base-directory", base], quiet=True)
    import folder_paths

    import nodes

    ckpt = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], CKPT)
    if not os.path.exists(ckpt):
        tiny_checkpoint(ckpt)
    write_dataset(os.path.join(folder_paths.get_input_directory(), "dataset"))
    paging_cache(os.path.join(folder_paths.get_output_directory(), "streaming_caches", PAGING_CACHE))
    return nodes.NODE_CLASS_MAPPINGS


PAGING_CACHE = "paging"
PAGING_SAMPLES = 30  # two pages of the dataset preview (24 a page)
WAIT_S = 120
"""How long the page may take to show what a check waits for before the check fails. A wait ends as soon as it
shows, so the bound costs nothing where the check passes; it is long because a loaded 2-core machine can take tens
of seconds to reload the frontend or draw a node."""


def paging_cache(path: str) -> None:
    """A cache of ``PAGING_SAMPLES`` tiny latents (Load Streaming Cache needs no sources), built with the engine."""
    if os.path.exists(path):
        return
    sys.path.append(PACK)  # appended: ComfyUI's own top-level ``nodes`` stays first
    import torch

    import streaming_cache as sc

    items = [sc.Item(f"img{i:02d}", {"latent": sc.Part(data=f"{i}".encode()), "cond": sc.Part(data=b"a photo")})
             for i in range(PAGING_SAMPLES)]
    encoders = {"latent": sc.Encoder("latent", lambda parts: [{"samples": torch.full((1, 4, 8, 8), int(p.data) / 30)}
                                                              for p in parts]),
                "cond": sc.Encoder("cond", lambda parts: [torch.zeros(2) for _ in parts])}
    sc.build(path, items, encoders)


def start_server(comfyui: str, base: str, port: int, log_path: str, frontend: str | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", base,
           "--database-url", f"sqlite:///{os.path.join(base, 'user', 'comfyui.db')}"]
    if frontend:
        cmd += ["--front-end-root", frontend]
    proc = subprocess.Popen(cmd, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ComfyUI exited at start:\n{open(log_path).read()[-4000:]}")
        try:
            http(f"http://127.0.0.1:{port}/api/system_stats")
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"ComfyUI did not start in 180 s:\n{open(log_path).read()[-4000:]}")


LOAD_JS = """(async () => {
  const wf = %s;
  const errorsBefore = %d;
  await app.loadGraphData(wf);
  await new Promise(r => setTimeout(r, 500));
  const saved = app.graph.serialize();
  const known = t => !!(LiteGraph.registered_node_types[t]);
  const dialogs = Array.from(document.querySelectorAll('[role=dialog], .p-dialog')).map(d => d.innerText);
  const prompt = (await app.graphToPrompt()).output;
  for (const k in prompt) delete prompt[k]._meta;
  return {
    unknown_types: saved.nodes.filter(n => !known(n.type)).map(n => n.type),
    widgets: Object.fromEntries(saved.nodes.map(n => [String(n.id), n.widgets_values ?? null])),
    node_errors: saved.nodes.filter(n => n.has_errors).map(n => n.type),
    dialogs: dialogs,
    prompt: prompt,
  };
})()"""

NEW_NODE_JS = """(() => {
  const node = LiteGraph.createNode(%s);
  return Object.fromEntries((node?.widgets || []).map(w => [w.name, w.value]));
})()"""

SET_WIDGETS_JS = """(() => {
  const values = %s;
  for (const node of app.graph._nodes) {
    const own = values[node.type] || (node.type.startsWith('StreamingCache') ? values.pack : null);
    for (const w of node.widgets || []) {
      if (own && w.name in own) w.value = own[w.name];
    }
  }
  return true;
})()"""

# A Memory & Precision options node (fp32: the tiny model trains fast on a CPU) put at the head of Train LoRA's
# option chain, the way a user wires one in: from its output to the free "options" input of the chain.
ADD_MEMORY_OPTIONS_JS = """(() => {
  const chain = app.graph._nodes.filter(n => n.type === 'StreamingCacheTrain' || /^StreamingCache.*Options$/.test(n.type));
  const head = chain.find(n => { const slot = n.findInputSlot('options'); return slot >= 0 && n.inputs[slot].link == null; });
  const node = LiteGraph.createNode('StreamingCacheMemoryOptions');
  node.pos = [head.pos[0] - 380, head.pos[1] + 420];
  app.graph.add(node);
  for (const w of node.widgets) { if (w.name === 'training_dtype' || w.name === 'lora_dtype') w.value = 'fp32'; }
  node.connect(0, head, head.findInputSlot('options'));
  return head.type;
})()"""

SUMMARY_JS = """(() => Object.fromEntries(app.graph._nodes.filter(n => n.type.startsWith('StreamingCache'))
  .map(n => [n.type, (n.widgets || []).find(w => w.name === 'summary')?.value ?? null])))()"""


CHART_JS = """(() => {
  const graph = app.canvas && app.canvas.graph;
  const node = graph && graph._nodes.find(n => n.type === 'StreamingCacheTrain' || n.type === 'StreamingCacheTrainLoRA');
  const st = node && node.__streamingCacheChart;
  if (!st || !st.data) return null;
  return {steps: st.data.steps, loss: st.data.loss, validation: st.data.validation, lr: st.data.lr,
          total: st.data.total, log: st.log, zoom: st.zoom, readout: st.readout.textContent,
          summary: (node.widgets || []).find(w => w.name === 'summary')?.value ?? null};
})()"""

CHART_ACT_JS = """((action, a, b) => {
  const graph = app.canvas && app.canvas.graph;
  const node = graph && graph._nodes.find(n => n.type === 'StreamingCacheTrain' || n.type === 'StreamingCacheTrainLoRA');
  const st = node.__streamingCacheChart;
  const rect = st.canvas.getBoundingClientRect();
  const at = (type, step) => st.canvas.dispatchEvent(new MouseEvent(type, {
    clientX: rect.left + st.xOf(step), clientY: rect.top + 60, bubbles: true}));
  if (action === 'hover') at('mousemove', a);
  if (action === 'zoom') { at('mousedown', a); at('mousemove', b); at('mouseup', b); }
  if (action === 'reset') st.canvas.dispatchEvent(new MouseEvent('dblclick', {bubbles: true}));
  if (action === 'scale') st.scale.click();
  return {hover: st.hoverStep, readout: st.readout.textContent, log: st.log, zoom: st.zoom};
})(%s)"""


async def check_chart(b: Browser, url: str, artifacts: str) -> dict:
    """The loss chart on Train LoRA after a run: its curves, what hovering a step reads out, the log scale and a
    zoom; then the page is reloaded and the chart (and the summary) must come back from the prompt's history."""
    out: dict = {"after_run": await b.evaluate(CHART_JS)}
    if not out["after_run"]:
        return out
    steps = out["after_run"]["steps"]
    middle = steps[len(steps) // 2]

    def act(*args: object) -> str:
        return CHART_ACT_JS % ", ".join(json.dumps(a) for a in args)

    out["hover"] = await b.evaluate(act("hover", middle, None))
    await b.screenshot(os.path.join(artifacts, "chart_hover.png"))
    out["scale"] = await b.evaluate(act("scale", None, None))
    out["zoom"] = await b.evaluate(act("zoom", steps[1], steps[-2]))
    out["reset"] = await b.evaluate(act("reset", None, None))
    errors_before = len(b.errors)
    await b.goto(url)
    # app.canvas, not app.graph: newer frontends log an error when app.graph is read before the app has one
    await b.wait_for("!!(window.app && app.canvas && app.canvas.graph && app.extensionManager)", 120)
    out["after_reload"] = await b.wait_for(CHART_JS, WAIT_S)
    await b.screenshot(os.path.join(artifacts, "chart_after_reload.png"))
    # a page load logs the frontend's own errors, which differ from version to version (404s for the user files it
    # probes, a settings store reading its graph before it has one, ...): the check counts the errors raised in the
    # pack's script, and keeps the rest for the record
    loaded = b.errors[errors_before:]
    out["errors"] = [e[:500] for e in loaded if "streaming_cache.js" in e]
    out["page_load_errors"] = [e[:300] for e in loaded]
    return out


def is_network_error(text: str) -> bool:
    """Console errors of the frontend fetching from the internet, which this machine may not reach."""
    return any(s in text for s in ("Failed to fetch", "net::ERR", "NetworkError", "ERR_NAME_NOT_RESOLVED"))


def control_workflow() -> dict:
    """The folder example with one node renamed to a type nobody provides: the check must see it."""
    with open(os.path.join(PACK, "example_workflows", f"{FOLDER_EXAMPLE}.json"), encoding="utf-8") as f:
        workflow = json.load(f)
    for node in workflow["nodes"]:
        if node["type"] == "StreamingCacheEncode":
            node["type"] = "StreamingCacheNoSuchNode"
    return workflow


def release_fixtures() -> list[tuple[str, dict, dict]]:
    """(release/name, UI workflow, the API prompt that release exported for it) of every earlier release."""
    out = []
    for version in sorted(os.listdir(RELEASES)) if os.path.isdir(RELEASES) else []:
        folder = os.path.join(RELEASES, version)
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            continue
        with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        for entry in manifest["files"]:
            with open(os.path.join(folder, entry["workflow"]), encoding="utf-8") as f:
                workflow = json.load(f)
            with open(os.path.join(folder, entry["api_prompt"]), encoding="utf-8") as f:
                api = json.load(f)["prompt"]
            out.append((f"{version}/{entry['workflow'][:-5]}", workflow, api))
    return out


async def load_in_page(b: Browser, url: str, workflow: dict, fresh: bool = True) -> dict:
    """Load ``workflow`` as a user opens a file: into a freshly opened page, or (``fresh=False``) into the page
    open now, replacing its graph (as opening one workflow after another does; a page load is most of the time)."""
    if fresh:
        await b.goto(url)
        await b.wait_for("!!(window.app && app.graph && window.LiteGraph && app.extensionManager)", 120)
        await asyncio.sleep(1.0)
    errors_before = len(b.errors)
    loaded = await b.evaluate(LOAD_JS % (json.dumps(workflow), errors_before))
    await asyncio.sleep(0.5)
    loaded["errors_while_loading"] = [e[:500] for e in b.errors[errors_before:] if not is_network_error(e)]
    return loaded


async def check_loads(b: Browser, url: str, mappings: dict, artifacts: str) -> dict:
    """Each example, the control (a node type nobody provides) and every earlier release's workflows, loaded. An
    example of a family this ComfyUI is too old for (``headless.NEEDS_NEWER_COMFYUI``) loads in a page of its own
    (the missing-node dialog it opens stays open); ``missing_here`` lists its family's node types this ComfyUI
    lacks, and ``headless_error`` is what the headless runner says of it."""
    out: dict = {"releases": {}}
    fresh = True
    # the control last: the missing-node dialog it opens stays open
    for name in (*EXAMPLES, "control_missing_node"):
        if name == "control_missing_node":
            workflow = control_workflow()
        else:
            with open(os.path.join(PACK, "example_workflows", f"{name}.json"), encoding="utf-8") as f:
                workflow = json.load(f)
        missing_here = sorted(t for t in headless.NEEDS_NEWER_COMFYUI.get(name, (None, ()))[1] if t not in mappings)
        loaded = await load_in_page(b, url, workflow, fresh=fresh or bool(missing_here)
                                    or name == "control_missing_node")
        fresh = bool(missing_here)  # the next one in a page without the dialog
        await b.screenshot(os.path.join(artifacts, f"{name}.png"))
        expected_widgets = {str(n["id"]): n.get("widgets_values") for n in workflow["nodes"]}
        try:
            same_prompt, headless_error = (name != "control_missing_node"
                                           and loaded["prompt"] == headless.ui_to_api(workflow, mappings)), ""
        except headless.WorkflowError as exc:
            same_prompt, headless_error = False, str(exc)
        out[name] = {
            "unknown_types": loaded["unknown_types"],
            "missing_here": missing_here,
            "node_errors": loaded["node_errors"],
            "dialogs": [d[:400] for d in loaded["dialogs"]],
            "widgets_kept": {nid: (loaded["widgets"].get(nid) or []) == (v or [])
                             for nid, v in expected_widgets.items()},
            "same_prompt_as_headless": same_prompt,
            "headless_error": headless_error,
            "errors_while_loading": loaded["errors_while_loading"],
        }
    for i, (name, workflow, exported) in enumerate(release_fixtures()):
        loaded = await load_in_page(b, url, workflow, fresh=i == 0)
        prompt = loaded["prompt"]
        out["releases"][name] = {
            "unknown_types": loaded["unknown_types"],
            "errors_while_loading": loaded["errors_while_loading"],
            "same_prompt_as_headless": prompt == headless.ui_to_api(workflow, mappings),
            "train_presets": [n["inputs"].get("preset") for n in prompt.values()
                              if n.get("class_type") == "StreamingCacheTrain"],
            # every input the release exported is in today's prompt, with the same value or link
            "exported_inputs_kept": {nid: {k: prompt.get(nid, {}).get("inputs", {}).get(k) == v
                                           for k, v in node["inputs"].items()}
                                     for nid, node in exported.items()},
        }
    out["frontend_version"] = await b.evaluate("window.__COMFYUI_FRONTEND_VERSION__ ?? null")
    out["new_train_widgets"] = await b.evaluate(NEW_NODE_JS % json.dumps("StreamingCacheTrain"))
    return out


async def check_examples(url: str, mappings: dict, artifacts: str) -> dict:
    """The parts of the check, one after the other in one browser. A part that fails (a wait that times out, an
    error in the page) is recorded under ``failed`` with its message, and a screenshot of the page at that moment
    (``failed_PART.png``); the next parts still run (each opens the page afresh), so that only the tests of the
    part that failed fail, with its message."""
    out: dict = {"failed": {}}
    async with Browser() as b:
        async def part(name: str, check: Awaitable[dict]) -> None:
            try:
                out[name] = await check
            except Exception as exc:  # noqa: BLE001 - kept for the tests of this part, which fail with it
                out["failed"][name] = f"{type(exc).__name__}: {exc}"[:2000]
                try:
                    await b.screenshot(os.path.join(artifacts, f"failed_{name}.png"))
                except Exception as shot:  # noqa: BLE001
                    out["failed"][name] += f" (no screenshot: {shot})"

        await part("loads", check_loads(b, url, mappings, artifacts))
        await part("fit", check_node_sizes(b, url, artifacts))
        await part("templates", check_template_browser(b, url, artifacts))
        await part("run", run_from_the_frontend(b, url, artifacts, FOLDER_EXAMPLE, again=True))
        await part("run_previews", run_from_the_frontend(
            b, url, artifacts, PREVIEWS_EXAMPLE,
            {"steps": 8, "sample_every": 4, "sample_steps": 2, "sample_cfg": 1.0, "validate_every": 4,
             "sample_prompts": "a red square\na blue circle"}, chart=True))
        await part("paging", check_paging(b, url, artifacts))
    return out


SIZES_JS = """(() => {
  const out = {};
  let x = 20;
  app.canvas.ds.offset = [0, 0];
  for (const type of %s) {
    const node = LiteGraph.createNode(type);
    node.pos = [x, 60];
    app.graph.add(node);
    x += node.size[0] + 30;
    const size = node.computeSize ? node.computeSize() : node.size;
    out[type] = {height: Math.max(size[1], node.size[1]) + (LiteGraph.NODE_TITLE_HEIGHT || 30),
                 width: Math.max(size[0], node.size[0]), scale: app.canvas.ds.scale};
  }
  app.graph.setDirtyCanvas(true, true);
  return out;
})()"""


async def check_node_sizes(b: Browser, url: str, artifacts: str) -> dict:
    """Each node of the pack as a user adds it (new graph, default zoom): its height on screen, title included."""
    object_info = http(url + "object_info")
    types = sorted(k for k, v in object_info.items() if k.startswith("StreamingCache") and not v.get("deprecated"))
    await b.goto(url)
    await b.wait_for("!!(window.app && app.graph && window.LiteGraph && app.extensionManager)", 120)
    await asyncio.sleep(1.0)
    await b.evaluate("(async () => { app.graph.clear(); return true })()")
    sizes = await b.evaluate(SIZES_JS % json.dumps(types))
    await asyncio.sleep(0.5)
    await b.screenshot(os.path.join(artifacts, "nodes.png"))
    return {t: {"screen_height": round(v["height"] * v["scale"]), "limit": SCREEN_HEIGHT} for t, v in sizes.items()}


async def check_template_browser(b: Browser, url: str, artifacts: str) -> dict:
    """Open the template browser as a user does and pick the pack's entry; its workflows must be listed."""
    await b.goto(url)
    await b.wait_for("!!(window.app && app.graph && app.extensionManager)", 120)
    await asyncio.sleep(1.0)
    await b.evaluate("app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    await b.wait_for("Array.from(document.querySelectorAll('[role=dialog]')).some(d => d.innerText.includes(%r))"
                     % PACK_NAME, WAIT_S)
    click = """(() => {
      const el = Array.from(document.querySelectorAll('[role=dialog] *'))
        .find(e => e.children.length === 0 && e.textContent.trim() === %r);
      if (!el) return false;
      (el.closest('li, button, a, [role=option], [role=button]') || el).click();
      return true;
    })()""" % PACK_NAME
    listed_js = """(() => {
      const text = Array.from(document.querySelectorAll('[role=dialog]')).map(d => d.innerText).join('\\n');
      const names = %s.filter(n => text.includes(n) || text.includes(n.replaceAll('_', ' ')));
      return names.length === %d ? names : null;
    })()""" % (json.dumps(list(EXAMPLES)), len(EXAMPLES))
    listed = None
    for _ in range(3):  # the dialog may still be laying out when the first click lands
        await b.wait_for(click, WAIT_S)
        try:
            listed = await b.wait_for(listed_js, 15)
            break
        except BrowserError:
            continue
    if listed is None:
        text = await b.evaluate("Array.from(document.querySelectorAll('[role=dialog]')).map(d => d.innerText)")
        raise BrowserError(f"the template browser does not list the examples; it shows: {text}")
    await asyncio.sleep(2.0)
    await b.screenshot(os.path.join(artifacts, "template_browser.png"))
    served = http(url + "api/workflow_templates")
    # a card below the dialog's fold gets its image only once scrolled to (the frontend keeps the <img> hidden, or
    # puts a new one in place of a placeholder, until it loads): each card is scrolled to and its image looked up
    # again until it loads (at most 30 s), so what is checked is whether it loads, not where the dialog lays it out;
    # a card the dialog has not made (newer frontends make only the rows near the view) is looked for by scrolling
    # the grid from top to bottom
    thumbnails = await b.evaluate("""(async () => {
      const find = alt => Array.from(document.querySelectorAll('[role=dialog] img')).find(i => i.alt === alt);
      const loaded = i => !!i && i.complete && i.naturalWidth > 0;
      const sleep = ms => new Promise(r => setTimeout(r, ms));
      const seek = async alt => {
        const grids = Array.from(document.querySelectorAll('[role=dialog] *'))
          .filter(e => e.scrollHeight > e.clientHeight + 1);
        for (const grid of grids) {
          for (let top = 0; top <= grid.scrollHeight; top += Math.max(100, grid.clientHeight / 2)) {
            grid.scrollTop = top;
            await sleep(300);
            if (find(alt)) return find(alt);
          }
        }
        return null;
      };
      const out = [];
      for (const alt of %s) {
        const first = find(alt) || await seek(alt);
        if (!first) continue;
        let shown = first;  // a hidden <img> (shown once loaded) has no box to scroll to: its card has
        while (shown.parentElement && shown.getBoundingClientRect().height === 0) shown = shown.parentElement;
        shown.scrollIntoView({block: 'center'});
        const deadline = Date.now() + 30000;
        while (!loaded(find(alt)) && Date.now() < deadline) await new Promise(r => setTimeout(r, 250));
        out.push([alt, loaded(find(alt))]);
      }
      return out;
    })()""" % json.dumps(list(EXAMPLES)))
    return {"listed_in_browser": listed, "served": served.get(PACK_NAME) if isinstance(served, dict) else None,
            "thumbnails": dict(thumbnails or []), "errors": [e[:300] for e in b.errors if PACK_NAME in e]}


PREVIEW_JS = """(() => {
  const node = app.graph._nodes.find(n => n.type === 'StreamingCacheTrain');
  if (!node) return null;
  const live = (app.nodePreviewImages || {})[String(node.id)] || [];
  return {live: live.length, imgs: (node.imgs || []).length, height: node.size[1],
          sizes: (node.imgs || []).map(i => [i.naturalWidth, i.naturalHeight])};
})()"""


DATASET_PREVIEW_JS = """(() => {
  // the dataset preview a node shows: its pager's state and the image drawn (once loaded), and the images
  // ComfyUI itself would draw on the node (none: the preview is the pack's own widget)
  const node = app.graph._nodes.find(n => n.type === %s);
  const st = node && node.__streamingCachePreview;
  if (!st || st.loading || !st.img.complete || !st.img.naturalWidth) return null;
  return {page: st.page, pages: st.pages, label: st.label.textContent, error: st.error,
          width: st.img.naturalWidth, height: st.img.naturalHeight, src: st.img.src.slice(0, 40),
          node_images: (node.imgs || []).length};
})()"""

PAGING_GRAPH_JS = """(async () => {
  app.graph.clear();
  const load = LiteGraph.createNode('StreamingCacheLoad');
  load.pos = [40, 40];
  app.graph.add(load);
  load.widgets.find(w => w.name === 'cache_name').value = %s;
  const shown = LiteGraph.createNode('PreviewImage');
  shown.pos = [500, 40];
  app.graph.add(shown);
  load.connect(1, shown, 0);
  // as a loaded workflow (kept over a page reload), viewed at full scale with the node clear of the side bar: the
  // view is the graph's, and the parts before leave theirs (the node sizes' puts the node's left edge under it)
  const graph = app.graph.serialize();
  graph.extra = {...(graph.extra || {}), ds: {scale: 1, offset: [260, 60]}};
  await app.loadGraphData(graph);
  return true;
})()"""

PROMPT_JS = "(async () => JSON.stringify((await app.graphToPrompt()).output))()"

PAGER_STATE_JS = """(() => {
  const node = app.graph._nodes.find(n => n.type === 'StreamingCacheLoad');
  const st = node && node.__streamingCachePreview;
  return st ? {page: st.page, pages: st.pages, loading: st.loading, error: st.error, label: st.label.textContent,
               src: st.img.src.slice(0, 40), complete: st.img.complete} : (node ? 'no pager on the node' : 'no node');
})()"""

ARROW_JS = """((which, strict) => {
  // where the pager's arrow (`next` or `back`) of Load Streaming Cache is on the screen, and whether a click there
  // reaches it: the element hit testing finds at its centre is the arrow (or inside it). With `strict`, null until
  // the arrow is on the screen, on top and enabled
  const node = app.graph._nodes.find(n => n.type === 'StreamingCacheLoad');
  const st = node && node.__streamingCachePreview;
  if (!st) return null;
  const button = st[which];
  const r = button.getBoundingClientRect();
  const x = r.left + r.width / 2, y = r.top + r.height / 2;
  const inside = r.width > 0 && r.height > 0 && x >= 0 && y >= 0 && x <= innerWidth && y <= innerHeight;
  const hit = inside ? document.elementFromPoint(x, y) : null;
  const out = {x, y, text: button.textContent, disabled: button.disabled, loading: st.loading,
               on_top: !!hit && (hit === button || button.contains(hit)),
               hit: hit ? `${hit.tagName.toLowerCase()}.${String(hit.className).slice(0, 60)}` : null};
  return strict && !(out.on_top && !out.disabled && !out.loading) ? null : out;
})(%s)"""

# the restore from history the pack's script makes after the frontend configures a graph (the page makes it at
# set-up and after each graph load), made once more now: as an answer to the page load that arrives late
LATE_RESTORE_JS = """(() => {
  const ext = app.extensions.find(e => e.name === 'streaming_cache.nodes');
  ext.afterConfigureGraph();
  return true;
})()"""


async def click_arrow(b: Browser, which: str) -> dict:
    """Click the pager's arrow as a user does: a mouse click at its centre on the screen (:meth:`Browser.click`),
    once it is drawn there, on top and enabled, and stays put (the node's layout settles over a few frames after a
    page shows: the node grows to it, and the frontend moves its widgets after); returns where it was and what was
    on top there. Where it is not in sight within 10 s (the page's view keeps it off the screen or under a panel),
    the view is centred on the node, as a user scrolls to it (``centred``), and it gets :data:`WAIT_S` more; then it is
    clicked anyway, and the result says what was hit."""
    strict, loose = ARROW_JS % f"{json.dumps(which)}, true", ARROW_JS % f"{json.dumps(which)}, false"

    async def steady(timeout: float) -> dict:  # in sight, at the same place at two looks 0.5 s apart
        deadline, last = time.monotonic() + timeout, None
        while True:
            at = await b.evaluate(strict)
            if at and last and (at["x"], at["y"]) == (last["x"], last["y"]):
                return at
            if time.monotonic() > deadline:
                raise BrowserError(f"the {which} arrow is not in sight and still after {timeout:.0f} s: {at}")
            last = at
            await asyncio.sleep(0.5)

    centred = False
    try:
        at = await steady(10)
    except BrowserError:
        centred = await b.evaluate("""(() => {
          const node = app.graph._nodes.find(n => n.type === 'StreamingCacheLoad');
          if (!node) return false;
          app.canvas.centerOnNode(node);
          app.canvas.setDirty(true, true);
          return true;
        })()""")
        try:
            at = await steady(WAIT_S)
        except BrowserError:  # clicked anyway: the page stays unturned, and the test shows what covered the arrow
            at = await b.evaluate(loose)
            if not at:
                raise
    await b.click(at["x"], at["y"])
    return {**at, "centred": centred}


async def settled(url: str, before: set, runs: int, timeout: float) -> int:
    """The prompts run since ``before`` (history entries), once at least ``runs`` of them are there and the queue is
    empty: the page shows what a prompt's node sent before ComfyUI records the prompt in its history, and on a busy
    machine the gap is long enough to count a prompt that was queued before the clicks as queued by them."""
    deadline = time.monotonic() + timeout
    while True:
        done = len(set((http(url + "api/history") or {}).keys()) - before)
        queue = http(url + "api/queue") or {}
        busy = len(queue.get("queue_running", [])) + len(queue.get("queue_pending", []))
        if (done >= runs and not busy) or time.monotonic() > deadline:
            return done
        await asyncio.sleep(0.2)


async def check_paging(b: Browser, url: str, artifacts: str) -> dict:
    """Load Streaming Cache on a cache of two preview pages, run once; the node shows page 1, and a mouse click on
    its arrow turns to page 2 without changing the graph's prompt or queueing anything. After a page reload page 1
    is back from the prompt's history, and a click on the arrow once it shows turns the page (whatever the page
    load still has in flight); a restore from history answered after that (made again here, so that it comes late
    on every machine) leaves page 2 on, and the other arrow turns back to page 1."""
    await b.goto(url)
    await b.wait_for("!!(window.app && app.canvas && app.canvas.graph && app.extensionManager)", 120)
    await asyncio.sleep(1.0)
    await b.evaluate(PAGING_GRAPH_JS % json.dumps(PAGING_CACHE))
    before = set((http(url + "api/history") or {}).keys())
    await b.evaluate("(async () => { await app.queuePrompt(0, 1); return true })()")
    page = DATASET_PREVIEW_JS % json.dumps("StreamingCacheLoad")
    out: dict = {}

    async def shows(step: str, n: int | None, timeout: float) -> dict:
        """The preview once it shows page ``n`` (any page: None); a timeout names the step and the pager's state."""
        try:
            return await b.wait_for(page if n is None else page.replace(
                "return {page", f"if (st.page !== {n}) return null; return {{page"), timeout)
        except BrowserError as exc:
            state = await b.evaluate(PAGER_STATE_JS)
            raise BrowserError(f"{step}: {exc}\nthe pager then: {state}\nthe clicks: "
                               f"{ {k: v for k, v in out.items() if 'arrow' in k} }") from None

    out["first"] = await shows("the first run's page", None, 120)
    prompt = await b.evaluate(PROMPT_JS)
    runs = await settled(url, before, 1, WAIT_S)
    errors_before = len(b.errors)
    out["arrow"] = await click_arrow(b, "next")
    out["turned"] = await shows("page 2 at a click on the arrow", 2, WAIT_S)
    await b.screenshot(os.path.join(artifacts, "dataset_preview_page_2.png"))
    await asyncio.sleep(1.0)
    out["prompt_unchanged"] = await b.evaluate(PROMPT_JS) == prompt
    out["queued_by_paging"] = len(set((http(url + "api/history") or {}).keys()) - before) - runs
    queue = http(url + "api/queue") or {}
    out["queue_after_paging"] = len(queue.get("queue_running", [])) + len(queue.get("queue_pending", []))
    await b.goto(url)
    await b.wait_for("!!(window.app && app.canvas && app.canvas.graph && app.extensionManager)", 120)
    out["after_reload"] = await shows("the page back after the reload", None, WAIT_S)
    out["arrow_after_reload"] = await click_arrow(b, "next")
    out["turned_after_reload"] = await shows("page 2 at a click on the arrow after the reload", 2, WAIT_S)
    await b.screenshot(os.path.join(artifacts, "dataset_preview_after_reload.png"))
    histories = sum("/history" in u for u in b.finished)
    await b.evaluate(LATE_RESTORE_JS)
    deadline = time.monotonic() + WAIT_S  # its answer in (the page is idle: no other request of the history), then
    while sum("/history" in u for u in b.finished) == histories and time.monotonic() < deadline:  # applied
        await asyncio.sleep(0.1)
    out["late_restore_answered"] = sum("/history" in u for u in b.finished) > histories
    await asyncio.sleep(1.0)
    out["after_late_restore"] = await shows("the page after a late restore from history", None, WAIT_S)
    out["back_arrow"] = await click_arrow(b, "back")
    out["turned_back"] = await shows("page 1 at a click on the other arrow", 1, WAIT_S)
    out["errors"] = [e[:500] for e in b.errors[errors_before:] if "streaming_cache.js" in e]
    out["dialogs"] = b.dialogs[:]  # the frontend's "Leave site?" on the reload, answered (browser.py)
    return out


async def queue_and_wait(b: Browser, url: str, artifacts: str, name: str) -> tuple[dict | None, int, float, list]:
    """Press Run (queue the graph), watch the Train LoRA node for live previews (a screenshot at the first one)
    and for its chart, and wait for the prompt's history entry; returns it, how many polls saw a live preview, the
    seconds, and the (steps drawn, steps planned) the chart showed while the prompt ran."""
    before = set((http(url + "api/history") or {}).keys())
    await b.evaluate("(async () => { await app.queuePrompt(0, 1); return true })()")
    started = time.monotonic()
    entry, live_seen, shot, chart_steps = None, 0, False, []
    while time.monotonic() - started < 600:
        seen = await b.evaluate(PREVIEW_JS)
        if seen and seen["live"]:
            live_seen += 1
            if not shot:
                await b.screenshot(os.path.join(artifacts, f"live_{name}.png"))
                shot = True
        history = http(url + "api/history") or {}
        new = [v for k, v in history.items() if k not in before]
        if new and new[0].get("status", {}).get("completed") is not None:
            entry = new[0]
            if entry["status"].get("status_str") in ("success", "error"):
                break
        chart = await b.evaluate(CHART_JS)
        if chart:
            chart_steps.append([len(chart["steps"]), chart["total"]])
        await asyncio.sleep(0.3)
    return entry, live_seen, round(time.monotonic() - started, 1), chart_steps


async def run_from_the_frontend(b: Browser, url: str, artifacts: str, example: str, train: dict | None = None, *,
                                again: bool = False, chart: bool = False) -> dict:
    """Load an example, switch to the tiny checkpoint and small settings, wire in fp32 memory options, press Run
    and wait for the end; while it runs, watch the Train LoRA node for live previews. Afterwards read the
    summaries the nodes show (and with ``again``, queue the unchanged workflow once more and read them again; with
    ``chart``, check the loss chart, reloading the page: :func:`check_chart`)."""
    with open(os.path.join(PACK, "example_workflows", f"{example}.json"), encoding="utf-8") as f:
        workflow = json.load(f)
    name = "encode_and_train" if example == FOLDER_EXAMPLE else "train_with_previews"
    await b.goto(url)
    await b.wait_for("!!(window.app && app.graph && app.extensionManager)", 120)
    await asyncio.sleep(1.0)
    await b.evaluate("(async () => { await app.loadGraphData(%s); return true })()" % json.dumps(workflow))
    values = {"CheckpointLoaderSimple": {"ckpt_name": CKPT},
              "StreamingCacheEncode": {"resolution": 64, "batch_size": 2, "folder": "dataset"},
              "pack": {"steps": 3, "rank": 4, "lora_name": f"frontend_{name}", **(train or {})}}
    await b.evaluate(ADD_MEMORY_OPTIONS_JS)
    await b.evaluate(SET_WIDGETS_JS % json.dumps(values))
    errors_before = len(b.errors)
    entry, live_seen, seconds, chart_steps = await queue_and_wait(b, url, artifacts, name)
    if entry is None:
        return {"finished": False}
    preview = None
    if any(n["type"] == "PreviewImage" for n in workflow["nodes"]):
        preview = await b.wait_for("""(() => {
          const node = app.graph._nodes.find(n => n.type === 'PreviewImage');
          const imgs = node && (node.imgs || []);
          return imgs.length ? imgs.map(i => i.naturalWidth + 'x' + i.naturalHeight) : null;
        })()""", 60)
    await asyncio.sleep(1.0)
    await b.screenshot(os.path.join(artifacts, f"run_{name}.png"))
    texts = {k: v.get("text") for k, v in (entry.get("outputs") or {}).items() if isinstance(v, dict) and "text" in v}
    images = {k: len(v.get("images") or []) for k, v in (entry.get("outputs") or {}).items() if isinstance(v, dict)}
    final = await b.evaluate(PREVIEW_JS)
    encode_preview = await b.wait_for(DATASET_PREVIEW_JS % json.dumps("StreamingCacheEncode"), WAIT_S)
    out = {"finished": True, "status": entry["status"].get("status_str"), "texts": texts, "preview": preview,
           "live_polls_with_preview": live_seen, "train_node_images": (final or {}).get("sizes", []),
           "train_node_height": (final or {}).get("height"),
           "output_images": images, "seconds": seconds, "summaries": await b.evaluate(SUMMARY_JS),
           "encode_preview": encode_preview,
           "errors_while_running": [e[:500] for e in b.errors[errors_before:] if not is_network_error(e)],
           "chart_steps_while_running": chart_steps,
           "train_output": next((v for v in (entry.get("outputs") or {}).values()
                                 if isinstance(v, dict) and "chart" in v), None)}
    if chart:
        out["chart"] = await check_chart(b, url, artifacts)
    if again:
        entry, _, _, _ = await queue_and_wait(b, url, artifacts, f"{name}_again")
        await asyncio.sleep(1.0)
        await b.screenshot(os.path.join(artifacts, f"run_{name}_again.png"))
        out["again"] = {"status": (entry or {}).get("status", {}).get("status_str"),
                        "summaries": await b.evaluate(SUMMARY_JS)}
    return out


def console_shape(log: str) -> dict:
    """What the server's console showed of the runs: how often each node's summary of the first run appears, the
    warnings (Python's, and lines naming the pack's files) that appear more than once, and whether per-step
    progress text reached the console. Each summary counts once whether or not the console prefixes it with its
    level."""
    # newer ComfyUI's console prefixes a log record's first line with its level ("[INFO] "), in colour
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    lines = [re.sub(r"^\[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ", "", part.strip())
             for line in plain.splitlines() for part in line.split("\r") if part.strip()]
    # Python warnings ("UserWarning: ...") from anywhere, and any line naming the pack's files
    warnings = [line for line in lines
                if re.search(r"\w+Warning: ", line) or PACK in line or f"custom_nodes/{PACK_NAME}/" in line]
    return {"encode_summary": sum(line.startswith("encoded 10, reused 0, failed 0") for line in lines),
            "train_summary": sum(line.startswith("trained frontend_encode_and_train: steps 1-3 of 3")
                                 for line in lines),
            "run_named": sum(line == "new run frontend_encode_and_train" for line in lines),
            "repeated_warnings": sorted({w for w in warnings if warnings.count(w) > 1}),
            "step_texts": sum(line.startswith("step ") and "loss" in line for line in lines)}


def main() -> None:
    comfyui, workdir, artifacts = sys.argv[1:4]
    frontend = sys.argv[4] if len(sys.argv) > 4 else None
    base = os.path.join(workdir, "base")
    mappings = prepare(comfyui, base)
    port = free_port()
    log_path = os.path.join(workdir, "server.log")
    server = start_server(comfyui, base, port, log_path, frontend)
    try:
        url = f"http://127.0.0.1:{port}/"
        http(url + "api/settings/Comfy.TutorialCompleted", json.dumps(True).encode())  # no first-run dialog
        object_info = http(url + "object_info")
        result = {"registered": sorted(k for k in object_info if k.startswith("StreamingCache")),
                  **asyncio.run(check_examples(url, mappings, artifacts))}
    finally:
        server.terminate()
        server.wait(30)
    log = open(log_path, encoding="utf-8", errors="replace").read()
    result["import_failed"] = "IMPORT FAILED" in log
    result["console"] = console_shape(log)
    result["imported"] = any(PACK_NAME in line and "seconds" in line for line in log.splitlines())
    result["comfyui_version"] = comfyui_version(comfyui)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
