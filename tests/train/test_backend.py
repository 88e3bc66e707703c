"""The trainer's seam to a model runtime: ``train_with`` drives any ``TrainBackend`` (here a toy regression) from a
spec, with the loader, per-micro-step noise, the validation loss and the hooks; a run stopped and resumed from
its checkpoint ends bit for bit where the uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch

import streaming_cache as sc
from helpers.toy_backend import Toy, pairs_cache
from streaming_cache.mix import DatasetMix, MixPart
from streaming_cache.train import checkpoint, optim
from streaming_cache.train.backend import Validation, train_with
from streaming_cache.train.loop import TrainHooks
from streaming_cache.train.spec import TrainSpec

pytestmark = pytest.mark.oldest_torch


@pytest.fixture
def pairs(tmp_path):
    """A cache of (x, y) pairs with y = 3x + 1."""
    return sc.open_cache(pairs_cache(str(tmp_path / "cache"))).dataset()


SETTINGS = {"steps": 12, "learning_rate": 0.1, "batch_size": 4, "grad_accumulation_steps": 2, "optimizer": "Adam",
            "seed": 5, "workers": 0}


def test_train_with_trains_a_backend_from_its_spec(pairs):
    toy = Toy()
    steps = []
    result = train_with(toy, pairs, TrainSpec.build(SETTINGS), hooks=TrainHooks(on_step=lambda s, _loss: steps.append(s)))
    assert toy.runs == 1 and steps == list(range(1, 13))
    assert toy.micros == list(range(24)), "one micro-step number per batch, in order (noise and dropout key)"
    assert result.losses[-1] < result.losses[0] / 5


def test_the_loader_prepares_each_batch_with_the_backends_prepare_before_its_loss(pairs):
    """A backend's ``prepare`` runs on each collated batch before the step's loss sees it (ComfyUI's marks there
    what the step would otherwise compare on the device)."""

    class Preparing(Toy):
        prepared = 0

        def prepare(self, batch):
            Preparing.prepared += 1
            return dict(batch, marked=True)

        def loss(self, batch, draws, *, t=None):
            assert batch.get("marked") or t is not None, "a training batch reached the loss unprepared"
            return super().loss(batch, draws, t=t)

    train_with(Preparing(), pairs, TrainSpec.build(SETTINGS))
    assert Preparing.prepared == 24, "each of the 24 batches (12 steps of 2 micro-steps) once"


def test_validation_scores_held_out_rows_at_fixed_noise_levels(pairs):
    toy = Toy()
    spec = TrainSpec.build({**SETTINGS, "validate_every": 4})
    result = train_with(toy, pairs[:20], spec, validation=pairs[20:], validation_rows=3)
    assert [s for s, _ in result.validation] == [4, 8, 12]
    assert result.validation[-1][1] < result.validation[0][1]
    values = Validation(toy, pairs[20:], rows=3)
    assert values() == values(), "fixed noise: the same weights score the same"
    assert None in toy.micros, "validation draws no per-sample random choices"


def test_a_stopped_run_resumed_from_its_checkpoint_ends_exactly_where_the_whole_run_ends(pairs, tmp_path):
    spec = TrainSpec.build(SETTINGS)
    whole = Toy()
    train_with(whole, pairs, spec)
    half = Toy()
    path = str(tmp_path / "state.pt")
    first = train_with(half, pairs, spec, hooks=TrainHooks(save=lambda s, final: checkpoint.save_checkpoint(path, s),
                                                            should_stop=lambda: len(half.micros) >= 10))
    assert first.stopped and first.step == 5
    rest = Toy()
    train_with(rest, pairs, spec, resume=checkpoint.load_checkpoint(path))
    for k in whole.params:
        assert torch.equal(whole.params[k], rest.params[k]), k


@pytest.fixture
def two_sets(tmp_path):
    """Two caches of (x, y) pairs: 24 with y = 3x + 1 and 8 with y = -x."""
    path = str(tmp_path / "reg")
    with sc.CacheWriter(path) as w:
        for i in range(8):
            x = torch.tensor([i / 8.0])
            w.put(f"r{i}", {"x": x, "y": -x})
    return sc.open_cache(pairs_cache(str(tmp_path / "style"))).dataset(), sc.open_cache(path).dataset()


@pytest.mark.parametrize("reads", ["each step", "at the end"])
def test_a_mix_trains_each_dataset_its_own_way_and_keeps_each_ones_loss(two_sets, tmp_path, monkeypatch, reads):
    """Also where the steps' losses are read together at the end (a fused optimizer step, as on a GPU): each
    dataset's loss still goes to its own step."""
    if reads == "at the end":
        monkeypatch.setattr(optim, "_fused", lambda groups: True)
    style, reg = two_sets
    mix = DatasetMix([MixPart(style, "style"), MixPart(reg, "reg", batch_size=2, weight=2.0, caption_dropout=0.5)])
    toy = Toy()
    seen: list = []
    toy_loss = toy.loss
    toy.loss = lambda batch, draws, t=None: (seen.append((batch["x"].shape[0], draws.caption_dropout)),
                                            toy_loss(batch, draws, t=t))[1]
    spec = TrainSpec.build({**SETTINGS, "grad_accumulation_steps": 1, "steps": 20})
    result = train_with(toy, mix, spec, hooks=TrainHooks(report_seconds=float("inf")) if reads == "at the end" else None)
    assert {(4, None), (2, 0.5)} <= set(seen), "each dataset's batch size and caption dropout reach the loss"
    assert set(result.dataset_losses) == {"style", "reg"}
    steps = sorted(s for v in result.dataset_losses.values() for s, _ in v)
    assert steps == list(range(1, 21)), "every step's loss is attributed to the dataset it trained on"
    by_step = {s: v for series in result.dataset_losses.values() for s, v in series}
    assert all(abs(by_step[s] - loss) < 1e-9 for s, loss in enumerate(result.losses, 1))


