"""The ComfyUI installations the node tests run against, and environments for child processes."""

from __future__ import annotations

import functools
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
HELPERS = os.path.dirname(os.path.abspath(__file__))

# The pack's nodes: the compact Encode Dataset and Train LoRA with their option nodes, Load Streaming Cache, Dataset
# Mix, and the all-in-one nodes of releases up to 0.3.0 under their old ids (deprecated: hidden from search, still
# run).
NODE_TYPES = ["StreamingCacheAdapterOptions", "StreamingCacheDataOptions", "StreamingCacheDatasetMix",
              "StreamingCacheEncode", "StreamingCacheEncodeDataset", "StreamingCacheEncodeOptions",
              "StreamingCacheLoad", "StreamingCacheLossOptions", "StreamingCacheMemoryOptions",
              "StreamingCacheOptimizerOptions", "StreamingCachePreviewOptions", "StreamingCacheTrain",
              "StreamingCacheTrainLoRA"]


class ComfyInstall:
    """One ComfyUI to run the node tests against: its folder, its Python and its version."""

    def __init__(self, path: str, python: str):
        self.path, self.python = path, python
        version = "unknown"
        try:
            with open(os.path.join(path, "comfyui_version.py"), encoding="utf-8") as f:
                version = f.read().split("__version__ =", 1)[1].strip().strip('"\'')
        except (OSError, IndexError):
            pass
        self.version = version

    def __repr__(self) -> str:
        return f"ComfyUI {self.version}"


@functools.cache
def comfyui_installs() -> tuple[ComfyInstall, ...]:
    """ComfyUI installations named by ``COMFYUI_PATH`` (several joined with ``os.pathsep``), with the Pythons
    in ``COMFYUI_PYTHON`` (the same number, or one for all; default: this interpreter). Cached, so every test
    module sees the same objects and a module-scoped fixture runs once per installation."""
    paths = [p for p in os.environ.get("COMFYUI_PATH", "").split(os.pathsep) if p]
    pythons = [p for p in os.environ.get("COMFYUI_PYTHON", "").split(os.pathsep) if p] or [sys.executable]
    if len(pythons) == 1:
        pythons = pythons * len(paths)
    if len(pythons) != len(paths):
        raise pytest.UsageError(f"COMFYUI_PATH names {len(paths)} ComfyUI folders but COMFYUI_PYTHON names "
                                f"{len(pythons)} Pythons; give one Python per folder (or one for all)")
    for p in paths:
        if not os.path.isfile(os.path.join(p, "main.py")):
            raise pytest.UsageError(f"COMFYUI_PATH entry {p} is not a ComfyUI folder (no main.py)")
    return tuple(ComfyInstall(p, py) for p, py in zip(paths, pythons))


def extra_frontends() -> list[tuple[str, str]]:
    """(version, static folder) of the frontends named by ``STREAMING_CACHE_FRONTENDS`` (``VERSION=FOLDER``, several
    joined with ``os.pathsep``): checked with the newest ComfyUI besides the frontend it ships."""
    out = []
    for item in os.environ.get("STREAMING_CACHE_FRONTENDS", "").split(os.pathsep):
        version, sep, folder = item.partition("=")
        if not item:
            continue
        if not sep or not os.path.isfile(os.path.join(folder, "index.html")):
            raise pytest.UsageError(f"STREAMING_CACHE_FRONTENDS entry {item!r}: expected VERSION=FOLDER with the "
                                    "frontend's index.html in FOLDER")
        out.append((version, folder))
    return out


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_comfyui(install: ComfyInstall | None) -> ComfyInstall:
    """The install, or skip visibly without one; in CI (``CI=true``) a missing ComfyUI is a failure."""
    if install is not None:
        return install
    message = "needs a ComfyUI: set COMFYUI_PATH (and COMFYUI_PYTHON), see docs/tests.md"
    if in_ci():
        pytest.fail(f"CI runs every real-ComfyUI test; {message}")
    pytest.skip(message)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child Python processes: the checkout, its scripts and these helpers importable, whether
    or not the package is installed."""
    path = os.environ.get("PYTHONPATH")
    parts = [ROOT, SCRIPTS, os.path.dirname(HELPERS)] + ([path] if path else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(parts), **extra)


SCENARIO_ENV = "STREAMING_CACHE_SCENARIO"
"""Set in the environment of a scenario (:func:`run_scenario`), which every process it starts inherits: on a timeout
they are found by it and stopped."""


class ScenarioFailed(AssertionError):
    """A scenario child process exited without its RESULT line; the message holds the ends of its output."""


def run_scenario(install: ComfyInstall, script: str, *args: str, timeout: int = 900) -> dict:
    """Run ``tests/helpers/<script> COMFYUI_PATH *args`` with this ComfyUI's Python and return the JSON of the
    ``RESULT`` line it prints; :class:`ScenarioFailed` with the ends of its output when it prints none."""
    import json
    import subprocess
    import uuid

    from helpers import hang_limit
    from helpers.orphans import outliving, stop

    token = uuid.uuid4().hex
    hang_limit.allow(timeout)
    try:
        proc = subprocess.run([install.python, os.path.join(HELPERS, script), install.path, *args],
                              capture_output=True, text=True, timeout=timeout,
                              env=subprocess_env(**{SCENARIO_ENV: token}), check=False)
    except subprocess.TimeoutExpired as exc:
        # subprocess kills the scenario only: what it started (a ComfyUI server, a browser) would outlive the test
        stop(outliving(token, grace_s=0, variable=SCENARIO_ENV))
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        raise ScenarioFailed(f"{script} did not finish within {timeout} s (it and what it started are stopped):\n"
                             f"{out[-4000:]}\n{err[-8000:]}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise ScenarioFailed(f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT "):])


_ONCE: dict[tuple[str, str], dict] = {}


def scenario_once(install: ComfyInstall, script: str, workdir_factory, *args: str, timeout: int = 900,
                  check: bool = True) -> dict:
    """:func:`run_scenario` for a module's tests, run once per installation and script for the whole session.

    A module fixture cannot hold it: pytest orders a module's parametrized tests parameter by parameter,
    alternating between installations, and sets a module fixture up again at every switch (the whole scenario
    again, for minutes). A failed run is kept too, so every test that needs it fails with its output, quickly.
    ``workdir_factory``: pytest's ``tmp_path_factory`` (the scenario's working folder is made from it once).
    ``check``: fail the test here when the run failed; otherwise the result holds ``failed`` (its output)."""
    key = (install.path, script + "\0" + "\0".join(args))
    if key not in _ONCE:
        work = str(workdir_factory.mktemp(os.path.splitext(script)[0]))
        try:
            _ONCE[key] = run_scenario(install, script, work, *args, timeout=timeout)
        except ScenarioFailed as exc:
            _ONCE[key] = {"failed": str(exc)}
    if check and "failed" in _ONCE[key]:
        pytest.fail(_ONCE[key]["failed"], pytrace=False)
    return _ONCE[key]
