"""Which inputs a recomputed block runs on copies of (``recompute.checkpoint_module``): those it updates in place or
returns, learnt at its first call; the others it gets as they are, in its forward run and its recomputation.

Each copy is an operation a GPU launches, twice a block and step (forward run and recomputation). Copying only what
a block updates must give the same gradients, bit for bit, as copying every input, and still protect the inputs a
block does update (ComfyUI's Flux: ``img += ...``); a block that starts updating an input later, or an input that
changes between the passes, fails loudly instead of training on other values."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import streaming_cache as sc
from helpers.toy_backend import linear_pairs_cache
from streaming_cache.fallbacks import GRAPHS, Fallbacks
from streaming_cache.loader import BatchLoader
from streaming_cache.train import graphs, loop, recompute
from streaming_cache.train.graph_devices import EmulatedGraphDevice

pytestmark = pytest.mark.oldest_torch


@pytest.fixture(autouse=True)
def learned_copies(monkeypatch):
    """The copies learnt at a block's first call (the default), whatever the environment of the test run says."""
    monkeypatch.delenv("STREAMING_CACHE_RECOMPUTE_COPIES", raising=False)


class Clones(TorchDispatchMode):
    """Counts the ``aten.clone`` calls while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.clone:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Modulated(torch.nn.Module):
    """A block that updates nothing in place: its inputs as a Flux block's, the stream ``x``, a tracked modulation
    ``vec`` and an untracked float ``pe``."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(x * (1 + vec)))) * pe


