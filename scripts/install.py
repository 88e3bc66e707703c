"""From nothing to a trained LoRA in one command: ComfyUI, its Python environment, PyTorch, this pack, the demo.

    python3 scripts/install.py [DIR]        # DIR defaults to ~/comfyui-streaming-cache-install

makes ``DIR/ComfyUI`` (the ComfyUI release this pack is tested with, at its pinned commit), ``DIR/venv`` (a
virtual environment with PyTorch for this machine's GPU, or the CPU build, and ComfyUI's requirements), puts
this pack in ``DIR/ComfyUI/custom_nodes`` (a link to this folder, so ``git pull`` here updates it) and trains the
demo LoRA in ``DIR/demo`` (tiny random-weight models and sample images, no downloads; see ``headless.py
--demo``), printing each step. Run again, it reuses everything it made and the demo encodes nothing. A stopped
or failed run resumes where it stopped. DIR may not be this clone or lie inside it.

It records where it installed (:func:`record_path`: a small JSON file in the user's configuration folder), so that
``headless.py`` run from this clone finds that ComfyUI and its Python, and it ends with the exact commands that
start ComfyUI and run a workflow without the UI.

Where ComfyUI comes from is ``--comfyui-source``: the official repository (default; cloned with git, or its
archive downloaded when git is missing), another git repository, an archive (``.tar.gz``, ``.tgz``, ``.tar``,
``.zip``: a path or an http(s) URL; checked whole and unpacked within bounds by ``install_archive.py``), or a
ComfyUI folder to copy. ``--torch`` picks the PyTorch build (default: the machine's GPU), ``--torch-wheels``
installs PyTorch from wheel files (binaries only) for machines that cannot reach download.pytorch.org.

Given a ComfyUI the user already has (ComfyUI's Windows portable build, or a ComfyUI with a ``venv``/``.venv``),
it adds the pack to that ComfyUI with its own Python instead, and keeps ComfyUI and its PyTorch as they are.

Needs only Python 3.10+ (its standard library); no third-party package is imported here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import ntpath
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import install_archive
from install_archive import MAX_BYTES, MAX_MEMBERS, ArchiveError

PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK_NAME = "comfyui-streaming-cache"
OFFICIAL_REPOSITORY = "https://github.com/comfyanonymous/ComfyUI"
PINNED_COMMIT = "783545f689a0af730065994b46b382ae24844c99"
PINNED_VERSION = "0.33.0"  # master of 2026-08-22, the newest ComfyUI the pack is tested with
OLDEST_SUPPORTED = (0, 3, 64)
DEFAULT_DIR = os.path.join("~", f"{PACK_NAME}-install")  # not "~/comfyui-streaming-cache": a clone made in ~
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
STATE_FILE = ".install-state.json"
COPY_MARK = ".copied-by-install"

# Where each PyTorch build comes from, as ComfyUI's README at the pinned commit installs it.
TORCH_INDEXES = {
    "nvidia": ["--extra-index-url", "https://download.pytorch.org/whl/cu130"],  # cu128/cu126 for older drivers
    "amd": ["--index-url", "https://download.pytorch.org/whl/rocm7.2"],
    "intel": ["--index-url", "https://download.pytorch.org/whl/xpu"],
    "cpu": ["--index-url", "https://download.pytorch.org/whl/cpu"],
    "mps": [],  # macOS: PyPI's build has the Metal backend
}
TORCH_PACKAGES = ["torch", "torchvision", "torchaudio"]
# Rough disk use, in GB: the part a step adds when it has not run yet.
DISK_GB: dict[str, Any] = {"comfyui": 0.3, "venv": 1.5, "demo": 1.5,
           "torch": {"nvidia": 8.0, "amd": 20.0, "intel": 8.0, "cpu": 1.5, "mps": 1.5, "wheels": 1.5, "none": 0.0}}


class InstallError(Exception):
    """What went wrong and what to do about it; the installer prints it and exits with status 2."""


class Steps:
    """Numbered steps, each printed when it starts and with its time when it ends."""

    def __init__(self, names: list[str]):
        self.names = names
        self.index = 0
        self.started = 0.0

    def next(self, detail: str = "") -> None:
        self.end()
        self.index += 1
        self.started = time.monotonic()
        name = self.names[self.index - 1]
        say(f"step {self.index}/{len(self.names)}: {name}" + (f" ({detail})" if detail else ""))

    def end(self, note: str = "done") -> None:
        if self.index and self.started:
            say(f"  {note} ({time.monotonic() - self.started:.0f} s)")
            self.started = 0.0


def say(text: str) -> None:
    print(f"[install] {text}", flush=True)


def say_unused(option: str | None, why: str) -> None:
    """Say that an option the user gave (None: none given) is not used, and why."""
    if option:
        say(f"note: {option} is not used: {why}")


def torch_option(torch: str, wheels: str | None) -> str | None:
    """The PyTorch option given on the command line, as typed; None for the default."""
    return f"--torch-wheels {wheels}" if wheels else (f"--torch {torch}" if torch != "auto" else None)


def is_comfyui(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "main.py")) and os.path.isdir(os.path.join(folder, "comfy"))


def comfyui_version(folder: str) -> str:
    """The version ``comfyui_version.py`` states ("" for ComfyUI releases that predate the file)."""
    try:
        with open(os.path.join(folder, "comfyui_version.py"), encoding="utf-8") as f:
            found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", f.read())
    except OSError:
        return ""
    return found.group(1) if found else ""


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def check_python() -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 (this script is run by whatever Python a person has)
        raise InstallError(f"Python {sys.version.split()[0]} is too old: ComfyUI needs Python 3.10 or newer. "
                           "Install a newer Python (3.12 is a good choice) and run this script with it.")


def check_outside_pack(target: str, pack_dir: str = PACK_DIR) -> None:
    """Refuse this clone and every folder inside it: the installer would fill the checkout with ComfyUI, a venv and
    the demo (and ComfyUI's ``custom_nodes`` would link the clone into itself)."""
    real, pack = os.path.normcase(os.path.realpath(target)), os.path.normcase(os.path.realpath(pack_dir))
    if real == pack or real.startswith(pack.rstrip(os.sep) + os.sep):
        where = "is this pack's clone" if real == pack else f"lies inside this pack's clone ({pack_dir})"
        suggestion = os.path.join(os.path.dirname(os.path.realpath(pack_dir)), f"{PACK_NAME}-install")
        raise InstallError(f"{target} {where}: the installer would fill the checkout with ComfyUI, a venv and the "
                           f"demo. Choose a folder outside it, e.g. python3 scripts/install.py {suggestion}")


def check_target(target: str) -> None:
    """Refuse folders the installer must not write into."""
    check_outside_pack(target)
    if is_comfyui(target):
        place = os.path.join(target, "custom_nodes", PACK_NAME)
        raise InstallError(
            f"{target} is a ComfyUI folder whose Python the installer cannot tell (no venv or .venv in it or beside "
            f"it, not the portable build's python_embeded); this installer makes a new folder that holds ComfyUI/, "
            f"venv/ and demo/. Choose another folder, or add this pack to that ComfyUI by hand:\n"
            f"    git clone https://github.com/streaming-cache/{PACK_NAME} {place}\n"
            f"    <ComfyUI's python> -m pip install -r {os.path.join(place, 'requirements.txt')}")
    if os.path.exists(target) and not os.path.isdir(target):
        raise InstallError(f"{target} exists and is not a folder: choose another folder.")
    comfy = os.path.join(target, "ComfyUI")
    if os.path.lexists(comfy) and not is_comfyui(comfy):
        raise InstallError(f"{comfy} exists and is not a ComfyUI (no main.py and comfy/ in it): move it away or "
                           "choose another folder.")


PORTABLE_PYTHON = ("python_embeded", "python.exe")  # ComfyUI's Windows portable build: its Python beside ComfyUI/


@dataclass(frozen=True)
class ExistingComfyUI:
    """A ComfyUI the user already has and the Python it runs with; ``portable`` is the portable build's folder."""

    comfy: str
    python: str
    portable: str | None = None


def existing_comfyui(target: str, windows: bool = os.name == "nt") -> ExistingComfyUI | None:
    """The ComfyUI at ``target`` when the pack can be added to it: ComfyUI's Windows portable build (its folder, or
    the ComfyUI inside it: ``python_embeded\\python.exe`` beside ``ComfyUI``), or a ComfyUI folder with a virtual
    environment in it or beside it (``venv``, ``.venv``). None otherwise: a folder this installer fills (its own
    ``DIR/ComfyUI`` and ``DIR/venv`` included), or a ComfyUI whose Python cannot be told."""
    comfy = target if is_comfyui(target) else os.path.join(target, "ComfyUI")
    if not is_comfyui(comfy):
        return None
    root = os.path.dirname(comfy)
    python = os.path.join(root, *PORTABLE_PYTHON)
    if os.path.isfile(python):
        return ExistingComfyUI(comfy, python, root)
    if comfy != target:
        return None
    for folder in (comfy, root):
        for name in ("venv", ".venv"):
            python = os.path.join(folder, name, *VENV_PYTHON[windows])
            if os.path.isfile(python):
                return ExistingComfyUI(comfy, python)
    return None


def check_disk(target: str, needed_gb: float) -> None:
    probe = target
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free_gb = shutil.disk_usage(probe).free / 1e9
    if free_gb < needed_gb:
        raise InstallError(f"not enough disk space for {target}: about {needed_gb:.1f} GB is needed and {probe} "
                           f"has {free_gb:.1f} GB free. Free some space or choose a folder on another disk.")


def machine_torch() -> str:
    """The PyTorch build for this machine's accelerator: nvidia, amd, intel, mps or cpu."""
    if shutil.which("nvidia-smi") and _succeeds(["nvidia-smi", "-L"]):
        return "nvidia"
    if shutil.which("rocminfo") and _succeeds(["rocminfo"]):
        return "amd"
    if sys.platform == "darwin":
        return "mps"
    return "cpu"


def driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA the NVIDIA driver runs, as ``nvidia-smi`` states it ("CUDA Version: 12.8")."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def cuda_build(driver: tuple[int, int] | None) -> str:
    """The PyTorch CUDA build a driver runs: the one ComfyUI's README names (cu130) where the driver allows it,
    else the newest older build it runs (cu128, cu126; a driver older than that gets cu126 and a note)."""
    if driver is None or driver >= (13, 0):
        return "cu130"
    if driver >= (12, 8):
        return "cu128"
    if driver < (12, 6):
        say(f"  note: the NVIDIA driver runs CUDA {driver[0]}.{driver[1]}; PyTorch's builds need 12.6 or newer. "
            "Update the driver if PyTorch sees no GPU.")
    return "cu126"


def _succeeds(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ComfyUI's source


def source_kind(source: str) -> str:
    """``git``, ``url`` (an archive to download), ``archive`` (a local one) or ``folder``."""
    lowered = source.lower()
    if lowered.startswith(("http://", "https://")):
        return "url" if lowered.endswith(ARCHIVE_SUFFIXES) else "git"
    if lowered.startswith(("git@", "ssh://", "git://")) or lowered.endswith(".git"):
        return "git"
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return "folder"
    if os.path.isfile(path) and lowered.endswith(ARCHIVE_SUFFIXES):
        return "archive"
    raise InstallError(f"--comfyui-source {source}: no such folder or archive file (.tar.gz, .tgz, .tar, .zip), "
                       "and not a git repository or archive URL.")


def fetch_comfyui(source: str | None, comfy: str, downloads: str) -> tuple[str, str]:
    """Put a ComfyUI at ``comfy`` (whole or not at all: it is assembled beside it and renamed, and removed on any
    failure); return its version and commit (each "" where the source does not say)."""
    partial = comfy + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a run that was killed
    try:
        return _assemble(source, comfy, partial, downloads)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _assemble(source: str | None, comfy: str, partial: str, downloads: str) -> tuple[str, str]:
    kind = source_kind(source) if source else "official"
    commit = ""
    if kind == "official" and not shutil.which("git"):
        say("git not found: downloading the archive of the pinned commit instead (install git to update ComfyUI "
            "with git pull later)")
        kind, source = "url", f"{OFFICIAL_REPOSITORY}/archive/{PINNED_COMMIT}.tar.gz"
    source = source or OFFICIAL_REPOSITORY
    if kind in ("official", "git"):
        commit = git_checkout(source, PINNED_COMMIT if kind == "official" else None, partial)
    elif kind == "folder":
        path = os.path.abspath(os.path.expanduser(source))
        if not is_comfyui(path):
            raise InstallError(f"--comfyui-source {path} is not a ComfyUI folder (no main.py and comfy/ in it).")
        shutil.copytree(path, partial, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        commit = _git_head(path)
    else:
        url = source if kind == "url" else None
        archive = download(source, downloads) if url else os.path.abspath(os.path.expanduser(source))
        commit = extract_archive(archive, partial, url)
    if not is_comfyui(partial):
        raise InstallError(f"{source} does not hold a ComfyUI: no main.py and comfy/ at its top level.")
    version = comfyui_version(partial)
    if version and _version_tuple(version) < OLDEST_SUPPORTED:
        raise InstallError(f"{source} holds ComfyUI {version}; this pack needs v0.3.64 or newer (it is tested "
                           f"with {PINNED_VERSION}). Leave out --comfyui-source to get that one.")
    os.replace(partial, comfy)
    return version, commit


def describe(version: str, commit: str) -> str:
    text = f"ComfyUI {version or '(version unknown)'}" + (f", commit {commit[:8]}" if commit else "")
    if commit and commit != PINNED_COMMIT:
        text += f"; the pack is tested with {PINNED_VERSION} ({PINNED_COMMIT[:8]}) and v0.3.64"
    return text


def git_checkout(repository: str, commit: str | None, dest: str) -> str:
    if not shutil.which("git"):
        raise InstallError(f"git is needed to clone {repository} and was not found: install git, or pass "
                           "--comfyui-source with an archive of ComfyUI (.tar.gz or .zip, a path or a URL).")
    say(f"  cloning {repository}")
    _git(["clone", "--filter=blob:none", "--no-checkout", repository, dest], repository)
    if commit:
        _git(["-C", dest, "checkout", "--detach", "-q", commit], repository)
    else:
        _git(["-C", dest, "checkout", "-q"], repository)
    return _git_head(dest)


def _git(arguments: list[str], repository: str) -> None:
    proc = subprocess.run(["git", *arguments], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise InstallError(f"git {arguments[0] if arguments[0] != '-C' else arguments[2]} of {repository} failed: "
                           f"{last}. No network here? Download {OFFICIAL_REPOSITORY}/archive/{PINNED_COMMIT}.tar.gz "
                           "on a machine that has one and pass it as --comfyui-source FILE.")


def _git_head(folder: str) -> str:
    if not (shutil.which("git") and os.path.exists(os.path.join(folder, ".git"))):
        return ""
    proc = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def download(url: str, downloads: str, max_bytes: int = MAX_BYTES) -> str:
    """Download ``url`` into ``downloads`` and return the file's path. What is kept is checked first, read to its
    end (:func:`check_comfyui_archive`); a second run reuses it after checking it again, and a file that fails the
    check is deleted, never reused. At most ``max_bytes`` are downloaded."""
    os.makedirs(downloads, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1]) or "comfyui.tar.gz"
    path = os.path.join(downloads, name)
    if os.path.isfile(path):
        try:
            check_comfyui_archive(path)
            return path
        except InstallError as exc:
            say(f"  {path} is not usable ({exc}); deleted, downloading it again")
            os.remove(path)
    say(f"  downloading {url}")
    part = path + ".part"
    try:
        _fetch(url, part, max_bytes)
        check_comfyui_archive(part, what=f"what {url} sent", remedy="It was deleted. Check the URL, or download "
                              "ComfyUI yourself and pass the file as --comfyui-source FILE.")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _remove(part)
        reason = getattr(exc, "reason", exc)
        raise InstallError(f"could not download {url}: {reason}. No network here? Download it on a machine that "
                           "has one and pass the file as --comfyui-source FILE.") from exc
    except BaseException:
        _remove(part)
        raise
    os.replace(part, path)
    return path


def _fetch(url: str, part: str, max_bytes: int) -> None:
    """Write what ``url`` sends to ``part``, printing the progress; refused past ``max_bytes`` or when the
    connection ends before the length the server stated."""
    too_large = (f"{url} sends more than {max_bytes:,} bytes, far more than an archive of ComfyUI. Check the URL, "
                 "or download ComfyUI yourself and pass the file as --comfyui-source FILE.")
    with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        if total > max_bytes:
            raise InstallError(too_large)
        done, shown = 0, 0.0
        while chunk := response.read(1 << 20):
            done += len(chunk)
            if done > max_bytes:
                raise InstallError(too_large)
            out.write(chunk)
            if total and done / total >= shown + 0.1:
                shown = done / total
                say(f"  {done / 1e6:.0f} of {total / 1e6:.0f} MB")
    if total and done != total:
        raise InstallError(f"the download of {url} stopped after {done} of {total} bytes. Run the command "
                           "again, or download it yourself and pass the file as --comfyui-source FILE.")


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


def check_comfyui_archive(path: str, what: str | None = None, remedy: str = "", max_bytes: int = MAX_BYTES,
                          max_members: int = MAX_MEMBERS) -> None:
    """Raise :class:`InstallError` (what is wrong, then ``remedy``) unless ``path`` is a whole archive of ComfyUI
    that :func:`extract_archive` unpacks: read to its end, checksums included, with the same opener and the same
    checks of its members (:mod:`install_archive`)."""
    try:
        install_archive.check_comfyui(path, max_bytes, max_members)
    except ArchiveError as exc:
        raise InstallError(f"{what or path} is refused: {exc}." + (f" {remedy}" if remedy else "")) from exc


def extract_archive(archive: str, dest: str, url: str | None = None, max_bytes: int = MAX_BYTES,
                    max_members: int = MAX_MEMBERS) -> str:
    """Unpack the ComfyUI archive ``archive`` into ``dest`` without its top folder (nothing of ``dest`` is left
    on failure); return the commit it names ("" for none). An archive downloaded from ``url`` that is refused is
    deleted, so the next run downloads it again; one the user gave (``url`` None) is named as the cause and kept."""
    try:
        return install_archive.extract(archive, dest, max_bytes, max_members)
    except ArchiveError as exc:
        if url:
            _remove(archive)
            raise InstallError(f"the archive downloaded from {url} is refused: {exc}. It was deleted: run the command "
                               "again to download it again, or download ComfyUI yourself and pass the file as "
                               "--comfyui-source FILE.") from exc
        raise InstallError(f"--comfyui-source {archive} is refused: {exc}. That file is left as it is: download "
                           f"ComfyUI again ({OFFICIAL_REPOSITORY}/archive/{PINNED_COMMIT}.tar.gz) and pass the new "
                           "file, or leave out --comfyui-source.") from exc
    except OSError as exc:
        raise InstallError(f"could not write ComfyUI into {dest}: {exc}. Free some disk space (or make the folder "
                           "writable) and run this again.") from exc


# The Python environment


VENV_PYTHON = {True: ("Scripts", "python.exe"), False: ("bin", "python")}  # by "on Windows"


def venv_python(venv: str, windows: bool = os.name == "nt") -> str:
    """A virtual environment's Python: ``Scripts\\python.exe`` on Windows, ``bin/python`` elsewhere."""
    return (ntpath if windows else posixpath).join(venv, *VENV_PYTHON[windows])


def make_venv(venv: str) -> str:
    python = venv_python(venv)
    if os.path.exists(python) and _succeeds([python, "-c", "import sys"]):
        return python
    shutil.rmtree(venv, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise InstallError(f"could not create a virtual environment in {venv}: {last}. On Debian or Ubuntu: "
                           f"sudo apt install python{version}-venv, then run this again.")
    return python


def pip(python: str, arguments: list[str], what: str, remedy: str, isolated: bool = False) -> None:
    """``pip install`` into the environment. ``--no-compile``: Python compiles what ComfyUI imports when it first
    imports it; compiling every module of torch, transformers and scipy ahead took most of the install's time.
    ``isolated``: Python's ``-s`` (the user's site-packages ignored), as ComfyUI's portable build runs its Python."""
    proc = subprocess.run([python, *(["-s"] if isolated else []), "-m", "pip", "install",
                           "--disable-pip-version-check", "--no-compile", *arguments], check=False)
    if proc.returncode != 0:
        raise InstallError(f"pip could not install {what} (exit {proc.returncode}; its output is above). {remedy}")


def installed_torch(python: str) -> dict[str, str] | None:
    """Versions of torch, torchvision and torchaudio in the environment as pip knows them (a build's
    ``__version__`` can differ: ``0.28.0+cu130`` for the distribution 0.28.0), and whether PyTorch sees a GPU;
    None unless all three import."""
    code = ("import json, torch, torchvision, torchaudio; from importlib.metadata import version; "
            "print(json.dumps({**{n: version(n) for n in ('torch', 'torchvision', 'torchaudio')}, "
            "'cuda': torch.cuda.is_available()}))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_version(python: str) -> str | None:
    """The version of the PyTorch that ``python`` imports, None when it imports none (a ComfyUI runs without
    torchvision and torchaudio, so a ComfyUI the user has is asked for torch alone)."""
    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                              text=True, check=False)
    except OSError:  # not a program this system runs
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if proc.returncode == 0 and lines else None


def torch_device(python: str) -> str:
    """The accelerator the environment's PyTorch runs on: ``cuda`` (NVIDIA), ``rocm`` (AMD, which PyTorch reports
    as CUDA), ``xpu`` (Intel), ``mps`` (Apple silicon) or ``cpu``."""
    code = ("import torch; x = getattr(torch, 'xpu', None); m = getattr(torch.backends, 'mps', None); "
            "print('rocm' if torch.cuda.is_available() and torch.version.hip else 'cuda' if torch.cuda.is_available() "
            "else 'xpu' if x is not None and x.is_available() else 'mps' if m is not None and m.is_available() "
            "else 'cpu')")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if proc.returncode == 0 and lines else "cpu"


DEVICE_NAMES = {"cuda": "an NVIDIA GPU", "rocm": "an AMD GPU (ROCm)", "xpu": "an Intel GPU (XPU)",
                "mps": "Apple silicon (MPS)", "cpu": "the CPU only"}


def start_command(python: str, comfy: str, device: str, windows: bool = os.name == "nt",
                  portable: bool = False) -> str:
    """The command that starts ComfyUI with this environment, quoted for the shell of the OS it runs on. ComfyUI
    finds CUDA, ROCm, XPU and MPS itself; only the CPU needs ``--cpu``. The portable build starts as its own
    ``run_*.bat`` files start it (its Python ignoring the user's site-packages, ComfyUI told it is that build)."""
    main = (ntpath if windows else posixpath).join(comfy, "main.py")
    arguments = [python, "-s", main, "--windows-standalone-build"] if portable else [python, main]
    arguments += ["--cpu"] if device == "cpu" else []
    return subprocess.list2cmdline(arguments) if windows else shlex.join(arguments)


def torch_wheel_files(folder: str) -> list[str]:
    """The wheel files of torch, torchvision and torchaudio in ``folder``, given to pip by path so it installs
    exactly those files (by name and version it could take the package index's build of the same release)."""
    found: dict[str, str] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        parts = name[:-len(".whl")].split("-") if name.endswith(".whl") else []
        if len(parts) >= 5 and parts[0].lower() in TORCH_PACKAGES:
            found[parts[0].lower()] = os.path.join(os.path.abspath(folder), name)
    missing = [p for p in TORCH_PACKAGES if p not in found]
    if missing:
        raise InstallError(f"--torch-wheels {folder}: no wheel file of {', '.join(missing)} there. Put the wheels of "
                           "torch, torchvision and torchaudio for this Python and machine in that folder.")
    return [found[p] for p in TORCH_PACKAGES]


def install_torch(python: str, choice: str, wheels: str | None, found: dict[str, str] | None) -> dict[str, str]:
    """``found``: what ``installed_torch`` saw in the environment (kept when it is there)."""
    if found:
        return found
    if choice == "none":
        raise InstallError(f"--torch none: install PyTorch (torch, torchvision, torchaudio) into {python}'s "
                           "environment yourself, then run this again.")
    if wheels:  # binaries only: a source package left in that folder would be built, running its setup.py
        arguments = ["--only-binary", ":all:", "--find-links", os.path.abspath(wheels), *torch_wheel_files(wheels)]
        remedy = (f"--torch-wheels {wheels} needs wheel files of torch, torchvision and torchaudio for this Python "
                  "(and, with no network, wheel files of their dependencies: source packages are not built).")
    else:
        index = TORCH_INDEXES[choice]
        if choice == "nvidia":
            index = ["--extra-index-url", f"https://download.pytorch.org/whl/{cuda_build(driver_cuda())}"]
        arguments = [*TORCH_PACKAGES, *index]
        remedy = ("No network here? Pass --torch-wheels DIR with wheel files of torch, torchvision and torchaudio. "
                  "A GPU that needs another build? Pass --torch (nvidia, amd, intel, cpu).")
        if index and not reachable(TORCH_INDEX_HOST):
            say(f"  {TORCH_INDEX_HOST} cannot be reached from here: taking PyTorch from the package index pip is "
                "configured with instead")
            arguments = list(TORCH_PACKAGES)
    pip(python, arguments, "PyTorch", remedy)
    found = installed_torch(python)
    if not found:  # a broken copy of the same release satisfies pip: replace the three packages themselves
        pip(python, ["--force-reinstall", "--no-deps", *arguments], "PyTorch", remedy)
        found = installed_torch(python)
    if not found:
        raise InstallError(f"PyTorch was installed into {python}'s environment but does not import. Remove that "
                           "folder and run this again, or pass --torch with another build.")
    if not wheels and arguments == list(TORCH_PACKAGES) and TORCH_INDEXES[choice]:
        say(f"  took torch {found['torch']} from the configured package index: "
            + ("a CPU-only build; " if "+cpu" in found["torch"] else "")
            + f"it was meant to be PyTorch's {choice} build. If it does not use the GPU, install that build from "
            f"{TORCH_INDEX_HOST} (or pass --torch-wheels DIR) into this environment.")
    if choice in ("nvidia", "amd") and not found["cuda"]:
        say(f"  note: this PyTorch sees no GPU; ComfyUI will run on the CPU (slow). Check the driver ({choice}).")
    return found


TORCH_INDEX_HOST = "download.pytorch.org"


def reachable(host: str, timeout: float = 10.0) -> bool:
    """Whether ``https://host/`` answers at all (any HTTP status counts; a refused or timed-out connection, or a
    name that does not resolve, does not)."""
    try:
        with urllib.request.urlopen(f"https://{host}/", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def requirements_key(*files: str, extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in files:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def install_requirements(python: str, comfy: str, torch_versions: dict[str, str], target: str) -> None:
    """ComfyUI's and the pack's requirements, with the installed PyTorch pinned so none of them swaps it."""
    constraints = os.path.join(target, "constraints.txt")
    with open(constraints, "w", encoding="utf-8") as f:
        f.writelines(f"{name}=={torch_versions[name]}\n" for name in TORCH_PACKAGES)
    pip(python, ["-r", os.path.join(comfy, "requirements.txt"), "requests", "-c", constraints],
        "ComfyUI's requirements", "No network here? pip needs the package index (or a mirror: PIP_INDEX_URL).")
    pip(python, ["-r", os.path.join(PACK_DIR, "requirements.txt"), "-c", constraints], "this pack's requirements",
        "No network here? pip needs the package index (or a mirror: PIP_INDEX_URL).")


def link_pack(comfy: str) -> str:
    """Make this pack one of ComfyUI's custom nodes: a link to this folder, or a copy where links are not allowed."""
    place = os.path.join(comfy, "custom_nodes", PACK_NAME)
    os.makedirs(os.path.dirname(place), exist_ok=True)
    if os.path.islink(place):
        if os.path.realpath(place) == os.path.realpath(PACK_DIR):
            return place
        os.unlink(place)
    elif os.path.exists(place):
        if os.path.realpath(place) == os.path.realpath(PACK_DIR):
            return place
        if os.path.isfile(os.path.join(place, COPY_MARK)):  # a copy an earlier run made: made afresh
            shutil.rmtree(place)
        else:
            raise InstallError(f"{place} exists and is another copy of this pack: remove it (or move it away) so the "
                               f"installer can link {PACK_DIR} there.")
    try:
        os.symlink(PACK_DIR, place, target_is_directory=True)
    except OSError:  # Windows without the right to make links
        shutil.copytree(PACK_DIR, place, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info"))
        with open(os.path.join(place, COPY_MARK), "w", encoding="utf-8") as f:
            f.write(f"copied from {PACK_DIR} by install.py; it replaces this copy when run again\n")
    return place


def run_demo(python: str, comfy: str, demo: str) -> None:
    command = [python, os.path.join(PACK_DIR, "scripts", "headless.py"), "--demo", demo, "--comfyui", comfy]
    proc = subprocess.run(command, check=False)
    if proc.returncode != 0:
        raise InstallError(f"the demo training failed (exit {proc.returncode}; its output is above). What was "
                           f"installed stays; run the demo again with: {' '.join(command)}")


def load_state(target: str) -> dict:
    try:
        with open(os.path.join(target, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def save_state(target: str, state: dict) -> None:
    path = os.path.join(target, STATE_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


RECORD_FILE = "installs.json"


@dataclass(frozen=True)
class Recorded:
    """An installation of this pack that the installer recorded: its ComfyUI, the Python that runs it, and whether
    that Python runs with ``-s`` (the portable build's, which ignores the user's site-packages)."""

    comfyui: str
    python: str
    isolated: bool = False


def record_path(environ: Mapping[str, str] = os.environ, windows: bool = os.name == "nt") -> str:
    """The file in which the installer records, for each clone of this pack, where it installed it:
    ``%APPDATA%\\comfyui-streaming-cache\\installs.json`` on Windows, ``$XDG_CONFIG_HOME/comfyui-streaming-cache/
    installs.json`` elsewhere (``~/.config`` where XDG_CONFIG_HOME is unset or relative). In the user's
    configuration folder rather than the clone: nothing in the checkout changes, and each clone has its entry."""
    paths: Any = ntpath if windows else posixpath
    if windows:
        base = environ.get("APPDATA") or paths.join(os.path.expanduser("~"), "AppData", "Roaming")
    else:
        base = environ.get("XDG_CONFIG_HOME", "")
        if not paths.isabs(base):
            base = paths.join(os.path.expanduser("~"), ".config")
    return str(paths.join(base, PACK_NAME, RECORD_FILE))


def _pack_key(pack_dir: str) -> str:
    return os.path.normcase(os.path.realpath(pack_dir))


def _read_records(path: str) -> dict[str, Any] | None:
    """The record's entries by clone; {} when there is no record, None when the file is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    installs = data.get("installs") if isinstance(data, dict) else None
    return installs if isinstance(installs, dict) else None


def record_install(found: Recorded, pack_dir: str = PACK_DIR, path: str | None = None) -> str | None:
    """Record that the clone at ``pack_dir`` is installed in ``found`` (its earlier entry replaced, other clones'
    kept); return the record's path. A file there that is no record is kept beside it (``.unreadable``). Where the
    record cannot be written, the installer says so and goes on (None): headless.py then needs ``--comfyui``."""
    path = path or record_path()
    installs = _read_records(path)
    try:
        if installs is None:
            os.replace(path, path + ".unreadable")
            say(f"  note: {path} was not a record of installations; kept as {path}.unreadable")
            installs = {}
        installs[_pack_key(pack_dir)] = {"comfyui": found.comfyui, "python": found.python,
                                         "isolated": found.isolated}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"installs": installs}, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        say(f"  note: could not record this installation in {path} ({exc}); headless.py needs --comfyui "
            f"{found.comfyui} and {found.python} to run it")
        return None
    return path


def recorded_install(pack_dir: str = PACK_DIR, path: str | None = None) -> Recorded | None:
    """The installation recorded for the clone at ``pack_dir`` (None when there is none or the record is not
    readable); whether it still exists is the caller's to check."""
    entry = (_read_records(path or record_path()) or {}).get(_pack_key(pack_dir))
    if not (isinstance(entry, dict) and isinstance(entry.get("comfyui"), str) and isinstance(entry.get("python"),
                                                                                                str)):
        return None
    return Recorded(entry["comfyui"], entry["python"], entry.get("isolated") is True)


def headless_command(python: str, comfy: str, demo: str, windows: bool = os.name == "nt", portable: bool = False,
                     pack_dir: str = PACK_DIR) -> str:
    """The command that runs the demo in ``demo`` without the UI, with this installation's ComfyUI and Python, quoted
    for the shell of the OS it runs on (a workflow file in place of ``--demo DIR`` runs that workflow)."""
    script = (ntpath if windows else posixpath).join(pack_dir, "scripts", "headless.py")
    arguments = [python, *(["-s"] if portable else []), script, "--demo", demo, "--comfyui", comfy]
    return subprocess.list2cmdline(arguments) if windows else shlex.join(arguments)


def say_ready(python: str, comfy: str, demo: str, recorded: str | None, portable: bool = False) -> None:
    """The installer's last lines: how to run a workflow without the UI, and what the record does."""
    say("run the demo without the UI (or a workflow: its file in place of --demo DIR) with:")
    print(f"    {headless_command(python, comfy, demo, portable=portable)}", flush=True)
    if recorded:
        say(f"recorded in {recorded}: scripts/headless.py of {PACK_DIR}, run with any Python, uses this ComfyUI "
            "and its Python.")


def install(target: str, source: str | None, torch: str, wheels: str | None, demo: bool) -> int:
    check_python()
    target = os.path.abspath(os.path.expanduser(target))
    check_outside_pack(target)
    existing = existing_comfyui(target)
    if existing is not None:
        return add_to_existing(existing, source, torch, wheels, demo)
    check_target(target)
    comfy, venv = os.path.join(target, "ComfyUI"), os.path.join(target, "venv")
    choice = "wheels" if wheels else (machine_torch() if torch == "auto" else torch)
    python = venv_python(venv)
    found = installed_torch(python) if os.path.exists(python) else None
    has_torch = found is not None
    if found is not None:
        say_unused(torch_option(torch, wheels), f"{venv} already has torch {found['torch']}, which is kept. To "
                   f"install another build, remove {venv} and run this again.")
    needed = (0.0 if is_comfyui(comfy) else DISK_GB["comfyui"]) + (0.0 if os.path.exists(python) else DISK_GB["venv"])
    needed += (0.0 if has_torch else DISK_GB["torch"][choice]) + (DISK_GB["demo"] if demo else 0.0)
    check_disk(target, needed)
    os.makedirs(target, exist_ok=True)
    state = load_state(target)
    names = ["ComfyUI", "Python environment", "PyTorch", "requirements", "this pack"]
    steps = Steps([*names, "demo LoRA"] if demo else names)

    steps.next(comfy)
    if is_comfyui(comfy):
        steps.end(f"kept: {describe(comfyui_version(comfy), _git_head(comfy) or state.get('commit', ''))}")
    else:
        version, commit = fetch_comfyui(source, comfy, os.path.join(target, "downloads"))
        state["commit"] = commit
        save_state(target, state)
        steps.end(describe(version, commit))

    steps.next(venv)
    python = make_venv(venv)
    steps.end(f"Python {_python_version(python)}")

    steps.next("kept if installed" if has_torch else (f"from {wheels}" if wheels else f"the {choice} build"))
    versions = install_torch(python, choice, wheels, found)
    device = torch_device(python)
    steps.end(f"torch {versions['torch']}, runs on {DEVICE_NAMES.get(device, device)}")

    steps.next("ComfyUI's and this pack's")
    key = requirements_key(os.path.join(comfy, "requirements.txt"), os.path.join(PACK_DIR, "requirements.txt"),
                           extra=json.dumps(versions, sort_keys=True))
    if state.get("requirements") == key:
        steps.end("kept: unchanged since the last run")
    else:
        install_requirements(python, comfy, versions, target)
        state["requirements"] = key
        save_state(target, state)

    steps.next()
    place = link_pack(comfy)
    recorded = record_install(Recorded(comfy, python))
    steps.end(f"{place} -> {PACK_DIR}")

    demo_dir = os.path.join(target, "demo")
    if demo:
        steps.next(demo_dir)
        run_demo(python, comfy, demo_dir)
        steps.end()
    say("ready. Start ComfyUI with:")
    print(f"    {start_command(python, comfy, device)}", flush=True)
    say("then open http://127.0.0.1:8188 and pick a workflow under Workflow > Browse Templates > "
        f"{PACK_NAME}" + (f" (the demo's files are in {demo_dir})." if demo else "."))
    say_ready(python, comfy, demo_dir, recorded)
    return 0


def add_to_existing(found: ExistingComfyUI, source: str | None, torch: str, wheels: str | None, demo: bool) -> int:
    """Add this pack to a ComfyUI the user already has, with that ComfyUI's own Python, as ComfyUI-Manager adds a
    pack: linked (or copied) into ``custom_nodes``, its requirements installed; ComfyUI and its PyTorch are kept."""
    what = f"ComfyUI's portable build in {found.portable}" if found.portable else f"a ComfyUI in {found.comfy}"
    say(f"{what}, run by {found.python}: this pack is added to it; ComfyUI and its PyTorch stay as they are.")
    say_unused(torch_option(torch, wheels), "the PyTorch of that ComfyUI is kept.")
    say_unused(f"--comfyui-source {source}" if source else None, "that ComfyUI is kept.")
    version = comfyui_version(found.comfy)
    if version and _version_tuple(version) < OLDEST_SUPPORTED:
        update = os.path.join(found.portable, "update", "update_comfyui.bat") if found.portable else "git pull"
        raise InstallError(f"ComfyUI {version} in {found.comfy} is older than v0.3.64, the oldest this pack "
                           f"supports. Update it first ({update}), then run this again.")
    check_disk(os.path.dirname(found.comfy), DISK_GB["demo"] if demo else 0.0)
    torch_found = torch_version(found.python)
    if torch_found is None:
        raise InstallError(f"{found.python} cannot import torch: start that ComfyUI once (or repair its Python) so "
                           "that it runs, then run this again.")
    steps = Steps(["this pack", "requirements", "demo LoRA"] if demo else ["this pack", "requirements"])
    steps.next()
    place = link_pack(found.comfy)
    recorded = record_install(Recorded(found.comfy, found.python, bool(found.portable)))
    steps.end(f"{place} -> {PACK_DIR}")
    steps.next(found.python)
    pip(found.python, ["-r", os.path.join(PACK_DIR, "requirements.txt")], "this pack's requirements",
        "No network here? pip needs the package index (or a mirror: PIP_INDEX_URL).", isolated=bool(found.portable))
    steps.end()
    demo_dir = os.path.join(os.path.dirname(found.comfy), "streaming-cache-demo")
    if demo:
        steps.next(demo_dir)
        run_demo(found.python, found.comfy, demo_dir)
        steps.end()
    device = torch_device(found.python)
    say(f"ready (torch {torch_found}, runs on {DEVICE_NAMES.get(device, device)}). Start ComfyUI as you do"
        + (" (its run_*.bat)" if found.portable else "") + ", or with:")
    print(f"    {start_command(found.python, found.comfy, device, portable=bool(found.portable))}", flush=True)
    say(f"then pick a workflow under Workflow > Browse Templates > {PACK_NAME}"
        + (f" (the demo's files are in {demo_dir})." if demo else "."))
    say_ready(found.python, found.comfy, demo_dir, recorded, portable=bool(found.portable))
    return 0


def _python_version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                          text=True, check=False)
    return proc.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default=DEFAULT_DIR, help=f"where to install (default {DEFAULT_DIR})")
    p.add_argument("--comfyui-source", metavar="SOURCE",
                   help=f"ComfyUI from: a git repository, an archive (.tar.gz/.zip path or URL) or a folder "
                        f"(default: {OFFICIAL_REPOSITORY} at {PINNED_COMMIT[:8]}, ComfyUI {PINNED_VERSION})")
    p.add_argument("--torch", choices=["auto", "nvidia", "amd", "intel", "mps", "cpu", "none"], default="auto",
                   help="PyTorch build (default: the machine's GPU, else the CPU build; none: install it yourself)")
    p.add_argument("--torch-wheels", metavar="DIR",
                   help="install torch, torchvision and torchaudio from the wheel files in DIR (no network needed)")
    p.add_argument("--no-demo", action="store_true", help="install only; do not train the demo LoRA")
    args = p.parse_args(argv)
    try:
        return install(args.dir, args.comfyui_source, args.torch, args.torch_wheels, not args.no_demo)
    except InstallError as exc:
        print(f"[install] error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("[install] stopped; run the same command again to go on from here", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
