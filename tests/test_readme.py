"""The README's and docs' promises: the README opens with the main job's command and the test command (CI runs
exactly the latter), the Python examples of docs/api.md run, and every link between the documents resolves."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
API_DOC = os.path.join("docs", "api.md")
DOCS = sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _bash_commands(block: str) -> list[str]:
    return [line for line in block.strip().splitlines() if line and not line.startswith("#")]


def test_api_doc_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", _read(API_DOC), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{API_DOC} python block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "encoded 2, reused 0, failed 0" in out
    assert "True" in out


def test_ci_runs_the_readme_test_command():
    """The README opens with two code blocks of one command each: the main job (the installer and the demo LoRA),
    then the tests; .ci/run runs the second verbatim."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    main_job, tests = _bash_commands(blocks[0]), _bash_commands(blocks[1])
    assert len(main_job) == 1 and main_job[0].startswith("python3 scripts/install.py "), main_job
    assert len(tests) == 1 and tests[0].endswith("python3 -m pytest -q"), tests
    assert README.index(blocks[1]) < README.index("\n## "), "both commands come before the README's first section"
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert tests[0] in ci.splitlines()


@pytest.mark.parametrize("path", ["README.md", "CHANGELOG.md", *DOCS])
def test_relative_links_resolve(path):
    text = _read(path)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file)) if file else \
            os.path.join(ROOT, path)
        assert os.path.exists(resolved), f"{path}: {target}"
        if anchor and resolved.endswith(".md"):
            with open(resolved, encoding="utf-8") as f:
                headings = re.findall(r"^#+ (.*)$", f.read(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{path}: {target} (no such heading)"


def test_readme_links_every_doc():
    for doc in DOCS:
        assert f"]({doc})" in README, f"the README's Read on list does not link {doc}"


@pytest.mark.parametrize("path", ["README.md", "CHANGELOG.md", *DOCS])
def test_no_table_cell_is_a_paragraph(path):
    for number, line in enumerate(_read(path).splitlines(), 1):
        if line.startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                assert len(cell.strip()) <= 300, f"{path}:{number}: a table cell of {len(cell.strip())} characters"


@pytest.mark.parametrize("name", ["LICENSE", "docs/FORMAT.md", "docs/RELIABILITY.md", "pyproject.toml",
                                  "requirements.txt", "__init__.py"])
def test_project_files_present(name):
    assert os.path.isfile(os.path.join(ROOT, name))


def test_requirements_do_not_pull_torch():
    reqs = open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8").read()
    assert not re.search(r"^\s*torch\b", reqs, re.M)
