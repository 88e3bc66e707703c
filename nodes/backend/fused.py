"""ComfyUI's layers computed directly while a LoRA trains: the adapter merged into the weight in one product or run
beside the frozen weight (``streaming_cache.train.lowrank``), trained bias and norm differences added to the weight,
in place of ComfyUI's casting path.

ComfyUI applies training adapters as weight wrappers: every call of a wrapped layer copies its weight, merges the
adapter into the copy and runs the layer on it, through a cast path written for offloading and quantized weights
(several Python calls and up to eight kernels a layer). On a model of a thousand layers that is most of a training
step's time on a fast GPU. :func:`fused_layers` gives each layer whose wrappers are the ones training added (a
plain LoRA, trained bias and norm-weight differences) a forward that computes the same function in two to four
kernels, and leaves every other layer, and every call it cannot serve, to ComfyUI: weights not on the input's
device (offloading), quantized weights, layers whose class computes differently from ComfyUI's plain cast ops
(scaled fp8, fp8 matrix products, mixed precision, a family's own layers), LoRA variants other than plain LoRA,
other wrappers or patches, layers something else already replaced the forward of (bypass hooks, checkpointing).

The wrappers stay registered, so whatever ComfyUI does with the model (previews, the fallback calls, saving)
sees the adapters as before; the fused forward reads the same parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ...streaming_cache.train import lowrank
from ...streaming_cache.train.forwards import replaced_forwards
from ...streaming_cache.train.inference import usable_in_autograd
from . import compat

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if device != "meta" and torch.is_autocast_enabled(device):  # meta has no autocast (the memory estimate's)
        return torch.get_autocast_dtype(device)
    return x.dtype


def _plain_lora(adapter: Any) -> bool:
    """A LoRA layer the fused forward computes: up and down only (no Tucker mid matrix, no DoRA magnitude)."""
    return isinstance(adapter, compat.LoraDiff) and adapter.lora_mid is None and \
        isinstance(adapter.lora_up, torch.nn.Linear) and getattr(adapter, "dora_scale", None) is None


def _fused_forward(m: torch.nn.Module, original: Callable[..., Any], mode: str) -> Callable[..., Any] | None:
    """The fused forward of ``m``, or None when its wrappers or kind are not ones it serves."""
    if not compat.standard_layer(m):
        return None
    wf, bf = list(m.weight_function), list(m.bias_function)
    if len(wf) > 1 or len(bf) > 1:
        return None
    adapter = wf[0] if wf else None
    bias_diff = bf[0] if bf else None
    if bias_diff is not None and not isinstance(bias_diff, compat.BiasDiff):
        return None
    if isinstance(m, torch.nn.Linear) or (isinstance(m, _CONVS) and m.groups == 1 and m.padding_mode == "zeros"):
        if not _plain_lora(adapter):
            return None
        scale = float(adapter.alpha) / adapter.rank
        down_w, up_w = adapter.lora_down.weight, adapter.lora_up.weight
        conv = not isinstance(m, torch.nn.Linear)
        fan_in, fan_out = down_w.shape[1], up_w.shape[0]
        channels = m.in_channels if conv else m.in_features

        def layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
            # in the dtype the layer computes in (autocast's): casting the weight to the input's dtype first, as
            # ComfyUI's cast path does, makes the same values with two more full-size copies
            dtype = _compute_dtype(x)
            weight, down, up = weight.to(dtype), down_w.to(dtype), up_w.to(dtype)
            if bias is not None:
                bias = lowrank.shifted(bias, bias_diff.bias, dtype) if bias_diff is not None else bias.to(dtype)
            low = mode == "lowrank" or (mode == "auto" and lowrank.prefers_low_rank(x.numel() // channels, fan_in,
                                                                                     fan_out))
            if not low:
                weight = lowrank.merged_weight(weight, down, up, scale)
                if conv:
                    return F.conv1d(x, weight, bias, m.stride, m.padding, m.dilation) if weight.ndim == 3 else \
                        F.conv2d(x, weight, bias, m.stride, m.padding, m.dilation)
                return F.linear(x, weight, bias)
            if conv:
                return lowrank.conv(x, weight, bias, down, up, scale, m.stride, m.padding, m.dilation)
            return lowrank.linear(x, weight, bias, down, up, scale)
    elif isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        if adapter is not None and not isinstance(adapter, compat.BiasDiff):
            return None
        group = isinstance(m, torch.nn.GroupNorm)

        def layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
            weight = lowrank.shifted(weight, adapter.bias, x.dtype) if adapter is not None else weight.to(x.dtype)
            if bias is not None:
                bias = lowrank.shifted(bias, bias_diff.bias, x.dtype) if bias_diff is not None else bias.to(x.dtype)
            if group:
                return F.group_norm(x, m.num_groups, weight, bias, m.eps)
            return F.layer_norm(x, m.normalized_shape, weight, bias, m.eps)
    else:
        return None

    def forward(*args: Any, **kwargs: Any) -> Any:
        weight, bias = m.weight, m.bias
        wf_now, bf_now = m.weight_function, m.bias_function
        if (kwargs or len(args) != 1 or weight is None or type(weight) not in _PLAIN
                or len(wf_now) != len(wf) or (wf and wf_now[0] is not adapter)
                or len(bf_now) != len(bf) or (bf and bf_now[0] is not bias_diff)
                or weight.device != args[0].device or not usable_in_autograd(weight)
                or (bias is not None and (type(bias) not in _PLAIN or not usable_in_autograd(bias)))):
            return original(*args, **kwargs)
        # detached: autograd keeps these tensors, not the module's parameters, which ComfyUI may swap
        return layer(args[0], weight.detach(), None if bias is None else bias.detach())

    return forward


MODES = ("auto", "lowrank", "merged", "off")
"""``auto``: each LoRA layer in the form that is faster at its size (``lowrank.prefers_low_rank``); ``lowrank`` /
``merged``: every one in that form; ``off``: ComfyUI's weight wrappers."""


@contextlib.contextmanager
def fused_layers(model: torch.nn.Module, mode: str = "auto") -> Iterator[int]:
    """Fused forwards on ``model``'s trainable layers (those with ComfyUI's ``weight_function``) while the block
    runs, in ``mode`` (:data:`MODES`); yields how many layers got one. Install after the model is loaded for
    training (the wrappers are attached at load) and before checkpointing wraps the blocks; removed on exit, also
    on errors."""
    if mode not in MODES:
        raise ValueError(f"unknown fused-layer mode {mode!r}; choose one of {', '.join(MODES)}")
    layers = [m for m in model.modules() if hasattr(m, "weight_function")] if mode != "off" else []
    with replaced_forwards(layers, lambda m: _fused_forward(m, m.forward, mode)) as count:
        yield count
