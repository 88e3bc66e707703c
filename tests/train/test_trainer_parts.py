"""Caption shuffling and dropout, the optional optimizers, LoRA+, cosine restarts, the EMA and LoRA metadata."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from streaming_cache.train import captions, ema, metadata, optim, spec

pytestmark = pytest.mark.oldest_torch

# ---------------------------------------------------------------------------------------------- captions


def test_shuffle_tags_keeps_the_first_tokens_and_permutes_the_rest():
    caption = "sks dog, red collar, grass,  sunny day ,, photo"
    tags = ["sks dog", "red collar", "grass", "sunny day", "photo"]
    for seed in range(20):
        out = captions.shuffle_tags(caption, keep_tokens=1, generator_or_seed=seed)
        parts = out.split(", ")
        assert parts[0] == "sks dog" and sorted(parts) == sorted(tags)
    assert captions.shuffle_tags(caption, keep_tokens=1, generator_or_seed=3) == \
        captions.shuffle_tags(caption, keep_tokens=1, generator_or_seed=3)
    orders = {captions.shuffle_tags(caption, keep_tokens=0, generator_or_seed=s) for s in range(30)}
    assert len(orders) > 10
    assert captions.shuffle_tags(caption, keep_tokens=9, generator_or_seed=1) == ", ".join(tags)
    by_torch = captions.shuffle_tags(caption, keep_tokens=2, generator_or_seed=torch.Generator().manual_seed(0))
    assert by_torch.split(", ")[:2] == tags[:2]
    rng = random.Random(5)
    assert captions.shuffle_tags("a b c d", keep_tokens=1, generator_or_seed=rng, separator=" ").startswith("a ")
    with pytest.raises(ValueError):
        captions.shuffle_tags(caption, keep_tokens=-1, generator_or_seed=0)


def test_caption_variants_are_deterministic_and_distinct():
    caption = "1girl, solo, smile, outdoors, hat"
    variants = captions.caption_variants(caption, shuffles=4, keep_tokens=1, seed=0)
    assert variants[0] == caption and len(variants) == 5
    assert len({tuple(v.split(", ")) for v in variants}) == 5
    assert all(v.startswith("1girl, ") for v in variants)
    assert captions.caption_variants(caption, shuffles=4, keep_tokens=1, seed=0) == variants
    assert captions.caption_variants(caption, shuffles=4, keep_tokens=1, seed=1) != variants
    assert captions.caption_variants("a, b", shuffles=10, keep_tokens=0, seed=0) == ["a, b", "b, a"]
    assert captions.caption_variants("only one", shuffles=3, keep_tokens=0, seed=0) == ["only one"]
    assert captions.caption_variants("a,b", shuffles=5, keep_tokens=0, seed=0)[1:] == ["b, a"], \
        "a re-spaced copy of the caption is not a variant"
    assert captions.caption_variants(caption, shuffles=0, keep_tokens=0, seed=0) == [caption]


def test_dropout_is_a_function_of_seed_step_and_index():
    decisions = [captions.dropout(7, step, 0.3) for step in range(4000)]
    assert decisions == [captions.dropout(7, step, 0.3) for step in range(4000)]
    assert 0.27 < sum(decisions) / len(decisions) < 0.33
    assert decisions != [captions.dropout(8, step, 0.3) for step in range(4000)]
    assert [captions.dropout(7, 5, 0.5, i) for i in range(64)] != [captions.dropout(7, 5, 0.5)] * 64
    assert not any(captions.dropout(7, s, 0.0) for s in range(100))
    assert all(captions.dropout(7, s, 1.0) for s in range(100))
    state = torch.get_rng_state()
    captions.dropout(1, 2, 0.5)
    assert torch.equal(torch.get_rng_state(), state), "independent of torch's generators"


# ---------------------------------------------------------------------------------------------- optimizers


def named(**shapes):
    return {k.replace("__", "."): torch.zeros(s, requires_grad=True) for k, s in shapes.items()}


def test_is_lora_up_knows_comfyui_kohya_and_peft_names():
    ups = ["diffusion_model.input_blocks.1.1.proj_in.lora_up.weight", "lora_unet_x.lora_up.weight",
           "base_model.model.q.lora_B.weight", "transformer.x.lora_B.default.weight", "unet.to_q_lora.up.weight"]
    others = ["diffusion_model.a.lora_down.weight", "diffusion_model.a.lora_mid.weight", "diffusion_model.a.alpha",
              "diffusion_model.a.diff", "diffusion_model.a.diff_b", "diffusion_model.a.hada_w1_a",
              "diffusion_model.a.hada_w1_b", "diffusion_model.a.lokr_w1", "diffusion_model.a.lokr_w2_b",
              "diffusion_model.a.oft_blocks", "diffusion_model.up.weight", "lora_A.weight", "blocks.up_proj.weight"]
    assert all(optim.is_lora_up(k) for k in ups)
    assert not any(optim.is_lora_up(k) for k in others)


def test_lora_plus_puts_up_matrices_in_a_faster_group():
    params = named(m__lora_up__weight=(4, 2), m__lora_down__weight=(2, 4), m__alpha=(), m__diff_b=(4,))
    opt = optim.make_optimizer("AdamW", params, 1e-3, lora_plus_ratio=16)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 16e-3]
    assert opt.param_groups[1]["params"] == [params["m.lora_up.weight"]]
    assert len(opt.param_groups[0]["params"]) == 3
    assert len(optim.make_optimizer("AdamW", params, 1e-3).param_groups) == 1, "ratio 1: one group"
    loha = named(m__hada_w1_a=(4, 2), m__hada_w1_b=(2, 4), m__hada_w2_a=(4, 2), m__hada_w2_b=(2, 4))
    groups = optim.make_optimizer("AdamW", loha, 1e-3, lora_plus_ratio=16).param_groups
    assert len(groups) == 1 and groups[0]["lr"] == 1e-3, "no up matrices (LoHa): the ratio applies to none"
    with pytest.raises(ValueError, match="by name"):
        optim.make_optimizer("AdamW", list(params.values()), 1e-3, lora_plus_ratio=4)
    with pytest.raises(ValueError, match="positive"):
        optim.make_optimizer("AdamW", params, 1e-3, lora_plus_ratio=0)


def test_lora_plus_speeds_up_only_the_up_matrices():
    def first_step(ratio):
        torch.manual_seed(0)
        params = {"m.lora_up.weight": torch.randn(4, 2, requires_grad=True),
                  "m.lora_down.weight": torch.randn(2, 4, requires_grad=True)}
        before = {k: v.detach().clone() for k, v in params.items()}
        opt = optim.make_optimizer("SGD", params, 0.01, lora_plus_ratio=ratio)
        (params["m.lora_up.weight"] @ params["m.lora_down.weight"]).square().sum().backward()
        opt.step()
        return {k: v.detach() - before[k] for k, v in params.items()}

    plain, fast = first_step(1.0), first_step(8.0)
    assert torch.allclose(fast["m.lora_up.weight"], 8 * plain["m.lora_up.weight"])
    assert torch.equal(fast["m.lora_down.weight"], plain["m.lora_down.weight"])


def test_cosine_with_restarts():
    f = [optim.lr_factor("cosine_with_restarts", s, 100, 10, cycles=3) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[10] == pytest.approx(1.0)
    assert f[40] == pytest.approx(1.0) and f[70] == pytest.approx(1.0), "hard restarts every 30 steps"
    assert f[39] < 0.01 and f[25] == pytest.approx(0.5)
    assert optim.lr_factor("cosine_with_restarts", 100, 100, 10, cycles=3) == 0.0
    assert [optim.lr_factor("cosine_with_restarts", s, 50, 0) for s in range(50)] == \
        pytest.approx([optim.lr_factor("cosine", s, 50, 0) for s in range(50)]), "one cycle is plain cosine"
    with pytest.raises(ValueError, match="cycles"):
        optim.lr_factor("cosine_with_restarts", 1, 10, 0, cycles=0)


def test_the_polynomial_schedule_and_the_minimum_lr_ratio():
    """Polynomial decay as transformers' ``get_polynomial_decay_schedule_with_warmup`` computes it (lr_end =
    floor x lr), power 1 is linear; every decaying schedule ends at the floor, none goes below it, and the warm-up
    and a constant schedule are unchanged by it."""
    def transformers_polynomial(step, total, warmup, power, floor):  # its formula, written out
        if step < warmup:
            return (step + 1) / warmup
        remaining = 1 - (step - warmup) / (total - warmup)
        return (1 - floor) * remaining ** power + floor

    got = [optim.lr_factor("polynomial", s, 100, 10, power=2.0, floor=0.1) for s in range(101)]
    assert got == pytest.approx([transformers_polynomial(s, 100, 10, 2.0, 0.1) for s in range(101)])
    assert got[55] == pytest.approx(0.1 + 0.9 * 0.25), "half-way at power 2: a quarter of the span"
    assert [optim.lr_factor("polynomial", s, 50, 5) for s in range(50)] == \
        pytest.approx([optim.lr_factor("linear", s, 50, 5) for s in range(50)]), "power 1 is linear"
    for schedule in ("cosine", "linear", "polynomial", "cosine_with_restarts"):
        f = [optim.lr_factor(schedule, s, 60, 0, cycles=2, floor=0.25) for s in range(61)]
        assert f[0] == pytest.approx(1.0) and f[-1] == pytest.approx(0.25) and min(f) >= 0.25 - 1e-12, schedule
        plain = [optim.lr_factor(schedule, s, 60, 0, cycles=2) for s in range(61)]
        assert f == pytest.approx([0.25 + 0.75 * p for p in plain]), schedule
    assert optim.lr_factor("constant", 50, 100, 0, floor=0.5) == 1.0
    assert optim.lr_factor("cosine", 3, 100, 10, floor=0.5) == pytest.approx(0.4), "the warm-up starts at zero"
    with pytest.raises(ValueError, match="minimum-LR ratio"):
        optim.lr_factor("cosine", 1, 10, 0, floor=1.5)
    with pytest.raises(ValueError, match="power must be positive"):
        optim.lr_factor("polynomial", 1, 10, 0, power=0.0)


def test_optimizer_arguments_are_read_as_literals_and_reach_the_optimizer():
    args = optim.parse_optimizer_args("betas=0.8,0.9  eps=1e-6\namsgrad=True note=plain")
    assert args == {"betas": (0.8, 0.9), "eps": 1e-6, "amsgrad": True, "note": "plain"}
    assert optim.parse_optimizer_args("") == {} and optim.parse_optimizer_args("x=[1,2]") == {"x": (1, 2)}
    assert optim.parse_optimizer_args("x=__import__('os').getcwd()") == {"x": "__import__('os').getcwd()"}, \
        "a call is kept as text, never run"
    w = torch.ones(3, requires_grad=True)
    opt = optim.make_optimizer("AdamW", {"w": w}, 0.1, 0.01, arguments={"betas": (0.8, 0.9), "eps": 1e-6})
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["eps"] == 1e-6
    assert opt.param_groups[0]["weight_decay"] == 0.01
    for text, message in (("betas", "not name=value"), ("lr=1", "set by learning_rate"),
                          ("weight_decay=0.1", "set by weight_decay"), ("eps=1 eps=2", "given twice"),
                          ("x" * 5000 + "=1", "at most 4096")):
        with pytest.raises(ValueError, match=message):
            optim.parse_optimizer_args(text)
    with pytest.raises(ValueError, match=r"AdamW refused optimizer_args \{'momentum': 0.9\}.*momentum"):
        optim.make_optimizer("AdamW", {"w": w}, 0.1, arguments={"momentum": 0.9})
    with pytest.raises(ValueError, match="not name=value"):
        spec.TrainSpec.build({"optimizer_args": "betas"})
    assert spec.TrainSpec.build({"optimizer_args": " eps=1e-6\n"}).optimizer.optimizer_args == "eps=1e-6"


@pytest.mark.parametrize("name,package", [("Prodigy", "prodigyopt"), ("AdamWScheduleFree", "schedulefree"),
                                          ("Lion", "lion_pytorch"), ("CAME", "came_pytorch")])
def test_optional_optimizers_build_and_step(name, package):
    pytest.importorskip(package, reason=f"{package} is not installed (python -m pip install {package})")
    w = torch.ones(3, requires_grad=True)
    opt = optim.make_optimizer(name, {"w": w}, 1.0 if name == "Prodigy" else 0.1)
    if name in optim.SCHEDULE_FREE:
        opt.train()
    (w ** 2).sum().backward()
    opt.step()
    assert float(w.detach().sum()) < 3.0
    assert optim.missing_package(name) is None


@pytest.mark.parametrize("name,module,pip_name", [("Prodigy", "prodigyopt", "prodigyopt"),
                                                   ("Lion", "lion_pytorch", "lion-pytorch"),
                                                   ("CAME", "came_pytorch", "came-pytorch")])
def test_missing_package_names_the_pip_command(monkeypatch, name, module, pip_name):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(optim.OptimizerUnavailableError, match=rf"python -m pip install {pip_name}"):
        optim.make_optimizer(name, {"w": torch.zeros(2, requires_grad=True)}, 1.0)
    assert optim.missing_package(name) == pip_name
    assert optim.missing_package("AdamW") is None


def test_adamw8bit_is_refused_off_cuda_with_advice():
    with pytest.raises(optim.OptimizerUnavailableError, match="CUDA GPUs only.*choose AdamW"):
        optim.make_optimizer("AdamW8bit", {"w": torch.zeros(2, requires_grad=True)}, 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="AdamW8bit (bitsandbytes) needs a CUDA GPU")
def test_adamw8bit_on_cuda_with_lora_plus():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (python -m pip install bitsandbytes)")
    params = {"m.lora_up.weight": torch.zeros(64, 8, device="cuda", requires_grad=True),
              "m.lora_down.weight": torch.randn(8, 64, device="cuda", requires_grad=True)}
    opt = optim.make_optimizer("AdamW8bit", params, 1e-3, lora_plus_ratio=4)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 4e-3]
    (params["m.lora_up.weight"] @ params["m.lora_down.weight"]).sum().backward()
    opt.step()
    assert params["m.lora_up.weight"].abs().sum() > 0
    opt.load_state_dict(opt.state_dict())


def test_prodigy_refuses_lora_plus():
    pytest.importorskip("prodigyopt", reason="prodigyopt is not installed (python -m pip install prodigyopt)")
    params = named(m__lora_up__weight=(4, 2), m__lora_down__weight=(2, 4))
    with pytest.raises(ValueError, match="LoRA\\+ cannot be used"):
        optim.make_optimizer("Prodigy", params, 1.0, lora_plus_ratio=4)


# ---------------------------------------------------------------------------------------------- EMA


def test_ema_averages_with_warmup_and_round_trips():
    w = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    avg = ema.EMA({"w": w}, 0.9)
    with torch.no_grad():
        w.fill_(1.0)
    avg.update()  # decay min(0.9, 1/10) = 0.1
    assert torch.allclose(avg.shadow["w"], torch.full((3,), 0.9))
    avg.update()  # decay min(0.9, 2/11)
    expected = 0.9 * (2 / 11) + (1 - 2 / 11)
    assert torch.allclose(avg.shadow["w"], torch.full((3,), expected))
    assert avg.shadow["w"].dtype == torch.float32
    out = avg.averaged()
    assert out["w"].dtype == torch.bfloat16 and out["w"] is not w
    for _ in range(100):
        avg.update()
    assert avg.current_decay() == 0.9
    other = ema.EMA({"w": w}, 0.9)
    other.load_state_dict(avg.state_dict())
    assert torch.equal(other.shadow["w"], avg.shadow["w"]) and other.updates == avg.updates
    with pytest.raises(Exception, match="LoRA layout"):
        ema.EMA({"v": w}, 0.9).load_state_dict(avg.state_dict())
    with pytest.raises(ValueError):
        ema.EMA({"w": w}, 1.0)


# ---------------------------------------------------------------------------------------------- metadata


SPEC = spec.TrainSpec.build({
    "lora_name": "my_lora", "rank": 16, "algorithm": "LoRA", "learning_rate": 1e-4, "lr_schedule": "cosine_with_restarts",
    "lr_cycles": 3, "warmup_steps": 50, "steps": 1000, "seed": 42, "optimizer": "AdamW", "noise_offset": 0.05,
    "loss_weighting": "min_snr", "min_snr_gamma": 5.0, "caption_dropout": 0.1, "grad_accumulation_steps": 4,
    "max_grad_norm": 1.0, "batch_size": 2, "training_dtype": "bf16", "gradient_checkpointing": True,
    "loss_function": "MSE", "timestep_sampling": "shifted", "timestep_scale": 1.0, "timestep_shift": 3.1,
    "lora_plus_ratio": 16, "validate_every": 100, "ema_decay": 0.999, "workers": 2})
DATASET = {"resolution": 512, "caption_shuffles": 2, "keep_tokens": 1}


def test_lora_metadata_uses_kohya_keys_and_formats():
    meta = metadata.lora_metadata(SPEC, dataset_fingerprint="abc", steps_done=250, num_train_images=40,
                                  validating=True, model_config="SDXL", dataset_settings=DATASET,
                                  started_at=1700000000.5, finished_at=1700000100.25)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    expected = {
        "ss_network_module": "networks.lora", "ss_network_dim": "16", "ss_network_alpha": "1.0",
        "ss_learning_rate": "0.0001", "ss_unet_lr": "0.0001", "ss_lr_scheduler": "cosine_with_restarts",
        "ss_lr_scheduler_num_cycles": "3", "ss_lr_warmup_steps": "50", "ss_max_train_steps": "1000",
        "ss_steps": "250", "ss_seed": "42", "ss_optimizer": "torch.optim.adamw.AdamW", "ss_noise_offset": "0.05",
        "ss_min_snr_gamma": "5.0", "ss_caption_dropout_rate": "0.1", "ss_shuffle_caption": "True",
        "ss_keep_tokens": "1", "ss_gradient_accumulation_steps": "4", "ss_max_grad_norm": "1.0",
        "ss_batch_size_per_device": "2", "ss_total_batch_size": "8", "ss_mixed_precision": "bf16",
        "ss_gradient_checkpointing": "True", "ss_loss_type": "l2", "ss_resolution": "(512, 512)",
        "ss_num_train_images": "40", "ss_output_name": "my_lora", "ss_base_model_version": "sdxl_base_v1-0",
        "streaming_cache_base_model": "SDXL",
        "ss_training_started_at": "1700000000.5", "ss_training_finished_at": "1700000100.25",
        "ss_timestep_sampling": "shift", "ss_sigmoid_scale": "1.0", "ss_discrete_flow_shift": "3.1",
        "ss_validate_every_n_steps": "100", "streaming_cache_dataset": "abc", "streaming_cache_lora_format": "comfyui",
    }
    assert {k: meta.get(k) for k in expected} == expected
    assert json.loads(meta["ss_network_args"]) == {"loraplus_lr_ratio": "16.0"}
    assert json.loads(meta["streaming_cache_settings"]) == {**SPEC.settings(), **DATASET}


def test_lora_metadata_for_other_adapters_and_unset_options():
    plain = spec.TrainSpec.build({"algorithm": "LoKr", "optimizer": "Prodigy", "noise_offset": 0.0,
                                  "min_snr_gamma": 7.0, "loss_function": "Huber", "training_dtype": "fp32",
                                  "lora_format": "kohya"})
    meta = metadata.lora_metadata(plain, dataset_fingerprint="f", model_config="WAN21",
                                  extra={"streaming_cache_run": "r1"})
    assert meta["ss_network_module"] == "lycoris.kohya"
    assert json.loads(meta["ss_network_args"]) == {"algo": "lokr"}
    assert meta["ss_optimizer"] == "prodigyopt.prodigy.Prodigy"
    assert meta["ss_noise_offset"] == meta["ss_min_snr_gamma"] == "None", "min-SNR is off unless its weighting is on"
    assert meta["ss_loss_type"] == "huber" and meta["ss_mixed_precision"] == "no"
    assert meta["streaming_cache_run"] == "r1" and float(meta["ss_training_finished_at"]) > 0
    assert meta["streaming_cache_lora_format"] == "kohya"
    assert "ss_steps" not in meta and "ss_validate_every_n_steps" not in meta and "ss_resolution" not in meta
    assert "ss_lr_scheduler_num_cycles" not in meta, "cycles only mean something for cosine_with_restarts"
    assert "ss_base_model_version" not in meta and meta["streaming_cache_base_model"] == "WAN21"
    assert metadata.base_model_version("SD20", v_prediction=True) == "sd_v2_v"
    assert metadata.base_model_version("Flux") == "flux1" and metadata.base_model_version("WAN21") is None


def test_lora_metadata_names_alpha_weight_decay_and_the_timestep_range_as_sd_scripts_does():
    meta = metadata.lora_metadata(spec.TrainSpec.build({"rank": 16, "alpha": 8, "weight_decay": 0.01,
                                                        "min_timestep": 100}), dataset_fingerprint="f")
    assert meta["ss_network_alpha"] == "8.0" and meta["ss_network_dim"] == "16"
    assert (meta["ss_min_timestep"], meta["ss_max_timestep"]) == ("100", "1000")
    assert meta["ss_optimizer"] == "torch.optim.adamw.AdamW(weight_decay=0.01)"


def test_tag_dropout_leaves_tags_out_of_the_variants_only_after_the_kept_ones():
    caption = "sks, red, square, bright, shiny, small, outdoors, daylight"
    plain = captions.caption_variants(caption, shuffles=6, keep_tokens=1, seed=0)
    dropped = captions.caption_variants(caption, shuffles=6, keep_tokens=1, seed=0, tag_dropout=0.5)
    assert dropped[0] == caption, "the caption itself stays whole"
    assert captions.caption_variants(caption, shuffles=6, keep_tokens=1, seed=0, tag_dropout=0.0) == plain, \
        "without dropout the variants (and their cache keys) are the ones made before it came"
    tags = set(captions.split_tags(caption))
    sizes = [len(captions.split_tags(v)) for v in dropped[1:]]
    assert all(v.startswith("sks") and set(captions.split_tags(v)) <= tags for v in dropped[1:])
    assert min(sizes) < 8 and sum(sizes) < 8 * len(sizes), "some tags are left out"
    assert dropped == captions.caption_variants(caption, shuffles=6, keep_tokens=1, seed=0, tag_dropout=0.5), \
        "the same caption gives the same variants every time"
    rng = random.Random(0)
    left = [len(captions.split_tags(captions.drop_tags(caption, keep_tokens=1, probability=0.25, rng=rng)))
            for _ in range(2000)]
    assert abs((8 - sum(left) / len(left)) - 7 * 0.25) < 0.15, "each of the 7 droppable tags goes 1 time in 4"
    with pytest.raises(ValueError, match="tag dropout must be between 0 and 1"):
        captions.drop_tags(caption, keep_tokens=1, probability=1.5, rng=rng)
