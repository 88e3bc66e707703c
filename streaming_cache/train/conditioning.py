"""Collated batches as a diffusion model's conditioning: one CONDITIONING for a whole batch in which every sample
keeps its own caption, the samples a batch must split into, the reference latents of edit pairs, and caption
dropout.

A *collated* value is what :meth:`DatasetHandle.collate` returns for a batch of entries: tensors stacked on a
new first (sample) dimension, scalars and strings as one list per sample. A CONDITIONING is ComfyUI's value: a
list of ``[tensor, options]`` pairs whose tensors carry a batch dimension. No ComfyUI is needed here: these are
plain tensors, lists and dicts, so the rules are tested on their own (``tests/train/test_conditioning.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..fallbacks import PINNED_MEMORY, Fallbacks, describe
from ..transfers import Transfers, for_device


def flatten_batch(t: torch.Tensor) -> torch.Tensor:
    """Collated entries are stacked on a new first dim; ComfyUI values already carry a batch dim of 1."""
    return t.flatten(0, 1) if t.dim() >= 2 else t


def _batch_option(value: Any, batch: int) -> Any:
    """One option of a collated conditioning dict, as a single conditioning for ``batch`` samples holds it.

    The rule is ComfyUI's own for conditioning shared by a batch: a value every sample has alike is given once
    (with batch dimension 1; ComfyUI repeats it to the batch), a tensor that differs is stacked, one row per
    sample. Giving an equal value once matters: some models derive sizes from it (Lumina 2 counts its text
    tokens as the sum of ``attention_mask``, which stacking would double). A list of tensors (e.g.
    ``reference_latents``) follows the rule element by element; scalars (guidance, sizes) are equal within a
    batch, whose rows share their shapes."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and all(torch.equal(value[0], value[i]) for i in range(1, value.shape[0])):
            return value[0]
        if _unbatched(value, batch):
            raise ValueError("samples of one model call differ in an option ComfyUI holds once per conditioning; "
                             "group them with option_groups first")
        return flatten_batch(value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [_batch_option(v, batch) for v in value]
    if isinstance(value, list) and len(value) == batch:
        return value[0]
    return value


def batch_conditioning(cond: Any) -> list:
    """A collated CONDITIONING (one list per entry, stacked) -> one CONDITIONING with batch = samples, so each
    sample keeps its own caption (ComfyUI's TrainLoraNode averages all captions of a batch instead)."""
    out = []
    for c, extra in cond:
        batch = c.shape[0]
        out.append([flatten_batch(c), {k: _batch_option(v, batch) for k, v in extra.items()}])
    return out


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (also inside lists such as ``reference_latents``) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def upload(tensor: torch.Tensor, device: torch.device, fallbacks: Fallbacks | None = None, *,
           pin_budget: Callable[[int], bool] | None = None, transfers: Transfers | None = None) -> torch.Tensor:
    """A CPU ``tensor`` on ``device`` without making the host wait: a plain copy to a CUDA device waits until the
    stream has run everything queued on it, so one small tensor made on the host (a step's noise, noise levels,
    loss weights) would keep the host from preparing a step while the device still runs the previous one. On
    CUDA the copy goes through pinned memory (PyTorch's caching host allocator holds the block until the copy has
    run); elsewhere it is a plain ``to``. ``transfers``: how (:func:`~..transfers.for_device` of ``device`` when
    None: the CPU emulation on the CPU with ``STREAMING_CACHE_EMULATE_DEVICE=1``).

    It pins only while ``pin_budget(nbytes)`` allows (the host's budget: ComfyUI's, which refuses every pin when
    it was started with ``--disable-pinned-memory``) and no pin of the run failed (``fallbacks``); a pin that
    raises makes this copy plain and is noted there as ``PINNED_MEMORY``."""
    if tensor.device.type != "cpu":
        return tensor.to(device)
    transfers = transfers if transfers is not None else for_device(device)
    if transfers is None or (fallbacks is not None and fallbacks.reason(PINNED_MEMORY) is not None):
        return tensor.to(device)
    try:
        if pin_budget is not None and not pin_budget(tensor.nelement() * tensor.element_size()):
            return tensor.to(device)
        pinned = transfers.pin(tensor)
    except Exception as exc:  # out of pinned memory: the plain copy, and no more pins in this run
        if fallbacks is not None:
            fallbacks.note(PINNED_MEMORY, f"pinning host memory for a step's tensor failed ({describe(exc)})")
        return tensor.to(device)
    return transfers.copy(pinned, device)


def _is_leaf_list(value: Any) -> bool:
    """A list collate made of one scalar, string or None per sample (not a structure of tensors)."""
    return isinstance(value, list) and bool(value) and \
        not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in value)


