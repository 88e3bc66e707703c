"""Every model ComfyUI loads trains: the family sweep over ComfyUI's own ``supported_models`` list.

For each family (``helpers/family_recipes.py``: one recipe per ``supported_models`` entry, with variants such as
Flux Kontext) one ComfyUI child process per installation builds a tiny random-weight model from ComfyUI's own
classes, proven by ComfyUI's own detection to load as that family (``helpers/tiny_models.py``), builds a cache
holding the keys and shapes that family's encoders and conditioning nodes produce (edit references,
image-to-video start frames and masks, CLIP vision outputs, sound tracks), trains two steps with Train LoRA
through the executor, loads the saved LoRA with LoraLoaderModelOnly (every key must apply) and samples one
KSampler step with and without it (``helpers/family_sweep.py``).

The default run trains the CI families (``CI_FAMILIES``: at least one of each architecture kind, the smallest
that detection allows); ``STREAMING_CACHE_SWEEP=all`` trains every family and also runs ComfyUI's own
TrainLoraNode on each, for the families table (docs/families.md). Each installation's report goes to
``test-artifacts/families-comfyui-<version>.json``; ``scripts/families_table.py`` turns the reports into the
families table of docs/families.md. A family this ComfyUI does not list is skipped, saying so; one that detection only
recognises at a size above the sweep's limit is skipped with the parameter count and what detection fixes.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from helpers.family_recipes import BY_KEY, CI_FAMILIES, CI_MAX_PARAMS, OTHER, PRECISION_FAMILIES, RECIPES, Recipe
from helpers.family_sweep import LORA_DTYPES, TRAINING_DTYPES, precision_combinations
from helpers.installs import ROOT, comfyui_installs, require_comfyui, scenario_once

FULL = os.environ.get("STREAMING_CACHE_SWEEP", "").lower() == "all"
TRAINED = [r for r in RECIPES if not r.skip and (FULL or r.ci)]
_REPORTED: set[str] = set()


def report_path(version: str) -> str:
    folder = os.environ.get("STREAMING_CACHE_ARTIFACTS", os.path.join(ROOT, "test-artifacts"))
    return os.path.join(folder, f"families-comfyui-{version}.json")


def pytest_generate_tests(metafunc) -> None:
    """The precision matrix runs on the newest ComfyUI (the one users run; the oldest trains each family in its
    default precision in the same sweep), on every installation with STREAMING_CACHE_SWEEP=all."""
    if "precision_install" in metafunc.fixturenames:
        installs = list(comfyui_installs())
        chosen: list = (installs if FULL else installs[-1:]) or [None]
        metafunc.parametrize("precision_install", chosen, ids=[i.version if i else "no-comfyui" for i in chosen],
                             scope="module")


@pytest.fixture
def sweep(comfyui, tmp_path_factory) -> dict:
    return _sweep(require_comfyui(comfyui), tmp_path_factory)


@pytest.fixture
def precision_sweep(precision_install, tmp_path_factory) -> dict:
    return _sweep(require_comfyui(precision_install), tmp_path_factory)


def _sweep(comfyui, tmp_path_factory) -> dict:
    """The sweep's result for this installation, run once per session (``scenario_once``)."""
    newest = comfyui_installs()[-1].path == comfyui.path
    args = ["all", str(1_200_000_000), "compare", "all"] if FULL else \
        [",".join(CI_FAMILIES), str(CI_MAX_PARAMS), "-", ",".join(PRECISION_FAMILIES) if newest else "-"]
    result = scenario_once(comfyui, "family_sweep.py", tmp_path_factory, *args, timeout=6 * 3600 if FULL else 1200,
                           check=False)  # the report is written, failed or not
    if comfyui.path not in _REPORTED:
        _REPORTED.add(comfyui.path)
        os.makedirs(os.path.dirname(report_path(comfyui.version)), exist_ok=True)
        with open(report_path(comfyui.version), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    assert "failed" not in result, result.get("failed")
    return result


PRECISIONS = [r for r in TRAINED if FULL or r.key in PRECISION_FAMILIES]


@pytest.fixture(params=TRAINED, ids=[r.key for r in TRAINED])
def family(request) -> Recipe:
    return request.param


@pytest.fixture(params=PRECISIONS, ids=[r.key for r in PRECISIONS])
def precision_family(request) -> Recipe:
    return request.param


def trained_row(sweep: dict, family: Recipe) -> dict:
    """The family's row, or a visible skip when this ComfyUI does not list it or it is too large to run here."""
    if family.config not in sweep["supported_models"]:
        pytest.skip(f"ComfyUI {sweep['comfyui']} has no {family.config}")
    row = sweep["families"][family.key]
    if not row.get("trained") and row.get("reason", "").startswith("needs "):
        pytest.skip(f"{family.key} on ComfyUI {sweep['comfyui']}: {row['reason']}")
    return row


def test_every_supported_model_has_a_row(sweep):
    """Every entry of this ComfyUI's ``supported_models`` list has a recipe: trained, or a row saying why not."""
    covered = {row["config"] for row in sweep["families"].values()}
    missing = sorted(set(sweep["supported_models"]) - covered)
    assert not missing, f"supported_models entries with no recipe in helpers/family_recipes.py: {missing}"


def test_family_trains_and_its_lora_changes_the_output(sweep, family):
    """Detected as its own class, two finite training steps, every LoRA key applied by LoraLoaderModelOnly,
    no weight of the file left unused, and the sampled output moves with the LoRA."""
    res = trained_row(sweep, family)
    assert res["ok"], f"{res.get('error')}\n{res.get('traceback', '')}"
    assert res["detected"] == family.config and not res["problem"], res
    assert (res["model_type"], res["config_type"])[1] == family.config
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"]), res["losses"]
    assert res["patched_weights"] == res["lora_targets"] > 0, f"not applied by ComfyUI: {res['unapplied']}"
    assert not res["unloaded"], f"weights ComfyUI's loader missed or left over: {res['unloaded']}"
    assert res["outputs_finite"]
    assert res["output_change"] > 1e-4


def test_family_trains_in_every_precision_through_every_train_lora_id(precision_sweep, precision_family):
    """One step in bf16, fp16 with its scaler and fp32, the LoRA in bf16 and fp32, through Train LoRA and the first
    release's ``StreamingCacheTrainLoRA`` that saved workflows use (bf16 with the LoRA in fp32 through Train LoRA
    training only the attention and MLP layers, ``family_sweep.PARTIAL``; every combination through Train LoRA, each
    training precision once through the first release's node; a CI family of each kind; every family and every
    combination through both with STREAMING_CACHE_SWEEP=all): each runs and its loss is finite (fp16's first step may be
    skipped by its scaler, which starts high and halves on overflow, as PyTorch's does).
    MiniMax H3 in fp32 failed here ("Inference tensors cannot be saved for backward": its conditioning goes through
    a trained layer while ComfyUI's guider prepares it, and fp32 makes no copy that would hide an inference tensor)."""
    res = trained_row(precision_sweep, precision_family)
    assert res["ok"], res.get("error")
    runs = res["precisions"]
    assert sorted(runs) == sorted("/".join(c) for c in precision_combinations(every=FULL)), sorted(runs)
    failed = {k: v["error"][-600:] or f"loss {v['loss']}" for k, v in runs.items() if not (v["ok"] and v["finite"])}
    assert not failed, failed


def test_the_precisions_are_the_trainers():
    """The sweep's precisions are every value Train LoRA offers (``streaming_cache.train.spec``)."""
    from streaming_cache.train import spec

    assert (TRAINING_DTYPES, LORA_DTYPES) == (spec.TRAINING_DTYPES, spec.LORA_DTYPES)


def test_model_is_trained_on_the_family_conditioning(sweep, family):
    """What reached the diffusion model while training: batches of the family's latent shape, and the keys its
    conditioning must give the model (pooled vectors, guidance, masks, edit references, image-to-video concat
    channels and CLIP vision features, given-frame masks, the streams of a joint audio-video latent)."""
    res = trained_row(sweep, family)
    assert res["ok"], res.get("error")
    inputs = res["model_inputs"][0]
    missing = set(family.model_keys) - set(inputs["keys"])
    assert not missing, f"the model was not given {sorted(missing)}: {inputs}"
    if family.kind not in ("audio-video",):
        assert inputs["x"][1:] == res["latent"][1:] or family.batch == 1, inputs


def test_the_default_run_trains_every_kind(sweep):
    """Each architecture kind this ComfyUI has (UNet, image DiT, video DiT, audio, edit, image-to-video, joint
    audio-video, 3D) is trained by the default run at least once, unless its CI family is one that detection in
    this version only recognises above the CI size (Stable Audio in v0.3.64 hard-codes its full 1 B model); "other"
    (SeedVR2, PiD) has no member detection recognises below a billion parameters."""
    listed = [r for r in RECIPES if r.config in sweep["supported_models"] and not r.skip]
    rows = sweep["families"]
    kinds = {r.kind for r in listed} - {OTHER}
    trained = {r.kind for r in listed if r.ci and rows[r.key].get("trained")}
    too_large = {r.kind for r in listed if r.ci and rows[r.key].get("reason", "").startswith("needs ")}
    assert kinds <= trained | too_large, f"kinds no CI family trained: {sorted(kinds - trained - too_large)}"


def test_a_dataset_with_a_column_the_family_does_not_read_is_refused(sweep):
    """Train LoRA takes the columns the model's family reads (Wan image-to-video: the start frame's latent, the
    mask, the CLIP vision output) and refuses another before training, naming what it takes."""
    res = trained_row(sweep, BY_KEY["Wan 2.1 / 2.2 A14B I2V"])
    refused = res["other_column"]
    assert not refused["ok"]
    for name in ("pose_keypoints", "concat_latent_image", "concat_mask", "clip_vision_output", "WAN21"):
        assert name in refused["error"], refused["error"]


def test_samples_that_differ_in_a_scalar_option_run_as_separate_calls(sweep):
    """SDXL's size conditioning is one value per conditioning in ComfyUI; two samples of different sizes in
    one batch are run as two model calls (one per size) instead of sharing the first one's size."""
    res = sweep["families"]["KOALA_700M"]
    assert res["ok"], res.get("error")
    assert res["model_calls"] == 4, "2 steps x 2 sizes"
    assert all(call["x"][0] == 1 for call in res["model_inputs"])


def test_guidance_distilled_models_train_at_the_cached_or_default_guidance(sweep):
    """Flux dev trains at guidance 1.0 where the cache has none; Kontext keeps the 2.5 FluxGuidance cached."""
    for key, expected in (("Flux dev", [1.0]), ("Flux Kontext", [2.5])):
        res = trained_row(sweep, BY_KEY[key])
        assert res["ok"], res.get("error")
        assert res["guidance_seen"] == expected, (key, res["guidance_seen"])


def test_models_that_update_in_place_train_without_checkpointing(sweep):
    """Without gradient checkpointing LTXV and HunyuanVideo (whose ComfyUI code updates activations in place)
    fail their first backward pass; they are then trained without recomputation, their blocks keeping copies of
    their inputs, after a warning (no fallback to checkpointing). Wan trains without it as asked."""
    for name in ("LTXV", "HunyuanVideo"):
        res = sweep["families"][name]
        assert res["ok"], res.get("error")
        assert any("keep copies of their inputs" in w for w in res["warnings"]), res["warnings"]
        assert not any("training with every block checkpointed" in w for w in res["warnings"]), res["warnings"]
    wan = sweep["families"]["Wan 2.1 / 2.2 A14B T2V"]
    assert wan["ok"] and not wan["warnings"]


def test_the_layer_presets_find_each_family_s_attention_and_mlp_layers(sweep, family):
    """``target_layers`` attention and attention_mlp take layers by their names in ComfyUI's model classes
    (``streaming_cache.train.layers``): in every family's own weights some layers are attention and some MLP, so
    neither preset leaves a family with nothing, or with only one of the two, to train."""
    res = trained_row(sweep, family)
    kinds = res["layer_kinds"]
    assert kinds["attention"], f"no attention layer found among {kinds['other'][:12]}"
    assert kinds["mlp"], f"no MLP layer found among {kinds['other'][:12]}"