def test_a_dataset_s_loss_weight_scales_the_loss_trained_on_its_batches_and_nothing_else(two_sets):
    """reg at loss weight 3: every step that trained on a reg batch minimised 3 x its loss (the loss the optimizer
    took; each dataset's own series keeps the unweighted one), style's steps are unchanged, and a mix whose loss
    weights are all 1 has the fingerprint it had before loss weights came."""
    style, reg = two_sets
    spec = TrainSpec.build({**SETTINGS, "grad_accumulation_steps": 1, "steps": 20})
    result = train_with(Toy(), DatasetMix([MixPart(style, "style"), MixPart(reg, "reg", loss_weight=3.0)]), spec)
    by_step = {name: dict(series) for name, series in result.dataset_losses.items()}
    assert by_step["reg"] and by_step["style"]
    for s, loss in enumerate(result.losses, 1):
        expected = 3.0 * by_step["reg"][s] if s in by_step["reg"] else by_step["style"][s]
        assert loss == pytest.approx(expected, rel=1e-6), s
    plain = DatasetMix([MixPart(style, "style"), MixPart(reg, "reg")])
    assert plain.fingerprint() == DatasetMix([MixPart(style, "style"), MixPart(reg, "reg", loss_weight=1.0)]
                                             ).fingerprint() != DatasetMix([MixPart(style, "style"),
                                                                            MixPart(reg, "reg", loss_weight=0.5)]
                                                                           ).fingerprint()
    assert set(plain.parts[1].settings()) == {"name", "weight", "repeats", "batch_size", "caption_dropout"}, \
        "the settings a mix's fingerprint was made of before loss weights came"
    with pytest.raises(ValueError, match="reg: loss_weight must be a positive number"):
        MixPart(reg, "reg", loss_weight=0.0)


def test_a_preserved_dataset_s_batches_ask_the_backend_to_preserve_and_others_do_not(two_sets):
    """reg with preserve: every reg batch (and only those) reaches the loss with ``preserve=True``; the setting is
    part of the mix's fingerprint only when on; a backend that cannot run without its adapters is refused before
    training, naming the dataset."""
    style, reg = two_sets

    class Preserving(Toy):
        preserves_outputs = True

        def __init__(self):
            super().__init__()
            self.asked: list[tuple[bool, bool]] = []  # (a reg batch, preserve asked)

        def loss(self, batch, draws, *, t=None, preserve=False):
            self.asked.append((bool((batch["y"] <= 0).all()), preserve))
            return super().loss(batch, draws, t=t)

    backend = Preserving()
    mix = DatasetMix([MixPart(style, "style"), MixPart(reg, "reg", preserve=True)])
    train_with(backend, mix, TrainSpec.build({**SETTINGS, "steps": 10}))
    assert {reg_batch for reg_batch, _ in backend.asked} == {True, False}, "batches of both datasets"
    assert all(reg_batch == preserve for reg_batch, preserve in backend.asked)
    plain = DatasetMix([MixPart(style, "style"), MixPart(reg, "reg")])
    assert "preserve" not in plain.parts[1].settings() and mix.fingerprint() != plain.fingerprint()
    with pytest.raises(ValueError, match="reg: this model runtime \\(Toy\\) cannot preserve"):
        train_with(Toy(), mix, TrainSpec.build(SETTINGS))


def test_a_mix_resumes_exactly_with_its_datasets_losses(two_sets, tmp_path):
    style, reg = two_sets
    mix = DatasetMix([MixPart(style, "style"), MixPart(reg, "reg", weight=0.5)])
    spec = TrainSpec.build(SETTINGS)
    whole = Toy()
    expected = train_with(whole, mix, spec)
    half = Toy()
    path = str(tmp_path / "state.pt")
    train_with(half, mix, spec, hooks=TrainHooks(save=lambda s, final: checkpoint.save_checkpoint(path, s),
                                                 should_stop=lambda: len(half.micros) >= 10))
    rest = Toy()
    resumed = train_with(rest, mix, spec, resume=checkpoint.load_checkpoint(path))
    assert torch.equal(whole.params["w"], rest.params["w"]) and torch.equal(whole.params["b"], rest.params["b"])
    assert resumed.dataset_losses == expected.dataset_losses
