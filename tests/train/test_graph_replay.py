"""Recorded and replayed training steps (``streaming_cache.train.graphs``): recording, the static inputs, replay, the
recorded gradients, signature matching, the check of the first replay, eviction and every fallback, on the CPU
emulation of CUDA graphs (``graph_devices.EmulatedGraphDevice``) and, where a GPU is at hand, on CUDA (the same tests;
``bash scripts/gpu_checks.sh graphs``). The trained tensors must equal those of the same steps run eagerly. A small
model of checkpointed blocks whose adapters are held outside its parameters, as ComfyUI's weight wrappers hold a
LoRA's.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.graph_nets import Net
from streaming_cache.fallbacks import GRAPHS, Fallbacks
from streaming_cache.train import graphs
from streaming_cache.train.graph_devices import CaptureError, CudaGraphDevice, EmulatedGraphDevice, graph_device

pytestmark = pytest.mark.oldest_torch

WHERE = [pytest.param("emulated", id="emulated"),
         pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA GPU"))]


@pytest.fixture(params=WHERE)
def where(request) -> str:
    """Where graphs are recorded: the CPU emulation, or a CUDA GPU."""
    return request.param


def _device(where: str) -> torch.device:
    return torch.device("cpu" if where == "emulated" else "cuda")


def _tolerance(where: str, autocast: bool = False) -> float:
    """Emulated replays run the eager kernels themselves; on a GPU reductions may run in another order."""
    return 1e-3 if autocast else (1e-5 if where == "emulated" else 1e-4)


def _pair(where: str = "emulated", **kwargs) -> tuple[Net, Net]:
    a = Net(**kwargs).to(_device(where))
    b = copy.deepcopy(a)
    start = a.adapters
    for n in (a, b):  # each its own copies
        n.adapters = [(d.detach().to(_device(where), copy=True).requires_grad_(),
                       u.detach().to(_device(where), copy=True).requires_grad_()) for d, u in start]
    return a, b


def _train(net: Net, steps: int, *, micro: int = 1, forwards: int = 1, autocast: bool = False,
           graphed: graphs.GraphedForward | None = None, between=None, rows=lambda step, i: 8,
           optimizer: str = "AdamW", scale=lambda step: 1.0) -> list[float]:
    opt = torch.optim.AdamW(net.params(), lr=1e-2) if optimizer == "AdamW" else torch.optim.SGD(net.params(), lr=0.5)
    device = net.params()[0].device
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        for _ in range(micro):
            if graphed is not None:
                graphed.begin_step()
            loss = 0.0
            for i in range(forwards):
                x = torch.randn(rows(step, i), 16, generator=g).to(device)
                c = torch.rand(rows(step, i), 16, generator=g).to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = net(x, context=c, transformer_options={"step": "train", "sigmas": c[:1, 0]})
                loss = loss + (out.float() ** 2).mean()
            (loss * scale(step) / micro).backward()
            losses.append(float(loss))
        if all(torch.isfinite(p.grad).all() for p in net.params()):  # as the fp16 gradient scaler skips a step
            opt.step()
        opt.zero_grad(set_to_none=True)
        if between is not None:
            between(step)
    return losses


def _same(eager: Net, replayed: Net, losses_a: list[float], losses_b: list[float], tol: float) -> None:
    assert losses_a == pytest.approx(losses_b, rel=tol, abs=tol)
    for a, b in zip(eager.params(), replayed.params()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    start = [p.to(eager.params()[0].device) for p in Net().params()]
    changed = min(float((a - b).abs().max()) for a, b in zip(eager.params(), start))
    assert changed > 20 * tol, "training changed too little for the comparison to see a wrong gradient"


def _graphed(net: Net, **options):
    if "device" not in options:
        options["device"] = CudaGraphDevice() if net.params()[0].is_cuda else EmulatedGraphDevice()
    return graphs.graphed_forward(net, net.params(), **options)


@pytest.mark.parametrize("autocast", [False, True])
def test_replayed_steps_give_the_eager_steps(where, autocast):
    eager, replayed = _pair(where)
    expected = _train(eager, 6, autocast=autocast)
    with _graphed(replayed) as graphed:
        got = _train(replayed, 6, autocast=autocast, graphed=graphed)
        assert graphed.failed is None and len(graphed.recordings) == 1 and graphed.recordings[0].checked
        # the call that records is checked against its warm-up pass, then replayed too
        assert graphed.replays == 6 and graphed.eager_calls == 0 and graphed.replayed_steps == 6
        assert getattr(graphed.device, "captures", 2) == 2, "one forward and one backward graph"
        assert graphed.report() == f"{graphed.device.name}: 6 of 6 micro-steps replayed (1 recorded)"
    _same(eager, replayed, expected, got, _tolerance(where, autocast))
    assert graphs.last_run["recorded"] == 1 and graphs.last_run["replays"] == 6


def test_a_replay_reads_the_inputs_of_its_own_call(where):
    """Each replay must copy its call's tensors into the recorded inputs: the emulated replay reads those, as a
    CUDA replay reads the memory it recorded."""
    _, net = _pair(where)
    with _graphed(net) as graphed:
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(8, 16, generator=g).to(_device(where))
            c = torch.rand(8, 16, generator=g).to(_device(where))
            graphed.begin_step()
            out = net(x, context=c, transformer_options={})
            out.sum().backward()
            torch.testing.assert_close(out, graphed.original(x, context=c, transformer_options={}),
                                       rtol=_tolerance(where), atol=_tolerance(where))
        assert graphed.replays == 4


def test_accumulated_micro_steps_and_a_second_forward_pass_match_eager(where):
    eager, replayed = _pair(where)
    expected = _train(eager, 4, micro=2, forwards=2)
    with _graphed(replayed) as graphed:
        got = _train(replayed, 4, micro=2, forwards=2, graphed=graphed)
        # the second forward pass of each micro-step runs eagerly: its backward pass would need the first's memory
        assert graphed.replays == 8 and graphed.eager_calls == 8
    _same(eager, replayed, expected, got, _tolerance(where))


def test_two_shapes_are_recorded_and_never_replayed_over_each_other(where):
    eager, replayed = _pair(where)

    def rows(step: int, i: int) -> int:  # steps alternate between two batch shapes; a step's two passes differ
        return (8, 4)[(step + i) % 2]

    expected = _train(eager, 6, forwards=2, rows=rows)
    with _graphed(replayed) as graphed:
        got = _train(replayed, 6, forwards=2, rows=rows, graphed=graphed)
        assert len(graphed.recordings) == 2 and graphed.replays == 6 and graphed.eager_calls == 6
    _same(eager, replayed, expected, got, _tolerance(where))


def test_moved_weights_are_recorded_again(where):
    eager, replayed = _pair(where)

    def move(net: Net):
        def between(step: int) -> None:
            if step == 1:
                for lin in net.blocks:
                    lin.weight.data = lin.weight.data.clone()  # what moving the model off and back does
        return between

    expected = _train(eager, 4, between=move(eager))
    with _graphed(replayed) as graphed:
        got = _train(replayed, 4, graphed=graphed, between=move(replayed))
        assert len(graphed.recordings) == 1 and graphed.attempts == 2 and graphed.replays == 4
    _same(eager, replayed, expected, got, _tolerance(where))


def test_a_forward_pass_that_reads_values_on_the_host_trains_eagerly_and_says_why(where, caplog):
    eager, replayed = _pair(where, sync=True)
    expected = _train(eager, 3)
    fallbacks = Fallbacks()
    with caplog.at_level(logging.WARNING), _graphed(replayed, fallbacks=fallbacks) as graphed:
        got = _train(replayed, 3, graphed=graphed)
        assert graphed.failed is not None and graphed.replays == 0 and graphed.eager_calls == 3
        assert f"trained without {graphed.device.name}: recording" in graphed.report()
    assert "recording the model's forward pass failed" in fallbacks.reason(GRAPHS)
    assert "CUDA graphs: off for the rest of the run" in caplog.text
    _same(eager, replayed, expected, got, _tolerance(where))


REFUSED = {
    "torch.equal": lambda x: torch.equal(x[0], x[1]),
    "item": lambda x: x.sum().item(),
    "nonzero": lambda x: x.nonzero(),
    "boolean mask": lambda x: x[x > 0],
    ".cpu()": lambda x: x.cpu(),
    ".to('cpu')": lambda x: x.to("cpu"),
    "torch.tensor(data, device)": lambda x: x + torch.tensor([1.0, 2.0], device=x.device),
    "host tensor to the device": lambda x: x + torch.ones(2).to(x.device),
    "list as an index": lambda x: x[[0, 2]],
}
"""What a CUDA capture refuses (the host would wait for the device, or the recording would read host memory),
each applied to a device tensor ``x`` of 3 x 2."""


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_emulated_capture_refuses_what_a_cuda_capture_refuses(name):
    device = EmulatedGraphDevice()
    x = torch.randn(3, 2)
    with pytest.raises(CaptureError, match="operation not permitted when stream is capturing"):
        device.capture(lambda: REFUSED[name](x), device.new_pool())
    assert device.captures == 0 and device.held == 0
    graph, out = device.capture(lambda: torch.where(x > 0, x, x * 2)[0:2].to(x.device) * 2, device.new_pool())
    assert device.held == 1 and out.shape == (2, 2), "device work is recorded"


class _Faulty(EmulatedGraphDevice):
    """An emulated device whose graphs go wrong in one way: ``stale`` forward replays do nothing (the outputs the
    capture computed come back), ``wrong_grads`` backward replays double the gradients, ``raises1`` and ``raises2``
    replays of the forward pass or of its gradients raise, from replay ``at`` of that graph on (the first replay of
    each is the recording's check; the second, the recording call's own)."""

    def __init__(self, fault: str, at: int = 1):
        super().__init__()
        self.fault, self.at = fault, at

    def capture(self, work, pool):
        graph, result = super().capture(work, pool)
        index = self.captures  # 1: the forward pass, 2: its gradients
        original = graph.replay

        def replay() -> None:
            if self.fault == "stale" and index == 1:
                return
            if self.fault == f"raises{index}" and graph.replays + 1 >= self.at:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            original()
            if self.fault == "wrong_grads" and index == 2:
                for t in graph.static:
                    if t is not None:
                        t.mul_(2)

        graph.replay = replay
        return graph, result


@pytest.mark.parametrize("fault,at,said", [
    ("stale", 1, "output is"), ("wrong_grads", 1, "gradients are"),
    ("raises1", 1, "checking the first replay's output failed"),
    ("raises2", 1, "checking the first replay's gradients failed"),
    ("raises1", 3, "replaying the model's forward pass failed"),
    ("raises2", 2, "replaying the backward pass failed")])
def test_a_replay_that_goes_wrong_is_caught_at_once_and_the_run_trains_what_eager_steps_train(fault, at, said):
    """A recording is checked against the eager pass before it serves a call; a replay that raises falls back for
    the call at hand. Either way the step takes the eager results and graphs are off for the rest of the run: the
    trained tensors are the eager ones, whatever went wrong."""
    eager, replayed = _pair()
    expected = _train(eager, 4)
    fallbacks = Fallbacks()
    with _graphed(replayed, device=_Faulty(fault, at), fallbacks=fallbacks) as graphed:
        got = _train(replayed, 4, graphed=graphed)
        assert graphed.failed is not None and not graphed.recordings and graphed.device.held == 0
    assert said in fallbacks.reason(GRAPHS), fallbacks.reason(GRAPHS)
    _same(eager, replayed, expected, got, 1e-5)


def test_the_check_is_what_catches_a_wrong_replay():
    """Without the check, the stale replay above trains something else (so the test above can fail)."""
    eager, replayed = _pair()
    expected = _train(eager, 4)
    with _graphed(replayed, device=_Faulty("stale")) as graphed:
        graphed._check = lambda rec, ref, tensors: None
        got = _train(replayed, 4, graphed=graphed)
        assert graphed.failed is None and graphed.replays == 4
    with pytest.raises(AssertionError):
        _same(eager, replayed, expected, got, 1e-5)


class _Float64Sizes(TorchDispatchMode):
    """The sizes of the fp64 tensors the operations made while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.numel() for t in pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        return out


