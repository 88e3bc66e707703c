"""Gradient checkpointing on a PyTorch that cannot read the saved-tensor hooks in force (before 2.8: no
``torch._C._autograd._top_saved_tensors_default_hooks``), stood in for by removing that function.

There a recomputed block that updates tensors in place after saving them (ComfyUI's Flux, LTXV, HunyuanVideo)
cannot save copies of them in its recomputation, and would learn from other values than its forward pass saw,
silently. Such blocks are found by a probing run and not recomputed; the others still are; the run says so once.
The toy blocks are those of ``test_checkpoint_share.py``."""

from __future__ import annotations

import logging

import pytest
import torch
from test_checkpoint_share import Block, InPlaceBlock, UpdatesWhatItSaved

from streaming_cache.fallbacks import Fallbacks
from streaming_cache.train import recompute

pytestmark = pytest.mark.oldest_torch

HAS_READER = recompute.has_hook_reader()  # PyTorch 2.8 and newer; CI also runs these tests on an older one


@pytest.fixture
def no_hook_reader(monkeypatch):
    monkeypatch.delattr(torch._C._autograd, recompute.HOOK_READER, raising=HAS_READER)
    assert not recompute.has_hook_reader()


def _train(block: type, mode: str, steps: int = 3, fallbacks: Fallbacks | None = None) -> dict:
    """``steps`` of SGD on four blocks (the weights stand in for a LoRA): ``truth`` runs their out-of-place twin
    without checkpointing; ``checkpointed`` recomputes every block, ``half`` every other one (the others keep
    copies of their inputs, as the trainer's ``checkpoint_share`` does)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[block(16, out_of_place=mode == "truth") for _ in range(4)])
    blocks = list(model)
    chosen = recompute.spread(blocks, {"checkpointed": 1.0, "half": 0.5}.get(mode, 0.0))
    replay = recompute.Replay([], fallbacks=fallbacks)
    for m in chosen:
        recompute.checkpoint_module(m, replay)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, requires_grad=True)  # as from a trained input layer: the blocks' inputs are tracked
    try:
        with recompute.inputs_kept([m for m in blocks if m not in chosen] if mode != "truth" else []):
            for _ in range(steps):
                optimizer.zero_grad()
                model(x * 1.0).square().mean().backward()
                optimizer.step()
    finally:
        for m in chosen:
            recompute.uncheckpoint_module(m)
    return {"weights": [p.detach().clone() for p in model.parameters()], "replay": replay,
            "runs": sum(getattr(m, "calls", 0) for m in blocks)}


def _farthest(a: dict, b: dict) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize("mode", ["checkpointed", "half"])
def test_without_the_probe_in_place_blocks_recomputed_here_learn_from_other_values(no_hook_reader, monkeypatch, mode):
    """What the probe guards against: recomputed with no watch over the checkpoint's hooks (the probe finding
    nothing), the blocks learn another LoRA than the one the forward pass computes, without an error."""
    monkeypatch.setattr(recompute, "_probe", lambda *args: (frozenset(), frozenset()))
    assert _farthest(_train(InPlaceBlock, "truth"), _train(InPlaceBlock, mode)) > 1e-3


@pytest.mark.parametrize("block,mode", [(InPlaceBlock, "checkpointed"), (InPlaceBlock, "half"),
                                        (UpdatesWhatItSaved, "checkpointed")])
def test_blocks_that_update_in_place_run_without_recomputation_and_learn_the_same_lora(no_hook_reader, block, mode):
    """Blocks updating their input (Flux) or an activation of their own after saving it keep their activations,
    with copies of what they update, and learn what they learn without checkpointing. (A block of the second kind
    that ``checkpoint_share`` leaves out fails loudly, with or without the hook reader: ``inputs_kept`` copies
    inputs only.)"""
    truth, got = _train(block, "truth"), _train(block, mode)
    assert _farthest(truth, got) <= 1e-6
    assert got["replay"].kept == [block.__name__] * {"checkpointed": 4, "half": 2}[mode]


class UpdatesLast(torch.nn.Module):
    """A block whose one in-place update comes after everything it saves (as Flux's single blocks: ``x += ...``
    last): a recomputation stops at the last save, before the update."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=False)
        self.a = torch.nn.Linear(width, width)
        self.out_of_place, self.calls = out_of_place, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        update = self.a(self.norm(x))
        if self.out_of_place:
            return x + update
        x += update
        return x


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_block_that_updates_only_after_its_last_save_is_still_recomputed(no_hook_reader, early_stop):
    """Recomputed with the checkpoint's early stop, whatever the caller set (without it the recomputation would go
    on to the update and overwrite what it saved)."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        truth, got = _train(UpdatesLast, "truth"), _train(UpdatesLast, "checkpointed")
    assert _farthest(truth, got) <= 1e-6
    assert got["replay"].kept == []
    assert got["runs"] == 3 * 4 + 4 + 3 * 4  # the steps' forward passes, the probes, the recomputations


class Counted(InPlaceBlock):
    """An in-place block that counts its runs."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__(width, out_of_place)
        self.calls = 0

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(img)


