"""The README's promises: its Python examples run, and CI runs exactly its test command."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "encoded 2, reused 0, failed 0" in out
    assert "True" in out


def test_ci_runs_the_readme_test_command():
    lines = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    commands = [line for line in lines if not line.startswith("#")]
    assert len(commands) == 2, "the README opens with exactly two commands: the main job and the tests"
    test_command = commands[1]
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert test_command in ci.splitlines()


@pytest.mark.parametrize("name", ["LICENSE", "FORMAT.md", "pyproject.toml", "requirements.txt", "__init__.py"])
def test_project_files_present(name):
    assert os.path.isfile(os.path.join(ROOT, name))


def test_requirements_do_not_pull_torch():
    reqs = open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8").read()
    assert not re.search(r"^\s*torch\b", reqs, re.M)
