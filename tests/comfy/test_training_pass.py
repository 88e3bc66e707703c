"""How Train LoRA runs ComfyUI's layers, in real ComfyUI (tests/helpers/training_pass_scenario.py): fused layers
train what ComfyUI's weight wrappers train, and gradient checkpointing survives a recomputation that sees other
free memory than its forward pass (the CPU form of the failure a GPU showed on the first training after start: the
recomputation chose another attention computation than the forward pass and PyTorch's checkpoint refused it)."""

from __future__ import annotations

import pytest

from helpers.installs import require_comfyui, run_scenario

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all


@pytest.fixture(scope="module")
def result(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    return run_scenario(comfyui, "training_pass_scenario.py", str(tmp_path_factory.mktemp("pass")), timeout=900)


def test_the_cpu_runs_memory_dependent_attention(result):
    assert result["attention"] == "attention_sub_quad", "the scenario needs ComfyUI's chunked attention"


def test_comfyuis_trainer_fails_when_memory_changes_before_the_recomputation(result):
    """The failure class, reproduced: without replay, the recomputation chunks its attention differently."""
    run = result["comfyui"]
    assert result["comfyui_backward_reads"] > 0, "its recomputation read the free memory again"
    assert not run["ok"], "ComfyUI's own checkpointing survived a change of free memory"
    assert "checkpoint" in run["error"] and ("metadata" in run["error"] or "number of tensors" in run["error"]), \
        run["error"]


def test_train_lora_replays_the_forward_readings_and_trains_the_same_lora(result):
    run = result["streaming"]
    assert run["ok"], run["error"]
    assert result["streaming_reads"]["forward"] > 0
    assert result["streaming_reads"]["backward"] == 0, "the recomputation was given the forward pass's readings"
    assert result["replayed"] >= result["streaming_reads"]["forward"] // 2 > 0
    diff = result["filling_vs_steady"]
    assert diff["same_keys"] and diff["moved"] > 0.01
    assert diff["max_difference"] == 0.0, "a replayed recomputation computes exactly what the forward pass did"


def test_fused_layers_train_the_lora_comfyuis_weight_wrappers_train(result):
    """fp32, SGD: the computations of the same function agree to float precision (the merged form, which small
    layers take by default, and the low-rank form)."""
    for run in ("fused", "lowrank", "wrapped"):
        assert result[run]["ok"], result[run]["error"]
    fused, lowrank, wrapped = result["fused_layers"][:3]
    assert fused == lowrank > 20 and wrapped == 0, result["fused_layers"]
    for form in ("fused", "lowrank"):
        diff = result[f"{form}_vs_wrapped"]
        assert diff["same_keys"] and diff["moved"] > 0.01
        assert diff["max_difference"] <= 1e-5 * diff["moved"], (form, diff)


def test_weights_moved_outside_inference_mode_train(result):
    """The GPU failure "Inference tensors do not track version counter" (Flux dev, whose bf16 weights the fused
    layers use without a cast), reproduced on the CPU by moving the loaded weights as loading onto a GPU does."""
    run = result["moved"]
    assert run["had_unversioned_weights"] == [True], "the move left weights without a version counter"
    assert run["ok"], run["error"]
    assert run["vs_unmoved"]["max_difference"] == 0.0, run["vs_unmoved"]
