"""Shared helpers for the engine tests."""

from __future__ import annotations

import functools
import json
import os
import struct
import sys

import pytest
import torch

import streaming_cache as sc
from streaming_cache import format as fmt


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))  # shared helpers (build_worker) importable by tests


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


@functools.lru_cache(maxsize=None)
def comfyui_installs() -> tuple[ComfyInstall, ...]:
    """ComfyUI installations named by ``COMFYUI_PATH`` (several joined with ``os.pathsep``), with the Pythons
    in ``COMFYUI_PYTHON`` (the same number, or one for all; default: this interpreter)."""
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


def require_comfyui(install: ComfyInstall | None) -> ComfyInstall:
    """The install, or skip visibly without one; in CI (``CI=true``) a missing ComfyUI is a failure."""
    if install is not None:
        return install
    message = "needs a ComfyUI: set COMFYUI_PATH (and COMFYUI_PYTHON), see README: Tests"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI runs every real-ComfyUI test; {message}")
    pytest.skip(message)


def pytest_generate_tests(metafunc) -> None:
    """Tests that take ``comfyui`` run once per configured ComfyUI (ids: its version)."""
    if "comfyui" in metafunc.fixturenames:
        installs: list = list(comfyui_installs()) or [None]  # the same objects each time: one setup per module
        metafunc.parametrize("comfyui", installs, ids=[i.version if i else "no-comfyui" for i in installs],
                             scope="module")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child Python processes: the checkout importable whether or not the pack is installed."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + path if path else ""), **extra)


def shard_paths(cache) -> list[str]:
    d = os.path.join(cache, fmt.SHARD_DIR)
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".safetensors"))


def shard_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def tensor_file_offset(cache, digest_hex: str) -> tuple[str, int, int]:
    """(shard path, absolute begin, end) of the tensor named ``digest_hex``."""
    for path in shard_paths(cache):
        start, header = shard_header(path)
        if digest_hex in header:
            b, e = header[digest_hex]["data_offsets"]
            return path, start + b, start + e
    raise KeyError(digest_hex)


def entry_digests(cache, key: str) -> list[str]:
    r = sc.open_cache(cache)
    i = r.index_of(key)
    return [r._row(row)[5] for row in r._leaf_rows(i)]


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def rewrite_index(cache, mutate) -> None:
    """Rewrite ``index.scc`` after ``mutate(header, sections)``, with valid checksums: what an attacker who
    knows the format would do."""
    path = os.path.join(cache, fmt.INDEX_NAME)
    index = fmt.IndexFile(path)
    sections = {name: bytes(index.section(name).tobytes()) for name in index.header["sections"]}
    header = {k: v for k, v in index.header.items() if k not in ("sections", "format_version")}
    mutate(header, sections)
    tmp = path + ".attacker"
    fmt.write_index(tmp, header, sections)
    os.replace(tmp, path)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def latent(seed: int, shape=(1, 4, 8, 8)) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"samples": torch.randn(*shape, generator=g), "batch_index": [seed]}


def conditioning(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(1, 768, generator=g)
    return [[torch.randn(1, 77, 768, generator=g), {"pooled_output": pooled, "guidance": 3.5, "note": "x"}]]
