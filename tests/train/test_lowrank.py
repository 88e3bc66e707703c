"""The low-rank layers (streaming_cache/train/lowrank.py) compute the layer with the merged weight, in float64 to
rounding, for linear layers and convolutions of every supported dimension, stride, padding and dilation, and their
gradients with respect to the adapter match the merged form's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streaming_cache.train import lowrank

pytestmark = pytest.mark.oldest_torch


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err = float((a - b).detach().abs().max() / b.detach().abs().max())
    assert err < 1e-12, err


@pytest.mark.parametrize("shape", [(5, 12), (2, 7, 12), (2, 3, 4, 12)])
def test_linear_equals_the_merged_weight_and_its_adapter_gradients(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    w, b = torch.randn(9, 12, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    down = torch.randn(3, 12, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    fused = lowrank.linear(x, w, b, down, up, 0.37)
    merged = F.linear(x, w + 0.37 * up @ down, b)
    _close(fused, merged)
    grads = torch.autograd.grad((fused * merged.detach().sin()).sum(), [down, up])
    expected = torch.autograd.grad((merged * merged.detach().sin()).sum(), [down, up])
    for a, e in zip(grads, expected):
        _close(a, e)


@pytest.mark.parametrize("dims,stride,padding,dilation", [
    (1, (1,), (1,), (1,)), (1, (2,), (0,), (2,)),
    (2, (1, 1), (1, 1), (1, 1)), (2, (2, 1), (0, 2), (1, 2)), (2, (1, 1), "same", (1, 1)),
    (3, (1, 2, 1), (1, 0, 1), (1, 1, 1))])
def test_conv_equals_the_merged_kernel_and_its_adapter_gradients(dims, stride, padding, dilation):
    g = torch.Generator().manual_seed(dims)
    kernel = (3,) * dims
    x = torch.randn(2, 4, *([9] * dims), generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, *kernel, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    down = torch.randn(2, 4 * 3 ** dims, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    fused = lowrank.conv(x, w, b, down, up, 0.5, stride, padding, dilation)
    merged = conv(x, w + 0.5 * (up @ down).reshape(w.shape), b, stride, padding, dilation)
    _close(fused, merged)
    grads = torch.autograd.grad((fused * merged.detach().cos()).sum(), [down, up])
    expected = torch.autograd.grad((merged * merged.detach().cos()).sum(), [down, up])
    for a, e in zip(grads, expected):
        _close(a, e)


def test_shifted_adds_in_the_differences_dtype_and_returns_the_asked_one():
    base = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    diff = torch.tensor([1e-3, -1e-3], dtype=torch.float32)
    out = lowrank.shifted(base, diff, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, base.float() + diff)
    assert lowrank.shifted(base, diff, torch.bfloat16).dtype == torch.bfloat16
