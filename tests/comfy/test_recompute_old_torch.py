"""Real Flux blocks checkpointed on a PyTorch that cannot read the saved-tensor hooks in force (before 2.8), in real
ComfyUI (tests/helpers/old_torch_scenario.py removes that function from the process's PyTorch): the double blocks,
which update their input in place between saves, run without recomputation; the single blocks (their update comes
after their last save) and layers without in-place updates are still recomputed; all keep the gradients of their
forward pass, the run says so, and Flux learns what it learns without gradient checkpointing."""

from __future__ import annotations

import pytest

from helpers.installs import require_comfyui, scenario_once


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "old_torch_scenario.py", tmp_path_factory, timeout=900)


def test_the_scenario_stands_in_for_a_pytorch_without_the_hook_reader(result):
    assert result["has_reader"] is False


@pytest.mark.parametrize("kind", ["double", "single"])
def test_flux_blocks_that_update_in_place_keep_the_gradients_of_their_forward_pass(result, kind):
    got = result["flux_blocks"][kind]
    assert abs(got["reference"]) > 1.0
    for how in ("recomputed", "kept"):
        assert got[how] == pytest.approx(got["reference"], rel=1e-6), (how, got)
    assert result["kept_blocks"] == ["DoubleStreamBlock"], "single blocks update after their last save: recomputed"


def test_without_the_probe_the_double_blocks_recomputation_learns_from_other_values(result):
    """What the probe guards against: the double block recomputed without a watch over the checkpoint's hooks
    overwrites what it saved before its last save, and its gradient is off."""
    got = result["flux_blocks_without_probe"]["double"]
    assert abs(got["recomputed"] - got["reference"]) > 0.01 * abs(got["reference"]), got


def test_a_layer_that_updates_nothing_in_place_is_still_recomputed(result):
    got = result["last_layer"]
    assert got["forward_runs"] == 2 and got["backward_runs"] == 1, got  # probed once, then recomputed
    assert got["checkpointed"] == pytest.approx(got["reference"], rel=1e-9), got


def test_the_run_says_which_blocks_are_not_recomputed_and_why(result):
    assert result["warnings"], "a warning for each run that kept blocks"
    assert all("_top_saved_tensors_default_hooks" in w and "update PyTorch to 2.8 or newer" in w
               for w in result["warnings"]), result["warnings"]


@pytest.mark.newest_comfyui
def test_flux_learns_the_same_lora_with_its_blocks_checkpointed(result):
    if "flux_none" not in result:
        pytest.skip("the Flux runs are made on a ComfyUI with offloading (0.33 and newer)")
    for run in ("flux_plain", "flux_none"):
        assert result[run]["ok"], result[run]["error"]
        assert len(result[run]["losses"]) == 3, result[run]
    assert result["flux_kept_blocks"] == ["DoubleStreamBlock"]
    diff = result["flux_plain_vs_none"]
    assert diff["same_keys"] and diff["moved"] > 0.01
    assert diff["max_difference"] <= 1e-5 * diff["moved"], diff
