"""The code passes its linter (ruff: pyflakes, pycodestyle, bugbear, import order, pyupgrade) and the engine its
type checker (mypy), as configured in pyproject.toml. Both come with the test extra; without them the tests skip
visibly, and fail in CI."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers.installs import in_ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        message = f"needs {tool} (python -m pip install -e '.[test]')"
        if in_ci():
            pytest.fail(f"CI runs the linters; {message}")
        pytest.skip(message)
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing_in_the_engine():
    out = _run("mypy", "--no-incremental")
    assert out.returncode == 0, out.stdout + out.stderr


def test_test_modules_have_names_of_their_own():
    """pytest imports the test files of folders without ``__init__.py`` by their bare names: two files of one name
    in different folders stop the whole run at collection ("import file mismatch")."""
    seen: dict[str, str] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), ROOT)
                assert name not in seen, f"{path} and {seen[name]}: rename one"
                seen[name] = path
