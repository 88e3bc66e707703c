"""What CUDA graphs of a training step cost in memory (``streaming_cache.train.graphs``), on the CPU emulation
(``graph_devices.EmulatedGraphDevice``): no eager pass runs beside a held recording of its own step, an
out-of-memory error anywhere in the graphs' work frees the recordings and the run goes on eagerly (training what a
run without graphs trains, the fallback noted), and the budget counts what the recordings hold in their pool. The
model tells the emulated device of each of its passes, so the device sees an eager pass that runs while a graph is
held: the moment that, on a GPU, needs a recorded step's memory and an eager step's at once.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.graph_nets import Net
from streaming_cache.fallbacks import GRAPHS, Fallbacks
from streaming_cache.train import graphs
from streaming_cache.train.graph_devices import CudaGraphDevice, EmulatedGraphDevice

pytestmark = pytest.mark.oldest_torch

OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 2.00 GiB"


class Device(EmulatedGraphDevice):
    """The emulated device, out of memory at ``oom``: ``warm-up`` (the first eager pass: a recording's warm-up),
    ``capture1``/``capture2`` (recording the forward pass, its gradients), ``check-forward``/``check-backward`` (the
    first replay of each graph: the recording's check), ``replay-forward`` (the third forward replay: after the check
    and the recording call's own, the next step's), ``replay-backward`` (the second backward replay: the recording
    call's own), ``eager-beside`` (any eager pass while a graph is held: the two do not fit together)."""

    REPLAYS = {"check-forward": (1, 1), "check-backward": (2, 1), "replay-forward": (1, 3), "replay-backward": (2, 2)}

    def __init__(self, oom: str | None = None):
        super().__init__()
        self.oom = oom
        self.raised = 0

    def _out_of_memory(self) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    def model_pass(self) -> None:
        beside = not self._running and self.held > 0
        first = not self._running and self.eager_passes == 0
        super().model_pass()
        if (self.oom == "eager-beside" and beside) or (self.oom == "warm-up" and first):
            self._out_of_memory()

    def capture(self, work, pool):
        if self.oom == f"capture{self.captures + 1}":
            self._out_of_memory()
        graph, result = super().capture(work, pool)
        index, original = self.captures, graph.replay

        def replay() -> None:
            if self.REPLAYS.get(self.oom) == (index, graph.replays + 1):
                self._out_of_memory()
            original()

        graph.replay = replay
        return graph, result


def _pair(device: Device) -> tuple[Net, Net]:
    """The same net twice: one to train eagerly (its passes told to a device of its own), one for ``device``."""
    a = Net(device=EmulatedGraphDevice())
    b = copy.deepcopy(a)
    b.device = device
    b.adapters = [(d.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()) for d, u in a.adapters]
    return a, b


def _train(net: Net, steps: int, graphed: graphs.GraphedForward | None = None, *, forwards: int = 1,
           rows=lambda step: 8, poisoned=lambda step: False) -> list[float]:
    """``steps`` AdamW steps of ``forwards`` passes each; a step whose gradients are not finite is skipped (as the
    fp16 gradient scaler skips it); ``poisoned`` steps have an infinite input."""
    opt = torch.optim.AdamW(net.params(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if graphed is not None:
            graphed.begin_step()
        loss = torch.zeros(())
        for _ in range(forwards):
            x = torch.randn(rows(step), 16, generator=g)
            c = torch.rand(rows(step), 16, generator=g)
            if poisoned(step):
                x[0, 0] = float("inf")
            loss = loss + (net(x, context=c) ** 2).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        if all(torch.isfinite(p.grad).all() for p in net.params()):
            opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _same(eager: Net, replayed: Net, losses_a: list[float], losses_b: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_a), rtol=1e-5, atol=1e-5, equal_nan=True)
    for a, b in zip(eager.params(), replayed.params()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    start = Net(device=EmulatedGraphDevice()).params()
    assert min(float((a - b).detach().abs().max()) for a, b in zip(eager.params(), start)) > 1e-3, \
        "training changed too little for the comparison to see a wrong gradient"


def _run(device: Device, steps: int = 4, **options) -> tuple[graphs.GraphedForward, Fallbacks, bool]:
    """Trains the same net with graphs on ``device`` and without, and checks that both trained the same; returns
    the graphed forward, the run's fallbacks, and whether nothing was held any more at the end of the training
    (before the run's end released what was left)."""
    eager, replayed = _pair(device)
    train = {k: options.pop(k) for k in ("forwards", "rows", "poisoned") if k in options}
    expected = _train(eager, steps, **train)
    fallbacks = Fallbacks()
    with graphs.graphed_forward(replayed, replayed.params(), device=device, fallbacks=fallbacks,
                                **options) as graphed:
        got = _train(replayed, steps, graphed, **train)
        freed = not graphed.recordings and graphed.held == 0 and device.held == 0 and graphed._pool is None
    _same(eager, replayed, expected, got)
    return graphed, fallbacks, freed


def test_no_eager_pass_runs_beside_a_held_recording():
    """The recording call is checked against its warm-up pass (run before anything is recorded) and then replayed;
    every later call is replayed: the only eager passes are the warm-ups, none beside a held graph."""
    device = Device()
    graphed, fallbacks, freed = _run(device, steps=6)
    assert not freed and not fallbacks and graphed.replays == 6 and graphed.eager_calls == 0
    assert device.eager_passes == 2 and device.eager_beside == 0  # the two warm-up passes
    assert device.held == 0, "the recordings are freed when the run ends"


def test_a_recording_made_again_after_the_weights_moved_frees_the_old_one_first():
    device = Device()
    eager, replayed = _pair(device)
    with graphs.graphed_forward(replayed, replayed.params(), device=device) as graphed:
        _train(replayed, 2, graphed)
        for lin in replayed.blocks:
            lin.weight.data = lin.weight.data.clone()  # what moving the model off and back does
        _train(replayed, 2, graphed)
        assert graphed.attempts == 2 and graphed.replays == 4 and device.held == 2
    assert device.eager_passes == 4 and device.eager_beside == 0


@pytest.mark.parametrize("oom,said", [
    ("warm-up", "recording the model's forward pass ran out of device memory"),
    ("capture1", "recording the model's forward pass ran out of device memory"),
    ("capture2", "recording the model's forward pass ran out of device memory"),
    ("check-forward", "checking the first replay's output ran out of device memory"),
    ("check-backward", "checking the first replay's gradients ran out of device memory"),
    ("replay-forward", "replaying the model's forward pass ran out of device memory"),
    ("replay-backward", "replaying the backward pass ran out of device memory")])
def test_out_of_memory_in_the_graphs_work_frees_the_recordings_and_the_run_goes_on_eagerly(oom, said):
    """Wherever the graphs' work runs out of memory, the recordings are freed before anything runs eagerly, the
    call (or the gradient) is computed eagerly, graphs stay off, and the fallback says why."""
    device = Device(oom)
    graphed, fallbacks, freed = _run(device)
    assert device.raised == 1 and freed
    reason = fallbacks.reason(GRAPHS)
    assert reason.startswith(said) and f"OutOfMemoryError: {OUT_OF_MEMORY}" in reason, reason
    assert graphed.failed == reason and reason in graphed.report()
    assert device.eager_beside == 0, "an eager pass ran beside a recording that was not freed"


def test_an_eager_pass_of_another_shape_that_runs_out_of_memory_beside_a_recording_frees_it_and_runs_again():
    """A shape not recorded (no room for it) runs eagerly beside the recording kept; where both do not fit, the
    recording is freed and the pass runs again in its memory."""
    device = Device("eager-beside")
    shapes = [8, 8, 4, 8]
    graphed, fallbacks, freed = _run(device, steps=4, rows=lambda step: shapes[step], max_recordings=1)
    assert device.raised == 1 and freed and graphed.replays == 2 and graphed.eager_calls == 2
    assert fallbacks.reason(GRAPHS).startswith("an eager pass beside the recorded graphs ran out of device memory")


def test_a_second_pass_of_a_micro_step_that_runs_out_of_memory_frees_the_pending_replay_too():
    """The first pass of the micro-step replayed and waits for its backward pass; the second runs eagerly and runs
    out of memory: every recording is freed, the pending one included, and the first pass's gradients are then
    computed eagerly."""
    device = Device("eager-beside")
    graphed, fallbacks, freed = _run(device, steps=3, forwards=2)
    assert device.raised == 1 and freed and graphed.replays == 1
    assert fallbacks.reason(GRAPHS).startswith("an eager pass beside the recorded graphs ran out of device memory")


def test_the_budget_counts_what_the_recordings_hold_in_their_pool_and_nothing_once_they_are_freed():
    """Each recording counts what it added to the pool (the device's own figure for the pool, not the device's
    memory at large) and the static buffers it keeps outside it; a second shape's recording, over the budget, is
    not kept."""
    device = Device()
    eager, replayed = _pair(device)
    with graphs.graphed_forward(replayed, replayed.params(), device=device) as graphed:
        _train(replayed, 2, graphed, rows=lambda step: (8, 4)[step])
        pool = device.pool_bytes(graphed._pool)
        outside = sum(t.untyped_storage().nbytes() for r in graphed.recordings for t in (*r.inputs, *r.grad_outputs)
                      if t is not None)
        assert pool > 0 and graphed.held == pool + outside == sum(r.nbytes for r in graphed.recordings)
        first = graphed.recordings[0].nbytes
        graphed.memory_budget = first
        _train(replayed, 2, graphed, rows=lambda step: 2)
        assert [r.key[0][0][0][:1] for r in graphed.recordings][:2] == [(8,), (4,)] and len(graphed.too_large) == 1
    assert graphed.held == 0 and device.held == 0


def test_an_eager_pass_that_is_not_finite_postpones_the_recording_to_a_later_call():
    """The check needs a finite eager pass to compare with: a call whose pass is not finite (an fp16 overflow, a bad
    batch) runs eagerly and a later call records; after a few such calls the shape trains eagerly (its last step
    here is finite, and eager)."""
    device = Device()
    graphed, fallbacks, _ = _run(device, steps=4, poisoned=lambda step: step == 0)
    assert not fallbacks and graphed.attempts == 1 and graphed.replays == 3 and graphed.eager_calls == 1
    assert list(graphed.unchecked.values()) == [1] and device.eager_beside == 0

    device = Device()
    graphed, fallbacks, _ = _run(device, steps=5, poisoned=lambda step: step < 4)
    assert not fallbacks and graphed.attempts == 0 and graphed.eager_calls == 5
    assert list(graphed.unchecked.values()) == [graphs._CHECK_TRIES]
    assert device.eager_passes == graphs._CHECK_TRIES * 2 + 5  # warm-ups of each try, then the calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_pool_counts_what_its_recordings_hold():
    """The pool's own segments: a recording's memory shows there, not the allocator's cache a capture empties."""
    device = CudaGraphDevice()
    pool = device.new_pool()
    assert device.pool_bytes(pool) == 0
    x = torch.randn(1024, 1024, device="cuda")
    (x @ x).relu()  # cuBLAS initialised before the capture, as the recordings' warm-up passes do
    torch.cuda.synchronize()
    graph, y = device.capture(lambda: (x @ x).relu(), pool)
    assert device.pool_bytes(pool) >= y.untyped_storage().nbytes()
    graph.reset()
    del y
    torch.cuda.empty_cache()
    assert device.pool_bytes(pool) == 0
