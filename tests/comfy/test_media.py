"""Video clips and edit pairs through EncodeDataset and TrainLoRA in real ComfyUI (tests/helpers/media_scenario.py),
on the newest ComfyUI named by ``COMFYUI_PATH`` (on each with ``STREAMING_CACHE_MATRIX=all``); a failure in CI,
where both supported versions are installed."""

from __future__ import annotations

import math
import re

import pytest

from helpers.installs import require_comfyui, scenario_once

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "media_scenario.py", tmp_path_factory)


def _final_loss(text: str) -> float:
    m = re.search(r"final loss ([^\s,]+)", text)
    assert m, text
    return float(m.group(1))


def test_video_clips_encode_to_5d_latents_and_train(result):
    video = result["video"]
    assert video["ok"], video["error"]
    assert video["encode"].startswith("encoded 6, reused 0, failed 0 (3 samples"), video["encode"]
    # Wan VAE: 8x spatial, 4x temporal; 5 frames -> 2 latent frames; a still image -> 1; the 96x64 clip's bucket
    # at resolution 64 is 128x64
    assert video["latent_shapes"] == [[1, 16, 1, 8, 8], [1, 16, 2, 8, 8], [1, 16, 2, 8, 16]]
    assert math.isfinite(_final_loss(video["train"]))


def test_frame_settings_are_part_of_the_cache_key(result):
    reframed = result["video"]["reframed"]
    assert reframed["encode"].startswith("encoded 2, reused 4"), "only the two clips are encoded again"
    assert reframed["latent_shapes"] == [[1, 16, 1, 8, 8], [1, 16, 3, 8, 8], [1, 16, 3, 8, 16]]


def test_edit_pairs_encode_reference_and_mask_in_the_target_bucket(result):
    edit = result["edit"]
    assert edit["ok"], edit["error"]
    assert edit["columns"] == ["cond", "latent", "mask", "ref"]
    for target, ref, mask in edit["pairs"]:
        assert ref == target, "the reference is cropped to its target's bucket"
        assert mask == [1, 1, *target[-2:]], "the mask is stored at latent resolution"
    assert edit["mask_values"][-1] == 1.0, "a sample without a mask file counts everywhere"
    assert 0.3 < edit["mask_values"][0] < 0.7, "a random grey mask averages near one half"
    assert math.isfinite(_final_loss(edit["train"]))


def test_flip_augmentation_adds_each_sample_mirrored_with_its_reference_and_mask(result):
    """flip_augmentation: twice the samples; sample a's mirrored copy holds the VAE's encoding of its image
    mirrored by hand (and of its reference), and its loss mask is a's own mask mirrored."""
    flipped = result["edit"]["flipped"]
    assert flipped["ok"], flipped["error"]
    assert flipped["rows"] == 4, "2 samples, each also mirrored"
    assert flipped["latent_gap"] < 1e-4 * flipped["latent_scale"], flipped
    assert flipped["ref_gap"] < 1e-4 * flipped["latent_scale"], flipped
    assert flipped["mask_pairs"] == 2, "a's mask and its mirror, each the other flipped"


def test_a_shortest_bucket_side_makes_every_bucket_at_least_that_wide_and_tall(result):
    """min_bucket_side 128 at resolution 64: both samples' buckets (64 x 64 and 128 x 64 without it) have sides of
    at least 128 px, latents of at least 16, their references and masks alike."""
    run = result["edit"]["sizes"]["edits_min_side"]
    assert run["ok"], run["error"]
    assert len(run["shapes"]) == 2 and all(min(target[-2:]) >= 16 for target, _, _ in run["shapes"]), run
    for target, ref, mask in run["shapes"]:
        assert ref == target and mask == [1, 1, *target[-2:]], run


def test_the_flux_example_runs_headless_with_tiny_files_and_its_presets(result):
    """example_workflows/Train a Flux LoRA from an image folder.json as it ships (Load Diffusion Model, DualCLIPLoader,
    Load VAE, both presets auto), its model files swapped for tiny ones: it encodes and trains, and Train LoRA's
    preset is Flux's, the settings the run gave (rank) kept."""
    run = result["flux_example"]
    if "skipped" in run:
        pytest.skip(run["skipped"])
    assert run["ok"], run["error"]
    assert run["presets"] == ["auto", "auto"]
    assert "preset auto: resolution 64 kept as set" in run["encode"], run["encode"]
    assert "preset auto (Flux.1): " in run["train"] and "kept as set: rank" in run["train"], run["train"]
    assert "timestep_sampling shifted, timestep_shift 3.1582" in run["train"], run["train"]


def test_more_resolutions_encode_each_sample_at_each_with_its_reference_and_mask_alike(result):
    """resolutions '128' beside Encode Dataset's 64: each sample twice, at 64 and at 128 (latents 8 and 16 wide for
    a square image), its reference and mask in the same bucket as its target at each size."""
    sizes = result["edit"]["sizes"]["edits_sizes"]
    assert sizes["ok"], sizes["error"]
    shapes = sizes["shapes"]
    assert len(shapes) == 4, shapes
    # a (64 x 64) is 64 x 64 at 64 and 128 x 128 at 128; b (96 x 64) is 128 x 64 at 64 (its aspect's nearest
    # bucket with sides of 64) and 128 x 128 at 128: latents of 8 x 8, 8 x 16 and twice 16 x 16
    assert sorted(target[-1] * target[-2] for target, _, _ in shapes) == [64, 128, 256, 256], shapes
    for target, ref, mask in shapes:
        assert ref == target and mask == [1, 1, *target[-2:]], shapes


