"""Layers with a trainable low-rank adapter, computed beside the frozen weight instead of merged into it.

A LoRA adapter changes a layer's weight to ``W + s * up @ down``. Merging that sum into a new weight at every
call, as weight wrappers do, writes a full-size weight per layer in the forward pass (and again in a checkpoint's
recomputation), and makes autograd compute the full-size weight gradient ``dL/dW'`` in the backward pass only to
project it onto ``up`` and ``down``: on a large model that gradient is a third of the step's matrix work. Here the
layer computes ``W x + s * up (down x)``: the frozen weight is only read, the backward pass computes the input
gradient through ``W`` and the small products of the adapter, nothing else. The result is the same function
(equal in exact arithmetic; in floating point the adapter's contribution is not rounded into the weight's dtype,
so it is the more accurate of the two).

Which form is faster depends on the layer: the low-rank form launches three matrix products in the forward pass
and five in the backward pass where the merged form (:func:`merged_linear`: one fused ``weight + s * up @ down``
product, then the layer) launches two and four; on a small layer the launches cost more than the full-size weight
gradient saves. :func:`prefers_low_rank` decides from the work of that gradient.

The functions take plain tensors; which module gets which is decided by the model runtime
(``nodes/backend/fused.py`` for ComfyUI's layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

LOW_RANK_MIN_FLOPS = 64e9
"""The work of a layer's full-size weight gradient (FLOPs) above which the low-rank form is used: about a tenth of
a millisecond on a data-centre GPU, what three more kernel launches and their autograd nodes cost its host."""


def prefers_low_rank(tokens: int, fan_in: int, fan_out: int, threshold: float = LOW_RANK_MIN_FLOPS) -> bool:
    """Whether a layer computing ``tokens`` outputs of ``fan_out`` from ``fan_in`` inputs each (for a convolution:
    output positions, ``in * kernel`` and ``out``) runs faster in the low-rank form: when the full-size weight
    gradient the merged form computes (``2 * tokens * fan_in * fan_out`` FLOPs) outweighs the extra launches."""
    return 2.0 * tokens * fan_in * fan_out >= threshold


def exact_scale(scale: float) -> bool:
    """Whether multiplying by ``scale`` is exact in binary floating point (barring overflow and underflow): a
    positive power of two other than 1, as the scale ``alpha / rank`` is with ComfyUI's default alpha of 1 and a
    rank that is a power of two."""
    return scale > 0 and scale != 1 and math.frexp(scale)[0] == 0.5


class _Merged(torch.autograd.Function):
    """``weight + scale * up @ down`` (2-D) whose backward pass applies ``scale`` inside the adapter's two gradient
    products (``addmm``'s ``alpha``) instead of in a multiplication after each, as ``addmm``'s own backward does:
    two kernels fewer a layer and step. Used where ``scale`` is a power of two (:func:`exact_scale`): scaling is then
    exact and commutes with the products' rounding, so the gradients are the same, bit for bit."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.scale, ctx.weight_dtype = scale, weight.dtype
        ctx.save_for_backward(up, down)
        return torch.addmm(weight, up, down, alpha=scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        up, down = ctx.saved_tensors
        # under autocast the product ran in the gradient's dtype (bf16, fp16) from matrices kept in another (an fp32
        # LoRA): the gradients are computed in that dtype and given back in the matrices' own, as autocast's casts
        # would have (they are not in this function's graph)
        u, d = up.to(grad.dtype), down.to(grad.dtype)
        grad_up = torch.addmm(u, grad, d.t(), beta=0, alpha=ctx.scale).to(up.dtype) \
            if ctx.needs_input_grad[1] else None
        grad_down = torch.addmm(d, u.t(), grad, beta=0, alpha=ctx.scale).to(down.dtype) \
            if ctx.needs_input_grad[2] else None
        return grad.to(ctx.weight_dtype) if ctx.needs_input_grad[0] else None, grad_up, grad_down, None


def merged_weight(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * up @ down`` reshaped to ``weight``'s shape, in one fused matrix product (its backward pass
    with the scale inside the products where that is exact: :class:`_Merged`)."""
    flat = weight.reshape(weight.shape[0], -1)
    if exact_scale(scale) and torch.is_grad_enabled() and (up.requires_grad or down.requires_grad):
        return _Merged.apply(flat, up, down, scale).view(weight.shape)
    return torch.addmm(flat, up, down, alpha=scale).view(weight.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor,
           up: torch.Tensor, scale: float) -> torch.Tensor:
    """``F.linear(x, weight + scale * up @ down, bias)`` without forming the merged weight. ``down``: ``[rank,
    in]``, ``up``: ``[out, rank]``."""
    return torch.add(F.linear(x, weight, bias), F.linear(F.linear(x, down), up), alpha=scale)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor, up: torch.Tensor,
         scale: float, stride: Sequence[int], padding: Sequence[int] | str, dilation: Sequence[int]) -> torch.Tensor:
    """A convolution (1-3 spatial dimensions, one group) whose kernel is ``weight + scale * (up @ down)`` reshaped
    to ``weight``'s shape, without forming that kernel: the input is convolved with ``down`` as ``rank`` kernels of
    the layer's size, stride, padding and dilation, then mixed by ``up`` (a 1x1 convolution). ``down``: ``[rank,
    in * kernel]``, ``up``: ``[out, rank]``."""
    dims = weight.ndim - 2
    fn = _CONV[dims]
    rank = down.shape[0]
    low = fn(x, down.reshape(rank, *weight.shape[1:]), None, stride, padding, dilation)
    mixed = fn(low, up.reshape(*up.shape, *([1] * dims)))
    return torch.add(fn(x, weight, bias, stride, padding, dilation), mixed, alpha=scale)


def shifted(base: torch.Tensor, diff: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``base + diff`` in ``dtype``, added in ``diff``'s dtype: a trained difference of a bias or norm weight, as
    ComfyUI's ``BiasDiff`` applies it to the weight cast for the call."""
    return (base.to(dtype).to(diff.dtype) + diff).to(dtype)