def take_rows(value: Any, rows: list[int]) -> Any:
    """The samples ``rows`` of a collated batch: tensors indexed on their first (sample) dimension, per-sample
    scalar lists picked, structures kept."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, dict):
        return type(value)((k, take_rows(v, rows)) for k, v in value.items())
    if _is_leaf_list(value):
        return [value[i] for i in rows]
    if isinstance(value, (list, tuple)):
        return type(value)(take_rows(v, rows) for v in value)
    return value


def _unbatched(value: Any, batch: int) -> bool:
    """A collated tensor whose per-sample values have no batch dimension (a scalar, or 1-D like Anima's T5 token
    ids): ComfyUI holds one such value per conditioning, as it does a scalar option."""
    return isinstance(value, torch.Tensor) and value.dim() <= 2 and value.shape[:1] == (batch,)


def option_groups(cond: Any, batch: int) -> list[list[int]]:
    """Samples of a collated CONDITIONING grouped by their scalar options (SDXL's size conditioning, Flux
    guidance, ...) and by options that are tensors without a batch dimension (Anima's T5 token ids). ComfyUI
    gives a conditioning one value of such an option for the whole batch, so samples that differ in one must run
    as separate model calls; usually there is one group, the whole batch."""
    keys: list[tuple] = [() for _ in range(batch)]
    for _, extra in cond:
        for name in sorted(extra):
            value = extra[name]
            if _is_leaf_list(value) and len(value) == batch and any(v != value[0] for v in value[1:]):
                keys = [k + ((name, repr(value[i])),) for i, k in enumerate(keys)]
            elif _unbatched(value, batch) and any(not torch.equal(value[0], value[i]) for i in range(1, batch)):
                firsts = [next(j for j in range(batch) if torch.equal(value[j], value[i])) for i in range(batch)]
                keys = [k + ((name, firsts[i]),) for i, k in enumerate(keys)]
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())


def append_reference(cond: list, latent: torch.Tensor) -> list:
    """What ComfyUI's ReferenceLatent node does to a conditioning: ``latent`` appended to the list under
    ``reference_latents`` of every entry (a new list; the input is not changed). With one reference latent
    per sample (batch dimension = samples), each sample is conditioned on its own reference."""
    out = []
    for c, extra in cond:
        extra = dict(extra)
        extra["reference_latents"] = list(extra.get("reference_latents") or []) + [latent]
        out.append([c, extra])
    return out


def set_values(cond: list, values: dict[str, Any]) -> list:
    """What ComfyUI's ``conditioning_set_values`` does: every entry of ``cond`` with ``values`` set (new dicts; the
    input is not changed)."""
    return [[c, dict(extra, **values)] for c, extra in cond]


def set_default(cond: list, name: str, value: Any) -> list:
    """``cond`` with option ``name`` set to ``value`` in entries that do not have it."""
    return [[c, extra if name in extra else dict(extra, **{name: value})] for c, extra in cond]


def _rows_replaced(value: torch.Tensor, empty: torch.Tensor, drop: list[bool]) -> torch.Tensor:
    """``value`` (samples stacked first) with the rows marked in ``drop`` replaced by ``empty`` (one sample's
    value), built where ``value`` is: the batch is on the training device, the cached empty caption and the
    decisions on the host."""
    rows = torch.tensor(drop, device=value.device).view(-1, *([1] * (value.dim() - 1)))
    return torch.where(rows, empty.to(value.device, value.dtype)[None], value)


def _repeated(value: Any, n: int, like: torch.Tensor) -> Any:
    """One sample's ``value`` repeated for ``n`` samples, on the device of ``like`` (tensors only)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(like.device)[None].expand(n, *value.shape).contiguous()


def drop_captions(cond: Any, empty: Any, drop: list[bool]) -> Any:
    """A collated CONDITIONING with the samples marked in ``drop`` given the empty caption's conditioning
    ``empty`` (one entry, as cached). Samples are replaced row by row where the shapes agree (CLIP's fixed 77
    tokens); otherwise the whole batch takes the empty caption if its first sample is dropped. What replaces a
    sample lands on the device of the conditioning it replaces (the empty caption is cached on the host)."""
    if not any(drop):
        return cond
    (e_cond, e_extra), = empty
    out = []
    for c, extra in cond:
        if tuple(c.shape[2:]) == tuple(e_cond.shape[1:]):
            extra = dict(extra)
            for k, v in e_extra.items():
                if isinstance(v, torch.Tensor) and isinstance(extra.get(k), torch.Tensor) and \
                        tuple(extra[k].shape[2:]) == tuple(v.shape[1:]):
                    extra[k] = _rows_replaced(extra[k], v, drop)
            out.append([_rows_replaced(c, e_cond, drop), extra])
        elif drop[0]:
            n = c.shape[0]
            out.append([_repeated(e_cond, n, c), {k: _repeated(v, n, c) for k, v in e_extra.items()}])
        else:
            out.append([c, extra])
    return out
