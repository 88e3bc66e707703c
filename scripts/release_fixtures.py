"""Adds this checkout's release to the compatibility fixtures in ``tests/fixtures/releases/<version>/``.

    python scripts/release_fixtures.py --comfyui PATH [--version X] [--force]     # with ComfyUI's Python

Each release adds its files to the fixture set, so that workflows and API prompts saved with any earlier release
keep being tested against today's nodes:

- ``<name>.json``: every file of ``example_workflows/``, byte for byte (UI format: widget values by position);
- ``<name>.api.json``: the body of a POST /prompt request for it, as this release's runner exports it
  (``headless.py WORKFLOW --export-api FILE``, run with ComfyUI's Python and a fresh base directory, so no
  other custom nodes load);
- ``manifest.json``: version, commit, commit date, the files and the ComfyUI version that exported each API
  prompt, and for each node type of the pack the names of its widget inputs in the order UI files store their
  values (the order the runner's UI -> API conversion reads them in), with the INT widgets that the frontend
  follows with a control value (``control_after_generate``).

``<version>`` is ``[project] version`` of pyproject.toml unless ``--version`` is given. An existing release
folder is never overwritten without ``--force``. The checkout must be a git checkout whose shipped files
(nodes, engine, runner, example workflows) have no uncommitted changes: the manifest names the commit.
Run it when a release is made, then commit the new folder; ``tests/test_release_fixtures.py`` checks it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import headless

PACK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = os.path.join(PACK, "tests", "fixtures", "releases")
RUNNER = "scripts/headless.py"  # as the manifest names it
SHIPPED = ["__init__.py", "nodes", "streaming_cache", "scripts/headless.py", "example_workflows", "pyproject.toml"]
SEED_NAMES = ("seed", "noise_seed")


def pyproject_version(pack: str = PACK) -> str:
    """``version`` of the ``[project]`` table of the checkout's pyproject.toml."""
    with open(os.path.join(pack, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    try:
        import tomllib

        return str(tomllib.loads(text)["project"]["version"])
    except ImportError:  # Python 3.10
        table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        found = re.search(r'^version\s*=\s*"([^"]+)"', table.group(1) if table else "", re.M)
        if not found:
            raise SystemExit("pyproject.toml has no [project] version; pass --version") from None
        return found.group(1)


def control_after_generate(kind: Any, name: str, opts: dict) -> bool | None:
    """Whether the frontend stores a control value ("fixed", "randomize", ...) after this widget's value: True
    or False for an INT widget that declares ``control_after_generate`` or is named like a seed (which the
    frontend gives a control unless the option says otherwise), None for every other widget."""
    if kind != "INT":
        return None
    if "control_after_generate" in opts:
        return bool(opts["control_after_generate"])
    return True if name in SEED_NAMES else None


def widget_order(widgets: list[tuple[str, Any]]) -> dict:
    """A node type's entry in the manifest from ``headless._widget_inputs(cls)``."""
    controls = {}
    for name, (kind, opts) in widgets:
        flag = control_after_generate(kind, name, opts)
        if flag is not None:
            controls[name] = flag
    return {"order": [name for name, _ in widgets], "control_after_generate": controls}


def build_manifest(version: str, commit: str, date: str, runner: str, exports: dict[str, str],
                   widgets: dict[str, dict], widgets_comfyui: str) -> dict:
    """``exports``: example workflow file name -> the ComfyUI version whose Python exported its API prompt."""
    return {
        "version": version,
        "commit": commit,
        "date": date,
        "runner": runner,
        "files": [{"workflow": name, "api_prompt": api_name(name), "api_prompt_exported_with_comfyui": comfy}
                  for name, comfy in sorted(exports.items())],
        "widgets_read_with_comfyui": widgets_comfyui,
        "widgets": {t: widgets[t] for t in sorted(widgets)},
    }


def api_name(workflow: str) -> str:
    return workflow[:-len(".json")] + ".api.json"


def comfyui_version(comfyui: str) -> str:
    try:
        with open(os.path.join(comfyui, "comfyui_version.py"), encoding="utf-8") as f:
            return f.read().split("__version__ =", 1)[1].strip().splitlines()[0].strip().strip("\"'")
    except (OSError, IndexError):
        return "unknown"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", PACK, *args], check=True, capture_output=True, text=True).stdout.strip()


def release_commit() -> tuple[str, str]:
    """(commit, commit date) of the checkout; refuses uncommitted changes to what a release ships."""
    try:
        commit = git("rev-parse", "HEAD")
        date = git("show", "-s", "--format=%cs", "HEAD")
        dirty = git("status", "--porcelain", "--", *SHIPPED)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"{PACK} must be a git checkout: the manifest names the release's commit ({exc})") from exc
    if dirty:
        raise SystemExit("uncommitted changes to files a release ships; commit them first:\n" + dirty)
    return commit, date


def export_api(comfyui: str, workflow: str, out: str) -> None:
    """The runner's own export, in a fresh ComfyUI process with an empty base directory."""
    with tempfile.TemporaryDirectory(prefix="release-fixtures-") as base:
        cmd = [sys.executable, os.path.join(PACK, *RUNNER.split("/")), workflow, "--comfyui", comfyui,
               "--export-api", out, "--", "--cpu", "--base-directory", base]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.isfile(out):
        output = (done.stdout + done.stderr)[-4000:]
        raise SystemExit(f"exporting {workflow} failed (exit {done.returncode}):\n{output}")


def pack_node_types(mappings: dict) -> dict[str, Any]:
    """The node classes ComfyUI loaded from this checkout; refuses a run where another copy of the pack loaded."""
    found = {}
    for name, cls in mappings.items():
        try:
            path = os.path.abspath(inspect.getfile(cls))
        except TypeError:
            continue
        if path.startswith(PACK + os.sep):
            found[name] = cls
        elif name.startswith("StreamingCache"):
            raise SystemExit(f"{name} was loaded from {path}, not from this checkout ({PACK}): another copy of "
                             "the pack is installed where ComfyUI loads custom nodes; remove it")
    if not found:
        raise SystemExit(f"ComfyUI loaded no nodes from {PACK}")
    return found


LAYOUTS = os.path.join(PACK, "web", "widget_layouts.json")
LAYOUTS_ABOUT = ("Widget order of the pack's nodes as each release saved them in UI workflow files (widgets_values), "
                 "by node id and release, from tests/fixtures/releases/*/manifest.json (scripts/release_fixtures.py "
                 "writes it). Read by web/streaming_cache.js and scripts/headless.py to load files saved by an "
                 "earlier release whose order differs from today's. 'created': the value a widget takes on a node "
                 "added in the UI where that is not its default (the default is what an API prompt without it "
                 "gets); 'absent': its value in a file saved before the widget existed, where that is not its "
                 "default.")
CREATED: dict[str, dict[str, object]] = {"StreamingCacheTrain": {"preset": "auto"},
                                         "StreamingCacheEncode": {"preset": "auto"}}
"""Node id -> widget -> its value on a node added in the UI: the presets of Train LoRA and Encode Dataset are auto
there, and none (their default) in API prompts that leave them out and in the workflows saved before they came
(``ABSENT``), which keep training with the settings they show."""
ABSENT: dict[str, dict[str, object]] = {"StreamingCacheTrain": {"preset": "none"},
                                        "StreamingCacheEncode": {"preset": "none"}}


def widget_layouts() -> dict:
    """``web/widget_layouts.json`` as the fixture set's manifests make it: node id -> release -> widget names."""
    layouts: dict[str, dict[str, list[str]]] = {}
    versions = [v for v in os.listdir(RELEASES) if os.path.isfile(os.path.join(RELEASES, v, "manifest.json"))]
    for version in sorted(versions, key=lambda v: [int(x) if x.isdigit() else x for x in re.split(r"[.+-]", v)]):
        with open(os.path.join(RELEASES, version, "manifest.json"), encoding="utf-8") as f:
            widgets = json.load(f)["widgets"]
        for node_type, info in sorted(widgets.items()):
            layouts.setdefault(node_type, {})[version] = list(info["order"])
    return {"about": LAYOUTS_ABOUT, "layouts": layouts, "created": CREATED, "absent": ABSENT}


def write_widget_layouts() -> None:
    with open(LAYOUTS, "w", encoding="utf-8") as f:
        json.dump(widget_layouts(), f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release_fixtures.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", required=True, help="ComfyUI folder (run this script with its Python)")
    p.add_argument("--version", help="release version (default: [project] version of pyproject.toml)")
    p.add_argument("--force", action="store_true", help="replace an existing folder of this version")
    args = p.parse_args(argv)
    version = args.version or pyproject_version()
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+-]*", version):
        raise SystemExit(f"not a version: {version!r}")
    dest = os.path.join(RELEASES, version)
    if os.path.exists(dest) and not args.force:
        raise SystemExit(f"{dest} exists: release {version} is already in the fixture set (pyproject.toml says "
                         f"{pyproject_version()}; raise it for a new release, or pass --version; --force replaces)")
    comfyui = headless.find_comfyui(args.comfyui)
    commit, date = release_commit()
    comfy_version = comfyui_version(comfyui)
    folder = os.path.join(PACK, "example_workflows")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    if not names:
        raise SystemExit(f"no example workflows in {folder}")

    work = tempfile.mkdtemp(prefix=f"release-{version}-")
    try:
        for name in names:
            shutil.copyfile(os.path.join(folder, name), os.path.join(work, name))
            print(f"exporting {name} with ComfyUI {comfy_version}", flush=True)
            export_api(comfyui, os.path.join(folder, name), os.path.join(work, api_name(name)))

        with tempfile.TemporaryDirectory(prefix="release-fixtures-") as base:
            headless.boot(comfyui, ["--cpu", "--base-directory", base], quiet=True)
            import nodes

            mappings = nodes.NODE_CLASS_MAPPINGS
            ours = pack_node_types(mappings)
            widgets = {t: widget_order(headless._widget_inputs(cls)) for t, cls in ours.items()}
            for name in names:  # the exporting process loaded the same code: it converts the same way
                with open(os.path.join(work, api_name(name)), encoding="utf-8") as f:
                    exported = json.load(f)["prompt"]
                if exported != headless.load_workflow(os.path.join(folder, name), mappings):
                    raise SystemExit(f"the exported API prompt of {name} differs from this checkout's conversion")
        manifest = build_manifest(version, commit, date, RUNNER, {n: comfy_version for n in names}, widgets,
                                  comfy_version)
        with open(os.path.join(work, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        if os.path.exists(dest):
            shutil.rmtree(dest)
        os.makedirs(RELEASES, exist_ok=True)
        shutil.move(work, dest)
    finally:
        if os.path.isdir(work):
            shutil.rmtree(work)
    write_widget_layouts()
    print(f"wrote {dest}: {', '.join(sorted(os.listdir(dest)))}, and {LAYOUTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
