"""The step memory estimate (``nodes/backend/memory_estimate.py``) in real ComfyUI: SDXL's and Flux dev's full-size
models on the ``meta`` device, one training step counted (tests/helpers/memory_estimate_scenario.py).

The peaks are held to a baseline (``tests/fixtures/memory_estimate.json``, made by the scenario on ComfyUI
0.33.0): a change that makes a step need more than :data:`GROWTH` more memory fails here, before a user's GPU
runs out of it. A change that makes it need less (or a new ComfyUI whose models do) is welcome: write the new
figures into the baseline. The estimates' structure is checked too: checkpointing lowers the peak, the weights are
the parameters in bf16, the attention was counted as the fused kernels keep it."""

from __future__ import annotations

import json
import os

import pytest

from helpers.installs import require_comfyui, scenario_once

pytestmark = pytest.mark.newest_comfyui

GROWTH = 0.05
"""The most a peak may grow over the baseline."""
GIB = 1024 ** 3
BASELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "memory_estimate.json")


def _baseline() -> dict:
    with open(BASELINE, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture
def result(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    version = _baseline()["comfyui"]
    if comfyui.version != version:
        pytest.skip(f"the baseline was made on ComfyUI {version}; {comfyui.version}'s models may differ in size")
    return scenario_once(comfyui, "memory_estimate_scenario.py", tmp_path_factory, timeout=900)


@pytest.mark.parametrize("family,setting", [("sdxl", "checkpointing"), ("sdxl", "no_checkpointing"),
                                            ("sdxl", "fp8_bypass"), ("flux-dev", "checkpointing")])
def test_the_peak_stays_within_the_baseline(result, family, setting):
    peak = result[family][setting]["peak_gib"]
    baseline = _baseline()["peak_gib"][family][setting]
    assert peak <= baseline * (1.0 + GROWTH), \
        f"{family} {setting}: {peak:.2f} GiB, {peak / baseline - 1:+.1%} over the baseline {baseline:.2f} GiB"


@pytest.mark.parametrize("family", ["sdxl", "flux-dev"])
def test_weights_are_the_parameters_in_bf16_and_adam_keeps_two_moments(result, family):
    run = result[family]["checkpointing"]
    assert run["parameters"] == _baseline()["parameters"][family]
    buffers = abs(run["weights_gib"] * GIB - 2 * run["parameters"])
    assert buffers < 2 ** 20, "beyond the parameters, only the sampling tables (a few KiB)"
    assert run["optimizer_gib"] == pytest.approx(2 * run["adapters_gib"])
    assert run["adapters_gib"] * GIB == pytest.approx(2 * run["trained_parameters"], rel=1e-3)


def test_checkpointing_lowers_the_peak_and_fp8_halves_the_weights(result):
    sdxl = result["sdxl"]
    assert sdxl["no_checkpointing"]["activations_gib"] > 3 * sdxl["checkpointing"]["activations_gib"]
    assert sdxl["no_checkpointing"]["peak_gib"] > sdxl["checkpointing"]["peak_gib"] + 5
    assert sdxl["fp8_bypass"]["weights_gib"] == pytest.approx(sdxl["checkpointing"]["weights_gib"] / 2, rel=1e-3)
    assert sdxl["fp8_bypass"]["peak_gib"] < sdxl["checkpointing"]["peak_gib"] - 2


def test_a_video_family_counts_its_weights_and_checkpointing_lowers_its_peak(result):
    """Wan 2.1 1.3B at 256 px and 9 frames (tests/helpers/memory_estimate_scenario.py: ``VIDEO``): its published
    configuration's parameters, in bf16 (its fp32 patch embedding and the sampling tables: a few hundred KiB
    more), and checkpointing keeps less than half of the activations."""
    wan = result["wan21-1.3b"]
    run = wan["checkpointing"]
    assert run["parameters"] == 1_418_996_800 and run["frames"] == 9
    assert 0 <= run["weights_gib"] * GIB - 2 * run["parameters"] < 2 ** 20
    assert wan["no_checkpointing"]["activations_gib"] > 2 * run["activations_gib"]
    assert wan["no_checkpointing"]["peak_gib"] > run["peak_gib"]
    assert run["attention"]["flash"] > 0 and run["attention"]["math"] == 0


def test_hunyuan_video_15_takes_its_image_to_video_channels_and_is_found_when_loaded(result):
    """HunyuanVideo 1.5 at 256 px and 9 frames (tests/helpers/memory_estimate_scenario.py: ``HUNYUAN15``): its
    published configuration's parameters in bf16; its inputs are the latent, the noise, the 33 channels of the
    image-to-video condition beside them (the model's 65 input channels less the latent's 32: the step would not
    run without them) and 256 tokens of Qwen2.5-VL features, all fp32; a model configured from the published
    weights is found as this family; a dataset row's caption gives the text length, the latent the condition's
    size."""
    hunyuan = result["hunyuan-video-1.5"]
    run = hunyuan["checkpointing"]
    assert run["parameters"] == 8_326_608_160 and run["frames"] == 9
    assert 0 <= run["weights_gib"] * GIB - 2 * run["parameters"] < 2 ** 20
    frame = 3 * 16 * 16  # 9 frames: 3 latent frames; 256 px: 16 x 16 (16 times fewer)
    inputs = 4 * ((32 + 32 + 33) * frame + 1 + 256 * 3584)  # latent, noise, concat, sigma, text
    assert run["inputs_gib"] * GIB == pytest.approx(inputs, abs=1)
    assert run["attention"]["flash"] > 0 and run["attention"]["math"] == 0
    assert hunyuan["detected"] == "hunyuan-video-1.5"
    assert hunyuan["row_conditioning"] == {"c_crossattn": [1, 17, 3584], "c_concat": [1, 33, 3, 16, 16]}


SCORES_GIB = {"sdxl": 10 * 4096 ** 2 * 2 / GIB, "flux-dev": 24 * 4352 ** 2 * 2 / GIB}
"""One bf16 score matrix of each model's largest attention at 1024 px: SDXL's first transformer level (10 heads,
64 x 64 tokens), Flux dev's blocks (24 heads, 4096 image and 256 text tokens)."""


@pytest.mark.parametrize("family", ["sdxl", "flux-dev"])
def test_attention_is_counted_as_the_fused_kernels_keep_it(result, family):
    fused, math = result[family]["checkpointing"], result[family]["math_attention"]
    calls = fused["attention"]
    assert calls["flash"] > 0 and calls["math"] == 0 and calls["efficient"] == 0, calls
    assert math["attention"] == {}
    assert math["activations_gib"] - fused["activations_gib"] >= SCORES_GIB[family], \
        "the math path keeps at least one score matrix more (the recomputed block's) than the fused kernels"


@pytest.mark.parametrize("gib, chosen", [(80, "no checkpointing"), (24, "no checkpointing"), (12, "checkpointing"),
                                         (8, "checkpointing"), (6, "checkpointing, offloading")])
def test_the_plan_takes_the_fastest_settings_whose_estimate_fits(result, gib, chosen):
    """SDXL at 1024 px (estimated 15.6 GiB without checkpointing, 6.6 with, 1.8 beside its streamed weights; half
    of the blocks recomputed lies between, 11.1 GiB): the first candidate that fits with the margin."""
    plan = result["plans"][f"auto_{gib}"]
    assert plan["label"] == chosen and plan["fits"]
    peak = {"no checkpointing": 15.6, "checkpointing": 6.6, "checkpointing, offloading": 1.8}[chosen]
    assert plan["summary"].startswith(f"memory plan auto: estimated peak {peak} GiB")
    assert f"of {gib}.0 GiB free: checkpointing {'off' if chosen == 'no checkpointing' else 'on'}" in plan["summary"]


def test_the_plan_says_when_nothing_fits_and_manual_warns(result):
    plans = result["plans"]
    assert not plans["auto_1"]["fits"] and plans["auto_1"]["label"] == "checkpointing, offloading"
    assert "It may run out of memory: lower the resolution or the batch size" in plans["auto_1"]["summary"]
    assert plans["manual_12"]["summary"].startswith("memory plan manual: estimated peak 15.6 GiB of 12.0 GiB free: "
                                                    "checkpointing off")
    assert "set plan to auto" in plans["manual_12"]["summary"]
    assert plans["cpu"]["summary"] == "memory plan auto: training on the CPU: settings as set"


def test_comfyuis_trainloranode_step_runs_its_rank_16_adapters_on_every_layer_it_patches(result):
    """ComfyUI's own TrainLoraNode estimated on full-size SDXL at 256 px (tests/helpers/memory_estimate_scenario.py:
    ``COMFYUI_STEP``): its adapters are a rank-16 LoRA on every matrix weight of the layers it patches (with each
    LoRA's alpha, which its adapters hold as a parameter) and a full-size difference on every 1-D weight and bias,
    counted by arithmetic on the layers' shapes; they are bf16, AdamW's two moments beside them. Its default
    checkpointing (depth 1) patches the whole UNet, so the recomputation in the backward pass holds what a step
    without checkpointing holds."""
    step = result["comfyui_step"]
    run = step["checkpointing"]
    assert run["settings"]["trainer"] == "TrainLoraNode" and run["settings"]["checkpointed"] == ["UNetModel"]
    assert run["trained_parameters"] == step["expected_trained_parameters"]
    assert run["adapters_gib"] * GIB == pytest.approx(2 * run["trained_parameters"], rel=1e-3)
    assert run["optimizer_gib"] == pytest.approx(2 * run["adapters_gib"])
    assert run["parameters"] == _baseline()["parameters"]["sdxl"]
    assert run["peak_gib"] == pytest.approx(step["no_checkpointing"]["peak_gib"], abs=2 ** 20 / GIB)


def test_comfyuis_trainloranode_peak_is_the_trackers_count(result):
    """The estimate's peak is the tracker's peak of the step counted with the node's functions plus AdamW's state;
    the step keeps a merged copy of every patched weight for its backward pass (its weight wrappers add the LoRA
    to the weight), so its activations exceed those of Train LoRA's step without checkpointing (same model, same
    inputs) by the frozen weights' size (measured: 99.94 % of it)."""
    step = result["comfyui_step"]
    run, counted = step["checkpointing"], step["counted"]
    assert run["peak_gib"] * GIB == counted["peak"] + 2 * counted["trained_bytes"]
    assert run["activations_gib"] * GIB == counted["transient"]
    pack = step["pack_no_checkpointing"]
    assert run["activations_gib"] - pack["activations_gib"] >= 0.99 * run["weights_gib"]


def test_train_loras_step_launches_fewer_kernels_than_trainloranodes(result):
    """The kernel launches of one forward and backward pass (``streaming_cache.train.launches``: the ATen operations
    dispatched, views, allocations and host reads left out), counted on full-size SDXL at 256 px without
    checkpointing for both trainers: Train LoRA's fused LoRA layers make each adapted layer one product beside the
    base weight's (``addmm``), where TrainLoraNode's weight wrappers cast, scale and add a merged weight at every
    call. Neither pass reads a value on the host."""
    step = result["comfyui_step"]
    pack, node = step["pack_no_checkpointing"]["launches"], step["no_checkpointing"]["launches"]
    assert pack["forward"] > 1000 and pack["backward"] > 1000, pack
    assert pack["total"] <= 0.75 * node["total"], (pack, node)
    assert pack["forward"] <= 0.75 * node["forward"], (pack, node)
    for counted in (pack, node):
        assert counted["host_reads"] == {"forward": 0, "backward": 0}, counted


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _estimated_families() -> tuple[dict[str, str], tuple[str, ...]]:
    """``memory_estimate.FAMILIES``' table names by key and ``COMFYUI_FAMILIES``, read from the module's source:
    importing it needs ComfyUI, and the table is checked without one."""
    import ast

    with open(os.path.join(ROOT, "nodes", "backend", "memory_estimate.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names, comfyui = {}, ()
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(
            node, ast.Assign) else None
        if getattr(target, "id", None) == "FAMILIES":
            names = {ast.literal_eval(k): ast.literal_eval(v.args[0]) for k, v in zip(node.value.keys,
                                                                                        node.value.values)}
        elif getattr(target, "id", None) == "COMFYUI_FAMILIES":
            comfyui = ast.literal_eval(node.value)
    return names, comfyui


def test_the_table_estimates_trainloranode_on_exactly_its_families_at_every_size():
    """docs/vram.md (``scripts/estimate_memory.py --merge``) has TrainLoraNode's default (checkpointing) at every
    size Train LoRA's rows have, for each family of ``COMFYUI_FAMILIES`` and for no other; a family of the table
    without them is named in the text that says why."""
    names, comfyui = _estimated_families()
    assert comfyui and set(comfyui) <= set(names)
    with open(os.path.join(ROOT, "docs", "vram.md"), encoding="utf-8") as f:
        text = f.read()
    rows = [tuple(c.strip() for c in line.strip("|").split("|")[:3]) for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| family |", "| --- |"))]
    node = {(family, size) for family, size, setting in rows if setting == "TrainLoraNode, checkpointing"}
    pack = {(family, size) for family, size, setting in rows if setting == "checkpointing"}
    assert {family for family, _ in node} == {names[k] for k in comfyui}
    assert node == {(family, size) for family, size in pack if family in {names[k] for k in comfyui}}
    paragraph = next(p for p in text.split("\n\n") if p.startswith("The *TrainLoraNode* rows"))
    for family in {family for family, _ in pack} - {names[k] for k in comfyui}:
        assert f"{family} has none" in " ".join(paragraph.split()), f"{family}: no TrainLoraNode rows, and no reason"
