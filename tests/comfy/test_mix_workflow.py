"""Several datasets in one training through real ComfyUI: the example workflow "Train a LoRA with regularisation
images" (two Encode Dataset nodes, two Dataset Mix nodes, Train LoRA) trains, keeps each dataset's loss, and a
queue again continues the run while another weight trains a new one (``helpers/mix_scenario.py``)."""

from __future__ import annotations

import pytest

from helpers.installs import require_comfyui, run_scenario

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all


@pytest.fixture(scope="module")
def mixed(comfyui, tmp_path_factory):
    return run_scenario(require_comfyui(comfyui), "mix_scenario.py", str(tmp_path_factory.mktemp("mix")))


def test_the_regularisation_example_trains_on_both_datasets(mixed):
    first = mixed["first"]
    assert first["ok"], first["error"]
    assert "trained mixed: steps 1-6 of 6" in first["text"]
    assert "per dataset: style" in first["text"] and "regularization" in first["text"]
    assert any("style (" in t and "regularization (" in t and "weight 0.5" in t for t in first["mix_text"])
    assert set(first["dataset_losses"]) == {"style", "regularization"}
    assert sum(first["dataset_losses"].values()) == first["steps"] == 6, "every step belongs to one dataset"


def test_queued_again_it_continues_and_another_weight_is_another_run(mixed):
    assert mixed["again"]["ok"] and "already trained for 6 steps" in mixed["again"]["text"]
    other = mixed["other_weight"]
    assert other["ok"] and "new run" in other["text"] and "mixed_00002_" in other["text"]
    assert other["states"] == ["mixed.state.pt", "mixed_00002_.state.pt"]


def test_a_loss_weight_is_shown_on_the_mix_and_is_another_run(mixed):
    """The regularisation dataset at loss weight 0.5: Dataset Mix says so, and the training is a new run (the
    weight is part of the mix's fingerprint; at 1 it is not, so the runs above kept theirs)."""
    weighted = mixed["loss_weight"]
    assert weighted["ok"], weighted["error"]
    assert any("regularization (" in t and "loss weight 0.5" in t for t in weighted["mix_text"]), weighted
    assert "new run mixed_00003_" in weighted["text"], weighted["text"]
    assert set(weighted["dataset_losses"]) == {"style", "regularization"}


def test_a_preserved_dataset_trains_toward_the_base_models_own_prediction(mixed):
    """preserve_outputs on the regularisation dataset. Alone, it trains toward what the model predicts without the
    LoRA, which at the start (the LoRA's up matrices are zero) is what it predicts with it: the first step's loss
    is zero to rounding, where the same images with their latents as target lose far more. Beside the style
    images, once style batches have moved the LoRA, its loss is the LoRA's own effect on the output: above zero,
    so the target is not the trained model's prediction."""
    alone, mixed_run = mixed["preserved_alone"], mixed["preserved"]
    for run in (alone, mixed_run):
        assert run["ok"], run["error"]
        assert any("regularization (" in t and "preserving the base model's outputs" in t
                   for t in run["mix_text"]), run["mix_text"]
    plain_reg = [v for _, v in mixed["first"]["dataset_series"]["regularization"]]
    assert min(plain_reg) > 1e-3, "with its latents as target the regularisation loss is far from zero"
    assert abs(alone["losses"][0]) < 1e-6 * min(plain_reg), alone["losses"]
    series = mixed_run["dataset_series"]
    first_style = min(step for step, _ in series["style"])
    after = [v for step, v in series["regularization"] if step > first_style]
    assert after, "the seed puts regularisation batches after style ones"
    assert max(after) > 1e3 * abs(alone["losses"][0]) and max(after) > 1e-9, series
    assert max(v for _, v in series["regularization"]) < 1e-2 * min(plain_reg), \
        "the LoRA's effect after a few steps is far smaller than the distance to the latents"


def test_bypass_adapters_are_off_for_the_base_models_prediction(mixed):
    """The same mix in bypass mode (the adapters run as hooks beside each layer): after style batches, the
    regularisation loss is the LoRA's effect, above zero (with the hooks left on it would be zero)."""
    run = mixed["preserved_bypass"]
    if "skipped" in run:
        pytest.skip(run["skipped"])
    assert run["ok"], run["error"]
    series = run["dataset_series"]
    first_style = min(step for step, _ in series["style"])
    after = [v for step, v in series["regularization"] if step > first_style]
    assert after and max(after) > 1e-9, series
    plain_reg = [v for _, v in mixed["first"]["dataset_series"]["regularization"]]
    assert max(v for _, v in series["regularization"]) < 1e-2 * min(plain_reg), series
