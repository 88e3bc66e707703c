"""The training spec: every setting named once, checked once; which settings make a run's identity; the loop's
configuration and the learning-rate curve it implies; the option groups chained by the option nodes."""

from __future__ import annotations

import dataclasses

import pytest

from streaming_cache.train import optim, spec
from streaming_cache.train.loop import TrainConfig


def test_build_takes_flat_settings_by_node_input_name_and_keeps_defaults():
    s = spec.TrainSpec.build({"steps": 10, "optimizer": "Adam", "loss_weighting": "min_snr", "offloading": True,
                              "sample_prompts": "a red square\n\n  a blue circle  \n", "caption_dropout": 0.1})
    assert s.steps == 10 and s.optimizer.optimizer == "Adam" and s.objective.loss_weighting == "min_snr"
    assert s.memory.offloading and s.data.caption_dropout == 0.1
    assert s.previews.sample_prompts == ("a red square", "a blue circle")
    assert s.rank == 16 and s.optimizer.lr_schedule == "constant", "absent settings keep their defaults"
    assert s.objective.snr_gamma == 5.0 and spec.TrainSpec().objective.snr_gamma == 0.0
    assert s.settings()["sample_prompts"] == ["a red square", "a blue circle"]
    assert set(s.settings()) == set(spec.setting_names())


def test_values_take_the_type_of_their_setting():
    """A prompt posted from a browser carries 1 for 1.0; a boolean may arrive as 0/1."""
    s = spec.TrainSpec.build({"learning_rate": 1, "max_grad_norm": 2, "masked_loss": 0, "steps": 5.0})
    assert isinstance(s.learning_rate, float) and isinstance(s.optimizer.max_grad_norm, float)
    assert s.objective.masked_loss is False and isinstance(s.steps, int)


@pytest.mark.parametrize("settings,message", [
    ({"optimizer": "Lion9000"}, "optimizer must be one of AdamW"),
    ({"lr_schedule": "wavy"}, "lr_schedule must be one of constant"),
    ({"timestep_sampling": "random"}, "timestep_sampling must be one of uniform"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"learning_rate": 0.0}, "learning_rate must be above 0"),
    ({"ema_decay": 1.0}, r"ema_decay must be in \[0, 1\)"),
    ({"caption_dropout": 1.5}, "caption_dropout must be between 0 and 1"),
    ({"validation_split": 0.9}, "validation_split must be between 0 and 0.5"),
    ({"training_dtype": "fp8"}, "training_dtype must be one of bf16, fp16, fp32"),
    ({"checkpoint_depth": 0}, "checkpoint_depth must be at least 1"),
    ({"checkpoint_share": 1.5}, "checkpoint_share must be between 0 and 1"),
    ({"lora_format": "peft"}, "lora_format must be one of comfyui, kohya, diffusers"),
    ({"weight_decay": -0.01}, "weight_decay must be at least 0"),
    ({"alpha": 0}, "alpha must be above 0"),
    ({"min_timestep": 600, "max_timestep": 400}, r"min_timestep \(600\) must be below max_timestep \(400\)"),
    ({"max_timestep": 1001}, "max_timestep must be at least 1 and at most 1000"),
    ({"lr_power": 0}, "lr_power must be above 0"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio must be at least 0 and at most 1"),
    ({"input_perturbation": -0.1}, "input_perturbation must be at least 0"),
    ({"target_layers": "mlp"}, "target_layers must be one of all, matrices, attention_mlp, attention"),
    ({"layer_filter": "re:[a-"}, "layer_filter: 're:\\[a-' is not a regular expression"),
    ({"layer_ranks": "attn"}, "layer_ranks: 'attn' is not 'pattern=rank'"),
    ({"layer_ranks": "attn=-1"}, "layer_ranks: 'attn=-1' is not 'pattern=rank'"),
    ({"optimizer_args": "lr=0.1"}, "optimizer_args: lr is set by learning_rate"),
    ({"dora": True, "algorithm": "LoKr"}, "dora decomposes LoRA layers; the LoKr algorithm has none"),
    ({"stepz": 3}, "unknown training settings: stepz"),
])
def test_bad_settings_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        spec.TrainSpec.build(settings)


def test_identity_covers_what_an_exact_resume_depends_on_and_nothing_else():
    base = spec.TrainSpec()
    ident = base.identity_settings()
    for harmless in ({"steps": 2000}, {"save_every": 100}, {"prefetch": 8}, {"workers": 0}, {"validate_every": 5},
                     {"sample_prompts": "x"}, {"sample_every": 3}, {"checkpoint_depth": 2}, {"offloading": True},
                     {"bypass_mode": True}, {"lora_name": "other"}, {"resume": False}, {"plot_scale": "log"},
                     {"lora_format": "kohya"}, {"lora_format": "diffusers"}, {"checkpoint_share": 0.5},
                     {"cuda_graphs": False}):
        assert spec.TrainSpec.build(harmless).identity_settings() == ident, harmless
    for change in ({"seed": 1}, {"rank": 8}, {"learning_rate": 2e-4}, {"optimizer": "Prodigy"}, {"ema_decay": 0.9},
                   {"batch_size": 2}, {"caption_dropout": 0.1}, {"validation_split": 0.1}, {"algorithm": "LoKr"},
                   {"training_dtype": "fp16"}, {"guidance": 3.5}, {"timestep_sampling": "sigmoid"},
                   {"weight_decay": 0.01}, {"alpha": 16.0}, {"min_timestep": 200}, {"max_timestep": 800},
                   {"lr_schedule": "polynomial"}, {"lr_power": 2.0}, {"min_lr_ratio": 0.1},
                   {"optimizer_args": "eps=1e-6"}, {"loss_weighting": "debiased"}, {"input_perturbation": 0.1},
                   {"target_layers": "attention"}, {"layer_filter": "attn1"}, {"layer_ranks": "attn=4"},
                   {"optimizer": "Lion"}, {"dora": True}):
        assert spec.TrainSpec.build(change).identity_settings() != ident, change


