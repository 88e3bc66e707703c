"""The fixture set of past releases (tests/fixtures/releases/): each release's example workflows, the API prompts
its runner exported for them and its manifest agree with each other. No ComfyUI needed."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import release_fixtures

from helpers.installs import ROOT

RELEASES = os.path.join(ROOT, "tests", "fixtures", "releases")
PUBLISHED = ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"]  # the set only grows
NOT_RUN = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}  # frontend-only nodes: never in an API prompt
SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
PACK_PREFIX = "StreamingCache"
VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:[-+.][0-9A-Za-z.+-]+)?")


def release_folders() -> list[str]:
    return sorted(n for n in os.listdir(RELEASES) if os.path.isdir(os.path.join(RELEASES, n)))


def version_key(version: str) -> tuple[int, int, int]:
    m = VERSION.fullmatch(version)
    assert m, f"release folder {version!r} is not named by a version (MAJOR.MINOR.PATCH)"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def load(release: str, name: str):
    with open(os.path.join(RELEASES, release, name), encoding="utf-8") as f:
        return json.load(f)


def manifest(release: str) -> dict:
    return load(release, "manifest.json")


def runs(node: dict) -> bool:
    """Whether a UI node becomes a node of the API prompt (muted: 2, bypassed: 4)."""
    return node["type"] not in NOT_RUN and node.get("mode", 0) not in (2, 4)


def split_widget_values(order: dict, values: list) -> dict:
    """A pack node's widgets_values -> {widget name: value}, leaving out the control values of the widgets that
    have one in that release."""
    out, pos = {}, 0
    for name in order["order"]:
        out[name] = values[pos]
        pos += 1
        if order["control_after_generate"].get(name):
            assert values[pos] in SEED_CONTROLS, f"{name}: expected a control value after it, found {values[pos]!r}"
            pos += 1
    return out


def test_every_published_release_is_in_the_fixture_set():
    assert set(PUBLISHED) <= set(release_folders())


def test_every_release_of_the_changelog_is_in_the_fixture_set():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        released = re.findall(r"^## (\d+\.\d+\.\d+) \(\d{4}-\d{2}-\d{2}\)$", f.read(), re.M)
    assert "0.1.0" in released and set(released) <= set(release_folders()), released


def test_releases_in_version_order_have_ascending_dates_and_distinct_commits():
    releases = sorted(release_folders(), key=version_key)
    manifests = [manifest(r) for r in releases]
    dates = [m["date"] for m in manifests]
    assert dates == sorted(dates), list(zip(releases, dates))
    commits = [m["commit"] for m in manifests]
    assert len(set(commits)) == len(commits), list(zip(releases, commits))


@pytest.mark.parametrize("release", release_folders())
def test_manifest_lists_files_that_exist_and_nothing_else(release):
    m = manifest(release)
    assert m["version"] == release
    assert re.fullmatch(r"[0-9a-f]{40}", m["commit"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["date"])
    assert m["runner"].endswith("/headless.py") and not os.path.isabs(m["runner"]), "the runner's path in the commit"
    assert m["files"], "a release ships at least one example workflow"
    listed = {"manifest.json"}
    for entry in m["files"]:
        assert entry["api_prompt"] == entry["workflow"][:-len(".json")] + ".api.json"
        assert VERSION.fullmatch(entry["api_prompt_exported_with_comfyui"]), entry
        for name in (entry["workflow"], entry["api_prompt"]):
            assert os.path.isfile(os.path.join(RELEASES, release, name)), f"{release}/{name} is listed but missing"
            listed.add(name)
    assert sorted(os.listdir(os.path.join(RELEASES, release))) == sorted(listed)
    assert m["widgets"], "the manifest records the widget order of the pack's nodes"
    for node_type, order in m["widgets"].items():
        assert node_type.startswith(PACK_PREFIX)
        assert len(set(order["order"])) == len(order["order"]), f"{node_type}: a widget named twice"
        assert set(order["control_after_generate"]) <= set(order["order"])


@pytest.mark.parametrize("release", release_folders())
def test_manifest_has_the_layout_the_release_script_writes(release):
    m = manifest(release)
    exports = {e["workflow"]: e["api_prompt_exported_with_comfyui"] for e in m["files"]}
    assert m == release_fixtures.build_manifest(m["version"], m["commit"], m["date"], m["runner"], exports,
                                                m["widgets"], m["widgets_read_with_comfyui"])


def workflows(release: str) -> list[tuple[str, str, str]]:
    return [(release, e["workflow"], e["api_prompt"]) for e in manifest(release)["files"]]


ALL_WORKFLOWS = [w for r in release_folders() for w in workflows(r)]
IDS = [f"{r}/{w}" for r, w, _ in ALL_WORKFLOWS]


@pytest.mark.parametrize("release,workflow,api", ALL_WORKFLOWS, ids=IDS)
def test_workflow_is_valid_ui_format(release, workflow, api):
    wf = load(release, workflow)
    assert isinstance(wf.get("nodes"), list) and wf["nodes"] and isinstance(wf.get("links"), list)
    nodes = {}
    for n in wf["nodes"]:
        assert isinstance(n.get("id"), int) and isinstance(n.get("type"), str), n
        assert n["id"] not in nodes, f"node id {n['id']} used twice"
        nodes[n["id"]] = n
    if "last_node_id" in wf:
        assert wf["last_node_id"] >= max(nodes)
    link_ids = set()
    for link in wf["links"]:
        assert isinstance(link, list) and len(link) == 6, link
        link_id, src, src_slot, dst, dst_slot, _type = link
        assert link_id not in link_ids, f"link id {link_id} used twice"
        link_ids.add(link_id)
        assert src in nodes and dst in nodes, f"link {link_id} from {src} to {dst}: an end is missing"
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id, f"link {link_id}: node {dst} does not know it"
        assert link_id in (nodes[src]["outputs"][src_slot].get("links") or []), \
            f"link {link_id}: node {src} does not know it"
    if link_ids and "last_link_id" in wf:
        assert wf["last_link_id"] >= max(link_ids)
    for n in nodes.values():
        for slot in n.get("inputs") or []:
            assert slot.get("link") is None or slot["link"] in link_ids, f"node {n['id']}.{slot['name']}"


@pytest.mark.parametrize("release,workflow,api", ALL_WORKFLOWS, ids=IDS)
def test_api_prompt_matches_the_workflow_node_for_node(release, workflow, api):
    body = load(release, api)
    assert isinstance(body, dict) and list(body) == ["prompt"] and isinstance(body["prompt"], dict)
    prompt = body["prompt"]
    for nid, entry in prompt.items():
        assert isinstance(entry.get("class_type"), str) and isinstance(entry.get("inputs"), dict), nid
        for name, value in entry["inputs"].items():
            if isinstance(value, list):  # a link: [source node id, output slot]
                assert len(value) == 2 and value[0] in prompt and isinstance(value[1], int), (nid, name, value)
    wf = load(release, workflow)
    running = {str(n["id"]): n for n in wf["nodes"] if runs(n)}
    assert sorted(prompt) == sorted(running)
    for nid, n in running.items():
        assert prompt[nid]["class_type"] == n["type"]
    nodes = {n["id"]: n for n in wf["nodes"]}
    for link_id, src, src_slot, dst, dst_slot, _ in wf["links"]:
        if str(dst) in running:
            name = nodes[dst]["inputs"][dst_slot]["name"]
            assert prompt[str(dst)]["inputs"][name] == [str(src), src_slot], f"link {link_id}"


@pytest.mark.parametrize("release,workflow,api", ALL_WORKFLOWS, ids=IDS)
def test_widget_order_of_the_release_reads_its_workflows_as_its_runner_did(release, workflow, api):
    orders = manifest(release)["widgets"]
    prompt = load(release, api)["prompt"]
    pack_nodes = [n for n in load(release, workflow)["nodes"] if n["type"].startswith(PACK_PREFIX)]
    assert pack_nodes, "every example workflow uses the pack"
    for n in pack_nodes:
        assert n["type"] in orders, f"{n['type']}: no widget order in the manifest"
        order, values = orders[n["type"]], n["widgets_values"]
        assert isinstance(values, list)
        controls = sum(1 for flag in order["control_after_generate"].values() if flag)
        assert len(values) == len(order["order"]) + controls, \
            f"node {n['id']} ({n['type']}): {len(values)} values for {len(order['order'])} widgets + {controls}"
        widgets = split_widget_values(order, values)
        exported = {k: v for k, v in prompt[str(n["id"])]["inputs"].items() if k in widgets}
        assert exported == widgets, f"node {n['id']} ({n['type']})"


@pytest.mark.parametrize("release,workflow,api", ALL_WORKFLOWS, ids=IDS)
def test_workflow_is_the_file_the_release_commit_shipped(release, workflow, api):
    commit = manifest(release)["commit"]
    try:
        shipped = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:example_workflows/{workflow}"],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"commit {commit[:12]} of release {release} is not in this clone (shallow?)")
    with open(os.path.join(RELEASES, release, workflow), "rb") as f:
        assert f.read() == shipped


def test_control_after_generate_follows_the_frontend_rule():
    rule = release_fixtures.control_after_generate
    assert rule("INT", "seed", {}) is True  # the frontend adds a control to a seed unless told otherwise
    assert rule("INT", "noise_seed", {"control_after_generate": False}) is False
    assert rule("INT", "sample_seed", {"control_after_generate": True}) is True
    assert rule("INT", "steps", {}) is None
    assert rule(["a", "b"], "seed", {}) is None
    order = release_fixtures.widget_order([("seed", ("INT", {"control_after_generate": False})),
                                           ("steps", ("INT", {})), ("name", ("STRING", {}))])
    assert order == {"order": ["seed", "steps", "name"], "control_after_generate": {"seed": False}}


def test_release_script_reads_the_version_and_never_replaces_a_release_without_force():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        declared = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M).group(1)
    assert release_fixtures.pyproject_version() == declared
    existing = release_folders()[0]
    before = sorted(os.listdir(os.path.join(RELEASES, existing)))
    with pytest.raises(SystemExit, match="already in the fixture set"):
        release_fixtures.main(["--comfyui", os.path.join(ROOT, "no-comfyui-here"), "--version", existing])
    assert sorted(os.listdir(os.path.join(RELEASES, existing))) == before


def test_the_widget_layouts_the_frontend_and_the_runner_read_are_the_manifests_orders():
    """web/widget_layouts.json maps files saved by earlier releases; it is made from the fixture set, never by
    hand (``scripts/release_fixtures.py`` writes both)."""
    with open(release_fixtures.LAYOUTS, encoding="utf-8") as f:
        assert json.load(f) == release_fixtures.widget_layouts()
    assert release_fixtures.widget_layouts()["layouts"]["StreamingCacheEncodeDataset"]["0.1.0"][-1] == "captions"