class UpdatesItsInput(torch.nn.Module):
    """A block that updates ``x`` in place twice, each time after a norm saved it (ComfyUI's Flux double block's
    ``img``), and leaves ``vec`` and ``pe`` alone."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=False)
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.c = torch.nn.Linear(width, width)
        self.out_of_place = out_of_place

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        first = self.c(self.norm(x) * (1 + vec))
        x = x + first if self.out_of_place else x.add_(first)
        second = self.b(torch.nn.functional.gelu(self.a(self.norm(x)))) * pe
        return x + second if self.out_of_place else x.add_(second)


class SavesASlice(UpdatesItsInput):
    """A block that saves a slice of its input (an offset view) before it updates the input in place."""

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        gate = torch.cat([x[:, half:] * vec[:, half:], x[:, :half]], dim=-1)  # mul saves the slice x[:, half:]
        x = x + self.c(gate) if self.out_of_place else x.add_(self.c(gate))
        return super().forward(x, vec, pe)


def _train(block: type, checkpointed: bool = True, steps: int = 3, blocks: int = 3) -> dict:
    """``steps`` of SGD on ``blocks`` blocks after a trained layer that makes ``vec`` (the weights stand in for a
    LoRA); the clones of each step's forward and backward pass counted. Not checkpointed, the blocks run their
    out-of-place twin."""
    torch.manual_seed(0)
    width = 16
    model = torch.nn.ModuleList([block(width, out_of_place=not checkpointed) for _ in range(blocks)])
    embed = torch.nn.Linear(width, width)
    replay = recompute.Replay([])
    if checkpointed:
        for m in model:
            recompute.checkpoint_module(m, replay)
    parameters = [*embed.parameters(), *model.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    source = torch.randn(4, width, requires_grad=True)
    y, pe = torch.randn(4, width), torch.rand(4, width) + 0.5
    clones, grads = [], []
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            source.grad = None
            with Clones() as counted:
                x, vec = source * 1.0, embed(y)
                for m in model:
                    x = m(x, vec, pe)
                loss = x.square().mean()
                loss.backward()
            clones.append(counted.count)
            grads.append([p.grad.clone() for p in parameters] + [source.grad.clone(), loss.detach()])
            optimizer.step()
    finally:
        for m in model if checkpointed else []:
            recompute.uncheckpoint_module(m)
    return {"clones": clones, "grads": grads, "weights": [p.detach().clone() for p in parameters]}


def _copying_every_input(monkeypatch) -> None:
    """From now on the blocks copy every input they might update at every call, forward run and recomputation (as
    before the copies were learnt)."""
    placed = recompute._OwnInputs.placed
    monkeypatch.setattr(recompute._OwnInputs, "placed",
                        lambda self, args, kwargs, mode, tape: placed(self, args, kwargs, "", None))


def test_a_block_that_updates_nothing_in_place_is_recomputed_on_its_inputs_themselves():
    """Copying every input, each block and step would make six clones (three inputs, forward run and recomputation).
    Its first forward run copies its three inputs and finds them left alone, and its recomputation runs on copies
    as the forward run did; from then on, nothing is copied. (Without the hook reader, a probing run on copies of
    the inputs comes first.)"""
    probe = 0 if recompute.has_hook_reader() else 3
    assert _train(Modulated)["clones"] == [3 * (3 + 3 + probe), 0, 0]


@pytest.mark.parametrize("block", [Modulated, UpdatesItsInput, SavesASlice])
def test_the_gradients_are_those_of_copying_every_input_bit_for_bit(block, monkeypatch):
    """An input handed on uncopied is an alias of itself where autograd tracks it: the backward graph keeps its
    shape, so even the order in which gradients are summed (``vec``'s, from every block) is unchanged."""
    got = _train(block)
    _copying_every_input(monkeypatch)
    every = _train(block)
    if block is Modulated or recompute.has_hook_reader():  # else the others are not recomputed
        assert sum(got["clones"][1:]) < sum(every["clones"][1:])
    for step_got, step_every in zip(got["grads"], every["grads"]):
        for a, b in zip(step_got, step_every):
            assert torch.equal(a, b)


@pytest.mark.parametrize("block", [Modulated, UpdatesItsInput, SavesASlice])
def test_recomputed_blocks_learn_what_they_learn_without_checkpointing(block):
    truth, got = _train(block, checkpointed=False), _train(block)
    for a, b in zip(truth["weights"], got["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(truth["grads"][-1], got["grads"][-1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_block_that_updates_its_input_copies_that_input_only():
    """Per block and step: ``x`` copied for the forward run and for the recomputation, and the second save of ``x``
    (after the first update, before the second) copied in the recomputation; its first save is of the input's own
    values, and the input itself is saved. ``vec`` and ``pe`` are copied only in the first step, whose forward run
    copies every input, and so does its recomputation (copying every input, and each save the block updates: eight
    clones a block and step)."""
    if not recompute.has_hook_reader():
        pytest.skip("without the hook reader such a block is not recomputed")
    got = _train(UpdatesItsInput)
    assert got["clones"] == [3 * (3 + 3 + 1), 3 * (1 + 1 + 1), 3 * (1 + 1 + 1)]


class PassesOn(torch.nn.Module):
    """A block that returns ``vec`` beside its result, which the caller then updates in place (as ComfyUI's Flux
    adds a ControlNet's residual to a block's output)."""

    def __init__(self, width: int, out_of_place: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.tanh(self.a(x) * vec), vec


def test_an_input_a_block_returns_is_copied_as_one_it_updates():
    """Handed on uncopied, the caller's update of the returned ``vec`` would change the block's input before its
    recomputation."""
    results = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        blocks = [PassesOn(8) for _ in range(3)]
        replay = recompute.Replay([])
        for m in blocks if checkpointed else []:
            recompute.checkpoint_module(m, replay)
        grads = []
        for _ in range(2):
            for m in blocks:
                m.zero_grad()
            x, vec = torch.randn(2, 8) * 1.0, torch.randn(2, 8, requires_grad=True) * 1.0
            for m in blocks:
                x, vec = m(x, vec)
                vec = vec * 1.5 if not checkpointed else vec.mul_(1.5)
            x.square().mean().backward()
            grads.append([p.grad.clone() for m in blocks for p in m.parameters()])
        results[checkpointed] = grads
    for a, b in zip(results[False][-1], results[True][-1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class Sometimes(Modulated):
    """A block that updates ``x`` in place only where ``updates`` is set."""

    updates = False

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        out = super().forward(x, vec, pe)
        return x.add_(out) if self.updates else out


def test_a_block_that_starts_updating_an_input_later_stops_that_call_and_copies_every_input_from_then_on():
    """The call that updates an input it was not given a copy of cannot be recomputed: it raises (for the training
    loop, which runs the micro-step again), and from then on every block of the run copies every input, noted once
    as a fallback."""
    fallbacks = Fallbacks()
    block, other = Sometimes(8), Modulated(8)
    replay = recompute.Replay([], fallbacks=fallbacks)
    for m in (block, other):
        recompute.checkpoint_module(m, replay)
    vec, pe = torch.ones(2, 8, requires_grad=True), torch.ones(2, 8)
    for m in (block, other):
        m(torch.randn(2, 8) * 1.0, vec * 1.0, pe).sum().backward()
    block.updates = True
    with pytest.raises(recompute.InputUpdatedLater,
                       match="left alone at its first call.*STREAMING_CACHE_RECOMPUTE_COPIES=all"):
        block(torch.randn(2, 8) * 1.0, vec * 1.0, pe)
    assert "(Sometimes) updated an input at a later call" in fallbacks.reason(recompute.LEARNT_COPIES)
    for m in (block, other):
        with Clones() as counted:
            m(torch.randn(2, 8) * 1.0, vec * 1.0, pe).sum().backward()
        assert counted.count >= 6, "three inputs copied for the forward run and for the recomputation"


def _trained_through_the_loop(handle, copies: str, monkeypatch, batch_updated: bool = False) -> tuple:
    """Six steps of the training loop on a recomputed :class:`Sometimes` block that starts updating its input in
    place at micro-step 3 (the batch's ``x`` itself with ``batch_updated``, else a product of it); returns the
    weights, the losses and the run's fallbacks."""
    monkeypatch.setenv("STREAMING_CACHE_RECOMPUTE_COPIES", copies)
    torch.manual_seed(0)
    block, fallbacks = Sometimes(4), Fallbacks()
    recompute.checkpoint_module(block, recompute.Replay([], fallbacks=fallbacks))
    params = dict(block.named_parameters())
    vec, pe = torch.full((4,), 0.5), torch.ones(4)

    def loss_fn(batch, micro):
        block.updates = micro >= 3
        x = batch["x"] if batch_updated else batch["x"] * 1.0
        return (block(x, vec, pe) - batch["y"]).square().mean()

    result = loop.train(params, BatchLoader(handle, 4, seed=1, workers=0), loss_fn,
                        loop.TrainConfig(steps=6, learning_rate=0.05), hooks=loop.TrainHooks(fallbacks=fallbacks))
    return {k: v.detach().clone() for k, v in params.items()}, result.losses, fallbacks


def test_the_training_loop_runs_that_micro_step_again_and_trains_what_copying_every_input_trains(tmp_path,
                                                                                                 monkeypatch):
    handle = sc.open_cache(linear_pairs_cache(str(tmp_path / "cache"), 16)).dataset()
    weights, losses, fallbacks = _trained_through_the_loop(handle, "learned", monkeypatch)
    assert fallbacks.reason(recompute.LEARNT_COPIES) is not None
    every_weights, every_losses, every_fallbacks = _trained_through_the_loop(handle, "all", monkeypatch)
    assert not every_fallbacks
    assert losses == every_losses
    for name, value in weights.items():
        assert torch.equal(value, every_weights[name]), name


def test_a_micro_step_whose_batch_the_block_changed_is_not_run_again(tmp_path, monkeypatch):
    """Run again, it would train on the changed batch: the error stands, and says how to train."""
    handle = sc.open_cache(linear_pairs_cache(str(tmp_path / "cache"), 16)).dataset()
    with pytest.raises(recompute.InputUpdatedLater, match="STREAMING_CACHE_RECOMPUTE_COPIES=all"):
        _trained_through_the_loop(handle, "learned", monkeypatch, batch_updated=True)


class _SwitchingNet(torch.nn.Module):
    """A layer, then a recomputed :class:`Sometimes` block that updates its input in place from the net's second
    run on (a warm-up pass of the graphs' recording)."""

    def __init__(self):
        super().__init__()
        self.embed, self.block, self.runs = torch.nn.Linear(8, 8), Sometimes(8), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        self.block.updates = self.runs >= 2
        return self.block(self.embed(x), torch.full((8,), 0.5), torch.ones(8))


def test_under_graphs_the_fallback_is_the_loops_and_graphs_stay_on():
    """The recording lets the error through instead of turning graphs off for it: the micro-step run again
    records with every input copied, and its steps replay."""
    torch.manual_seed(0)
    net, fallbacks = _SwitchingNet(), Fallbacks()
    recompute.checkpoint_module(net.block, recompute.Replay([], fallbacks=fallbacks))
    x = torch.randn(4, 8)
    with graphs.graphed_forward(net, list(net.parameters()), device=EmulatedGraphDevice(),
                                fallbacks=fallbacks) as graphed:
        graphed.begin_step()
        with pytest.raises(recompute.InputUpdatedLater):
            net(x)
        for _ in range(3):
            graphed.begin_step()
            net(x).square().mean().backward()
        assert graphed.failed is None and graphed.replayed_steps >= 2, graphed.report()
    assert fallbacks.reason(recompute.LEARNT_COPIES) is not None and fallbacks.reason(GRAPHS) is None


def test_with_every_input_copied_a_block_may_update_an_input_at_some_calls_only(monkeypatch):
    """``STREAMING_CACHE_RECOMPUTE_COPIES=all``, the way out the error names: every input copied at
    every call, the gradients those of the block run without recomputation."""
    class OutOfPlace(Sometimes):
        def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
            out = Modulated.forward(self, x, vec, pe)
            return x + out if self.updates else out

    monkeypatch.setenv("STREAMING_CACHE_RECOMPUTE_COPIES", "all")
    block, plain = Sometimes(8), OutOfPlace(8)
    plain.load_state_dict(block.state_dict())
    recompute.checkpoint_module(block, recompute.Replay([]))
    for updates in (False, True, False):
        block.updates = plain.updates = updates
        x, vec, pe = torch.randn(2, 8), torch.randn(2, 8, requires_grad=True), torch.ones(2, 8)
        vec_plain = vec.detach().clone().requires_grad_(True)
        block(x.clone(), vec * 1.0, pe).square().sum().backward()
        plain(x.clone(), vec_plain * 1.0, pe).square().sum().backward()
        assert torch.allclose(vec.grad, vec_plain.grad)
    monkeypatch.setenv("STREAMING_CACHE_RECOMPUTE_COPIES", "some")
    with pytest.raises(ValueError, match="use learned .the default. or all"):
        block(torch.randn(2, 8), vec, pe)


def test_an_input_updated_between_the_forward_run_and_the_recomputation_fails_loudly():
    """A copy made at the recomputation (as before the copies were learnt) would have run on the changed values
    silently."""
    block = Modulated(8)
    recompute.checkpoint_module(block, recompute.Replay([]))
    vec = torch.randn(2, 8, requires_grad=True) * 1.0
    out = block(torch.randn(2, 8), vec, torch.ones(2, 8))
    vec.add_(1.0)
    with pytest.raises(RuntimeError, match="between its forward run and its recomputation"):
        out.sum().backward()


def test_inference_tensors_are_copied_at_every_call():
    """Autograd cannot save an inference tensor (ComfyUI makes conditioning in inference mode): the block gets a
    copy in its forward run and its recomputation, however often it is called."""
    block = Modulated(8)
    recompute.checkpoint_module(block, recompute.Replay([]))
    with torch.inference_mode():
        x = torch.randn(2, 8)
    for _ in range(2):
        with Clones() as counted:
            block(x, torch.ones(2, 8, requires_grad=True) * 1.0, torch.ones(2, 8)).sum().backward()
    assert counted.count == 2


def test_an_input_a_block_updates_is_copied_for_its_recomputation_too():
    """Two blocks run on the same ``x``: the recomputation of the second (the first in the backward pass) updates
    its copy, not ``x``, from which the first is then recomputed. (Without the hook reader such blocks are not
    recomputed, and run on the caller's tensors, as without checkpointing.)"""
    if not recompute.has_hook_reader():
        pytest.skip("without the hook reader such blocks are not recomputed")
    results = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        blocks = [UpdatesItsInput(8, out_of_place=not checkpointed) for _ in range(2)]
        for m in blocks if checkpointed else []:
            recompute.checkpoint_module(m, recompute.Replay([]))
        vec, pe = torch.zeros(2, 8), torch.ones(2, 8)
        for _ in range(2):  # the second call is one whose copies were learnt
            for m in blocks:
                m.zero_grad()
            x = torch.randn(2, 8, requires_grad=True) * 1.0
            sum(m(x, vec, pe).square().sum() for m in blocks).backward()
        results[checkpointed] = [p.grad.clone() for m in blocks for p in m.parameters()]
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_block_given_a_slice_is_recomputed_on_what_its_forward_run_was_given():
    """A slice's copy is contiguous, the slice is not, and ``F.linear`` picks its kernel for a 3-d input by layout
    (one product over the flattened copy, or a batched one over the slice), each saving its two tensors in another
    order: the first call's recomputation runs on copies, as its forward run did (ComfyUI's LTX-2 gives its caption
    projection such a slice), or PyTorch refuses the recomputed values. The later calls get the slice itself in both
    passes."""
    results = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        before, block = torch.nn.Linear(4, 32), torch.nn.Linear(16, 8)
        if checkpointed:
            recompute.checkpoint_module(block, recompute.Replay([]))
        grads = []
        for _ in range(2):
            before.zero_grad()
            block.zero_grad()
            x = before(torch.randn(2, 8, 4))[:, :, :16]
            assert not x.is_contiguous() and x.clone().is_contiguous()
            block(x).square().mean().backward()
            grads.append([p.grad.clone() for m in (before, block) for p in m.parameters()])
        results[checkpointed] = grads
    for step_plain, step_recomputed in zip(results[False], results[True]):
        for a, b in zip(step_plain, step_recomputed):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _second_call_clones(device: str) -> list[int]:
    torch.manual_seed(0)
    block = UpdatesItsInput(8).to(device)
    recompute.checkpoint_module(block, recompute.Replay([]))
    vec, pe = torch.zeros(2, 8, device=device), torch.ones(2, 8, device=device)
    counts = []
    for _ in range(2):
        x = torch.randn(2, 8, device=device, requires_grad=True) * 1.0
        with Clones() as counted:
            block(x, vec, pe).square().sum().backward()
        counts.append(counted.count)
    return counts


def test_on_meta_every_save_the_block_updates_is_a_copy():
    """The memory estimate runs the model on ``meta``, where every storage's address is 0 and a copy cannot be told
    from another tensor: there the saves stay copies (what they were before inputs were saved in their place), and
    the estimate does not count a view of the input where a real run saves it."""
    if not recompute.has_hook_reader():
        pytest.skip("without the hook reader such a block is not recomputed")
    assert _second_call_clones("cpu") == [3 + 3 + 1, 1 + 1 + 1]
    assert _second_call_clones("meta") == [3 + 3 + 2, 1 + 1 + 2]