def test_the_checks_difference_is_the_fp64_one_without_fp64_copies():
    """The check's measure (the norm of the difference over the reference's, all tensors together, None as zeros)
    agrees with the same sum in fp64 to far inside :data:`graphs.TOLERANCE`, from norms taken in fp32: no fp64
    tensor larger than the two norms of each pair is made."""
    torch.manual_seed(0)
    values = [torch.randn(300, dtype=torch.bfloat16), None, torch.randn(40, 3), torch.randn(7)]
    reference = [values[0] + 0.05 * torch.randn(300, dtype=torch.bfloat16), torch.ones(2),
                 values[2] + 1e-4 * torch.randn(40, 3), None]
    diff = sum(float((v.double() - r.double()).square().sum()) for v, r in zip(values, reference)
               if v is not None and r is not None) + 2.0 + float(values[3].double().square().sum())
    norm = sum(float(r.double().square().sum()) for r in reference if r is not None)
    with _Float64Sizes() as made:
        got = graphs.relative_difference(values, reference)
    assert got == pytest.approx((diff / norm) ** 0.5, rel=1e-5)
    assert max(made.sizes) <= 2 * len(values)
    assert graphs.relative_difference([torch.tensor([float("inf")])], [torch.ones(1)]) == float("inf")
    assert graphs.relative_difference([None, torch.zeros(3)], [None, torch.zeros(3)]) == 0.0


