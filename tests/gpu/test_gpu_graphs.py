"""CUDA graphs of a training step (``streaming_cache.train.graphs``), against the same steps run eagerly (skipped
without CUDA). A small model of checkpointed blocks whose adapters are held outside its parameters, as ComfyUI's
weight wrappers hold a LoRA's: the replayed steps give the eager steps' losses and trained tensors."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from streaming_cache.train import graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Net(torch.nn.Module):
    def __init__(self, d: int = 64, blocks: int = 3, sync: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))
        self.requires_grad_(False)
        self.sync = sync
        g = torch.Generator().manual_seed(0)
        self.adapters = [((torch.randn(4, d, generator=g) * 0.1).requires_grad_(),
                          (torch.randn(d, 4, generator=g) * 0.1).requires_grad_()) for _ in range(blocks)]

    def params(self) -> list[torch.Tensor]:
        return [t for pair in self.adapters for t in pair]

    def forward(self, x: torch.Tensor, context: torch.Tensor, transformer_options: dict) -> torch.Tensor:
        if self.sync and float(x.sum()) == 12345.0:  # a value read on the host: cannot be recorded
            x = x + 1
        for lin, (down, up) in zip(self.blocks, self.adapters):
            def block(h: torch.Tensor, lin=lin, down=down, up=up) -> torch.Tensor:
                return torch.nn.functional.gelu(lin(h) + (h @ down.t()) @ up.t()) * context
            x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False) + x
        return x


def _pair(**kwargs) -> tuple[Net, Net]:
    a = Net(**kwargs).cuda()
    b = copy.deepcopy(a)
    for n in (a, b):
        n.adapters = [(d.detach().cuda().requires_grad_(), u.detach().cuda().requires_grad_()) for d, u in n.adapters]
    return a, b


def _train(net: Net, steps: int, *, micro: int = 1, forwards: int = 1, autocast: bool = False,
           graphed: graphs.GraphedForward | None = None, between=None, rows=lambda step, i: 8) -> list[float]:
    opt = torch.optim.AdamW(net.params(), lr=1e-2)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(steps):
        for _ in range(micro):
            if graphed is not None:
                graphed.begin_step()
            loss = 0.0
            for i in range(forwards):
                x = torch.randn(rows(step, i), 64, device="cuda", generator=g)
                c = torch.rand(rows(step, i), 64, device="cuda", generator=g)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    out = net(x, context=c, transformer_options={"step": "train", "sigmas": c[:1, 0]})
                loss = loss + (out.float() ** 2).mean()
            (loss / micro).backward()
            losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if between is not None:
            between(step)
    torch.cuda.synchronize()
    return losses


def _same(eager: Net, replayed: Net, losses_a: list[float], losses_b: list[float], tol: float) -> None:
    assert losses_a == pytest.approx(losses_b, rel=tol, abs=tol)
    for a, b in zip(eager.params(), replayed.params()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    start = [p.cuda() for p in Net().params()]
    changed = min(float((a - b).abs().max()) for a, b in zip(eager.params(), start))
    assert changed > 20 * tol, "training changed too little for the comparison to see a wrong gradient"


@pytest.mark.parametrize("autocast", [False, True])
def test_replayed_steps_give_the_eager_steps(autocast):
    eager, replayed = _pair()
    expected = _train(eager, 6, autocast=autocast)
    with graphs.graphed_forward(replayed, replayed.params()) as graphed:
        got = _train(replayed, 6, autocast=autocast, graphed=graphed)
        assert graphed.failed is None and len(graphed.recordings) == 1
        assert graphed.replays == 6 and graphed.eager_calls == 0
    _same(eager, replayed, expected, got, 1e-4 if not autocast else 1e-3)


def test_accumulated_micro_steps_and_a_second_forward_pass_match_eager():
    eager, replayed = _pair()
    expected = _train(eager, 4, micro=2, forwards=2)
    with graphs.graphed_forward(replayed, replayed.params()) as graphed:
        got = _train(replayed, 4, micro=2, forwards=2, graphed=graphed)
        # the second forward pass of each micro-step runs eagerly: its backward pass would need the first's memory
        assert graphed.replays == 8 and graphed.eager_calls == 8
    _same(eager, replayed, expected, got, 1e-4)


def test_two_shapes_are_recorded_and_never_replayed_over_each_other():
    eager, replayed = _pair()

    def rows(step: int, i: int) -> int:  # steps alternate between two batch shapes; a step's two passes differ
        return (8, 4)[(step + i) % 2]

    expected = _train(eager, 6, forwards=2, rows=rows)
    with graphs.graphed_forward(replayed, replayed.params()) as graphed:
        got = _train(replayed, 6, forwards=2, rows=rows, graphed=graphed)
        # the second pass of a step waits for the first's backward pass (the recordings share memory): eager
        assert len(graphed.recordings) == 2 and graphed.replays == 6 and graphed.eager_calls == 6
    _same(eager, replayed, expected, got, 1e-4)


def test_moved_weights_are_recorded_again():
    eager, replayed = _pair()

    def move(net: Net):
        def between(step: int) -> None:
            if step == 1:
                for lin in net.blocks:
                    lin.weight.data = lin.weight.data.clone()  # what moving the model off and back does
        return between

    expected = _train(eager, 4, between=move(eager))
    with graphs.graphed_forward(replayed, replayed.params()) as graphed:
        got = _train(replayed, 4, graphed=graphed, between=move(replayed))
        assert len(graphed.recordings) == 1 and graphed.attempts == 2 and graphed.replays == 4
    _same(eager, replayed, expected, got, 1e-4)


def test_a_forward_pass_that_reads_values_on_the_host_trains_eagerly(caplog):
    eager, replayed = _pair(sync=True)
    expected = _train(eager, 3)
    with caplog.at_level(logging.WARNING), graphs.graphed_forward(replayed, replayed.params()) as graphed:
        got = _train(replayed, 3, graphed=graphed)
        assert graphed.failed is not None and graphed.replays == 0 and graphed.eager_calls == 3
    assert "training without CUDA graphs" in caplog.text
    _same(eager, replayed, expected, got, 1e-4)
