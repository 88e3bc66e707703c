"""Stacking samples into a batch: tensors along a new first dimension, other leaves as per-sample lists."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from .errors import CacheError


def collate(samples: list[Any], pin: bool = False) -> Any:
    """Stack equal-structured samples; numpy arrays become tensors, scalars and strings become lists."""
    if not samples:
        raise CacheError("cannot collate an empty batch: give at least one sample")
    first = samples[0]
    if isinstance(first, torch.Tensor):
        shapes = {tuple(s.shape) for s in samples}
        if len(shapes) > 1 or any(s.dtype != first.dtype for s in samples):
            raise CacheError(f"cannot stack tensors of different shapes/dtypes into one batch: {sorted(shapes)}")
        out = torch.empty((len(samples), *first.shape), dtype=first.dtype, pin_memory=pin)
        return torch.stack(samples, out=out)
    if isinstance(first, np.ndarray):
        return collate([torch.from_numpy(s) for s in samples], pin)
    if type(first) in (dict, collections.OrderedDict):
        if any(not isinstance(s, dict) or s.keys() != first.keys() for s in samples):
            raise CacheError("cannot batch samples whose dicts have different keys")
        return type(first)((k, collate([s[k] for s in samples], pin)) for k in first)
    if type(first) in (list, tuple):
        if any(len(s) != len(first) for s in samples):
            raise CacheError("cannot batch samples whose lists have different lengths")
        parts = [collate([s[i] for s in samples], pin) for i in range(len(first))]
        return parts if type(first) is list else tuple(parts)
    return list(samples)


def replicate(value: Any, n: int) -> Any:
    """What :func:`collate` returns for ``n`` samples equal to ``value`` whose tensors are already batched."""
    if isinstance(value, torch.Tensor):
        return value
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((k, replicate(v, n)) for k, v in value.items())
    if type(value) in (list, tuple):
        parts = [replicate(v, n) for v in value]
        return parts if type(value) is list else tuple(parts)
    return [value] * n
