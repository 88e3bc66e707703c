"""What users saved keeps running: the example workflows and API prompts of every earlier release
(``tests/fixtures/releases``, taken from the git history; each release adds its own) run on today's nodes in
real ComfyUI (``tests/helpers/compat_scenario.py``), on every supported ComfyUI version: every API prompt
executes, every UI file is converted and validated as the server validates a prompt, and the first release's UI
files (the most converted) execute on the newest ComfyUI (``STREAMING_CACHE_COMPAT=all``: every UI file on every
version). The frontend side (the same files loaded in a browser) is in ``test_frontend.py``."""

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


def _executed_ui(comfyui) -> str:
    """Whose UI files execute on this ComfyUI: every release's with ``STREAMING_CACHE_COMPAT=all``; else the first
    release's on the newest ComfyUI (the last in ``COMFYUI_PATH``) and none on the others."""
    return "all" if FULL else EXECUTED_UI if comfyui is comfyui_installs()[-1] else "none"


@pytest.fixture
def result(comfyui, tmp_path_factory):
    """The scenario on this ComfyUI: every API prompt executes; the UI files are converted and validated, and
    executed as :func:`_executed_ui` says."""
    comfyui = require_comfyui(comfyui)
    return scenario_once(comfyui, "compat_scenario.py", tmp_path_factory, _executed_ui(comfyui), timeout=1500)


def test_every_release_is_covered():
    assert {f.split("/")[0] for f in FIXTURES} >= {"0.1.0", "0.2.0", "0.3.0"} and len(FIXTURES) >= 8


@pytest.mark.parametrize("fixture", FIXTURES)
def test_api_prompt_saved_with_an_earlier_release_runs(result, fixture):
    run = result[f"{fixture}/api"]
    assert run["ok"], run["error"]
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


def test_the_ui_files_asked_execute(result, comfyui):
    executed = sorted(k for k, v in result.items() if k.endswith("/ui") and v["executed"])
    asked = _executed_ui(comfyui)
    expected = sorted(f"{f}/ui" for f in FIXTURES if asked == "all" or f.startswith(asked + "/"))
    assert executed == expected and (asked == "none" or expected), (asked, executed)


def test_the_runner_says_which_inputs_an_old_file_lacks(result):
    notes = result["0.1.0/encode_and_train/ui"]["notes"]
    assert any("StreamingCacheTrainLoRA" in n and "sample_prompts" in n and "using the defaults" in n for n in notes)
    assert any("StreamingCacheEncodeDataset" in n and "frames" in n for n in notes), notes
    assert result["0.3.0/encode_and_train/ui"]["notes"] == [], "a file of the last release lacks nothing"