def _mixed_step(checkpointed: bool, steps: int = 2) -> dict:
    """``steps`` forward and backward passes through plain and in-place blocks, all checkpointed (else the in-place
    ones' out-of-place twins, not checkpointed); the runs of each kind in the forward and in the backward passes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(16), Counted(16, not checkpointed), Block(16), Counted(16, not checkpointed))
    replay = recompute.Replay([])
    for m in model if checkpointed else []:
        recompute.checkpoint_module(m, replay)
    runs = {"plain_forward": 0, "plain_backward": 0, "in_place_forward": 0, "in_place_backward": 0}
    try:
        for _ in range(steps):
            before = [m.calls for m in model]
            out = model(torch.randn(4, 16, requires_grad=True) * 1.0)
            middle = [m.calls for m in model]
            out.square().mean().backward()
            after = [m.calls for m in model]
            for i, m in enumerate(model):
                kind = "in_place" if isinstance(m, Counted) else "plain"
                runs[f"{kind}_forward"] += middle[i] - before[i]
                runs[f"{kind}_backward"] += after[i] - middle[i]
    finally:
        for m in model if checkpointed else []:
            recompute.uncheckpoint_module(m)
    return {"runs": runs, "grads": [p.grad.clone() for p in model.parameters()], "replay": replay}


def test_blocks_that_update_nothing_in_place_are_still_recomputed(no_hook_reader):
    plain, got = _mixed_step(False), _mixed_step(True)
    # each block is probed once (its first call), the in-place ones then never recomputed, the others as always
    assert got["runs"] == {"plain_forward": 6, "plain_backward": 4, "in_place_forward": 6, "in_place_backward": 0}
    assert got["replay"].kept == ["Counted", "Counted"]
    for a, b in zip(plain["grads"], got["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not HAS_READER, reason="compares with a PyTorch that has the hook reader (2.8 and newer)")
def test_with_the_hook_reader_every_block_is_recomputed_and_nothing_is_probed_or_said(caplog):
    with caplog.at_level(logging.WARNING, logger="streaming_cache"):
        got = _mixed_step(True)
        run = _train(InPlaceBlock, "checkpointed")
    assert got["runs"] == {"plain_forward": 4, "plain_backward": 4, "in_place_forward": 4, "in_place_backward": 4}
    assert got["replay"].kept == [] and run["replay"].kept == [] and run["replay"].notice is None
    assert recompute.IN_PLACE_RECOMPUTATION not in caplog.text
    assert _farthest(_train(InPlaceBlock, "truth"), run) <= 1e-6


def test_recomputed_plain_blocks_hold_nothing_between_the_passes_and_learn_the_same(no_hook_reader):
    """The probe keeps nothing: recomputing plain blocks on such a PyTorch holds what it holds with the reader."""
    from test_checkpoint_share import _step

    full, none = _step(1.0), _step(0.0)
    assert full["recomputed"] == 8 and full["held"] == 0 < none["held"]
    for a, b in zip(full["grads"] + [full["input_grad"]], none["grads"] + [none["input_grad"]]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_run_says_once_which_blocks_are_not_recomputed_and_why(no_hook_reader, caplog):
    with caplog.at_level(logging.WARNING, logger="streaming_cache"):
        run = _train(InPlaceBlock, "checkpointed")
    lines = [r.getMessage() for r in caplog.records if recompute.IN_PLACE_RECOMPUTATION in r.getMessage()]
    assert len(lines) == 1, lines
    assert recompute.HOOK_READER in lines[0] and "update PyTorch to 2.8 or newer" in lines[0]
    notice = run["replay"].notice
    assert notice is not None and notice.startswith("4 checkpointed block(s) (InPlaceBlock) update tensors in place")
    assert "PyTorch 2.8 and newer" in notice

    fallbacks = Fallbacks()
    _train(InPlaceBlock, "half", fallbacks=fallbacks)
    assert len(fallbacks.lines()) == 1 and fallbacks.reason(recompute.IN_PLACE_RECOMPUTATION) is not None


class Noisy(torch.nn.Module):
    """An in-place block that draws random numbers (dropout): the probe must not change what the real run draws."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.inner = InPlaceBlock(width, out_of_place)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.inner(img), 0.2, training=True)


def test_the_probe_leaves_the_random_state_and_the_blocks_inputs_as_they_were(no_hook_reader):
    truth, got = _train(Noisy, "truth"), _train(Noisy, "checkpointed")
    assert all(bool(w.isfinite().all()) for w in truth["weights"])
    assert _farthest(truth, got) <= 1e-6
    assert got["replay"].kept == ["Noisy"] * 4