def test_settings_added_later_join_the_identity_only_away_from_their_defaults():
    """A run saved before weight decay, alpha and the timestep range could be set trained with 0, 1 and 0 to 1000:
    queued again with those values (the defaults a saved workflow gets) it continues, and with any other value a
    new run starts."""
    ident = spec.TrainSpec().identity_settings()
    added = {"weight_decay": 0.0, "alpha": 1, "min_timestep": 0, "max_timestep": 1000, "lr_power": 1,
             "min_lr_ratio": 0, "optimizer_args": "", "input_perturbation": 0, "target_layers": "all",
             "layer_filter": "", "layer_ranks": "", "dora": False}
    assert not set(added) & set(ident)
    assert spec.TrainSpec.build(added).identity_settings() == ident
    assert spec.TrainSpec.build({"max_timestep": 900}).objective.t_range == (0.0, 0.9)
    assert spec.TrainSpec.build({"weight_decay": 0.01}).identity_settings() == {**ident, "weight_decay": 0.01}
    assert spec.TrainSpec.build({"alpha": 8}).identity_settings() == {**ident, "alpha": 8.0}


def test_identities_are_the_ones_release_0_3_0_recorded_so_its_runs_resume():
    """Computed by release 0.3.0's node for its default settings on dataset "fp" and model layout "m": once with
    the values as a workflow file carries them (floats), once as a browser posts them (1 for 1.0)."""
    assert spec.TrainSpec().identities("fp", model="m", validation=None) == (
        "8d178d57d9bc86d5d4189739795171b2", "64701aaf721d61b7cff1e62710955930")
    assert len(spec.TrainSpec().identities("fp", model="m", validation="v")) == 2
    assert spec.TrainSpec().identities("fp", model="m", validation="v")[0] != "8d178d57d9bc86d5d4189739795171b2"


def test_loop_config_and_learning_rates_follow_the_spec():
    s = spec.TrainSpec.build({"steps": 100, "learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 10,
                              "grad_accumulation_steps": 4, "training_dtype": "fp16", "validate_every": 7,
                              "lr_cycles": 3, "ema_decay": 0.5, "lora_plus_ratio": 4, "max_grad_norm": 0.5,
                              "weight_decay": 0.02, "min_lr_ratio": 0.1, "optimizer_args": "eps=1e-6"})
    config = s.loop_config(validating=True)
    assert config == TrainConfig(steps=100, learning_rate=1e-3, optimizer="AdamW", schedule="cosine",
                                 warmup_steps=10, grad_accumulation=4, max_grad_norm=0.5, seed=0, save_every=0,
                                 lora_plus_ratio=4.0, cycles=3, ema_decay=0.5, validate_every=7, grad_scaling=True,
                                 weight_decay=0.02, min_lr_ratio=0.1, optimizer_args={"eps": 1e-6})
    assert s.loop_config(validating=False).validate_every == 0
    rates = s.learning_rates(100)
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert rates == [1e-3 * optim.lr_factor("cosine", i, 100, 10, 3, floor=0.1) for i in range(100)]
    assert 1e-4 < rates[-1] == pytest.approx(1e-3 * (0.1 + 0.9 * optim.lr_factor("cosine", 99, 100, 10, 3)))


def test_previews_are_due_every_n_steps_and_at_the_end():
    p = spec.PreviewOptions(sample_prompts=("x",), sample_every=4)
    assert [s for s in range(1, 11) if p.preview_due(s, 10)] == [4, 8, 10]
    assert [p.next_preview(s, 10) for s in (0, 3, 4, 9)] == [4, 4, 8, 10]
    off = spec.PreviewOptions()
    assert not any(off.preview_due(s, 10) for s in range(11)) and off.next_preview(3, 10) == 10


def test_option_groups_chain_once_each_and_build_a_spec():
    chain = spec.TrainOptions().with_part(spec.OptimizerOptions(optimizer="SGD"))
    chain = chain.with_part(spec.PreviewOptions(sample_prompts=("a",)), clip="CLIP", vae=None)
    assert chain.objects == {"clip": "CLIP"}, "objects not given (None) are not kept"
    with pytest.raises(ValueError, match="two OptimizerOptions nodes"):
        chain.with_part(spec.OptimizerOptions())
    s = spec.TrainSpec.from_options(chain, steps=3, rank=4)
    assert s.optimizer.optimizer == "SGD" and s.previews.sample_prompts == ("a",) and s.steps == 3
    assert s.memory == spec.MemoryOptions() and spec.TrainSpec.from_options(None).optimizer.optimizer == "AdamW"
    assert repr(chain) == "TrainOptions(optimizer, previews)"


def test_every_setting_is_named_once_across_the_groups():
    names = [f.name for f in dataclasses.fields(spec.TrainSpec) if f.name not in
             {"optimizer", "objective", "previews", "memory", "data", "adapter"}]
    for part in spec.PARTS:
        names += spec.part_fields(part)
    assert len(names) == len(set(names)) == len(spec.setting_names())
