"""The example workflows in the frontend that ships with a ComfyUI, as a user meets them; prints one JSON line.

    python frontend_check.py COMFYUI_PATH WORKDIR ARTIFACTS_DIR      (with ComfyUI's Python)

Installs the pack the way users do (a folder in ``custom_nodes``), starts ComfyUI's real server, and drives
headless Chromium (see ``browser.py``): the template browser lists the pack's workflows; each example loads
with every node type known, every widget value kept, and converts to the same API prompt as the headless
runner's conversion; the first example, with its checkpoint switched to a tiny random-weight one, runs from
the Run button to the loss plot on the Preview Image node. Screenshots go to ARTIFACTS_DIR.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)
from browser import Browser, BrowserError
from demo_assets import CKPT, tiny_checkpoint, write_dataset

PACK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACK_NAME = "comfyui-streaming-cache"
EXAMPLES = ("encode_and_train", "train_from_cache", "train_with_previews")


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
    return nodes.NODE_CLASS_MAPPINGS


def start_server(comfyui: str, base: str, port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", base,
           "--database-url", f"sqlite:///{os.path.join(base, 'user', 'comfyui.db')}"]
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

SET_WIDGETS_JS = """(() => {
  const values = %s;
  for (const node of app.graph._nodes) {
    for (const w of node.widgets || []) {
      if (values[node.type] && w.name in values[node.type]) w.value = values[node.type][w.name];
    }
  }
  return true;
})()"""


def is_network_error(text: str) -> bool:
    """Console errors of the frontend fetching from the internet, which this machine may not reach."""
    return any(s in text for s in ("Failed to fetch", "net::ERR", "NetworkError", "ERR_NAME_NOT_RESOLVED"))


def control_workflow() -> dict:
    """encode_and_train with one node renamed to a type nobody provides: the check must see it."""
    with open(os.path.join(PACK, "example_workflows", "encode_and_train.json"), encoding="utf-8") as f:
        workflow = json.load(f)
    for node in workflow["nodes"]:
        if node["type"] == "StreamingCacheEncodeDataset":
            node["type"] = "StreamingCacheNoSuchNode"
    return workflow


async def check_examples(url: str, mappings: dict, artifacts: str) -> dict:
    out: dict = {}
    async with Browser() as b:
        for name in (*EXAMPLES, "control_missing_node"):
            if name == "control_missing_node":
                workflow = control_workflow()
            else:
                with open(os.path.join(PACK, "example_workflows", f"{name}.json"), encoding="utf-8") as f:
                    workflow = json.load(f)
            await b.goto(url)
            await b.wait_for("!!(window.app && app.graph && window.LiteGraph && app.extensionManager)", 120)
            await asyncio.sleep(1.0)
            errors_before = len(b.errors)
            loaded = await b.evaluate(LOAD_JS % (json.dumps(workflow), errors_before))
            await asyncio.sleep(1.0)
            await b.screenshot(os.path.join(artifacts, f"{name}.png"))
            expected_widgets = {str(n["id"]): n.get("widgets_values") for n in workflow["nodes"]}
            out[name] = {
                "unknown_types": loaded["unknown_types"],
                "node_errors": loaded["node_errors"],
                "dialogs": [d[:400] for d in loaded["dialogs"]],
                "widgets_kept": {nid: (loaded["widgets"].get(nid) or []) == (v or [])
                                 for nid, v in expected_widgets.items()},
                "same_prompt_as_headless": name != "control_missing_node"
                and loaded["prompt"] == headless.ui_to_api(workflow, mappings),
                "errors_while_loading": [e[:500] for e in b.errors[errors_before:] if not is_network_error(e)],
            }
        out["templates"] = await check_template_browser(b, url, artifacts)
        out["run"] = await run_from_the_frontend(b, url, artifacts)
        out["run_previews"] = await run_from_the_frontend(
            b, url, artifacts, "train_with_previews",
            {"steps": 8, "sample_every": 4, "sample_steps": 2, "sample_cfg": 1.0, "validate_every": 4,
             "sample_prompts": "a red square\na blue circle"})
    return out


async def check_template_browser(b: Browser, url: str, artifacts: str) -> dict:
    """Open the template browser as a user does and pick the pack's entry; its workflows must be listed."""
    await b.goto(url)
    await b.wait_for("!!(window.app && app.graph && app.extensionManager)", 120)
    await asyncio.sleep(1.0)
    await b.evaluate("app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    await b.wait_for("Array.from(document.querySelectorAll('[role=dialog]')).some(d => d.innerText.includes(%r))"
                     % PACK_NAME, 30)
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
        await b.wait_for(click, 30)
        try:
            listed = await b.wait_for(listed_js, 15)
            break
        except BrowserError:
            continue
    if listed is None:
        text = await b.evaluate("Array.from(document.querySelectorAll('[role=dialog]')).map(d => d.innerText)")
        raise BrowserError(f"the template browser does not list the examples; it shows: {text}")
    await asyncio.sleep(1.0)
    await b.screenshot(os.path.join(artifacts, "template_browser.png"))
    served = http(url + "api/workflow_templates")
    return {"listed_in_browser": listed, "served": served.get(PACK_NAME) if isinstance(served, dict) else None}


