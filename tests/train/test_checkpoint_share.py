"""Recomputing a share of the blocks (``recompute.spread``, the ``checkpoint_share`` setting): which blocks, what
it trades (activations held from the forward pass to the backward pass against blocks run again), and that the
gradients do not change."""

from __future__ import annotations

import pytest
import torch

from streaming_cache.train import recompute

pytestmark = pytest.mark.oldest_torch


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


def _step(share: float, blocks: int = 8, width: int = 32) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(width) for _ in range(blocks)])
    x = torch.randn(16, width, requires_grad=True)
    chosen = recompute.spread(list(model), share)
    replay = recompute.Replay([])
    for m in chosen:
        recompute.checkpoint_module(m, replay)
    held = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal held
        held += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    held_after_forward = held
    forwards = sum(b.calls for b in model)
    out.square().mean().backward()
    for m in chosen:
        recompute.uncheckpoint_module(m)
    return {"chosen": [list(model).index(m) for m in chosen], "held": held_after_forward,
            "recomputed": sum(b.calls for b in model) - forwards, "grads": [p.grad.clone() for p in model.parameters()],
            "input_grad": x.grad.clone()}


def test_the_share_picks_that_many_blocks_spread_evenly_first_block_included():
    blocks = list(range(10))
    assert recompute.spread(blocks, 1.0) == blocks
    assert recompute.spread(blocks, 0.0) == []
    assert recompute.spread(blocks, 0.5) == [0, 2, 4, 6, 8]
    assert recompute.spread(blocks, 0.25) == [0, 3, 6]  # 2.5 blocks round to 3
    for n in (1, 3, 7, 19, 57):
        for share in (0.05, 0.3, 0.5, 0.75, 0.95):
            chosen = recompute.spread(list(range(n)), share)
            assert len(chosen) == int(share * n + 0.5) and chosen == sorted(set(chosen)), (n, share, chosen)
            if chosen:
                gaps = [b - a for a, b in zip([*chosen, chosen[0] + n], [*chosen[1:], chosen[0] + n])]
                assert max(gaps) - min(gaps) <= 1, (n, share, chosen)  # evenly spread


def test_a_share_out_of_range_is_refused():
    with pytest.raises(ValueError, match="between 0 and 1"):
        recompute.spread([1, 2], 1.5)


def test_recomputing_fewer_blocks_holds_more_activations_runs_fewer_blocks_again_and_learns_the_same():
    steps = {share: _step(share) for share in (1.0, 0.5, 0.0)}
    full, half, none = steps[1.0], steps[0.5], steps[0.0]
    assert full["recomputed"] == 8 and half["recomputed"] == 4 and none["recomputed"] == 0
    assert full["held"] < half["held"] < none["held"]
    # each block not recomputed holds the same activations between the passes: half of them, half the difference
    assert 2 * (half["held"] - full["held"]) == none["held"] - full["held"]
    for other in (half, none):
        for a, b in zip(full["grads"] + [full["input_grad"]], other["grads"] + [other["input_grad"]]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class InPlaceBlock(torch.nn.Module):
    """A residual block that updates its input in place twice, each time after a norm saved it, and hands the same
    tensor to the next block, as ComfyUI's Flux blocks do (``img += attn(norm1(img)); img += mlp(norm2(img))``)."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=False)
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.c = torch.nn.Linear(width, width)
        self.out_of_place = out_of_place

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        first = self.c(self.norm(img))
        if self.out_of_place:
            img = img + first
            return img + self.b(torch.nn.functional.gelu(self.a(self.norm(img))))
        img += first
        img += self.b(torch.nn.functional.gelu(self.a(self.norm(img))))
        return img


def _in_place_gradients(mode: str, input_grad: bool = True) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[InPlaceBlock(16, out_of_place=mode == "truth") for _ in range(4)])
    x = torch.randn(4, 16, requires_grad=input_grad)
    blocks = list(model)
    chosen = recompute.spread(blocks, {"checkpointed": 1.0, "half": 0.5}.get(mode, 0.0))
    replay = recompute.Replay([])
    for m in chosen:
        recompute.checkpoint_module(m, replay)
    with recompute.inputs_kept([m for m in blocks if m not in chosen] if mode != "truth" else []):
        model(x * 1.0).square().mean().backward()
    for m in chosen:
        recompute.uncheckpoint_module(m)
    return [p.grad for p in model.parameters()] + ([x.grad] if input_grad else [])


@pytest.mark.parametrize("mode", ["checkpointed", "half", "kept"])
def test_blocks_that_update_their_input_in_place_get_the_gradients_of_the_forward_pass(mode):
    """Recomputed, a block runs on its own copy of its input (the next block would otherwise change it before
    the recomputation) and its recomputation saves copies of what it saves from it (its own updates would
    otherwise overwrite them), both silently; not recomputed, it keeps a copy where autograd saves its input
    (autograd would otherwise refuse the backward pass)."""
    for a, b in zip(_in_place_gradients("truth"), _in_place_gradients(mode)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class UpdatesWhatItSaved(torch.nn.Module):
    """A block that updates one of its own activations in place after a norm saved it (not its input)."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=False)
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.out_of_place = out_of_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        update = self.b(self.norm(h))
        if self.out_of_place:
            return torch.tanh(h + update)
        h += update
        return torch.tanh(h)


@pytest.mark.parametrize("mode", ["checkpointed", "half", "kept"])
def test_a_first_block_whose_input_autograd_does_not_track_gets_the_gradients_of_the_forward_pass(mode):
    """The first block's input comes from a layer that trains nothing (target_layers leaves out Flux's img_in, so
    ``img`` needs no gradient) and the block updates it in place: recomputed, it must still run on a copy (the
    update made the caller's tensor part of the graph, and its recomputation would save other tensors than its
    forward pass did: "Recomputed values ... have different metadata"); kept, its saves from the input are copied."""
    for a, b in zip(_in_place_gradients("truth", input_grad=False), _in_place_gradients(mode, input_grad=False)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_recomputed_block_that_updates_what_it_saved_gets_the_gradients_of_the_forward_pass():
    grads = {}
    for mode in ("truth", "checkpointed"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[UpdatesWhatItSaved(16, out_of_place=mode == "truth") for _ in range(3)])
        x = torch.randn(4, 16, requires_grad=True)
        replay = recompute.Replay([])
        for m in model if mode == "checkpointed" else []:
            recompute.checkpoint_module(m, replay)
        model(x).square().mean().backward()
        grads[mode] = [p.grad for p in model.parameters()] + [x.grad]
    for a, b in zip(grads["truth"], grads["checkpointed"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_without_the_copies_such_blocks_fail_or_learn_from_other_activations():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[InPlaceBlock(16) for _ in range(2)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(4, 16, requires_grad=True) * 1.0).square().mean().backward()


def test_a_block_kept_without_recomputation_still_fails_loudly_on_other_in_place_updates():
    """Saved-tensor hooks turn off autograd's check of what was saved; the copies' hooks do it themselves."""

    class Bad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = (x * 2).exp()  # exp saves its output
            y += 1
            return y

    block = Bad()
    with recompute.inputs_kept([block]):
        out = block(torch.randn(3, requires_grad=True) * 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
