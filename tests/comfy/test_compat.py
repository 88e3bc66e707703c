"""What users saved keeps running: the example workflows and API prompts of every earlier release
(``tests/fixtures/releases``, taken from the git history; each release adds its own) run on today's nodes in
real ComfyUI (``tests/helpers/compat_scenario.py``), on every supported ComfyUI version: every UI file is
converted, and every file validated as the server validates a prompt. On the newest ComfyUI every API prompt
executes, and the first release's UI files (the most converted); on the others the API prompts of the first
release and of the newest (``STREAMING_CACHE_COMPAT=all``: every file on every version). The frontend side (the
same files loaded in a browser) is in ``test_frontend.py``."""

from __future__ import annotations

import json
import os

import pytest

from helpers.installs import ROOT, comfyui_installs, require_comfyui, scenario_once

RELEASES = os.path.join(ROOT, "tests", "fixtures", "releases")


def _fixtures() -> list[str]:
    out = []
    for version in sorted(os.listdir(RELEASES)):
        manifest = os.path.join(RELEASES, version, "manifest.json")
        if os.path.isfile(manifest):
            with open(manifest, encoding="utf-8") as f:
                out += [f"{version}/{e['workflow'][:-5]}" for e in json.load(f)["files"]]
    return out


FIXTURES = _fixtures()


FULL = os.environ.get("STREAMING_CACHE_COMPAT", "").lower() == "all"
EXECUTED_UI = FIXTURES[0].split("/")[0]  # the first release: the most converted (widget order, missing inputs)
EXECUTED_API = f"{EXECUTED_UI},{FIXTURES[-1].split('/')[0]}"  # ... and the newest, as saved with this code


def _executed_ui(comfyui) -> str:
    """Whose UI files execute on this ComfyUI: every release's with ``STREAMING_CACHE_COMPAT=all``; else the first
    release's on the newest ComfyUI (the last in ``COMFYUI_PATH``) and none on the others."""
    return "all" if FULL else EXECUTED_UI if comfyui is comfyui_installs()[-1] else "none"


def _executed_api(comfyui) -> str:
    """Whose API prompts execute on this ComfyUI: every release's on the newest ComfyUI (and on every one with
    ``STREAMING_CACHE_COMPAT=all``); on the others the first release's and the newest one's (each prompt of the
    releases between runs the nodes these two run, with values the newest ComfyUI executes)."""
    return "all" if FULL or comfyui is comfyui_installs()[-1] else EXECUTED_API


@pytest.fixture
def result(comfyui, tmp_path_factory):
    """The scenario on this ComfyUI: the UI files are converted, and every file validated, and executed as
    :func:`_executed_ui` and :func:`_executed_api` say."""
    comfyui = require_comfyui(comfyui)
    return scenario_once(comfyui, "compat_scenario.py", tmp_path_factory, _executed_ui(comfyui),
                         _executed_api(comfyui), timeout=1500)


def test_every_release_is_covered():
    assert {f.split("/")[0] for f in FIXTURES} >= {"0.1.0", "0.2.0", "0.3.0"} and len(FIXTURES) >= 8


@pytest.mark.parametrize("fixture", FIXTURES)
def test_api_prompt_saved_with_an_earlier_release_runs(result, fixture):
    """Accepted by ComfyUI's validation and, where executed (see ``result``), trained."""
    run = result[f"{fixture}/api"]
    assert run["ok"], run["error"]
    if run["executed"]:
        assert "trained compat_" in run["train"] and "step 1 of 1" in run["train"], run["train"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_ui_workflow_saved_with_an_earlier_release_runs_with_its_values(result, fixture):
    """Converted with every value the release saved, accepted by ComfyUI's validation and, where executed
    (see ``result``), trained."""
    run = result[f"{fixture}/ui"]
    assert run["ok"], run["error"]
    assert run["lost"] == {}, "the runner reads every value the release saved under the name it had"
    if run["executed"]:
        assert "trained compat_" in run["train"] and "step 1 of 1" in run["train"], run["train"]


@pytest.mark.parametrize("form", ["ui", "api"])
def test_the_files_asked_execute(result, comfyui, form):
    executed = sorted(k for k, v in result.items() if k.endswith(f"/{form}") and v["executed"])
    asked = (_executed_ui if form == "ui" else _executed_api)(comfyui)
    expected = sorted(f"{f}/{form}" for f in FIXTURES if asked == "all" or f.split("/")[0] in asked.split(","))
    assert executed == expected and (asked == "none" or expected), (asked, executed)
    assert all("trained compat_" in result[k]["train"] for k in executed)


def test_the_runner_says_which_inputs_an_old_file_lacks(result):
    notes = result["0.1.0/encode_and_train/ui"]["notes"]
    assert any("StreamingCacheTrainLoRA" in n and "sample_prompts" in n and "using the defaults" in n for n in notes)
    assert any("StreamingCacheEncodeDataset" in n and "frames" in n for n in notes), notes
    assert result["0.3.0/encode_and_train/ui"]["notes"] == [], "a file of the last release lacks nothing"
