"""Big models on small GPUs, in real ComfyUI (tests/helpers/memory_scenario.py): the checkpoint depth, offloading
of the frozen model, LoRA training on fp8 base weights through ComfyUI's bypass hooks, and fp16 training with a
gradient scaler, each compared with a plain run of the same seed and data. What these options save in GPU memory
is measured by ``devtools/memory_bench.py`` on a GPU; here the CPU shows that each one trains what it should."""

from __future__ import annotations

import math
import re

import pytest

from helpers.installs import require_comfyui, run_scenario


@pytest.fixture(scope="module")
def result(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    return run_scenario(comfyui, "memory_scenario.py", str(tmp_path_factory.mktemp("memory")), timeout=900)


def _trained(run: dict) -> None:
    assert run["ok"], run["error"]
    assert "trained" in run["train"] and len(run["losses"]) == 3, run
    assert all(math.isfinite(x) for x in run["losses"])


def test_the_memory_plan_says_what_it_did_and_a_model_it_cannot_estimate_trains_as_set(result):
    assert "memory plan auto: training on the CPU: settings as set" in result["plain"]["train"]
    planned = result["planned"]
    assert planned["ok"], planned["error"]
    assert len(planned["losses"]) == 1 and math.isfinite(planned["losses"][0])
    # the families this ComfyUI has (v0.3.64 has no Z-Image, Flux.2 or LTX-2); SD3.5 Large is SD3 at another size
    assert re.search(r"memory plan auto: no estimate for SD3 at this size yet \(estimated: SDXL, Flux dev, "
                     r"SD3\.5 Large, [^)]*Qwen-Image[^)]*\): settings as set", planned["train"]), planned["train"]
    # the memory a plan may count on: what is free plus what the loaded models hold (the trained model here)
    assert result["loaded_on_cpu"] > 0
    assert result["memory_for_training"] > result["loaded_on_cpu"]


def test_checkpoint_depth_checkpoints_smaller_pieces_and_learns_the_same(result):
    _trained(result["plain"])
    _trained(result["depth2"])
    assert result["depth2"]["checkpointed_modules"] > result["plain"]["checkpointed_modules"] > 0
    diff = result["depth2_vs_plain"]
    assert diff["same_keys"] and diff["moved"] > 0.01
    assert diff["max_difference"] <= 1e-5 * diff["moved"], "recomputation changes memory, not the result"


def test_a_share_of_the_blocks_recomputed_learns_the_same(result):
    _trained(result["share"])
    assert result["share"]["checkpointed_modules"] == int(result["plain"]["checkpointed_modules"] * 0.5 + 0.5)
    assert 0 < result["share"]["checkpointed_modules"] < result["plain"]["checkpointed_modules"]
    diff = result["share_vs_plain"]
    assert diff["same_keys"] and diff["moved"] > 0.01
    assert diff["max_difference"] <= 1e-5 * diff["moved"], "recomputing fewer blocks changes memory, not the result"


def test_offloading_trains_the_same_lora_or_is_refused_clearly(result):
    run = result["offloading"]
    if not result["has_offloading"]:
        assert not run["ok"] and "offloading needs a newer ComfyUI than 0.3" in run["error"], run
        assert "update ComfyUI or turn offloading off" in run["error"]
        return
    _trained(run)
    diff = result["offloading_vs_plain"]
    assert diff["same_keys"] and diff["max_difference"] <= 1e-3 * diff["moved"], diff


def test_offloading_trains_flux_like_a_plain_run_including_its_input_layer(result):
    """Flux adds to a top-level layer's output in place and feeds that layer the latent itself: with ComfyUI's
    offload-aware checkpointing alone the first fails in autograd and the second never trains that layer."""
    if not result["has_offloading"]:
        assert "flux_offload" not in result  # refused above, before anything is trained
        return
    _trained(result["flux_plain"])
    _trained(result["flux_offload"])
    diff = result["flux_offloading_vs_plain"]
    assert diff["same_keys"] and diff["max_difference"] <= 1e-3 * diff["moved"], diff
    assert result["flux_offload_img_in_moved"] > 0.01, "the layer that takes the latent trained too"


@pytest.mark.parametrize("kind", ["double", "single"])
def test_flux_blocks_recomputed_or_kept_give_the_gradients_of_their_forward_pass(result, kind):
    """A real Flux block (ComfyUI's class, float64) updates its input in place after norms saved it: recomputed by
    the pack's gradient checkpointing or kept without recomputation, the gradient of its inputs' scale is the
    central difference of its forward pass."""
    got = result["flux_blocks"][kind]
    reference = got["reference"]
    assert abs(reference) > 1.0
    for how in ("recomputed", "kept"):
        assert got[how] == pytest.approx(reference, rel=1e-6), (how, got)


@pytest.mark.parametrize("kind", ["double", "single"])
def test_comfyuis_own_checkpoint_wrapper_gets_flux_gradients_wrong(result, kind):
    """What the check above guards against: ComfyUI's wrapper (TrainLoraNode's) recomputes each block from its
    input as the block's own updates left it (6-38 % off on these blocks)."""
    got = result["flux_blocks"][kind]
    assert abs(got["comfyui_checkpoint"] - got["reference"]) > 0.01 * abs(got["reference"]), got


@pytest.mark.newest_comfyui
@pytest.mark.parametrize("run", ["flux_plain", "flux_share"])
def test_flux_learns_what_its_forward_pass_computed_with_all_some_or_none_of_its_blocks_recomputed(result, run):
    """Flux updates each block's input in place and passes the same tensor on: recomputed blocks run on their own
    copy of it (else each recomputation starts from what later blocks left there, and the gradients come from
    other activations), blocks that are not recomputed keep a copy where autograd saves it (else autograd refuses
    the backward pass). All three train the same LoRA."""
    if "flux_none" not in result:
        pytest.skip("the Flux runs are made on a ComfyUI with offloading (0.33 and newer)")
    _trained(result["flux_none"])
    _trained(result[run])
    diff = result[f"{run}_vs_none"]
    assert diff["same_keys"] and diff["moved"] > 0.01
    assert diff["max_difference"] <= 1e-5 * diff["moved"], diff


def test_memory_options_continue_the_same_run(result):
    """They change where tensors live, not what is learned: queueing again with another depth (and offloading
    where ComfyUI has it) and more steps resumes the run."""
    run = result["continued"]
    assert run["ok"], run["error"]
    assert run["train"].startswith("resuming plain"), run["train"]
    assert "step 4 of 4" in run["train"] and len(run["losses"]) == 4


def test_bypass_mode_trains_on_fp8_weights_like_weight_wrappers_do(result):
    _trained(result["fp8_wrapped"])
    run = result["fp8_bypass"]
    if not result["has_bypass"]:
        assert not run["ok"] and "bypass mode needs a newer ComfyUI than 0.3" in run["error"], run
        return
    _trained(run)
    diff = result["bypass_vs_wrapped"]
    assert diff["same_keys"] and diff["moved"] > 0.01, "the hooks were in place: the LoRA trained"
    assert diff["max_difference"] <= 1e-4 * diff["moved"], "a branch beside the layer learns what a merged weight does"
    applied = result["bypass_lora"]
    assert applied["patched_weights"] == applied["lora_targets"] > 0, "ComfyUI's LoRA loader takes every key"
    assert applied["outputs_finite"] and applied["output_change"] > 1e-4


def test_bypass_mode_refuses_an_adapter_without_a_bypass_branch(result):
    run = result["bypass_loha"]
    assert not run["ok"], run
    if result["has_bypass"]:
        assert "bypass mode cannot train LohaDiff adapters" in run["error"], run
        assert "choose the LoRA, LoKr or OFT algorithm" in run["error"]
    else:
        assert "bypass mode needs a newer ComfyUI than 0.3" in run["error"], run


def test_fp16_trains_with_a_gradient_scaler(result):
    run = result["fp16"]
    _trained(run)
    assert run["scaler"] is not None and run["scaler"]["scale"] > 1, "the scaler's state is saved for resuming"
    assert run["overflow_steps"] == 0
    assert run["losses"][0] == pytest.approx(result["plain"]["losses"][0], rel=1e-3), \
        "the first step (before any update) computes the same loss in fp16 as in fp32"
    assert run["losses"][0] != result["plain"]["losses"][0], "and it did compute in fp16"


def test_memory_benchmark_runs_against_comfyuis_trainer(comfyui, tmp_path):
    """scripts/bench_memory.py end to end on a small Flux (CPU here: times only; memory is measured on a GPU):
    TrainLoraNode and Train LoRA plain and replayed from emulated graphs (with STREAMING_CACHE_MATRIX=all also
    with offloading and with fp8 + bypass, whose training the scenario tests) each train in a process of their
    own, ratios are against TrainLoraNode from the same run. A ComfyUI whose trainer lacks the options to compare
    with is told so. The ATen ops of each step are counted (a GPU's kernel launches): Train LoRA's forward and
    backward passes dispatch fewer than TrainLoraNode's, and read the device from the host no more often; replayed from
    CUDA graphs (emulated on the CPU), a fifth of its eager passes' at most."""
    import json
    import os
    import subprocess

    from helpers.installs import SCRIPTS, subprocess_env

    comfyui = require_comfyui(comfyui)
    chosen = ["comfyui", "streaming", "streaming_graphs_emulated"]  # one process each
    if os.environ.get("STREAMING_CACHE_MATRIX", "").lower() == "all":  # their training is tested in the scenario
        chosen[2:2] = ["streaming_offloading", "streaming_fp8_bypass"]
    proc = subprocess.run([comfyui.python, os.path.join(SCRIPTS, "bench_memory.py"), "--comfyui", comfyui.path,
                           "--tiny", "--model", "flux", "--steps", "5", "--json", "--only", ",".join(chosen),
                           "--count-ops"],
                          capture_output=True, text=True, timeout=600, env=subprocess_env(TMPDIR=str(tmp_path)),
                          check=False)
    if "has no offloading, bypass mode or checkpoint depth" in proc.stderr:
        assert proc.returncode == 2 and comfyui.version.startswith("0.3."), proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(report["results"]) == chosen and report["forward_flops"] > 0
    for name, r in report["results"].items():
        assert r["ok"], (name, r["error"])
        assert r["step_seconds"] > 0 and r["step_seconds_vs_comfyui"] > 0, (name, r)
        assert r["ops"]["steps_counted"] >= 2 and r["ops"]["forward"] > 0 and r["ops"]["backward"] > 0, (name, r)
    ours, theirs = report["results"]["streaming"]["ops"], report["results"]["comfyui"]["ops"]
    assert ours["model_passes"] < theirs["model_passes"], (ours, theirs)
    assert ours["host_reads"]["forward"] <= theirs["host_reads"]["forward"], (ours, theirs)
    # a replayed step launches each recorded pass as one graph: what is left is the work around them (the batch
    # copied in, noise, loss), a tenth of the eager passes on this two-block model and less the deeper it is
    graphed = report["results"]["streaming_graphs_emulated"]
    assert graphed["cuda_graphs"]["replayed_steps"] == 5 and graphed["cuda_graphs"]["eager_calls"] == 0, graphed
    assert graphed["ops"]["graph_replays"] == 2 and ours["graph_replays"] == 0, (graphed["ops"], ours)
    assert graphed["ops"]["model_passes"] * 5 < ours["model_passes"], (graphed["ops"], ours)
