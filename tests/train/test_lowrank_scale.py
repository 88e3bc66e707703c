"""The merged LoRA weight's backward pass with the scale inside the adapter's gradient products
(``lowrank.merged_weight``): where the scale ``alpha / rank`` is a power of two (ComfyUI's default alpha of 1 and a
rank of 16 give 1/16), two kernels fewer a layer and step than ``addmm``'s own backward (a product, then a
multiplication, for each of ``up`` and ``down``), and the same gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from streaming_cache.train import lowrank

pytestmark = pytest.mark.oldest_torch


class Ops(TorchDispatchMode):
    """The ATen operations dispatched while it is entered, by name (views left out: they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _layer(dtype: torch.dtype, scale: float, merge, seed: int = 0, shape=(48, 20), rank: int = 4) -> tuple:
    """A linear layer with a LoRA merged into its weight by ``merge``: its output and the gradients of the input,
    ``down`` and ``up``, and the operations of the backward pass."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(*shape, generator=g).to(dtype), torch.randn(shape[0], generator=g).to(dtype)
    down = torch.randn(rank, shape[1], generator=g).to(dtype).requires_grad_()
    up = torch.randn(shape[0], rank, generator=g).to(dtype).requires_grad_()
    x = torch.randn(3, 5, shape[1], generator=g).to(dtype).requires_grad_()
    y = F.linear(x, merge(weight, down, up, scale), bias)
    loss = y.float().sin().sum()
    with Ops() as ops:
        loss.backward()
    return [y.detach(), x.grad, down.grad, up.grad], ops.names


def _addmm(weight, down, up, scale):
    return torch.addmm(weight, up, down, alpha=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1 / 16, 0.5, 4.0, 2.0 ** -7])
def test_a_power_of_two_scale_gives_addmms_gradients_bit_for_bit_with_two_kernels_fewer(dtype, scale):
    for seed, (shape, rank) in enumerate([((48, 20), 4), ((300, 129), 16), ((8, 64), 1)]):
        got, ops = _layer(dtype, scale, lowrank.merged_weight, seed, shape, rank)
        expected, addmm_ops = _layer(dtype, scale, _addmm, seed, shape, rank)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        assert len(ops) == len(addmm_ops) - 2
        assert addmm_ops.count("mul") - ops.count("mul") == 2  # the loss's sine has one of its own


@pytest.mark.parametrize("scale", [0.37, 1.0, 1 / 3])
def test_other_scales_run_addmms_own_backward(scale):
    got, ops = _layer(torch.float32, scale, lowrank.merged_weight)
    expected, addmm_ops = _layer(torch.float32, scale, _addmm)
    assert ops == addmm_ops
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_exact_scales_are_the_powers_of_two_other_than_one():
    assert [lowrank.exact_scale(s) for s in (1 / 16, 0.5, 8.0, 2.0 ** -40)] == [True] * 4
    assert [lowrank.exact_scale(s) for s in (1.0, 0.0, -0.5, 0.37, 3.0, 1 / 3)] == [False] * 6


def test_only_the_gradients_asked_for_are_computed():
    """A frozen ``down`` (or ``up``) gets no product in the backward pass; a trained weight gets the gradient."""
    weight = torch.randn(6, 5, requires_grad=True)
    down, up = torch.randn(2, 5), torch.randn(6, 2, requires_grad=True)
    loss = lowrank.merged_weight(weight, down, up, 0.25).sum()
    with Ops() as ops:
        loss.backward()
    assert down.grad is None and ops.names.count("addmm") == 1
    torch.testing.assert_close(weight.grad, torch.ones(6, 5), rtol=0, atol=0)
    torch.testing.assert_close(up.grad, 0.25 * torch.ones(6, 5) @ down.t())


def test_the_merged_weight_of_a_convolution_keeps_its_shape_and_gradients():
    weight = torch.randn(6, 4, 3, 3)
    down, up = torch.randn(2, 36, requires_grad=True), torch.randn(6, 2, requires_grad=True)
    merged = lowrank.merged_weight(weight, down, up, 0.5)
    assert merged.shape == weight.shape
    torch.testing.assert_close(merged, weight + 0.5 * (up @ down).reshape(weight.shape))
    merged.square().sum().backward()
    grads = [down.grad.clone(), up.grad.clone()]
    down.grad = up.grad = None
    (weight + 0.5 * (up @ down).reshape(weight.shape)).square().sum().backward()
    for a, b in zip(grads, [down.grad, up.grad]):
        torch.testing.assert_close(a, b)


def test_compiled_it_gives_the_same_gradients():
    def loss(x, weight, down, up):
        return F.linear(x, lowrank.merged_weight(weight, down, up, 1 / 16)).sin().sum()

    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(4, 16, generator=g), torch.randn(32, 16, generator=g)
    down = torch.randn(4, 16, generator=g, requires_grad=True)
    up = torch.randn(32, 4, generator=g, requires_grad=True)
    eager = torch.autograd.grad(loss(x, weight, down, up), [down, up])
    compiled = torch.autograd.grad(torch.compile(loss, backend="aot_eager")(x, weight, down, up), [down, up])
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16], ids=["fp32 LoRA", "bf16 LoRA"])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_under_autocast_the_gradients_are_autocasts_in_the_lora_dtype(lora_dtype, autocast_dtype):
    """Training in bf16 or fp16 runs the layers under autocast, which casts an fp32 LoRA's matrices for the product:
    the backward pass computes in the product's dtype and gives the gradients in the matrices' own, the same bit for
    bit as autocast's ``addmm`` and its casts give them."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 12, generator=g).to(torch.bfloat16)
    up0, down0 = torch.randn(16, 4, generator=g).to(lora_dtype), torch.randn(4, 12, generator=g).to(lora_dtype)
    x = torch.randn(5, 12, generator=g).to(torch.bfloat16)
    grads = []
    for merged in (lowrank.merged_weight, lambda w, d, u, s: torch.addmm(w, u, d, alpha=s)):
        up, down = up0.clone().requires_grad_(), down0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = x @ merged(weight, down, up, 0.25).t()
        out.float().square().sum().backward()
        grads.append((up.grad, down.grad))
    (up_grad, down_grad), (up_ref, down_ref) = grads
    assert up_grad.dtype == down_grad.dtype == lora_dtype
    assert torch.equal(up_grad, up_ref) and torch.equal(down_grad, down_ref)
