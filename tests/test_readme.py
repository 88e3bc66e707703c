"""The README's and docs' promises: the README opens with the main job's command and the test command (CI runs
exactly the latter), the Python examples of docs/api.md run, every link between the documents resolves, every
node's display name is in docs/nodes.md, and docs/tests.md names the tests that run on the newest ComfyUI only."""

from __future__ import annotations

import ast
import glob
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
    assert tests == ["python3 scripts/test.py"], tests
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


def _display_names() -> dict[str, str]:
    """Node id -> display name of every node of the pack, from the sources (``node_schema(ID, NAME, ...)`` and the
    option nodes' ``NODE_ID`` / ``TITLE``), without importing ComfyUI."""
    names: dict[str, str] = {}
    for path in glob.glob(os.path.join(ROOT, "nodes", "*.py")):
        tree = ast.parse(_read(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "node_schema":
                node_id, title = node.args[0], node.args[1]
                if isinstance(node_id, ast.Constant) and isinstance(title, ast.Constant):
                    names[node_id.value] = title.value
            if isinstance(node, ast.ClassDef):
                attrs = {t.id: s.value.value for s in node.body if isinstance(s, ast.Assign)
                         for t in s.targets if isinstance(t, ast.Name) and isinstance(s.value, ast.Constant)}
                if "NODE_ID" in attrs and "TITLE" in attrs:
                    names[attrs["NODE_ID"]] = attrs["TITLE"]
    return names


def test_every_node_s_display_name_is_in_the_nodes_doc():
    names = _display_names()
    assert len(names) >= 13 and names["StreamingCacheTrain"] == "Train LoRA (streaming cache)", names
    nodes_doc = _read(os.path.join("docs", "nodes.md"))
    for node_id, title in names.items():
        assert f"| {title} | `{node_id}` |" in nodes_doc, f"docs/nodes.md has no row for {title} ({node_id})"


def test_the_readme_tells_the_pack_s_trainer_from_comfyui_s():
    """ComfyUI's own trainer is "Train LoRA" too: the README names this pack's by its display name."""
    assert f"*{_display_names()['StreamingCacheTrain']}*" in README
    assert "plain *Train LoRA*" in README


def test_the_tests_doc_names_every_test_that_runs_on_the_newest_comfyui_only():
    """The README says some node tests run on the newest ComfyUI only and links docs/tests.md for which."""
    section = re.search(r"^## What runs\n(.*?)^## ", _read(os.path.join("docs", "tests.md")), re.S | re.M).group(1)
    marked = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "comfy", "test_*.py"))
                    if "newest_comfyui" in _read(p))
    assert len(marked) >= 5, marked
    for name in marked:
        assert f"`{name}`" in section, f"docs/tests.md does not say that {name} runs on the newest ComfyUI only"
    assert "(docs/tests.md#what-runs)" in README


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_nodes_doc_names_every_widget_of_this_release():
    """Each node's section of docs/nodes.md (reached through the names table) names every widget the node has in
    the release pyproject.toml names (its manifest in tests/fixtures/releases/)."""
    import json

    import release_fixtures

    manifest = os.path.join(ROOT, "tests", "fixtures", "releases", release_fixtures.pyproject_version(),
                            "manifest.json")
    if not os.path.isfile(manifest):
        pytest.skip("pyproject.toml names a release whose fixtures are not made yet (scripts/release_fixtures.py)")
    with open(manifest, encoding="utf-8") as f:
        widgets = json.load(f)["widgets"]
    doc = _read(os.path.join("docs", "nodes.md"))
    sections = {_slug(m.group(1)): m.group(2) for m in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", doc, re.S | re.M)}
    rows = re.findall(r"^\| \[[^\]]+\]\(#([\w-]+)\) \| [^|]+ \| `(\w+)` \|$", doc, re.M)
    checked = 0
    for anchor, node_id in rows:
        if anchor == "workflows-saved-with-earlier-releases":
            continue  # the earlier releases' nodes, kept as they were: their inputs are in the CHANGELOG
        missing = [w for w in widgets[node_id]["order"] if f"`{w}`" not in sections[anchor]]
        assert not missing, f"docs/nodes.md, section #{anchor}, does not name {node_id}'s widgets {missing}"
        checked += 1
    assert checked == len(widgets) - 2, (checked, sorted(widgets))