@pytest.mark.parametrize("overflowing", [0, 1])
def test_gradients_that_overflow_in_a_replayed_step_leave_graphs_on(where, overflowing):
    """fp16 training scales the loss; gradients that overflow are expected (the scaler skips the step), in the
    replay as in the eager step. The check differentiates with gradients of its own, not the loss's, so an overflow
    at the step that records does not touch it either."""
    eager, replayed = _pair(where)
    overflow = lambda step: 1e60 if step == overflowing else 1.0  # noqa: E731
    expected = _train(eager, 5, scale=overflow)
    fallbacks = Fallbacks()
    with _graphed(replayed, fallbacks=fallbacks) as graphed:
        got = _train(replayed, 5, graphed=graphed, scale=overflow)
        assert graphed.failed is None and graphed.replays == 5 and graphed.recordings[0].checked
    assert not fallbacks
    _same(eager, replayed, expected, got, _tolerance(where))


def test_a_later_pass_of_the_same_run_stays_eager_after_a_fallback():
    fallbacks = Fallbacks()
    fallbacks.note(GRAPHS, "recording failed earlier")
    _, net = _pair()
    with _graphed(net, fallbacks=fallbacks) as graphed:
        _train(net, 2, graphed=graphed)
        assert graphed.replays == 0 and graphed.attempts == 0 and graphed.eager_calls == 2


