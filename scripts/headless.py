"""Run a ComfyUI workflow file without the web UI, inside a ComfyUI installation, printing progress.

    python scripts/headless.py WORKFLOW.json [--comfyui PATH] [--set NODE.INPUT=VALUE ...] [-- COMFYUI ARGS]
    python scripts/headless.py --demo DIR            # no models or images needed: see below
    python scripts/headless.py WORKFLOW.json --export-api PROMPT.json   # for POST /prompt

WORKFLOW.json may be in UI format (as the frontend saves it, e.g. this pack's ``example_workflows/``) or in API
format ("Export (API)"). ComfyUI is found with ``--comfyui``, else ``COMFYUI_PATH``, else the installation
``install.py`` recorded for this clone, else from this pack's location in ``ComfyUI/custom_nodes/``. Run by a
Python that cannot import torch (a system ``python3``), it runs again with that ComfyUI's Python: the one
``install.py`` recorded, or a ``venv``/``.venv`` in it or beside it. Arguments after ``--`` go to ComfyUI (e.g.
``-- --cpu``). ``--set`` overrides a node input by node id and input name; the value is read as JSON when it
parses (``--set 4.ckpt_name=model.safetensors --set 7.steps=100``). Exit status: 0 when every output node ran, 1
otherwise.
Without CUDA, ``--cpu`` is passed to ComfyUI unless given.

``--demo DIR`` runs ``example_workflows/encode_and_train.json`` with ComfyUI's base directory set to DIR, after
creating there a tiny random-weight SD1.x checkpoint and a sample dataset (see ``demo_assets.py``): the whole
encode -> cache -> train -> LoRA path on any machine with ComfyUI, no downloads. Run it twice to see the
second run encode nothing.

Several processes, one GPU each (data-parallel training and parallel encoding; see docs/multi-gpu.md)::

    torchrun --nproc-per-node 2 scripts/headless.py WORKFLOW.json

Each process runs the workflow on its own GPU (its ``LOCAL_RANK``-th); Encode Dataset and Train LoRA work on
their share and combine it; only rank 0 runs the other output nodes (saving images, previews) and writes files.
Stopping (Ctrl-C, or a SIGTERM from the launcher) lets a training save the steps done.

A standalone program: it boots ComfyUI, which then loads the pack (only the engine's process-group setup is
imported from the pack, before ComfyUI starts, so each process picks its GPU first).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from install import DEFAULT_DIR, PINNED_COMMIT, existing_comfyui, is_comfyui, record_path, recorded_install

PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
FRONTEND_ONLY = {"Note", "MarkdownNote"}
TOGETHER = {"StreamingCacheTrain", "StreamingCacheTrainLoRA", "StreamingCacheEncode", "StreamingCacheEncodeDataset"}
"""Nodes the processes of a process group run together (each its share); other output nodes run on rank 0."""
EXAMPLES_RENAMED = {"encode_and_train": "Train a LoRA from an image folder",
                    "train_from_cache": "Train a LoRA from a saved dataset cache",
                    "train_with_previews": "Train a LoRA with sample previews and validation"}
"""Example workflows by their earlier file names (release 0.3.0 and before) -> their names now, which the
template browser shows as titles; the runner accepts either."""
EXAMPLES = (*EXAMPLES_RENAMED.values(), "Train a LoRA with regularisation images",
            "Train a Flux LoRA from an image folder", "Train a Qwen-Image LoRA from an image folder",
            "Train a Qwen-Image-Edit LoRA from edit pairs", "Train a Wan 2.1 text-to-video LoRA from video clips",
            "Train a Wan 2.1 image-to-video LoRA from video clips", "Train an LTX-2 LoRA from video clips")
"""Every example workflow (``example_workflows/<name>.json``)."""
NEEDS_NEWER_COMFYUI: dict[str, tuple[tuple[int, int, int], tuple[str, ...]]] = {
    "Train an LTX-2 LoRA from video clips": ((0, 7, 0), ("LTXAVTextEncoderLoader", "LTXVAudioVAELoader")),
}
"""Examples of a model family that came after the oldest ComfyUI supported (v0.3.64): the ComfyUI version that has
every node the example uses (ComfyUI's own LTX-2 templates name v0.7.0 on its text encoder loader), and the example's
core node types that came with the family, which older versions lack (all or some: the audio VAE loader came
first)."""


def newer_comfyui_needed(missing: Iterable[str]) -> tuple[int, int, int] | None:
    """The ComfyUI version that has the core node types ``missing`` (types a workflow uses that this ComfyUI has
    not), where every one is a node of :data:`NEEDS_NEWER_COMFYUI`; None where some are not (custom nodes)."""
    needed = [version for version, types in NEEDS_NEWER_COMFYUI.values() if set(missing) <= set(types)]
    return max(needed) if missing and needed else None
DEMO_EXAMPLE = EXAMPLES_RENAMED["encode_and_train"]
"""The example workflow ``--demo`` runs when given none."""
TESTED_COMFYUI = PINNED_COMMIT[:8]  # the newest ComfyUI the pack is tested with; the oldest supported is v0.3.64
INSTALL_BY_HAND = (
    "    git clone https://github.com/comfyanonymous/ComfyUI ~/ComfyUI && git -C ~/ComfyUI checkout "
    f"{TESTED_COMFYUI}\n"
    "    python3 -m venv ~/ComfyUI/venv && ~/ComfyUI/venv/bin/pip install -r ~/ComfyUI/requirements.txt\n"
    "    git clone https://github.com/streaming-cache/comfyui-streaming-cache "
    "~/ComfyUI/custom_nodes/comfyui-streaming-cache\n"
    "    ~/ComfyUI/venv/bin/pip install -r ~/ComfyUI/custom_nodes/comfyui-streaming-cache/requirements.txt\n")


class WorkflowError(ValueError):
    """A workflow file that cannot be run as given."""


@dataclass(frozen=True)
class FoundComfyUI:
    """The ComfyUI to run in, how it was found (said when the run starts again with its Python), and the Python
    that runs it where that is known: the installer's record, else a ``venv``/``.venv`` in it or beside it, or the
    portable build's ``python_embeded`` (``isolated``: run with ``-s``, as the portable build runs it)."""

    path: str
    python: str | None
    isolated: bool
    how: str


def _found(path: str, how: str) -> FoundComfyUI:
    known = existing_comfyui(path)
    return FoundComfyUI(os.path.abspath(path), known.python if known else None, bool(known and known.portable), how)


def locate_comfyui(explicit: str | None = None, environ: Mapping[str, str] = os.environ, pack_dir: str = PACK_DIR,
                   record: str | None = None) -> FoundComfyUI:
    """The ComfyUI to run in: ``--comfyui`` (which must be one), else ``COMFYUI_PATH``, else the installation that
    ``install.py`` recorded for this clone (``record``: the record's file, :func:`install.record_path` by
    default), else the ComfyUI whose ``custom_nodes`` holds this pack. Exits with the ways to get one otherwise."""
    if explicit:
        if not is_comfyui(explicit):
            raise SystemExit(f"--comfyui {explicit}: not a ComfyUI folder (no main.py and comfy/ in it). Give the "
                             "folder that holds ComfyUI's main.py.")
        return _found(explicit, "--comfyui")
    variable = environ.get("COMFYUI_PATH")
    if variable and is_comfyui(variable):
        return _found(variable, "COMFYUI_PATH")
    recorded = recorded_install(pack_dir, record)
    if recorded is not None and is_comfyui(recorded.comfyui):
        return FoundComfyUI(os.path.abspath(recorded.comfyui), recorded.python, recorded.isolated,
                            f"recorded by install.py in {record or record_path()}")
    parent = os.path.dirname(pack_dir)
    if os.path.basename(parent) == "custom_nodes" and is_comfyui(os.path.dirname(parent)):
        return _found(os.path.dirname(parent), "custom_nodes")
    gone = (f"The ComfyUI that install.py recorded in {record or record_path()} ({recorded.comfyui}) is gone: run "
            "install.py again to make it anew.\n") if recorded is not None else ""
    raise SystemExit(gone + NOT_FOUND)


def find_comfyui(explicit: str | None = None) -> str:
    """The folder of the ComfyUI to run in (:func:`locate_comfyui`)."""
    return locate_comfyui(explicit).path


NOT_FOUND = (
    "ComfyUI not found: pass --comfyui PATH, set COMFYUI_PATH, or install this pack in ComfyUI/custom_nodes/.\n"
    "No ComfyUI yet? This pack's installer makes one (pinned, with its own Python environment and PyTorch),\n"
    "links this pack into it, trains the demo LoRA and records it, so that this script finds it:\n"
    f"    python3 {os.path.join(PACK_DIR, 'scripts', 'install.py')} {DEFAULT_DIR}\n"
    "or the ecosystem's installer, then this pack from the Comfy Registry:\n"
    "    pip install comfy-cli\n"
    "    comfy --workspace ~/ComfyUI --skip-prompt install --cpu      # or --nvidia\n"
    "    comfy --workspace ~/ComfyUI node install comfyui-streaming-cache\n"
    "or by hand, pinned to the newest ComfyUI this pack is tested with:\n"
    f"{INSTALL_BY_HAND}"
    "then run this script with ComfyUI's Python, e.g. ~/ComfyUI/venv/bin/python "
    "~/ComfyUI/custom_nodes/comfyui-streaming-cache/scripts/headless.py --demo /tmp/demo  (see docs/headless.md)")

RERUN = "STREAMING_CACHE_HEADLESS_RERUN"
"""Set (to the Python's path) in the environment of a run started again with ComfyUI's Python, so that a Python
that cannot import torch either is said, not started again and again."""


def rerun_command(found: FoundComfyUI, argv: list[str], executable: str = sys.executable,
                  environ: Mapping[str, str] = os.environ) -> list[str]:
    """The command that runs this script again, with ``argv``, by the Python that runs ``found``, for a Python
    (``executable``) that cannot import torch; exits with what to do where there is no other Python to run."""
    script = os.path.abspath(__file__)
    if found.python is None:
        raise SystemExit(f"{executable} cannot import torch, and which Python runs the ComfyUI in {found.path} is not "
                         f"known (no venv or .venv in it or beside it). Run this script with that Python:\n"
                         f"    <ComfyUI's python> {shlex.join([script, *argv])}")
    same = os.path.normcase(os.path.abspath(found.python)) == os.path.normcase(os.path.abspath(executable))
    if same or environ.get(RERUN):
        raise SystemExit(f"{found.python}, the Python that runs the ComfyUI in {found.path}, cannot import torch. "
                         "Repair that installation: run scripts/install.py again (or install PyTorch into it).")
    return [found.python, *(["-s"] if found.isolated else []), script, *argv]


def ensure_torch(found: FoundComfyUI, argv: list[str]) -> int | None:
    """None where this Python imports torch. Otherwise (a system ``python3`` after install.py made ``DIR/venv``)
    run this script again, with ``argv``, by the Python that runs ``found``: on POSIX in this process's place
    (``os.execve`` keeps the process, so Ctrl-C and a launcher's signals reach the run), on Windows, which has no
    such call, as a child whose exit status is returned."""
    if importlib.util.find_spec("torch") is not None:
        return None
    command = rerun_command(found, argv)
    print(f"[headless] {sys.executable} cannot import torch: running with {command[0]}, which runs the ComfyUI in "
          f"{found.path} ({found.how})", flush=True)
    env = {**os.environ, RERUN: command[0]}
    if os.name == "nt":
        return run_child(command, env)
    os.execve(command[0], command, env)
    return None  # not reached: execve returns only by raising


def run_child(command: list[str], env: Mapping[str, str]) -> int:
    """Run ``command`` to its end and return its exit status. Ctrl-C reaches the child too, which saves a training's
    steps and ends: this process waits for it instead of leaving it."""
    child = subprocess.Popen(command, env=dict(env))
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:
            continue


class Console:
    """What a headless run prints: one progress display per node (a bar redrawn in place on a terminal; where the
    output is not a terminal, as in CI and log files, a plain line at each tenth of the way and at least every
    ``every`` seconds), with the node's latest progress text (a training's step and loss) on it, and each node's
    result once, when the node finishes.

    A node sends its progress text just before the progress update it describes, and may send it less often than
    it updates (a training throttles its text, not its steps): a text belongs to the progress value that follows
    it, and is shown only with that value, so a display never pairs one step's count with another step's text. A
    line due where the text is older waits for the next text (at most until the next tenth or the end, and not
    again until a text comes: a text sent once does not hold every line back); a bar is not redrawn with an older
    text for up to ``hold`` seconds."""

    def __init__(self, stream: Any = None, *, tty: bool | None = None, every: float = 30.0, hold: float = 1.0):
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.every, self.hold = every, hold
        self.node: str | None = None
        self.value = self.total = 0.0
        self.note = ""
        self.note_at: float | None = None  # the progress value the note describes (None: the next one)
        self.drawn = ""  # the bar now on the terminal's last line
        self.drawn_at = 0.0
        self.tenth = -1
        self.waiting: int | None = None  # the tenth whose line waits for a current note
        self.unrefreshed = False  # a line went out without the note, which no text has replaced since
        self.printed_at = 0.0
        self.results: set[str] = set()

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _current(self) -> bool:
        """Whether the note describes the progress value now shown (or there is no note)."""
        return not self.note or self.note_at == self.value

    def _line(self) -> str:
        share = self.value / self.total if self.total else 0.0
        text = f"[headless] node {self.node}: {self.value:g}/{self.total:g}"
        if self.tty:
            width = 24
            filled = int(round(share * width))
            text += f" [{'#' * filled}{'.' * (width - filled)}] {share:4.0%}"
        else:
            text += f" ({share:.0%})"
        return f"{text}  {self.note}" if self.note and self._current() else text

    def _end_bar(self) -> None:
        if self.tty and self.drawn:
            self._write("\n")
        self.drawn = ""

    def start(self, node: str, class_type: str | None = None) -> None:
        """A node starts running."""
        self._end_bar()
        self.node, self.value, self.total, self.note, self.note_at = node, 0.0, 0.0, "", None
        self.tenth, self.waiting, self.unrefreshed = -1, None, False
        self._write(f"[headless] running node {node}{f' ({class_type})' if class_type else ''}\n")

    def progress(self, node: str, value: float, total: float) -> None:
        if node != self.node:
            self.start(node)
        self.value, self.total = float(value), float(total)
        if self.note_at is None:
            self.note_at = self.value
        self._show()

    def text(self, node: str, text: str) -> None:
        """The node's progress text: shown with the progress update that follows it (its first line), not printed
        on its own."""
        if node == self.node:
            self.note = text.splitlines()[0][:120] if text else ""
            self.note_at, self.unrefreshed = None, False

    def _show(self) -> None:
        now = time.monotonic()
        if self.tty:
            if not self._current() and self.drawn and now - self.drawn_at < self.hold:
                return  # the bar keeps the step its text describes until the next text
            line = self._line()
            columns = shutil.get_terminal_size((100, 20)).columns
            line = line[:max(20, columns - 1)]
            self._write("\r" + line + " " * max(0, len(self.drawn) - len(line)))
            self.drawn, self.drawn_at = line, now
            return
        tenth = int(10 * self.value / self.total) if self.total else 0
        if tenth > self.tenth or now - self.printed_at >= self.every:
            current = self._current()
            if not current and not self.unrefreshed and self.waiting in (None, tenth) and self.value < self.total:
                self.waiting = tenth  # printed with the next text, or at the next tenth without one
                return
            self.tenth, self.printed_at, self.waiting, self.unrefreshed = tenth, now, None, not current
            self._write(self._line() + "\n")

    def result(self, node: str, ui: Any) -> None:
        """A node's result (the text of its ``ui`` output), printed once however often it is reported."""
        texts = ui.get("text", []) if isinstance(ui, dict) else []
        lines = [line for text in texts for line in str(text).splitlines()]
        if node in self.results or not lines:
            return
        self.results.add(node)
        self._end_bar()
        for line in lines:
            self._write(f"[headless] node {node}: {line}\n")

    def close(self) -> None:
        self._end_bar()


class _Server:
    """What ComfyUI's executor needs of a server; ``console`` (None: silent) shows what a browser would."""

    def __init__(self, quiet: bool = False, console: Console | None = None):
        try:  # newer ComfyUI: nodes register replacements for deprecated node types here
            from app.node_replace_manager import NodeReplaceManager

            self.node_replace_manager: Any = NodeReplaceManager()
        except ImportError:
            self.node_replace_manager = None
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata: dict = {}
        self.quiet = quiet
        self.console = None if quiet else (console or Console())
        self.class_types: dict[str, str] = {}
        self.messages: list[tuple[str, Any]] = []

    def send_sync(self, event: Any, data: Any, sid: Any = None) -> None:
        self.messages.append((str(event), data))
        if self.console is None or not isinstance(data, dict):
            return
        if event == "executing" and data.get("node") is not None:
            node = str(data["node"])
            self.last_node_id = node
            self.console.start(node, self.class_types.get(node))
        elif event == "executed" and data.get("node") is not None:
            self.console.result(str(data["node"]), data.get("output"))
        elif event in ("execution_error", "execution_interrupted"):
            self.console.close()  # the runner reports the failure once, with the node's error

    def queue_updated(self) -> None:
        pass

    def send_progress_text(self, text: Any, node_id: str, sid: Any = None) -> None:
        if self.console is not None:
            self.console.text(str(node_id), text if isinstance(text, str) else text.decode())


def boot(comfyui: str, comfy_args: list[str], quiet: bool = False, others: bool = True) -> _Server:
    """Import ComfyUI in this process, load its nodes and custom nodes (this pack included; ``others`` False: this
    pack alone, for tools that need none of the others)."""
    sys.path.insert(0, comfyui)  # ComfyUI's own modules (nodes, server, ...) are top-level modules
    os.chdir(comfyui)
    import torch

    if "--cpu" not in comfy_args and not torch.cuda.is_available():
        comfy_args = [*comfy_args, "--cpu"]
    sys.argv = [os.path.join(comfyui, "main.py"), *comfy_args]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.utils
    import folder_paths
    import utils.extra_config  # noqa: F401  (ComfyUI's main imports it before the nodes)

    for folder in folder_paths.get_folder_paths("custom_nodes"):
        os.makedirs(folder, exist_ok=True)
    import server as comfy_server

    import nodes

    stub = _Server(quiet)
    comfy_server.PromptServer.instance = stub  # nodes that report text find this

    def hook(value: float, total: float, preview: Any, prompt_id: Any = None, node_id: Any = None) -> None:
        import comfy.model_management

        comfy.model_management.throw_exception_if_processing_interrupted()
        if stub.console is not None:
            stub.console.progress(str(node_id or stub.last_node_id), value, total)

    comfy.utils.set_progress_bar_global_hook(hook)
    comfy.utils.PROGRESS_BAR_ENABLED = False  # the console shows progress; nodes' own terminal bars stay off
    if hasattr(comfy.utils, "PROGRESS_THROTTLE_MIN_INTERVAL"):
        # ComfyUI 0.33 sends a node's progress at most every 0.1 s (for a browser's sake); the console pairs each
        # text with the update that follows it and thins the lines itself, so it must see every update
        comfy.utils.PROGRESS_THROTTLE_MIN_INTERVAL = 0.0
        comfy.utils.PROGRESS_THROTTLE_MIN_PERCENT = 0.0
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=others, init_api_nodes=False))
    if "StreamingCacheTrainLoRA" not in nodes.NODE_CLASS_MAPPINGS:
        asyncio.run(nodes.load_custom_node(PACK_DIR))
    if "StreamingCacheTrainLoRA" not in nodes.NODE_CLASS_MAPPINGS:
        # ComfyUI only logs a pack that fails to import; here that is fatal, with the remedy.
        raise SystemExit(f"this pack ({PACK_DIR}) failed to import into ComfyUI; the reason is in the traceback "
                         f"above. Usually its requirements are missing from ComfyUI's Python: {sys.executable} "
                         f"-m pip install -r {os.path.join(PACK_DIR, 'requirements.txt')}")
    return stub


