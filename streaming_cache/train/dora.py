"""DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024) as ComfyUI's LoRA loaders apply it.

A DoRA layer's weight is ``(W + s B A) * m / ||W + s B A||``: the LoRA update ``s B A`` (``s = alpha / rank``)
sets the weight's direction and a trained magnitude ``m`` its norm. The norm here is taken over each input column
(``m`` of shape ``[1, in, 1, ...]``), the one axis ComfyUI's ``weight_decompose`` normalises the updated weight
along: for a magnitude per output row it divides by the norm of the weight before the update, which is not what
any trainer computes. LyCORIS writes this axis with ``wd_on_out=False``; A1111's and Forge's LyCORIS loaders read
both. The file holds ``m`` as ``<module>.dora_scale`` beside the LoRA matrices.

Starting from ``m = ||W||`` (:func:`initial_magnitude`) and the LoRA's zero update, a new DoRA layer begins as
the base weight, as PEFT's and LyCORIS's do.
"""

from __future__ import annotations

import torch


def column_norm(weight: torch.Tensor) -> torch.Tensor:
    """The norm of each input column of ``weight`` (``[out, in, ...]``), shaped ``[1, in, 1, ...]`` to broadcast."""
    columns = weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)
    return columns.reshape(1, weight.shape[1], *[1] * (weight.dim() - 2))


def initial_magnitude(weight: torch.Tensor) -> torch.Tensor:
    """A new DoRA layer's magnitude: the base weight's column norms (float32), so that it starts as the base."""
    return column_norm(weight.detach().to(torch.float32))


def check_magnitude(magnitude: torch.Tensor, weight_shape: torch.Size | tuple[int, ...], name: str) -> None:
    """Refuse a magnitude that is not one per input column of a weight of ``weight_shape`` (``name``: the layer)."""
    expected = (1, weight_shape[1], *[1] * (len(weight_shape) - 2))
    if tuple(magnitude.shape) != expected:
        raise ValueError(f"the DoRA magnitude of {name} has shape {tuple(magnitude.shape)}, not {expected}: one per "
                         "input column is what ComfyUI applies and Train LoRA trains (a magnitude per output row, "
                         "LyCORIS' wd_on_out or PEFT's, cannot be continued); train a new DoRA instead")


def decomposed(updated: torch.Tensor, magnitude: torch.Tensor, eps: float) -> torch.Tensor:
    """The DoRA weight from the updated weight ``W + s B A`` and the magnitude: each input column rescaled to the
    magnitude's norm (``eps``: ComfyUI adds the base weight dtype's epsilon to the norm)."""
    return updated * (magnitude / (column_norm(updated) + eps))