def test_the_shapes_called_most_keep_their_recordings_and_an_evicted_one_is_released(where):
    _, net = _pair(where)
    # room for two: 8 and 4 are recorded; 2 is called more often than 8 at its fourth call and evicts it; 8 then
    # never overtakes 4 again
    shapes = [8] * 3 + [4] * 5 + [2] * 6 + [8] * 2

    with _graphed(net, max_recordings=2) as graphed:
        _train(net, len(shapes), graphed=graphed, rows=lambda step, i: shapes[step])
        kept = sorted(rec.key[0][0][0][0] for rec in graphed.recordings)
        assert kept == [2, 4] and graphed.evicted == 1 and graphed.attempts == 3
        assert graphed.replays == 3 + 5 + 3 and graphed.eager_calls == 3 + 2
        assert "of 16 micro-steps" in graphed.report() and "1 evicted" in graphed.report()


def test_recordings_beyond_the_memory_budget_are_not_kept():
    _, net = _pair()
    shapes = [8] * 3 + [64] * 4

    with _graphed(net, memory_budget=1) as graphed:  # any second recording exceeds it
        _train(net, len(shapes), graphed=graphed, rows=lambda step, i: shapes[step])
        assert len(graphed.recordings) == 1 and graphed.attempts == 2 and len(graphed.too_large) == 1
        assert graphed.replays == 3 and graphed.eager_calls == 4


def test_the_device_is_chosen_by_where_the_model_runs():
    assert graph_device(torch.device("cpu")) is None
    assert isinstance(graph_device(torch.device("cpu"), emulate=True), EmulatedGraphDevice)
    assert graph_device(torch.device("cuda", 0)).name == "CUDA graphs"
    assert graph_device(torch.device("meta")) is None
