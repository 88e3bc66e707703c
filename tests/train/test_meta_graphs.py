"""CUDA graphs' memory pool counted on ``meta`` (``streaming_cache.train.meta_graphs``): what a capture allocates is
the pool's, what it frees stays in the pool for later captures into it, the pool's size is its high-water mark,
a replay allocates nothing, and the pool goes back to the device once its graphs are reset; then
``streaming_cache.train.graphs`` on that device, with a small model: the first two steps of a graphs run fit one
eager step plus the recording, and an eager pass run beside the recording shows. (Full-size SDXL in real ComfyUI:
tests/comfy/test_graphs_memory_on_meta.py.)"""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.graph_nets import Net
from streaming_cache.train import graphs, memory_count
from streaming_cache.train.meta_graphs import MetaGraphDevice, PooledStorages

MIB = 2 ** 20


def _mib(n: float) -> torch.Tensor:
    return torch.empty(int(n * MIB), dtype=torch.uint8, device="meta")


def test_a_pool_holds_its_high_water_mark_and_reuses_what_its_captures_freed():
    with PooledStorages() as storages:
        device = MetaGraphDevice(storages)
        pool = device.new_pool()
        kept = []

        def first():
            a, b = _mib(1), _mib(1)
            del a
            kept.append(_mib(0.5))
            return b

        graph1, b = device.capture(first, pool)
        assert (pool.size, pool.used) == (2 * MIB, 1.5 * MIB)
        assert storages.live == 2 * MIB and storages.peak == 2 * MIB

        graph2, d = device.capture(lambda: _mib(0.5), pool)
        assert pool.size == 2 * MIB, "a block freed by an earlier capture is reused"
        graph3, e = device.capture(lambda: _mib(1), pool)
        assert pool.size == 3 * MIB and storages.live == 3 * MIB

        outside = _mib(1)
        assert storages.live == 4 * MIB and storages.beside == MIB

        graph3.replay()  # runs its closure again: the pool's memory written again, nothing allocated
        assert storages.live == 4 * MIB and pool.size == 3 * MIB and device.replays == 1

        del kept[:]  # a pool's storage freed while graphs use the pool: still reserved for them
        assert storages.live == 4 * MIB
        for graph in (graph1, graph2, graph3):
            graph.reset()
        assert pool.size == pool.used == 2.5 * MIB, "released: only its live storages stay"
        del b, d, e
        assert pool.size == 0 and storages.live == MIB
        del outside
        assert storages.live == 0 and storages.peak == 4 * MIB


def test_a_value_read_on_the_host_is_zero_outside_a_capture_and_refused_inside():
    with PooledStorages() as storages:
        device = MetaGraphDevice(storages)
        x = torch.empty(8, device="meta")
        assert bool(torch.isfinite(x.sum())) is True and float(x.sum()) == 0.0
        with pytest.raises(RuntimeError, match="capturing"):
            device.capture(lambda: float(x.sum()), device.new_pool())


D, ROWS, BLOCKS = 64, 1024, 32
"""The small model: 32 checkpointed blocks, whose saved inputs (``ROWS x D`` fp32 each, 256 KiB) outweigh the call's
inputs and output, as a diffusion model's activations outweigh its latent."""
IO = 3 * ROWS * D * 4
"""The bytes of a call's inputs and output (``x``, ``context``, the prediction)."""


def _steps(graphed: bool, eager_recording_call: bool = False, steps: int = 2) -> dict:
    """``steps`` AdamW steps of :class:`Net` on ``meta``, counted with the pools: the peak, the pool's largest size,
    what lived beside it, the live bytes after the first optimizer step, the trained bytes, eager layer calls beside
    the pool, and what graphs did. ``eager_recording_call``: the call that records runs eagerly beside its new
    recording (as graphs did before its check used the last warm-up pass)."""
    net = Net(d=D, blocks=BLOCKS).to("meta")
    net.adapters = [(d.to("meta").detach().requires_grad_(), u.to("meta").detach().requires_grad_())
                    for d, u in net.adapters]
    params = net.params()
    x, context = torch.empty(ROWS, D, device="meta"), torch.empty(ROWS, D, device="meta")
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    with memory_count.counting(net, *params, x, context, counter=PooledStorages) as c:
        storages = c.storages
        device = MetaGraphDevice(storages)
        handle = device.watch(net.blocks[0])
        with graphs.graphed_forward(net, params, graphed, device=device) as g:
            if g is not None and eager_recording_call:
                original = g._new_recording
                g._new_recording = lambda *a: original(*a) and None  # kept, and the call runs eagerly beside it
            for step in range(steps):
                if g is not None:
                    g.begin_step()
                net(x, context).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step == 0:
                    base = storages.live
            pool = max((p.largest for p in storages.pools), default=0)
        handle.remove()
    return {"peak": storages.peak, "pool": pool, "beside": storages.beside, "base": base,
            "trained": sum(p.numel() * p.element_size() for p in params), "eager_beside": device.eager_beside,
            "run": dict(graphs.last_run) if graphed else {}}


@functools.cache
def _eager() -> dict:
    return _steps(False)


def test_the_first_two_steps_of_a_graphs_run_fit_one_eager_step_and_the_recording():
    eager, run = _eager(), _steps(True)
    assert run["run"]["recorded"] == 1 and run["run"]["replayed_steps"] == 2 and run["run"]["eager_calls"] == 0
    assert run["eager_beside"] == 0
    transient = eager["peak"] - eager["base"]
    assert 0 < run["pool"] <= transient, "the pool holds at most what an eager step adds (its loss is outside it)"
    assert run["peak"] <= eager["peak"] + run["pool"]
    # sharper: beyond the eager step, the recorded gradients' copies handed to the optimizer, and the recording's
    # static inputs, its output gradient and its check (the warm-up's outputs, their differences)
    assert run["peak"] - eager["peak"] <= run["trained"] + 4 * IO


def test_an_eager_pass_beside_the_recording_is_seen():
    eager, run = _eager(), _steps(True, eager_recording_call=True, steps=1)
    assert run["eager_beside"] > 0 and run["run"]["eager_calls"] == 1
    transient = eager["peak"] - eager["base"]
    assert run["peak"] - eager["peak"] > run["trained"] + 4 * IO
    assert run["peak"] - eager["peak"] > transient / 2
    assert run["beside"] - eager["base"] > transient / 2
