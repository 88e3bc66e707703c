"""Modules' forwards replaced for the length of a training run, and given back afterwards.

The trainer changes how some of a model's modules compute while it trains (fused adapter layers, compiled
blocks) by giving them an instance ``forward``; the class's own forward returns when the run ends, also on errors.
A module that already has an instance ``forward`` was replaced by someone else (gradient checkpointing, a bypass
hook, another extension) and is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def replaced_forwards(modules: Iterable[torch.nn.Module],
                      make: Callable[[torch.nn.Module], Callable[..., Any] | None]) -> Iterator[int]:
    """Each of ``modules`` runs ``make(module)`` as its forward while the block runs (``make`` returning None: the
    module is left as it is); yields how many were replaced."""
    installed: list[torch.nn.Module] = []
    try:
        for m in modules:
            if "forward" in m.__dict__:
                continue
            forward = make(m)
            if forward is not None:
                m.forward = forward
                installed.append(m)
        yield len(installed)
    finally:
        for m in installed:
            m.__dict__.pop("forward", None)
