"""Train LoRA's GPU-only paths executed on the CPU, in real ComfyUI (tests/helpers/graphs_scenario.py): steps recorded
and replayed through the CPU emulation of CUDA graphs train the LoRA eager steps train (tiny SD1.5, SDXL and Flux
models; two bucket shapes, gradient accumulation, caption dropout, a dataset mix, fp16 with the scaler, a resume),
every tensor a step builds lands on the training device (checked with the ``meta`` device standing for it), and a
failed pass runs again another way only before the first optimizer step."""

from __future__ import annotations

import pytest

from helpers.installs import require_comfyui, scenario_once

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all

FAMILIES = ("sd15", "sdxl", "flux")
PLACEMENT = ("SD15", "KOALA_700M", "Flux dev", "Flux Kontext", "LTXV image-to-video")


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "graphs_scenario.py", tmp_path_factory, timeout=1500)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_steps_train_the_lora_eager_steps_train(result, family):
    run = result["graphs"][family]
    for mode in ("graphs", "eager"):
        for part in ("first", "resumed"):
            assert run[mode][part]["ok"], (mode, part, run[mode][part]["error"])
    for part in ("first", "resumed"):  # both passes replayed (the resumed one records again)
        text = run["graphs"][part]["text"]
        assert "emulated graphs:" in text and "micro-steps replayed" in text, text
        assert "fell back" not in text, text
        assert "emulated graphs" not in run["eager"][part]["text"]
    diff = run["graphs_vs_eager"]
    assert diff["same_keys"] and diff["moved"] > 1e-3, diff
    assert diff["max_difference"] <= 1e-6 * diff["moved"], diff


def test_the_emulated_copy_path_trains_what_the_plain_cpu_path_trains(result):
    run = result["graphs"]["sd15"]
    assert run["plain"]["resumed"]["ok"], run["plain"]["resumed"]["error"]
    diff = run["eager_vs_plain"]
    assert diff["same_keys"] and diff["moved"] > 1e-3 and diff["max_difference"] == 0.0, diff


def test_fp16_trained_with_the_gradient_scaler_and_the_others_without(result):
    assert result["graphs"]["flux"]["scaler"] and result["graphs"]["flux"]["scaler"]["scale"] > 0
    assert result["graphs"]["sd15"]["scaler"] is None and result["graphs"]["sdxl"]["scaler"] is None


def test_a_pass_that_fails_before_the_first_optimizer_step_runs_again_another_way(result):
    run = result["retry"]["first_step"]
    assert run["ok"], run["error"]
    assert run["passes"] == [False, True] and run["calls"] == 4, run  # the second keeps the blocks' inputs


def test_after_an_optimizer_step_the_same_error_ends_the_run_instead_of_restarting_it(result):
    """Restarting would train from weights an optimizer step already moved: not the same run."""
    run = result["retry"]["third_step"]
    assert not run["ok"] and "modified by an inplace operation" in run["error"], run
    assert run["passes"] == [False] and run["calls"] == 3, run


@pytest.mark.parametrize("key", PLACEMENT)
def test_everything_a_step_builds_is_on_the_training_device(result, key):
    run = result["placement"][key]
    assert run["ok"], run.get("traceback") or run.get("error")
    assert run["loss"] == "meta" and run["calls"], run
    assert all(call == {"x": "meta", "sigma": "meta"} for call in run["calls"]), run["calls"]
    host = {k: v for k, v in run["handed"].items() if k != "device" and v != "meta"}
    assert not host, f"handed to ComfyUI on the host: {host}"
    assert run["handed"]["device"] == "meta"


def test_graphs_are_recorded_on_cuda_and_in_the_emulation_and_not_on_rocm_or_with_offloading(result):
    decided = result["graph_decisions"]
    assert decided["cuda"] == {"recorder": "CUDA graphs", "report": None}
    assert decided["cpu_emulated"] == {"recorder": "emulated graphs", "report": None}
    assert decided["cpu"] == {"recorder": None, "report": None}
    assert decided["rocm"]["recorder"] is None and "ROCm" in decided["rocm"]["report"]
    assert decided["cuda_offloading"]["recorder"] is None and "offloading" in decided["cuda_offloading"]["report"]