PREVIEW_JS = """(() => {
  const node = app.graph._nodes.find(n => n.type === 'StreamingCacheTrainLoRA');
  if (!node) return null;
  const live = (app.nodePreviewImages || {})[String(node.id)] || [];
  return {live: live.length, imgs: (node.imgs || []).length};
})()"""


async def run_from_the_frontend(b: Browser, url: str, artifacts: str, example: str = "encode_and_train",
                                train: dict | None = None) -> dict:
    """Load an example, switch to the tiny checkpoint and small settings, press Run and wait for the end; while
    it runs, watch the Train LoRA node for live previews (the loss plot and sample images it sends) and take a
    screenshot when one shows."""
    with open(os.path.join(PACK, "example_workflows", f"{example}.json"), encoding="utf-8") as f:
        workflow = json.load(f)
    await b.goto(url)
    await b.wait_for("!!(window.app && app.graph && app.extensionManager)", 120)
    await asyncio.sleep(1.0)
    await b.evaluate("(async () => { await app.loadGraphData(%s); return true })()" % json.dumps(workflow))
    values = {"CheckpointLoaderSimple": {"ckpt_name": CKPT},
              "StreamingCacheEncodeDataset": {"resolution": 64, "batch_size": 2},
              "StreamingCacheTrainLoRA": {"steps": 3, "rank": 4, "lora_name": f"frontend_{example}",
                                          "training_dtype": "fp32", "lora_dtype": "fp32", **(train or {})}}
    await b.evaluate(SET_WIDGETS_JS % json.dumps(values))
    before = set((http(url + "api/history") or {}).keys())
    await b.evaluate("(async () => { await app.queuePrompt(0, 1); return true })()")
    started = time.monotonic()
    entry, live_seen, shot = None, 0, False
    while time.monotonic() - started < 600:
        seen = await b.evaluate(PREVIEW_JS)
        if seen and seen["live"]:
            live_seen += 1
            if not shot:
                await b.screenshot(os.path.join(artifacts, f"live_{example}.png"))
                shot = True
        history = http(url + "api/history") or {}
        new = [v for k, v in history.items() if k not in before]
        if new and new[0].get("status", {}).get("completed") is not None:
            entry = new[0]
            if entry["status"].get("status_str") in ("success", "error"):
                break
        await asyncio.sleep(0.3)
    if entry is None:
        return {"finished": False}
    preview = await b.wait_for("""(() => {
      const node = app.graph._nodes.find(n => n.type === 'PreviewImage');
      const imgs = node && (node.imgs || []);
      return imgs.length ? imgs.map(i => i.naturalWidth + 'x' + i.naturalHeight) : null;
    })()""", 60)
    await asyncio.sleep(1.0)
    await b.screenshot(os.path.join(artifacts, f"run_{example}.png"))
    texts = {k: v.get("text") for k, v in (entry.get("outputs") or {}).items() if isinstance(v, dict) and "text" in v}
    images = {k: len(v.get("images") or []) for k, v in (entry.get("outputs") or {}).items() if isinstance(v, dict)}
    final = await b.evaluate(PREVIEW_JS)
    return {"finished": True, "status": entry["status"].get("status_str"), "texts": texts, "preview": preview,
            "live_polls_with_preview": live_seen, "train_node_images": (final or {}).get("imgs", 0),
            "output_images": images, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    comfyui, workdir, artifacts = sys.argv[1:4]
    base = os.path.join(workdir, "base")
    mappings = prepare(comfyui, base)
    port = free_port()
    log_path = os.path.join(workdir, "server.log")
    server = start_server(comfyui, base, port, log_path)
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
    result["imported"] = any(PACK_NAME in line and "seconds" in line for line in log.splitlines())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
