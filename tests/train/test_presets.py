"""Train LoRA's preset auto (``streaming_cache.train.presets``): the family's values for the settings left at their
defaults, a value set by hand kept, sources for every value, and docs/presets.md written from the table."""

from __future__ import annotations

import os
import sys

import pytest

from streaming_cache.train import presets, spec
from streaming_cache.train.presets import PRESETS, RANK, preset_for, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_value_is_a_valid_setting_with_a_source_and_each_model_has_one_row():
    configs = [c for p in PRESETS for c in p.configs]
    assert len(configs) == len(set(configs)), "a ComfyUI model config in two rows"
    for p in PRESETS:
        values = {k: v.value for k, v in p.settings.items()}
        if values.get("alpha") == RANK:
            values["alpha"] = float(values["rank"])
        spec.TrainSpec.build(values)  # every value is one the settings take
        for name, value in p.settings.items():
            assert len(value.source) > 20 and any(repo in value.source for repo in (
                presets.AT, presets.KS, presets.MT, presets.OT, "SimpleTuner")), (p.name, name)
        if "timestep_shift" in p.settings:
            assert p.settings["timestep_sampling"].value == "shifted", "a shift is given with its sampling"


def test_auto_gives_the_family_s_values_to_the_settings_left_at_their_defaults():
    r = resolve(spec.TrainSpec(), "Flux")
    s = r.spec
    assert (s.learning_rate, s.rank, s.adapter.alpha) == (1e-4, 16, 16.0)
    assert (s.objective.timestep_sampling, s.objective.timestep_shift) == ("shifted", 3.1582)
    assert (s.objective.loss_weighting, s.adapter.target_layers) == ("native", "attention_mlp")
    assert r.summary("Flux") == ("preset auto (Flux.1): learning_rate 0.0001, rank 16, alpha 16, timestep_sampling "
                                 "shifted, timestep_shift 3.1582, loss_weighting native, target_layers attention_mlp")
    assert resolve(spec.TrainSpec(), "FluxSchnell").preset is preset_for("Flux")


def test_a_value_set_by_hand_is_kept_and_takes_its_partner_with_it():
    hand = spec.TrainSpec.build({"rank": 8, "timestep_sampling": "sigmoid", "learning_rate": 3e-4})
    r = resolve(hand, "SDXL")
    assert (r.spec.rank, r.spec.adapter.alpha, r.spec.learning_rate) == (8, 1.0, 3e-4), \
        "SDXL's alpha 16 belongs to its rank 32: with rank 8 set by hand the alpha stays"
    assert r.kept == {"learning_rate": 3e-4, "rank": 8, "alpha": 1.0}
    assert r.summary("SDXL").endswith("; kept as set: learning_rate, rank, alpha")
    flux = resolve(hand, "Flux").spec
    assert flux.adapter.alpha == 8.0, "alpha = rank follows a rank set by hand"
    assert (flux.objective.timestep_sampling, flux.objective.timestep_shift) == ("sigmoid", 3.0), \
        "the shift goes with its sampling, which was set by hand"


def test_the_learning_rate_is_given_with_the_adamw_family_only():
    for optimizer, rate in (("AdamW", 2e-4), ("AdamW8bit", 2e-4), ("Prodigy", 1e-4), ("Lion", 1e-4)):
        r = resolve(spec.TrainSpec.build({"optimizer": optimizer}), "HiDream")
        assert r.spec.learning_rate == rate, optimizer


def test_no_row_and_none_leave_the_spec_as_it_is():
    base = spec.TrainSpec()
    r = resolve(base, "GenmoMochi")
    assert r.spec is base and r.preset is None
    assert r.summary("GenmoMochi") == "preset auto: no preset for GenmoMochi models; the defaults train"
    presets.check_preset("none")
    with pytest.raises(ValueError, match="preset must be one of auto, none"):
        presets.check_preset("max")


def test_a_preset_is_part_of_the_run_so_its_values_make_the_identity():
    plain = spec.TrainSpec().identity_settings()
    assert resolve(spec.TrainSpec(), "Flux").spec.identity_settings() != plain
    assert resolve(spec.TrainSpec(), "Flux").spec.identity_settings() == \
        resolve(spec.TrainSpec(), "Flux").spec.identity_settings(), "the same model resolves alike every time"


def test_docs_presets_md_is_written_from_the_table():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import presets_doc
    finally:
        sys.path.pop(0)
    with open(presets_doc.DOC, encoding="utf-8") as f:
        text = f.read()
    assert text == presets_doc.render(text), "run python scripts/presets_doc.py"
    assert "| Flux.1 | Flux, FluxSchnell, FluxInpaint | 0.0001 | 16 | = rank | shifted | 3.1582 |" in text


def test_encode_dataset_s_auto_resolution_comes_from_the_clip_s_tokenizer():
    assert presets.resolution_note(512, 512, "SDXLTokenizer") == (
        1024, "preset auto: resolution 1024, SDXL's (known from its CLIP)")
    assert presets.resolution_note(512, 512, "QwenImageTokenizer")[0] == 1328
    assert presets.resolution_note(768, 512, "FluxTokenizer") == (
        768, "preset auto: resolution 768 kept as set (Flux.1 trains at 1024)")
    assert presets.resolution_note(512, 512, "WanT5Tokenizer") == (
        512, "preset auto: no native resolution known for this CLIP (WanT5Tokenizer); resolution 512"), \
        "UMT5 serves Wan models of several resolutions"
    assert presets.native_resolution("SD2Tokenizer") is None, "SD 2.x's base and 768-v models share it"
    assert presets.resolution_note(512, 512, "SD1Tokenizer")[0] == 512
