"""The example workflows in the frontend each supported ComfyUI ships, in headless Chromium.

The pack is installed as users install it (a folder in ``custom_nodes``) into a real ComfyUI server; see
``helpers/frontend_check.py`` for what is checked. Screenshots are saved as test artifacts in
``$STREAMING_CACHE_ARTIFACTS`` (default ``test-artifacts/`` in the checkout). Needs Debian's ``chromium``;
without it (or without a ComfyUI) the tests are skipped visibly, and fail in CI.
"""

from __future__ import annotations

import os
import shutil

import pytest

from helpers.installs import ROOT, ScenarioFailed, in_ci, require_comfyui, run_scenario
EXAMPLES = ["encode_and_train", "train_from_cache", "train_with_previews"]


def artifacts_dir(version: str) -> str:
    return os.path.join(os.environ.get("STREAMING_CACHE_ARTIFACTS", os.path.join(ROOT, "test-artifacts")),
                        f"frontend-comfyui-{version}")


@pytest.fixture(scope="module")
def frontend(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    if not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")):
        message = "needs headless Chromium (Debian: apt-get install chromium)"
        if in_ci():
            pytest.fail(f"CI runs the frontend tests; {message}")
        pytest.skip(message)
    work = str(tmp_path_factory.mktemp("frontend"))
    artifacts = artifacts_dir(comfyui.version)
    shutil.rmtree(artifacts, ignore_errors=True)
    try:
        result = run_scenario(comfyui, "frontend_check.py", work, artifacts)
    except ScenarioFailed as exc:
        pytest.fail(f"frontend check failed: {exc}")
    result["artifacts"] = artifacts
    return result


def test_pack_installed_in_custom_nodes_imports_and_registers(frontend):
    assert not frontend["import_failed"], "ComfyUI logged IMPORT FAILED"
    assert frontend["imported"], "the pack is missing from ComfyUI's import times"
    assert frontend["registered"] == ["StreamingCacheEncodeDataset", "StreamingCacheLoad", "StreamingCacheTrainLoRA"]


def test_example_workflows_load_without_errors(frontend):
    for name in EXAMPLES:
        loaded = frontend[name]
        assert loaded["unknown_types"] == [], f"{name}: node types the frontend does not know"
        assert loaded["node_errors"] == [], name
        assert not [d for d in loaded["dialogs"] if "node types were not found" in d or "Nodes Are Missing" in d]
        assert loaded["widgets_kept"] and all(loaded["widgets_kept"].values()), (name, loaded["widgets_kept"])
        assert loaded["same_prompt_as_headless"], f"{name}: the frontend's API prompt differs from the headless one"
        assert loaded["errors_while_loading"] == [], name
        assert os.path.getsize(os.path.join(frontend["artifacts"], f"{name}.png")) > 10_000


def test_the_check_sees_a_missing_node(frontend):
    """A control: the same workflow with a node type nobody provides is reported."""
    assert frontend["control_missing_node"]["unknown_types"] == ["StreamingCacheNoSuchNode"]


def test_template_browser_lists_the_examples(frontend):
    assert sorted(frontend["templates"]["served"]) == EXAMPLES
    assert sorted(frontend["templates"]["listed_in_browser"]) == EXAMPLES
    assert os.path.isfile(os.path.join(frontend["artifacts"], "template_browser.png"))


def test_example_runs_from_the_run_button_to_the_loss_plot(frontend):
    run = frontend["run"]
    assert run["finished"] and run["status"] == "success", run
    texts = "\n".join(t for v in run["texts"].values() for t in v)
    assert "encoded 10, reused 0, failed 0" in texts
    assert "trained frontend_encode_and_train: steps 1-3 of 3" in texts
    assert run["preview"], "the loss plot shows on the Preview Image node"
    assert os.path.isfile(os.path.join(frontend["artifacts"], "run_encode_and_train.png"))


def test_sample_previews_and_live_loss_show_on_the_node_in_the_frontend(frontend):
    """The previews example run from the Run button: while it trains, the Train LoRA node shows a live preview
    (the loss plot, then samples above it; screenshot live_train_with_previews.png), and at the end the last
    samples are its images."""
    run = frontend["run_previews"]
    assert run["finished"] and run["status"] == "success", run
    texts = "\n".join(t for v in run["texts"].values() for t in v)
    assert "4 sample images in" in texts and "validation loss" in texts, texts
    assert run["live_polls_with_preview"] > 0, "a live preview showed on the node while it trained"
    assert os.path.isfile(os.path.join(frontend["artifacts"], "live_train_with_previews.png"))
    assert 2 in run["output_images"].values(), "the last two samples are the node's images"
    assert run["train_node_images"] >= 1, "the node shows its sample images"
