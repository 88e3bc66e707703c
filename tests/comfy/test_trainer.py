"""What a user of TrainLoRA meets in real ComfyUI (tests/helpers/trainer_scenario.py): re-queueing never fails and
never loses a LoRA, sample previews and the live loss plot reach the node's preview, validation, every loss and
optimizer option together, kohya metadata, and exact continuation after a cancel with all of them on."""

from __future__ import annotations

import json

import pytest

from helpers.installs import require_comfyui, run_scenario


@pytest.fixture(scope="module")
def result(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    work = str(tmp_path_factory.mktemp("trainer"))
    return run_scenario(comfyui, "trainer_scenario.py", work, timeout=1200)


def test_requeue_after_the_dataset_grew_trains_a_new_numbered_lora_and_keeps_the_first(result):
    assert result["first"]["ok"], result["first"]["error"]
    grown = result["grown"]
    assert grown["ok"], grown["error"]
    assert grown["train"].startswith("new run rq_00002_: the saved training of rq used another dataset"), grown
    assert result["first_kept"], "the first LoRA is byte for byte what the first run saved"


def test_the_example_s_preset_auto_gives_the_sd1_values_to_the_settings_left_at_their_defaults(result):
    """The example workflow's Train LoRA (preset auto, as a new node has it) on the SD1.x checkpoint: the settings
    the scenario left at their defaults take SD 1.x's preset, the ones it set (learning rate, rank) are kept, and
    the summary says both."""
    first = result["first"]["train"]
    assert ("preset auto (SD 1.x): loss_weighting native, target_layers attention_mlp; kept as set: learning_rate, "
            "rank, alpha") in first, first


def test_requeue_with_another_seed_is_a_new_run_and_raising_steps_continues_it(result):
    assert result["reseeded"]["train"].startswith("new run rq_00003_"), result["reseeded"]
    continued = result["continued"]
    assert continued["train"].startswith("resuming rq_00003_: same dataset and settings"), continued
    assert "step 3 of 3" in continued["train"]
    off = result["resume_off"]
    assert off["train"].startswith("new run rq_00004_: resume is off"), off
    assert result["rq_files"] == ["rq.safetensors", "rq_00002_.safetensors", "rq_00003_.safetensors",
                                  "rq_00004_.safetensors"]


def test_sample_previews_are_saved_shown_live_and_returned(result):
    pv = result["previews"]
    assert pv["ok"], pv["error"]
    # two prompts at steps 2 and 4
    assert pv["saved"] == ["pv_s000002_01.png", "pv_s000002_02.png", "pv_s000004_01.png", "pv_s000004_02.png"]
    assert pv["ui_images"] == [], "no image drawn on the node at the end: the loss is the browser's chart"
    assert [p["step"] for p in pv["sent"]] == [2, 4], "the live preview is the samples, sent when they are drawn"
    sizes = {tuple(p["size"]) for p in pv["sent"]}
    assert len(sizes) == 1 and all(w == 512 and h > 256 for w, h in sizes), "two labelled 256 px samples, no plot"


def test_only_the_last_step_saves_are_kept(result):
    """save_every 1 over 4 steps writes snapshots at steps 1 to 3 (step 4 is the LoRA itself); keep_step_saves 2
    leaves the last two."""
    assert result["previews"]["step_saves"] == ["pv_step2.safetensors", "pv_step3.safetensors"]


def test_validation_loss_is_scored_every_n_steps_and_shown(result):
    pv = result["previews"]
    assert [step for step, _ in pv["validation"]] == [2, 4]
    assert "validation loss" in pv["train"]


def test_all_options_together_train_and_continue_exactly_after_a_cancel(result):
    for key in ("all_whole", "all_rest"):
        assert result[key]["ok"], result[key]["error"]
    half = result["all_half"]
    assert "cancelled at step 2 of 4: all_split saved with the steps done" in half["train"], half
    assert result["all_rest"]["train"].startswith("resuming all_split"), result["all_rest"]
    assert "steps 3-4 of 4" in result["all_rest"]["train"]
    assert result["all_equal"], "cancel + queue again ends bit for bit where the uninterrupted run ends"
    # tag shuffling: "sks, red, square, bright" gets two shuffled variants with "sks" kept first
    assert "(8 samples" in result["grown"]["encode"], result["grown"]["encode"]
    assert "(10 samples" in result["all_whole"]["encode"], result["all_whole"]["encode"]
    assert result["ema_file"]


def test_lora_files_carry_kohya_metadata(result):
    meta = result["all_metadata"]
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "4"
    assert meta["ss_steps"] == "4" and meta["ss_max_train_steps"] == "4"
    assert meta["ss_lr_scheduler"] == "cosine_with_restarts" and meta["ss_min_snr_gamma"] == "5.0"
    assert meta["ss_noise_offset"] == "0.05" and meta["ss_caption_dropout_rate"] == "0.5"
    assert meta["ss_lr_scheduler_num_cycles"] == "2", "the node's lr_cycles reach the metadata"
    assert meta["ss_validate_every_n_steps"] == "1"
    assert meta["ss_base_model_version"] == "sd_v1", "kohya's name of the model family, not ComfyUI's class name"
    assert meta["ss_network_alpha"] == "2.0"
    assert meta["ss_optimizer"] == "torch.optim.adamw.AdamW(weight_decay=0.01,betas=(0.85, 0.99))"
    assert (meta["ss_min_timestep"], meta["ss_max_timestep"]) == ("450", "550")
    assert json.loads(meta["ss_network_args"]) == {"loraplus_lr_ratio": "4.0", "target_layers": "attention"}


def test_attention_only_trains_the_attention_projections_and_the_file_holds_nothing_else(result):
    """target_layers attention: the file has a LoRA for each attention projection of the checkpoint's UNet (read
    from the checkpoint itself: to_q, to_k, to_v, to_out of attn1 and attn2) and for no other layer, and no norm or
    bias offsets; the layers left out have no adapter, so they are not trained."""
    assert result["all_layers"] == result["attention_layers"] and len(result["all_layers"]) >= 8
    assert result["all_parts"] == [".alpha", ".lora_down.weight", ".lora_up.weight"]


def test_training_draws_its_noise_levels_in_the_timestep_range(result):
    """min_timestep 450 and max_timestep 550 with logit-normal levels: every level a step drew lies in [0.45, 0.55]
    (of the whole distribution, about 1 draw in 6 does: 4 steps of one sample all inside by chance, 1 in 1,600)."""
    count, lo, hi = result["all_levels"]
    assert count >= 4 and 0.45 <= lo and hi <= 0.55, result["all_levels"]


def test_losses_read_a_few_steps_at_a_time_train_and_show_what_reading_every_step_does(result):
    """With the fused AdamW step a GPU takes, the loop reads the losses only every ``REPORT_SECONDS`` (here: only
    where a preview, a save or the end needs them): previews still come at their steps, and the LoRA and every
    loss are those of a run that read each step."""
    reads = result["reads"]
    for name in ("every_step", "together"):
        run = reads[name]
        assert run["ok"], (name, run["error"])
        assert run["fused"] and all(run["fused"]), (name, run["fused"])
        assert run["preview_steps"] == [2, 4, 5], (name, run["preview_steps"])
        done = f"trained reads_{name}: steps 1-5 of 5, final loss {run['losses'][-1]:.4f}, "
        assert len(run["losses"]) == 5 and done in run["train"] and " s/step -> " in run["train"], (name, run["train"])
    assert reads["together"]["losses"] == reads["every_step"]["losses"]
    assert reads["same_lora"]
