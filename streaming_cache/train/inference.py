"""Tensors made in inference mode, kept out of what autograd records: the one place that guarantees it.

Model runtimes such as ComfyUI build and load models under ``torch.inference_mode``. Such tensors cannot be saved
for the backward pass ("Inference tensors cannot be saved for backward"), and a parameter moved to another device
or dtype afterwards, outside inference mode, is worse: ``Module.to`` gives the parameter the new data in place
(``param.data = ...``), which clears its inference flag but not the missing version counter, so
``is_inference()`` says False and any view or saved use of it fails with "Inference tensors do not track version
counter" (every model a ComfyUI node loaded and training moved to a GPU). :func:`usable_in_autograd` tells both
apart from ordinary tensors; :func:`thaw` replaces them in a module by ordinary copies, once, before training, and
:func:`ordinary` does the same for what a training step hands the model (the cached conditioning, a family's extra
columns: a tensor that reaches a layer unchanged, as a conditioning does when no dtype cast copies it, is saved
for the backward pass as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def usable_in_autograd(tensor: torch.Tensor) -> bool:
    """Whether autograd can save ``tensor`` (or a view of it): neither an inference tensor nor a tensor that lost
    its version counter to one."""
    if tensor.is_inference():
        return False
    try:
        tensor._version  # noqa: B018  (raises for a tensor without a version counter)
    except RuntimeError:
        return False
    return True


def ordinary(value: Any) -> Any:
    """``value`` with every tensor autograd cannot use replaced by an ordinary copy, inside lists, tuples and dicts
    (new containers where something was replaced; the rest is returned as it is, tensors that are fine
    included)."""
    if isinstance(value, torch.Tensor):
        if usable_in_autograd(value):
            return value
        with torch.inference_mode(False), torch.no_grad():
            return value.clone()
    if isinstance(value, dict):
        items = {k: ordinary(v) for k, v in value.items()}
        return value if all(items[k] is value[k] for k in value) else _rebuilt(value, items)
    if isinstance(value, (list, tuple)):
        parts = [ordinary(v) for v in value]
        return value if all(a is b for a, b in zip(parts, value)) else _rebuilt(value, parts)
    return value


def _rebuilt(value: Any, parts: Any) -> Any:
    """A container of ``value``'s type holding ``parts`` (named tuples too; a plain dict or list where the type
    cannot be built from its items)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*parts)
    try:
        return type(value)(parts)
    except TypeError:
        return dict(parts) if isinstance(value, dict) else list(parts)


def thaw(module: torch.nn.Module, keep: Callable[[torch.Tensor], bool] | None = None) -> int:
    """Replace ``module``'s parameters and buffers that autograd cannot use (:func:`usable_in_autograd`) by
    ordinary copies with the same values, ``requires_grad`` and parameter type; returns how many. ``keep(tensor)``
    True leaves a tensor as it is (one the caller knows is never used directly). The old tensor is released, so
    the model holds one copy as before."""
    count = 0
    with torch.inference_mode(False):
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None or usable_in_autograd(tensor) or (keep is not None and keep(tensor)):
                        continue
                    with torch.no_grad():
                        copy = tensor.clone()
                    store[name] = torch.nn.Parameter(copy, requires_grad=tensor.requires_grad) \
                        if isinstance(tensor, torch.nn.Parameter) else copy  # type: ignore[assignment]
                    count += 1
    return count
