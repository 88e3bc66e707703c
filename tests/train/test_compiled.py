"""Blocks compiled for training: the same gradients as eager through gradient checkpointing, nothing left behind."""

from __future__ import annotations

import pytest
import torch

from streaming_cache.fallbacks import COMPILED_BLOCKS, Fallbacks
from streaming_cache.train import compiled
from streaming_cache.train.recompute import Replay, checkpoint_module, uncheckpoint_module

pytestmark = pytest.mark.oldest_torch


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(x))) * scale


def _grads(model: torch.nn.Sequential, compile_mode: str) -> tuple[list[torch.Tensor], int]:
    replay = Replay([])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with compiled.compiled_blocks(list(model), compile_mode, backend="aot_eager") as count:
        for m in model:
            checkpoint_module(m, replay)
        try:
            model.zero_grad()
            loss = model(x).square().mean() + model[0](x, scale=0.5).sum()
            loss.backward()
        finally:
            for m in model:
                uncheckpoint_module(m)
    return [p.grad.clone() for p in model.parameters()], count


def test_compiled_blocks_give_eager_gradients_through_checkpointing_and_are_removed_after():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block())
    eager, none = _grads(model, "off")
    compiled_grads, count = _grads(model, "blocks")
    assert (none, count) == (0, 3)
    for e, c in zip(eager, compiled_grads):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    assert all("forward" not in m.__dict__ for m in model)


def test_a_block_whose_forward_something_else_replaced_is_left_alone():
    block = Block()
    block.forward = lambda x: x  # type: ignore[method-assign]
    with compiled.compiled_blocks([block], "blocks", backend="aot_eager") as count:
        assert count == 0
    assert "forward" in block.__dict__


@pytest.mark.parametrize(("value", "mode"), [("", "off"), ("0", "off"), ("1", "blocks"), ("blocks", "blocks"),
                                              ("On", "blocks")])
def test_the_environment_variable_chooses_the_mode(monkeypatch, value, mode):
    monkeypatch.setenv("STREAMING_CACHE_COMPILE", value or "off")
    assert compiled.compile_mode() == mode


def test_an_unknown_mode_says_which_exist(monkeypatch):
    monkeypatch.setenv("STREAMING_CACHE_COMPILE", "graphs")
    with pytest.raises(ValueError, match="use blocks"):
        compiled.compile_mode()


def test_unchecking_a_block_leaves_its_class_forward_and_keeps_a_replaced_one():
    """A checkpointed block gets its class's forward back, not an instance attribute that the fused layers and
    compilation would take for someone else's replacement (they skip such modules: a second training in the
    same process would run slower)."""
    plain, replaced = Block(), Block()
    other = replaced.forward = lambda x: x  # type: ignore[method-assign]
    for m in (plain, replaced):
        checkpoint_module(m, Replay([]))
        uncheckpoint_module(m)
    assert "forward" not in plain.__dict__ and not hasattr(plain, "org_forward")
    assert replaced.__dict__["forward"] is other


def _failing_backend(gm, example_inputs):
    raise RuntimeError("the compiler is missing on this machine")


def test_a_block_that_fails_to_compile_runs_its_plain_forward_and_so_do_the_others_and_it_is_said():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block())
    eager, _ = _grads(model, "off")
    fallbacks = Fallbacks()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    replay = Replay([])
    with compiled.compiled_blocks(list(model), "blocks", backend=_failing_backend, fallbacks=fallbacks) as count:
        for m in model:
            checkpoint_module(m, replay)
        try:
            model.zero_grad()
            (model(x).square().mean() + model[0](x, scale=0.5).sum()).backward()
        finally:
            for m in model:
                uncheckpoint_module(m)
    assert count == 3
    for e, p in zip(eager, model.parameters()):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)
    assert "the compiler is missing" in fallbacks.reason(COMPILED_BLOCKS)
    with compiled.compiled_blocks(list(model), "blocks", backend=_failing_backend, fallbacks=fallbacks) as count:
        assert count == 0, "a later pass of the run compiles nothing"
    with pytest.raises(RuntimeError) as raised:
        torch.compile(lambda t: t * 2 + 1, backend=_failing_backend)(x)
    assert compiled.is_compile_error(raised.value)
    assert not compiled.is_compile_error(RuntimeError("CUDA out of memory"))
