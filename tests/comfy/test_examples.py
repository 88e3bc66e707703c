"""The example workflows of the families people train now (Qwen-Image, Qwen-Image-Edit, Wan 2.1 text- and
image-to-video, LTX-2 with its sound track) as they ship, run headless in real ComfyUI with tiny files in place of
their models (tests/helpers/examples_scenario.py says what is swapped and why), on the newest ComfyUI named by
``COMFYUI_PATH`` (on each with ``STREAMING_CACHE_MATRIX=all``)."""

from __future__ import annotations

import math
import re

import pytest

from helpers.installs import require_comfyui, scenario_once

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all

FAMILIES = {  # scenario -> the preset Train LoRA names, settings of the family it gives, the columns cached
    "qwen": ("Qwen-Image", "timestep_sampling shifted, timestep_shift 2.2", ["cond", "latent"]),
    "qwen_edit": ("Qwen-Image", "timestep_sampling shifted, timestep_shift 2.2", ["cond", "latent", "ref"]),
    "wan_t2v": ("Wan 2.1", "timestep_sampling shifted, timestep_shift 3", ["cond", "latent"]),
    "wan_i2v": ("Wan 2.1", "timestep_sampling shifted, timestep_shift 3", ["cond", "latent", "start"]),
    "ltx2": ("LTX-2", "target_layers attention_mlp", ["audio", "cond", "latent"]),  # v0.7.0 and newer
    # audio_vae disconnected: video alone (LTX-2's model then gets its sound stream empty)
    "ltx2_video_only": ("LTX-2", "target_layers attention_mlp", ["cond", "latent"]),
}


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "examples_scenario.py", tmp_path_factory)


@pytest.mark.parametrize("scenario", sorted(FAMILIES))
def test_the_example_encodes_and_trains_with_its_familys_preset(result, scenario):
    """The example as it ships, both presets auto: Encode Dataset keeps the resolution the run set (the stand-in
    CLIP cannot say the family), Train LoRA takes the family's preset (the run's rank kept) and trains two steps
    to a finite loss; the cache holds what the family trains on (edit references, start frames, LTX-2's sound
    track encoded by the checkpoint's audio VAE). A ComfyUI without the family skips, saying so."""
    run = result[scenario]
    if "skipped" in run:
        pytest.skip(run["skipped"])
    assert run["ok"], run["error"]
    family, settings, columns = FAMILIES[scenario]
    assert run["presets"] == ["auto", "auto"]
    assert "preset auto: resolution 64 kept as set" in run["encode"], run["encode"]
    assert f"preset auto ({family}): " in run["train"] and "kept as set: rank" in run["train"], run["train"]
    assert settings in run["train"] and "loss_weighting native" in run["train"], run["train"]
    assert run["columns"] == columns
    m = re.search(r"steps 1-2 of 2, final loss ([^\s,]+)", run["train"])
    assert m and math.isfinite(float(m.group(1))), run["train"]
