"""Every major model family trains in real ComfyUI: SDXL, Flux dev / schnell / Kontext, Chroma, Qwen-Image and
Qwen-Image-Edit, Wan 2.1 and 2.2, LTXV, HunyuanVideo and Lumina 2.

For each family (``helpers/families.py``) one ComfyUI child process per installation loads a tiny random-weight
model that ComfyUI's own detection recognises as that family, builds a cache holding exactly the keys and
shapes ComfyUI's encoders produce for it (and, for Kontext and Qwen-Image-Edit, an edit pair's reference
latent), trains two steps with Train LoRA through the executor and loads the saved file with
LoraLoaderModelOnly. Each test names the family and the ComfyUI version; what each family was detected as,
trained on and how long it took goes to ``test-artifacts/families-comfyui-<version>.json``.

Every family runs on both ends of the supported range. Detection pins some widths, so some "tiny" models
are not small: on v0.3.64 Flux's width is hard-coded (3072, about 400M parameters instead of 1.6M); Chroma
(its approximator and width), Qwen-Image (3072) and Lumina 2 (2304) are 380M to 520M parameters on every
version. Weights stay bf16 (``--bf16-unet``) and latents are a few patches, which keeps the whole module to
a few minutes per installation on two CPU cores.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from helpers.families import FAMILIES, Family
from helpers.installs import ROOT, ScenarioFailed, require_comfyui, run_scenario

_RUNS: dict[str, dict] = {}
"""The scenario's result per ComfyUI folder. pytest orders these tests family by family, alternating between
installations, which would set a module fixture up again at every switch; the run is kept here instead."""


@pytest.fixture
def families(comfyui, tmp_path_factory) -> dict:
    comfyui = require_comfyui(comfyui)
    if comfyui.path not in _RUNS:
        work = str(tmp_path_factory.mktemp("families"))
        names = ",".join(f.name for f in FAMILIES)
        try:
            _RUNS[comfyui.path] = run_scenario(comfyui, "comfy_scenario.py", work, "families", names, timeout=1200)
        except ScenarioFailed as exc:
            _RUNS[comfyui.path] = {"failed": str(exc)}
        report = os.path.join(os.environ.get("STREAMING_CACHE_ARTIFACTS", os.path.join(ROOT, "test-artifacts")),
                              f"families-comfyui-{comfyui.version}.json")
        os.makedirs(os.path.dirname(report), exist_ok=True)
        with open(report, "w", encoding="utf-8") as f:  # per family: detected class, shapes, keys, losses, seconds
            json.dump(_RUNS[comfyui.path], f, indent=1)
    result = _RUNS[comfyui.path]
    assert "failed" not in result, result.get("failed")
    return result


@pytest.fixture(params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request) -> Family:
    return request.param


def test_family_trains_and_its_lora_changes_the_output(families, family):
    """Detected as the family, two finite training steps, every LoRA key applied by LoraLoaderModelOnly, and
    the sampled output moves with the LoRA."""
    res = families["families"][family.name]
    assert res["ok"], f"{res['error']}\n{res.get('traceback', '')}"
    assert (res["model_type"], res["config_type"]) == (family.model_class, family.config_class)
    assert f"trained {family.name}_lora: steps 1-2 of 2," in res["train"], res["train"]
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"]), res["losses"]
    assert res["patched_weights"] == res["lora_targets"] > 0, "every LoRA key was recognised by ComfyUI"
    assert res["outputs_finite"]
    assert res["output_change"] > 1e-4


def test_model_is_trained_on_the_family_conditioning(families, family):
    """What reached the diffusion model while training: batches of the family's latent shape (5-D for video and
    Qwen-Image), the text conditioning of every sample, the keys the family's model reads (pooled vector,
    guidance, attention mask, frame rate, token count) and, for edit pairs, each sample's own reference latent
    in ``reference_latents``, as ReferenceLatent adds it."""
    res = families["families"][family.name]
    assert res["ok"], res["error"]
    inputs = res["model_inputs"][0]
    text = res["cond"][0][0]
    rows = 1 if family.split else family.batch
    assert inputs["x"] == [rows, *family.latent[1:]]
    assert inputs["c_crossattn"] == [rows, *text[1:]]
    missing = set(family.model_keys) - set(inputs["keys"])
    assert not missing, f"the model was not given {sorted(missing)}: {inputs}"
    if family.ref:
        assert inputs["ref_latents"] == [[rows, *family.ref[1:]]]
    if family.guidance_distilled:
        given = res["cond"][0][1].get("guidance")
        assert res["guidance_seen"] == [1.0 if given is None else given], \
            "the cached guidance is kept; where there is none, training uses 1.0"


def test_samples_that_differ_in_a_scalar_option_run_as_separate_calls(families):
    """SDXL's size conditioning is one value per conditioning in ComfyUI; two samples of different sizes in
    one batch are run as two model calls (one per size) instead of sharing the first one's size."""
    res = families["families"]["sdxl"]
    assert res["ok"], res["error"]
    assert res["model_calls"] == 4, "2 steps x 2 sizes"
    assert all(call["x"][0] == 1 for call in res["model_inputs"])


def test_models_that_update_in_place_train_without_checkpointing(families):
    """Without gradient checkpointing LTXV and HunyuanVideo (whose ComfyUI code updates activations in place)
    fail their first backward pass; they are then trained with checkpointing, after a warning. Wan trains
    without it as asked."""
    for name in ("ltxv", "hunyuan_video"):
        res = families["families"][name]
        assert res["ok"], res["error"]
        assert any("only trains with gradient checkpointing" in w for w in res["warnings"]), res["warnings"]
    assert families["families"]["wan21_t2v"]["ok"]
    assert not families["families"]["wan21_t2v"]["warnings"]
