"""Layers with a trainable low-rank adapter, computed beside the frozen weight instead of merged into it.

A LoRA adapter changes a layer's weight to ``W + s * up @ down``. Merging that sum into a new weight at every
call, as weight wrappers do, writes a full-size weight per layer in the forward pass (and again in a checkpoint's
recomputation), and makes autograd compute the full-size weight gradient ``dL/dW'`` in the backward pass only to
project it onto ``up`` and ``down``: on a large model that gradient is a third of the step's matrix work. Here the
layer computes ``W x + s * up (down x)``: the frozen weight is only read, the backward pass computes the input
gradient through ``W`` and the small products of the adapter, nothing else. The result is the same function
(equal in exact arithmetic; in floating point the adapter's contribution is not rounded into the weight's dtype,
so it is the more accurate of the two).

The functions take plain tensors; which module gets which is decided by the model runtime
(``nodes/backend/fused.py`` for ComfyUI's layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


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
