"""Run the tests in a virtual environment of their own, made and filled on first use:

    python3 scripts/test.py [PYTEST ARGUMENTS]        # default: -q (the whole suite)

Makes ``.venv-test`` in this checkout (``$STREAMING_CACHE_TEST_VENV`` to put it elsewhere) with the Python that
runs this script, installs PyTorch's CPU build (:data:`TORCH`) and the pack with its test extra there, then runs
pytest with the arguments given. It never installs into the Python that runs it, so it works where that Python
refuses installs (Debian 12, Ubuntu 23.04 and later, Homebrew: "externally-managed-environment"). Run again, it
installs nothing unless ``pyproject.toml``, ``requirements.txt`` or the PyTorch pin changed.

PyTorch comes from PyTorch's CPU wheel index where it answers. Where only the configured package index can be
reached, the CPU build (``+cpu``) is taken from there if it has one, else the release itself (on Linux, PyPI's
release brings CUDA libraries of several GB; it runs the tests on the CPU all the same). ComfyUI provides torch to
the pack, so the package does not list it.

Needs only Python 3.10+ (its standard library). Exits with pytest's status; 2 when the environment could not be
made, with what to do.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from install import (  # noqa: E402  (this folder, put on the path above)
    TORCH_INDEX_HOST,
    TORCH_INDEXES,
    InstallError,
    make_venv,
    reachable,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_ENV = "STREAMING_CACHE_TEST_VENV"
DEFAULT_VENV = os.path.join(ROOT, ".venv-test")
TORCH = "2.13.0"
"""The PyTorch the tests run on by default: the newest the pack supports (``streaming_cache/environment.py``)."""
STAMP = ".streaming-cache-test-install"
"""A file in the environment holding :func:`install_key` once everything is installed."""


def say(text: str) -> None:
    print(f"[test] {text}", flush=True)


def install_key(python: str) -> str:
    """What the environment's contents depend on: the pack's declared requirements, the PyTorch pin and the
    Python. A change to any of them installs again."""
    digest = hashlib.sha256(f"{TORCH}\0{python}\0{sys.version}".encode())
    for name in ("pyproject.toml", "requirements.txt"):
        with open(os.path.join(ROOT, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def torch_sources(system: str, cpu_index_answers: bool) -> list[tuple[list[str], str]]:
    """The ``pip install`` arguments to try for PyTorch, in order, each with what it brings: PyTorch's CPU index
    when it answers (it has the CPU build for Linux, Windows and macOS); else the configured index's ``+cpu``
    build where it has one; else the release itself (a CPU build on macOS and Windows, a CUDA one on Linux)."""
    if cpu_index_answers:
        return [([f"torch=={TORCH}", *TORCH_INDEXES["cpu"]], f"the CPU build from {TORCH_INDEX_HOST}")]
    release = ([f"torch=={TORCH}"], "the release from the configured package index"
               + (" (on Linux it brings CUDA libraries; the tests run on the CPU all the same)"
                  if system == "Linux" else ""))
    if system == "Darwin":
        return [release]
    return [([f"torch=={TORCH}+cpu"], "the CPU build from the configured package index"), release]


def _torch_version(python: str) -> str | None:
    proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _pip(python: str, arguments: list[str], quiet: bool = False) -> int:
    """``pip install`` into the environment, compiling what it installs (unlike the installer's): the tests start
    hundreds of Python processes, each of which would otherwise compile torch's modules again where bytecode is not
    written (``PYTHONDONTWRITEBYTECODE``)."""
    return subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *arguments],
                          capture_output=quiet, check=False).returncode


def install_torch(python: str) -> None:
    found = _torch_version(python)
    if found and found.split("+")[0] == TORCH:
        say(f"PyTorch {found} is there")
        return
    sources = torch_sources(platform.system(), reachable(TORCH_INDEX_HOST))
    for i, (arguments, what) in enumerate(sources):
        say(f"PyTorch {TORCH}: {what}")
        last = i == len(sources) - 1
        if _pip(python, ["--only-binary", "torch", *arguments], quiet=not last) == 0:
            return
        if not last:
            say("  not there; trying the next source")
    raise InstallError(f"pip could not install PyTorch {TORCH} (its output is above). Check the network or the "
                       "package index pip is configured with, then run this again.")


def prepare(venv: str) -> str:
    """The environment's Python, with PyTorch and the pack's test extra installed (once)."""
    python = make_venv(venv)
    key = install_key(python)
    stamp = os.path.join(venv, STAMP)
    if _read(stamp) == key:
        return python
    say(f"preparing {venv} (once; later runs reuse it)")
    install_torch(python)
    say("the pack and its test requirements")
    if _pip(python, ["-e", f"{ROOT}[test]"]) != 0:
        raise InstallError("pip could not install the pack's test requirements (its output is above). Check the "
                           "network or the package index pip is configured with, then run this again.")
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(key)
    return python


def main(argv: list[str]) -> int:
    venv = os.path.abspath(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    try:
        python = prepare(venv)
    except InstallError as exc:
        print(f"[test] error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return subprocess.run([python, "-m", "pytest", *(argv or ["-q"])], cwd=ROOT, check=False).returncode
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
