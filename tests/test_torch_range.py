"""The PyTorch releases the pack supports (``streaming_cache.environment.TORCH_OLDEST`` to ``TORCH_NEWEST_TESTED``):
stated once, in the test extra and in CI's run on the oldest; checked when the engine is imported (ComfyUI's nodes
import it first), an older PyTorch refused with what to do, a newer one noted in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.installs import ROOT, subprocess_env
from streaming_cache import environment

pytestmark = pytest.mark.oldest_torch


def _import_engine_as(version: str) -> subprocess.CompletedProcess:
    """Import the engine in a fresh Python whose PyTorch says it is ``version``, logging at INFO."""
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s'); "
            f"torch.__version__ = {version!r}; import streaming_cache; print('imported')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=ROOT, check=False)


def _oldest() -> str:
    return "%d.%d" % environment.TORCH_OLDEST


def test_the_range_is_the_one_the_test_extra_and_ci_name():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        extra = re.search(r"^test = \[([^]]*)\]", f.read(), re.M)
    assert extra is not None and f'"torch>={_oldest()}"' in extra[1]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert re.search(rf"^OLDEST_TORCH={re.escape(_oldest())}\.\d+$", ci, re.M), "CI tests the oldest release"
    assert environment.TORCH_OLDEST < environment.TORCH_NEWEST_TESTED


@pytest.mark.parametrize("version,release", [("2.7.1+cu126", (2, 7)), ("2.8.0a0+git1234", (2, 8)),
                                             ("2.13.0+cpu", (2, 13)), ("2.10.0", (2, 10)), ("1.13.1", (1, 13)),
                                             ("unknown", None)])
def test_releases_are_read_from_version_strings(version, release):
    assert environment.torch_release(version) == release


def test_an_older_pytorch_is_told_what_it_has_what_it_needs_and_what_to_do():
    major, minor = environment.TORCH_OLDEST
    older = f"{major}.{minor - 1}.1+cu121"
    message = environment.torch_too_old(older)
    assert message is not None
    assert f"needs PyTorch {_oldest()} or newer" in message and f"has PyTorch {older}" in message
    assert "pip install --upgrade torch" in message
    for supported in (f"{_oldest()}.0", f"{major}.{minor}.0a0+git", "2.13.0+cpu", "2.99.0", "unknown"):
        assert environment.torch_too_old(supported) is None, supported
    with pytest.raises(ImportError, match="needs PyTorch"):
        environment.check_torch(older)


def test_a_newer_pytorch_than_tested_gets_one_line_and_no_error():
    major, minor = environment.TORCH_NEWEST_TESTED
    assert environment.torch_newer_than_tested(f"{major}.{minor}.1") is None
    note = environment.torch_newer_than_tested(f"{major}.{minor + 1}.0")
    assert note is not None and "\n" not in note and f"{major}.{minor + 1}.0" in note
    environment.check_torch(f"{major}.{minor + 1}.0")


def test_the_running_pytorch_is_supported():
    assert environment.torch_too_old() is None


def test_importing_the_engine_checks_the_running_pytorch():
    major, minor = environment.TORCH_OLDEST
    old = _import_engine_as(f"{major}.{minor - 1}.1")
    assert old.returncode != 0 and "imported" not in old.stdout
    assert f"ImportError: comfyui-streaming-cache needs PyTorch {_oldest()} or newer" in old.stderr, old.stderr[-2000:]
    newer = _import_engine_as("2.99.0")
    assert newer.returncode == 0 and "imported" in newer.stdout, newer.stderr[-2000:]
    assert "streaming_cache: comfyui-streaming-cache is tested with PyTorch" in newer.stderr
    assert "2.99.0" in newer.stderr
    current = _import_engine_as("2.13.0+cpu")
    assert current.returncode == 0 and "tested with" not in current.stderr


VERSION_TERMS = ("torch.distributed", "torch.compile", "saved_tensors", "inference_mode", "fake_cuda", "pin_memory",
                 "graph_devices")
"""What a test names when it exercises code whose behaviour differs between PyTorch releases."""
NOT_VERSION_TESTS = {"tests/engine/test_layering.py": "names the engine's modules as text, runs none of them"}


def test_tests_of_what_differs_by_release_run_on_the_oldest_pytorch_in_ci():
    """CI's slice on the oldest PyTorch is the tests marked ``oldest_torch``; a test file that exercises process
    groups, compiling, recomputation hooks, inference tensors, pinned memory or graphs must be among them."""
    unmarked = []
    for folder in ("tests/engine", "tests/train"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = f"{folder}/{name}"
            if not (name.startswith("test_") and name.endswith(".py")) or path in NOT_VERSION_TESTS:
                continue
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
            if any(term in text for term in VERSION_TERMS) and "pytest.mark.oldest_torch" not in text:
                unmarked.append(path)
    assert not unmarked, f"mark these with pytest.mark.oldest_torch (CI runs them on the oldest PyTorch): {unmarked}"
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert re.search(r'OLD_TORCH_VENV/bin/python" -m pytest .*-m oldest_torch tests/engine tests/train', ci), \
        "CI runs the marked tests on the oldest PyTorch"