def _widget_inputs(node_cls: Any) -> list[tuple[str, Any]]:
    spec = node_cls.INPUT_TYPES()
    out = []
    for section in ("required", "optional"):
        for name, value in (spec.get(section) or {}).items():
            kind = value[0] if isinstance(value, (list, tuple)) and value else value
            listed = isinstance(value, (list, tuple))
            opts = value[1] if listed and len(value) > 1 and isinstance(value[1], dict) else {}
            if opts.get("forceInput"):
                continue
            if isinstance(kind, (list, tuple)) or kind in WIDGET_TYPES:
                out.append((name, (kind, opts)))
    return out


def _defaults(widgets: list[tuple[str, Any]]) -> dict:
    out = {}
    for name, (kind, opts) in widgets:
        if "default" in opts:
            out[name] = opts["default"]
        elif isinstance(kind, (list, tuple)) and kind:
            out[name] = kind[0]
        elif kind == "COMBO" and opts.get("options"):
            out[name] = opts["options"][0]
    return out


def node_defaults(class_type: str) -> dict:
    """The value of every widget input of a node as a newly added node in the UI has them: their defaults, or
    the value ``web/widget_layouts.json``'s ``created`` gives (:func:`created_values`)."""
    import nodes

    return {**_defaults(_widget_inputs(nodes.NODE_CLASS_MAPPINGS[class_type])),
            **created_values().get(class_type, {})}