@pytest.mark.parametrize("node", ["WanImageToVideo", "WanFirstLastFrameToVideo"])
def test_start_frames_cache_what_comfyuis_own_image_to_video_node_sets(result, node):
    run = result["start_frames"][node]
    assert run["ok"], run["error"]
    assert run["encode"].startswith("encoded 6, reused 0, failed 0 (2 samples"), run["encode"]
    assert run["columns"] == ["cond", "latent", "start"]
    clips = run["clips"]
    assert sorted(name for c in clips for name in c["same_as_node"]) == ["slide.mp4", "walk.mp4"], \
        "each clip's values are the node's for its own first (and fifth, last kept) frame"
    for c in clips:
        assert c["keys"] == ["clip_vision_output", "concat_latent_image", "concat_mask"]
        assert c["concat_latent_image"] == c["latent"] == [1, 16, 2, 8, 8], "5 frames -> 2 latent frames"
        if node == "WanImageToVideo":
            assert c["clip_vision"] == ["image_embeds", "last_hidden_state", "penultimate_hidden_states"]
            assert c["mask_by_frame"] == [[0.0, 1.0]], "the first latent frame is given, the rest generated"
        else:
            assert c["clip_vision"] == ["penultimate_hidden_states"], "the node joins both frames' states"
            assert c["mask_by_frame"] == [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]], \
                "the first frame and the last are given (the node's mask has 4 slots per latent frame)"


def test_start_frames_reach_an_image_to_video_model_in_training(result):
    """The cached start frames of WanImageToVideo train a tiny Wan 2.1 I2V model: every call gets the concat
    latent and mask (c_concat) and the CLIP vision states (clip_fea), for a batch of both clips."""
    run = result["start_frames"]["train"]
    assert run["ok"], run["error"]
    assert run["model_calls"], "the model was called while training"
    for call in run["model_calls"]:
        assert call["keys"] == ["c_concat", "c_crossattn", "clip_fea"], call
        assert call["x"] == [2, 16, 2, 8, 8], call
    assert all(math.isfinite(v) for v in run["losses"]) and len(run["losses"]) == 2


def test_audio_files_encode_as_comfyuis_own_load_audio_and_vae_encode_audio(result):
    """Stable Audio's VAE (random weights): each cached latent equals what LoadAudio + VAEEncodeAudio give for the
    file called directly (a 22.05 kHz and a 44.1 kHz stereo WAV, resampled to 44.1 kHz: 2048 samples per
    latent frame); a corrupt file fails alone, named, and so does one with a loss mask file beside it (masks weight
    pixels), without taking the other files with it."""
    run = result["audio"]["whole"]
    assert run["ok"], run["error"]
    assert run["encode"].startswith("encoded 5, reused 0, failed 2 (2 samples"), run["encode"]
    assert "failed: broken.mp3: " in run["encode"] and "cannot decode its audio" in run["encode"], run["encode"]
    assert "failed: voice.wav: voice_mask.png is a loss mask" in run["encode"], run["encode"]
    assert run["columns"] == ["cond", "latent"]
    assert run["files"] == {"tone.wav": [1, 64, 10], "hum.wav": [1, 64, 8]}, "each latent is the node's own"


def test_audio_duration_is_part_of_the_cache_key(result):
    run = result["audio"]["cut"]
    assert run["ok"], run["error"]
    assert run["encode"].startswith("encoded 2, reused 3, failed 2"), "only the two sounds are encoded again"
    assert run["files"] == {"tone.wav": [1, 64, 5], "hum.wav": [1, 64, 5]}, \
        "0.25 s of each, as TrimAudioDuration cuts it"


def test_clip_sound_tracks_encode_over_the_frames_time_span(result):
    """Encode Options' audio_vae: each clip's sound from its start over the frames its latent keeps, as LoadAudio +
    TrimAudioDuration + LTXVAudioVAEEncode (VAEEncodeAudio where ComfyUI has no LTX-2) give it; a clip without
    a sound track fails alone, named."""
    run = result["audio"]["sound_track"]
    assert run["ok"], run["error"]
    assert run["node"] == ("LTXVAudioVAEEncode" if run["audio_vae"] == "ltx2" else "VAEEncodeAudio")
    assert run["encode"].startswith("encoded 5, reused 0, failed 1 (1 samples"), run["encode"]
    assert "failed: mute.mp4: " in run["encode"] and "no sound track" in run["encode"], run["encode"]
    assert run["columns"] == ["audio", "cond", "latent"]
    [row] = run["rows"]
    assert row["same_as_node"], "the cached sound track is the node's for 0.625 s from 0.25 s on"
    assert row["latent"] == [1, 16, 2, 8, 8], "5 frames of the clip"
    assert row["audio"] == run["direct"]


def test_cached_sound_tracks_train_a_joint_audio_video_model(result):
    """The cached sound track trains a tiny LTX-2 model (random weights) through Train LoRA: every call gets the
    video and sound streams packed into one latent (LTX-2's 128x2x2x2 video latent + the 8x14x16 sound latent)."""
    track = result["audio"]["sound_track"]
    if track["audio_vae"] != "ltx2":
        pytest.skip("this ComfyUI has no LTX-2 (LTXAV) audio-video model or audio VAE")
    run = track["train"]
    assert run["ok"], run["error"]
    assert run["audio"] == [1, 8, 14, 16]
    assert run["model_calls"], "the model was called while training"
    for call in run["model_calls"]:
        assert "latent_shapes" in call["keys"], call
        assert call["x"] == [1, 1, 128 * 2 * 2 * 2 + 8 * 14 * 16], "both streams, packed as LTXVConcatAVLatent does"
    assert all(math.isfinite(v) for v in run["losses"]) and len(run["losses"]) == 2