def _layouts_file() -> dict[str, Any]:
    try:
        with open(os.path.join(PACK_DIR, "web", "widget_layouts.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def widget_layouts() -> dict[str, dict[str, list[str]]]:
    """The widget order of the pack's nodes in each earlier release (``web/widget_layouts.json``)."""
    return _layouts_file().get("layouts", {})


def created_values() -> dict[str, dict[str, Any]]:
    """Node id -> widget -> the value it takes on a node added in the UI, where that is not its default
    (``web/widget_layouts.json``'s ``created``; the frontend extension gives new nodes the same)."""
    return _layouts_file().get("created", {})


def absent_values() -> dict[str, dict[str, Any]]:
    """Node id -> widget -> the value it takes in a file saved before it existed, where that is not its default
    (``web/widget_layouts.json``'s ``absent``; the frontend extension reads the same)."""
    return _layouts_file().get("absent", {})


def widget_names(class_type: str, values: list, current: list[str],
                 layouts: dict[str, dict[str, list[str]]]) -> list[str]:
    """The widget names ``values`` were saved for: today's order, or an earlier release's when the file has
    that release's number of values and its order is not a prefix of today's (the frontend extension
    ``web/streaming_cache.js`` maps such files the same way)."""
    if len(values) == len(current):
        return current
    matching = [names for names in (layouts.get(class_type) or {}).values() if len(names) == len(values)]
    if not matching or current[:len(matching[-1])] == matching[-1]:
        return current
    return matching[-1]


def ui_to_api(workflow: dict, mappings: dict[str, Any], notes: list[str] | None = None) -> dict[str, dict]:
    """Convert a UI-format workflow (nodes, links, widgets_values) to ComfyUI's API format.

    As the frontend does when it loads a file saved by an older version of a node, widgets the file has no value
    for get their defaults, or the value ``web/widget_layouts.json`` gives them in files saved before they existed
    (:func:`absent_values`); each such node is described in ``notes`` (when given)."""
    nodes_by_id = {str(n["id"]): n for n in workflow.get("nodes", [])}
    links = {link[0]: link for link in workflow.get("links", []) if isinstance(link, list)}
    missing = sorted({n["type"] for n in nodes_by_id.values()
                      if n["type"] not in mappings and n["type"] not in FRONTEND_ONLY | {"Reroute", "PrimitiveNode"}})
    if missing:
        version = newer_comfyui_needed(missing)
        if version is not None:
            raise WorkflowError(f"the workflow uses node types this ComfyUI does not have: {', '.join(missing)}; "
                                f"they are ComfyUI's own, in v{'.'.join(map(str, version))} and newer: update "
                                "ComfyUI")
        raise WorkflowError(f"the workflow uses node types this ComfyUI does not have: {', '.join(missing)}; "
                            "install the custom nodes that provide them")

    def source(link_id: int) -> list | Any:
        """Follow reroutes and primitives back to [node id, output slot], or a primitive's value."""
        seen = set()
        while True:
            if link_id in seen or link_id not in links:
                raise WorkflowError(f"broken link {link_id} in the workflow")
            seen.add(link_id)
            _, from_id, from_slot = links[link_id][:3]
            src = nodes_by_id.get(str(from_id))
            if src is None:
                raise WorkflowError(f"link {link_id} comes from node {from_id}, which is not in the workflow")
            if src["type"] == "Reroute":
                link_id = (src.get("inputs") or [{}])[0].get("link")
                continue
            if src["type"] == "PrimitiveNode":
                return (src.get("widgets_values") or [None])[0]
            if src.get("mode") == 4:
                raise WorkflowError(f"node {from_id} ({src['type']}) is bypassed; un-bypass or remove it")
            return [str(from_id), from_slot]

    layouts, absent = widget_layouts(), absent_values()
    prompt: dict[str, dict] = {}
    for nid, node in nodes_by_id.items():
        if node["type"] in FRONTEND_ONLY | {"Reroute", "PrimitiveNode"} or node.get("mode") in (2, 4):
            continue  # notes, frontend helpers, muted (2) and bypassed (4) nodes do not run
        cls = mappings[node["type"]]
        inputs: dict[str, Any] = {}
        values = list(node.get("widgets_values") or [])
        if isinstance(node.get("widgets_values"), dict):  # some nodes save widgets by name
            inputs.update(node["widgets_values"])
            values = []
        widgets = _widget_inputs(cls)
        saved = widget_names(node["type"], values, [name for name, _ in widgets], layouts)
        if saved is not None and saved != [name for name, _ in widgets]:
            inputs.update(zip(saved, values))
            values = []
        pos = 0
        for name, (kind, opts) in widgets:
            if pos >= len(values):
                break
            inputs[name] = values[pos]
            pos += 1
            if kind == "INT" and pos < len(values) and values[pos] in SEED_CONTROLS and \
                    (opts.get("control_after_generate") or name in ("seed", "noise_seed")):
                pos += 1
            if opts.get("image_upload") and pos < len(values) and values[pos] == "image":
                pos += 1
        linked = {slot["name"] for slot in node.get("inputs") or [] if slot.get("link") is not None}
        filled = [name for name, _ in widgets if name not in inputs and name not in linked]
        defaults = {**_defaults(widgets), **absent.get(node["type"], {})}
        for name in filled:
            if name in defaults:
                inputs[name] = defaults[name]
        if filled and notes is not None:
            notes.append(f"node {nid} ({node['type']}): the file has no value for {', '.join(filled)}; "
                         "using the defaults")
        for slot in node.get("inputs") or []:
            if slot.get("link") is not None:
                inputs[slot["name"]] = source(slot["link"])
        prompt[nid] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def load_workflow(path: str, mappings: dict[str, Any], notes: list[str] | None = None) -> dict[str, dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise WorkflowError(f"{path}: not a readable workflow JSON file ({exc})") from exc
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        return ui_to_api(data, mappings, notes)
    if isinstance(data, dict) and "prompt" in data and isinstance(data["prompt"], dict):
        data = data["prompt"]  # the body of a POST /prompt request
    if isinstance(data, dict) and all(isinstance(v, dict) and "class_type" in v for v in data.values()):
        return data
    raise WorkflowError(f"{path}: neither a UI-format workflow (nodes, links) nor an API-format prompt")


def _input_names(cls: Any) -> set[str]:
    spec = cls.INPUT_TYPES()
    return {name for section in ("required", "optional") for name in (spec.get(section) or {})}


def apply_overrides(prompt: dict[str, dict], overrides: list[str], mappings: dict[str, Any] | None = None) -> None:
    """Apply ``--set NODE.INPUT=VALUE`` overrides. With ``mappings`` (the node classes), an input the node does
    not have is an error that names the node that has it (a setting of Train LoRA may live on an option node)."""
    for item in overrides:
        target, sep, raw = item.partition("=")
        nid, dot, name = target.partition(".")
        if not sep or not dot or nid not in prompt:
            raise WorkflowError(f"--set {item!r}: expected NODE_ID.INPUT=VALUE with a node id of the workflow "
                                f"({', '.join(sorted(prompt, key=lambda s: (len(s), s)))})")
        cls = (mappings or {}).get(prompt[nid]["class_type"])
        if cls is not None and name not in _input_names(cls):
            owners = sorted(t for t, c in mappings.items() if t.startswith("StreamingCache") and  # type: ignore[union-attr]
                            not getattr(c, "DEPRECATED", False) and name in _input_names(c))
            hint = f"; it is an input of {', '.join(owners)} (add that node and wire it in)" if owners else ""
            raise WorkflowError(f"--set {item!r}: node {nid} ({prompt[nid]['class_type']}) has no input {name!r}"
                                f"{hint}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        prompt[nid]["inputs"][name] = value


def train_nodes(mappings: dict[str, Any], model: list, dataset: list, settings: dict[str, Any], *,
                prefix: str = "train") -> tuple[dict[str, dict], str]:
    """API-prompt nodes for Train LoRA (streaming cache) with ``settings`` given flat, by setting name (as the
    legacy all-in-one node took them): the main node's own, every other one on the Train Options node that owns
    it, chained into the main node's ``options`` (``clip``, ``vae`` and ``validation_dataset`` go to the
    previews options node). Returns the nodes and the main node's id (``prefix``)."""
    main = mappings["StreamingCacheTrain"]
    owners: dict[str, str] = {}
    for class_type, cls in mappings.items():
        if class_type.startswith("StreamingCache") and class_type.endswith("Options") and \
                class_type != "StreamingCacheEncodeOptions":
            owners.update({name: class_type for name in _input_names(cls) if name != "options"})
    main_names = _input_names(main)
    nodes_: dict[str, dict] = {}
    groups: dict[str, dict[str, Any]] = {}
    main_inputs: dict[str, Any] = {"model": model, "dataset": dataset}
    for name, value in settings.items():
        if name in main_names:
            main_inputs[name] = value
        elif name in owners:
            groups.setdefault(owners[name], {})[name] = value
        else:
            raise WorkflowError(f"Train LoRA has no setting {name!r}")
    chain: list | None = None
    for n, (class_type, inputs) in enumerate(sorted(groups.items())):
        nid = f"{prefix}_options{n}"
        nodes_[nid] = {"class_type": class_type, "inputs": {**inputs, **({"options": chain} if chain else {})}}
        chain = [nid, 0]
    if chain is not None:
        main_inputs["options"] = chain
    nodes_[prefix] = {"class_type": "StreamingCacheTrain",
                      "inputs": {**_defaults(_widget_inputs(main)), **main_inputs}}
    return nodes_, prefix


def pack_module(name: str, part: str = "nodes") -> Any:
    """A module of this pack as ComfyUI loaded it (``backend.compat``: ``nodes/backend/compat.py``; with ``part``
    ``streaming_cache``, an engine module: the same objects the nodes use); after :func:`boot`."""
    import importlib

    import nodes

    package = nodes.NODE_CLASS_MAPPINGS["StreamingCacheTrain"].__module__.rsplit(".nodes.", 1)[0]
    return importlib.import_module(f"{package}.{part}.{name}")


def join_process_group() -> Any:
    """Under torchrun (``WORLD_SIZE`` > 1): join the process group and use this rank's GPU, before ComfyUI starts
    (it takes the current CUDA device as its own); the engine's ``Group``, or None for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    sys.path.insert(0, PACK_DIR)
    from streaming_cache.group import init_from_env

    return init_from_env()


def validate(prompt: dict[str, dict], server: _Server) -> tuple[list[str], str]:
    """Check a prompt as the server does for POST /prompt (node replacements applied in place, as it does):
    the output nodes to execute, and an empty error text; or no outputs and what is invalid, node by node.
    Unlike the server, an invalid output node fails the whole prompt (a run that silently skips one is a
    failure here)."""
    import execution

    if server.node_replace_manager is not None:  # as the server does for POST /prompt
        server.node_replace_manager.apply_replacements(prompt)
    valid = asyncio.run(execution.validate_prompt(str(uuid.uuid4()), prompt, None))
    failing = {nid: info for nid, info in (valid[3] or {}).items() if info.get("errors")}
    if not valid[0] or failing:
        details = "; ".join(f"node {nid} ({info.get('class_type')}): " +
                            "; ".join(e.get("message", "") + " " + str(e.get("details", ""))
                                      for e in info.get("errors", []))
                            for nid, info in failing.items())
        head = valid[1] if isinstance(valid[1], dict) else {}
        return [], f"{head.get('message', 'invalid workflow')}: {head.get('details', '')} {details}".strip()
    return list(valid[2]), ""


def run(prompt: dict[str, dict], server: _Server, *, together_only: bool = False,
        executor: Any = None, traceback: bool = False) -> tuple[bool, dict, str]:
    """Validate (:func:`validate`) and execute a prompt in this process. Returns (success, history result, error
    text). ``together_only`` (a rank other than 0): run only the output nodes the ranks run together (and what
    they need), not those that save or show results. ``executor``: one kept between prompts (its cache keeps the
    outputs of unchanged nodes, e.g. a loaded model, as ComfyUI's server does); a new one by default.
    ``traceback``: the error text ends with the failing node's traceback."""
    outputs, error = validate(prompt, server)
    if error:
        return False, {}, error
    prompt_id = str(uuid.uuid4())
    if together_only:
        outputs = [nid for nid in outputs if prompt[nid]["class_type"] in TOGETHER]
    executor = executor or pack_module("backend.compat").prompt_executor(server)
    server.last_prompt_id = prompt_id
    server.class_types = {nid: node["class_type"] for nid, node in prompt.items()}
    # the executor sends a node's start and result only to a client: the console is one
    extra = {"client_id": "headless"} if getattr(server, "console", None) is not None else {}
    executor.execute(prompt, prompt_id, extra, outputs)
    error = ""
    if not executor.success:
        for event, data in executor.status_messages:
            if event in ("execution_error", "execution_interrupted"):
                error = f"{event}: node {data.get('node_id')} ({data.get('node_type')}): " \
                        f"{data.get('exception_message', '')}".strip()
                if traceback and data.get("traceback"):
                    error += "\n" + "".join(data["traceback"])[-3000:]
    return executor.success, executor.history_result, error


def demo_setup(prompt: dict[str, dict]) -> None:
    """Create the demo's checkpoint and dataset (once) and point the workflow at them, with small settings."""
    import folder_paths
    from demo_assets import CKPT, tiny_checkpoint, write_dataset

    ckpt = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], CKPT)
    if not os.path.exists(ckpt):
        print(f"[headless] demo: building a tiny random-weight checkpoint {ckpt}", flush=True)
        tiny_checkpoint(ckpt)
    dataset = os.path.join(folder_paths.get_input_directory(), "dataset")
    if not os.path.isdir(dataset):
        print(f"[headless] demo: writing a sample dataset to {dataset}", flush=True)
        write_dataset(dataset)
    train = {"steps": 20, "batch_size": 2, "rank": 4, "lora_name": "demo_lora", "learning_rate": 1e-4}
    fp32 = {"training_dtype": "fp32", "lora_dtype": "fp32"}
    settings = {"CheckpointLoaderSimple": {"ckpt_name": CKPT},
                "StreamingCacheEncode": {"resolution": 64, "batch_size": 2, "folder": "dataset"},
                "StreamingCacheEncodeDataset": {"resolution": 64, "batch_size": 2},
                "StreamingCacheTrain": train, "StreamingCacheTrainLoRA": {**train, **fp32},
                "StreamingCacheMemoryOptions": fp32}
    for node in list(prompt.values()):
        node["inputs"].update(settings.get(node["class_type"], {}))
        if node["class_type"] == "StreamingCacheTrain" and "options" not in node["inputs"]:
            prompt["demo_memory"] = {"class_type": "StreamingCacheMemoryOptions", "inputs": {**fp32}}
            node["inputs"]["options"] = ["demo_memory", 0]


def example_path(path: str) -> str:
    """``path``, or the example workflow it names by its name alone or by an earlier file name
    (``example_workflows/encode_and_train.json``), which runs it as the current name would, without a word."""
    if os.path.exists(path):
        return os.path.abspath(path)
    stem = os.path.basename(path)
    stem = stem[:-len(".json")] if stem.endswith(".json") else stem  # names hold dots: "Wan 2.1"
    name = EXAMPLES_RENAMED.get(stem, stem)
    candidate = os.path.join(PACK_DIR, "example_workflows", f"{name}.json")
    if os.path.exists(candidate):
        return candidate
    return os.path.abspath(path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    given = list(argv)
    comfy_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, comfy_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="headless.py", description=__doc__.split("\n\n")[0])
    p.add_argument("workflow", nargs="?", help="workflow JSON (UI or API format)")
    p.add_argument("--comfyui", help="ComfyUI folder (default: COMFYUI_PATH, the installation install.py recorded, "
                                     "or the custom_nodes parent)")
    p.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE", help="override an input")
    p.add_argument("--demo", metavar="DIR", help="tiny models + sample dataset in DIR, then the example workflow")
    p.add_argument("--export-api", metavar="FILE", help="write the workflow in API format (for POST /prompt), "
                                                        "do not run it")
    p.add_argument("--verbose", action="store_true",
                   help="also ComfyUI's start-up and model-loading log and the pack's own info log (errors and "
                        "warnings are always shown)")
    args = p.parse_args(argv)
    if args.demo:
        workflow = example_path(args.workflow or DEMO_EXAMPLE)
        comfy_args = [*comfy_args, "--base-directory", os.path.abspath(args.demo)]
    elif args.workflow:
        workflow = example_path(args.workflow)
    else:
        p.error("give a workflow file, or --demo DIR")
    found = locate_comfyui(args.comfyui)
    code = ensure_torch(found, given)
    if code is not None:
        return code
    signal.signal(signal.SIGTERM, _terminated)
    group = join_process_group()
    configure_logging(args.verbose, speaks=group is None or group.is_main)
    finished = False
    try:
        code = _main(args, found.path, workflow, comfy_args, group)
        finished = True
        return code
    finally:
        if group is not None:
            from streaming_cache.group import leave

            leave(finished)


class _Once(logging.Filter):
    """Each distinct warning or error once: a warning raised at every step is read once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def configure_logging(verbose: bool, speaks: bool = True) -> None:
    """The log on stderr: warnings and errors, each once (Python warnings included); with ``verbose`` also the
    info log (ComfyUI's start-up and model loading, the pack's own notes). A process that does not speak (a rank
    other than 0 under torchrun) logs its errors only."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_Once())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.ERROR if not speaks else logging.INFO if verbose else logging.WARNING)
    logging.captureWarnings(True)


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (a launcher stopping the job) as an interrupt, so a training saves the steps done."""
    raise KeyboardInterrupt(f"signal {signum}")


def _main(args: argparse.Namespace, comfyui: str, workflow: str, comfy_args: list[str], group: Any) -> int:
    server = boot(comfyui, comfy_args, quiet=group is not None and not group.is_main)
    import nodes

    notes: list[str] = []
    try:
        prompt = load_workflow(workflow, nodes.NODE_CLASS_MAPPINGS, notes)
        for note in notes:
            print(f"[headless] {note}", flush=True)
        if args.demo:
            if group is not None and not group.is_main:
                group.barrier()  # rank 0 writes the demo's files first
            demo_setup(prompt)
            if group is not None and group.is_main:
                group.barrier()
        apply_overrides(prompt, args.set, nodes.NODE_CLASS_MAPPINGS)
    except WorkflowError as exc:
        print(f"[headless] {exc}", file=sys.stderr)
        return 1
    if args.export_api:
        with open(args.export_api, "w", encoding="utf-8") as f:
            json.dump({"prompt": prompt}, f, indent=2)
        print(f"[headless] wrote {args.export_api}: POST it to http://HOST:8188/prompt")
        return 0
    started = time.perf_counter()
    ok, result, error = run(prompt, server, together_only=group is not None and not group.is_main)
    console = server.console
    if console is not None:
        console.close()
    if not ok:
        print(f"[headless] failed: {error}", file=sys.stderr)
        return 1
    if console is not None:
        for nid, ui in (result.get("outputs") or {}).items():  # nodes whose result was not shown as they ran
            console.result(str(nid), ui)
        print(f"[headless] done in {time.perf_counter() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its report names the failing rank and its error
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    sys.exit(main())
