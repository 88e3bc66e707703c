"""Collated batches as a diffusion model's conditioning: one CONDITIONING for a whole batch in which every sample
keeps its own caption, the samples a batch must split into, the reference latents of edit pairs, and caption
dropout.

A *collated* value is what :meth:`DatasetHandle.collate` returns for a batch of entries: tensors stacked on a
new first (sample) dimension, scalars and strings as one list per sample. A CONDITIONING is ComfyUI's value: a
list of ``[tensor, options]`` pairs whose tensors carry a batch dimension. No ComfyUI is needed here: these are
plain tensors, lists and dicts, so the rules are tested on their own (``tests/train/test_conditioning.py``).

No host read of device values inside a micro-step: a training step runs these functions on a batch the loader has
put on the device, so they decide from host data only (how the samples split, which captions drop, which samples
hold equal options: :func:`mark_equal_samples`, run on the host before the copy) and neither read a device value nor
copy host memory to the device, either of which makes the host wait for the device (and cannot be recorded in a
CUDA graph). ``tests/train/test_host_waits.py`` counts such calls in a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..fallbacks import PINNED_MEMORY, Fallbacks, describe
from ..transfers import Transfers, for_device


def flatten_batch(t: torch.Tensor) -> torch.Tensor:
    """Collated entries are stacked on a new first dim; ComfyUI values already carry a batch dim of 1."""
    return t.flatten(0, 1) if t.dim() >= 2 else t


EQUAL_SAMPLES = "streaming_cache_equal_samples"
"""The option under which a collated conditioning entry may carry :class:`EqualSamples` (set on the host by
:func:`mark_equal_samples`; never handed to ComfyUI: :func:`batch_conditioning` leaves it out)."""

Key = tuple[str, int | None]
"""An option of a conditioning entry: its name, and for a list of tensors the index of one of them (else None)."""


@dataclass(frozen=True)
class EqualSamples:
    """Which samples of a collated conditioning entry hold equal values of its tensor options, decided on the host so
    that the step on the device does not read device values to decide it. ``classes``: per option (:data:`Key`),
    a class per sample, equal for samples whose values are equal (the index of the first such sample when marked);
    ``empty``: per option the caption dropout replaces row by row, the class of the empty caption's value (a class
    of its own when it equals no sample's)."""

    classes: Mapping[Key, tuple[int, ...]]
    empty: Mapping[str, int]

    def take(self, rows: Sequence[int]) -> EqualSamples:
        """The classes of the samples ``rows``."""
        return EqualSamples({k: tuple(c[i] for i in rows) for k, c in self.classes.items()}, self.empty)

    def dropped(self, names: Sequence[str], drop: Sequence[bool]) -> EqualSamples:
        """The classes once the samples marked in ``drop`` hold the empty caption's value of the options ``names``
        (an option whose empty class is unknown is left out: it is then compared where it is)."""
        classes = dict(self.classes)
        for name in names:
            key: Key = (name, None)
            if key not in classes:
                continue
            if name not in self.empty:
                del classes[key]
                continue
            classes[key] = tuple(self.empty[name] if d else c for c, d in zip(classes[key], drop))
        return EqualSamples(classes, self.empty)


HOST_ROWS = "streaming_cache_host_rows"
"""The option under which a conditioning entry may carry :class:`HostRows` (set on the host by :func:`keep_on_host`;
never handed to ComfyUI: :func:`host_rows_applied` puts its values in place of the options)."""

MARKERS = (EQUAL_SAMPLES, HOST_ROWS)
"""The pack's own options of a conditioning entry, which are not ComfyUI's."""


@dataclass(frozen=True)
class HostRows:
    """Host copies of options that a model's conditioning code reads on the host: ComfyUI's SDXL builds its size
    embedding on the host and copies the pooled output there to join it, which from a device tensor makes the
    host wait for the device at every model call. Kept beside the device copy (collated: samples stacked first, or
    one sample as cached), these follow every change the step makes to the options (rows taken, captions dropped,
    the batch's value) on the host, and replace the device values just before ComfyUI reads them."""

    values: Mapping[str, torch.Tensor]

    def take(self, rows: Sequence[int]) -> HostRows:
        """The samples ``rows``."""
        return HostRows({k: pick_rows(v, rows) for k, v in self.values.items()})


def _classes_of(value: torch.Tensor, classes: Sequence[int] | None) -> tuple[int, ...]:
    """A class per sample of ``value`` (samples stacked first; equal values, equal classes): ``classes`` when the
    host decided them, else the index of the first equal sample, compared where ``value`` is."""
    if classes is not None and len(classes) == value.shape[0]:
        return tuple(classes)
    n = value.shape[0]
    return tuple(next((j for j in range(i) if torch.equal(value[j], value[i])), i) for i in range(n))


def _all_equal(value: torch.Tensor, classes: Sequence[int] | None) -> bool:
    """Whether every sample of ``value`` holds the same value: from ``classes`` when the host decided it (no read of
    a device value), else compared where ``value`` is."""
    if classes is not None and len(classes) == value.shape[0]:
        return len(set(classes)) <= 1
    return all(torch.equal(value[0], value[i]) for i in range(1, value.shape[0]))


def _batch_option(value: Any, batch: int, key: Key, equal: EqualSamples | None) -> Any:
    """One option of a collated conditioning dict, as a single conditioning for ``batch`` samples holds it.

    The rule is ComfyUI's own for conditioning shared by a batch: a value every sample has alike is given once
    (with batch dimension 1; ComfyUI repeats it to the batch), a tensor that differs is stacked, one row per
    sample. Giving an equal value once matters: some models derive sizes from it (Lumina 2 counts its text
    tokens as the sum of ``attention_mask``, which stacking would double). A list of tensors (e.g.
    ``reference_latents``) follows the rule element by element; scalars (guidance, sizes) are equal within a
    batch, whose rows share their shapes. Which samples are equal comes from ``equal`` (decided on the host)
    where it has the option."""
    if isinstance(value, torch.Tensor):
        classes = None if equal is None else equal.classes.get(key)
        if value.dim() >= 2 and _all_equal(value, classes):
            return value[0]
        if _unbatched(value, batch):
            raise ValueError("samples of one model call differ in an option ComfyUI holds once per conditioning; "
                             "group them with option_groups first")
        return flatten_batch(value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [_batch_option(v, batch, (key[0], k), equal) for k, v in enumerate(value)]
    if isinstance(value, list) and len(value) == batch:
        return value[0]
    return value


def batch_conditioning(cond: Any) -> list:
    """A collated CONDITIONING (one list per entry, stacked) -> one CONDITIONING with batch = samples, so each
    sample keeps its own caption (ComfyUI's TrainLoraNode averages all captions of a batch instead)."""
    out = []
    for c, extra in cond:
        batch, equal = c.shape[0], extra.get(EQUAL_SAMPLES)
        options = {k: _batch_option(v, batch, (k, None), equal) for k, v in extra.items() if k not in MARKERS}
        host = extra.get(HOST_ROWS)
        if isinstance(host, HostRows):
            options[HOST_ROWS] = HostRows({k: _batch_option(v, batch, (k, None), equal)
                                           for k, v in host.values.items() if k in options})
        out.append([flatten_batch(c), options])
    return out


def keep_on_host(cond: Any, names: Sequence[str]) -> Any:
    """``cond`` (a CONDITIONING on the host: collated, or one entry as cached) with a host copy of its options
    ``names`` kept as :class:`HostRows` (copies: the loader may reuse the memory it collated into). Unchanged where
    ``names`` is empty or an entry has none of them."""
    if not names:
        return cond
    out = []
    for c, extra in cond:
        kept = {k: extra[k].detach().clone() for k in names if isinstance(extra.get(k), torch.Tensor)}
        out.append([c, {**extra, HOST_ROWS: HostRows(kept)} if kept else extra])
    return out


def host_rows_applied(cond: list) -> list:
    """A model call's CONDITIONING (:func:`step_conditioning`) with each option kept on the host
    (:func:`keep_on_host`) given its host value, and no marker left: what ComfyUI's conditioning code reads."""
    out = []
    for c, extra in cond:
        host = extra.get(HOST_ROWS)
        if isinstance(host, HostRows):
            extra = {**{k: v for k, v in extra.items() if k != HOST_ROWS}, **host.values}
        out.append([c, extra])
    return out


def step_conditioning(cond: Any, empty: Any = None, drop: Sequence[bool] | None = None) -> list:
    """A collated CONDITIONING as the one CONDITIONING of a model call in a training step: the samples marked in
    ``drop`` given the empty caption's conditioning ``empty`` (:func:`drop_captions`; keep it on the device of
    ``cond``, copied there once), then as :func:`batch_conditioning` gives it."""
    if drop is not None:
        cond = drop_captions(cond, empty, drop)
    return batch_conditioning(cond)


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


def sample_rows(samples: Sequence[int], per: int) -> list[int]:
    """The latent rows of ``samples`` when each sample has ``per`` rows (a clip's frames where they are the model's
    batch, as SVD's are; else 1)."""
    return [i * per + j for i in samples for j in range(per)]


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` as runs of consecutive rows, ``(start, stop)`` each."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def pick_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows ``rows`` of ``t`` (its first dimension), without an index made on the host: a slice where they are
    consecutive, else the slices of their runs joined. A list as an index is copied to the device first, and the
    host waits for that copy. Rows out of range raise ``IndexError``, as such an index does."""
    if any(not 0 <= r < t.shape[0] for r in rows):
        raise IndexError(f"rows {list(rows)} of a tensor of {t.shape[0]}")
    runs = _runs(rows)
    if not runs:
        return t[:0]
    if len(runs) == 1:
        return t[runs[0][0]:runs[0][1]]
    return torch.cat([t[a:b] for a, b in runs])


def take_rows(value: Any, rows: Sequence[int]) -> Any:
    """The samples ``rows`` of a collated batch: tensors' rows on their first (sample) dimension
    (:func:`pick_rows`), per-sample scalar lists picked, structures kept."""
    if isinstance(value, torch.Tensor):
        return pick_rows(value, rows)
    if isinstance(value, (EqualSamples, HostRows)):
        return value.take(rows)
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
    as separate model calls; usually there is one group, the whole batch. Which samples hold equal tensors comes
    from the entry's :class:`EqualSamples` where it has them (no device value read)."""
    keys: list[tuple] = [() for _ in range(batch)]
    for _, extra in cond:
        equal = extra.get(EQUAL_SAMPLES)
        for name in sorted(k for k in extra if k not in MARKERS):
            value = extra[name]
            if _is_leaf_list(value) and len(value) == batch and any(v != value[0] for v in value[1:]):
                keys = [k + ((name, repr(value[i])),) for i, k in enumerate(keys)]
            elif _unbatched(value, batch):
                classes = _classes_of(value, None if equal is None else equal.classes.get((name, None)))
                if len(set(classes)) > 1:
                    keys = [k + ((name, classes[i]),) for i, k in enumerate(keys)]
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


def _rows_replaced(value: torch.Tensor, empty: torch.Tensor, drop: Sequence[bool]) -> torch.Tensor:
    """``value`` (samples stacked first) with the rows marked in ``drop`` replaced by ``empty`` (one sample's
    value, broadcast to a row), built where ``value`` is from its rows and ``empty``, which the caller keeps there:
    the rows are chosen on the host, so no mask and no caption is copied to the device in a step."""
    if len(drop) != value.shape[0]:
        raise ValueError(f"{len(drop)} caption decisions for {value.shape[0]} samples")
    row = empty.to(value.device, value.dtype).expand(value.shape[1:])
    return torch.stack([row if d else value[i] for i, d in enumerate(drop)])


def _repeated(value: Any, n: int, like: torch.Tensor) -> Any:
    """One sample's ``value`` repeated for ``n`` samples, on the device of ``like`` (tensors only)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(like.device)[None].expand(n, *value.shape).contiguous()


def _row_by_row(c: torch.Tensor, e_cond: torch.Tensor) -> bool:
    """Whether the empty caption replaces samples of an entry whose (collated) tensor is ``c`` row by row: its
    tokens have the shape of the samples' (CLIP's fixed 77)."""
    return tuple(c.shape[2:]) == tuple(e_cond.shape[1:])


def _replaced(extra: Mapping[str, Any], e_extra: Mapping[str, Any]) -> list[str]:
    """The options of ``extra`` (collated) that the empty caption's ``e_extra`` replaces row by row: tensors of the
    shape of its own."""
    return [k for k, v in e_extra.items() if isinstance(v, torch.Tensor) and isinstance(extra.get(k), torch.Tensor)
            and tuple(extra[k].shape[2:]) == tuple(v.shape[1:])]


def drop_captions(cond: Any, empty: Any, drop: Sequence[bool]) -> Any:
    """A collated CONDITIONING with the samples marked in ``drop`` given the empty caption's conditioning
    ``empty`` (one entry, as cached). Samples are replaced row by row where the shapes agree (CLIP's fixed 77
    tokens); otherwise the whole batch takes the empty caption if its first sample is dropped. What replaces a
    sample lands on the device of the conditioning it replaces; a training step keeps ``empty`` there (copied once
    per run), so that it copies nothing from the host. An entry's :class:`EqualSamples` follow the replacement."""
    if not any(drop):
        return cond
    (e_cond, e_extra), = empty
    out = []
    for c, extra in cond:
        if _row_by_row(c, e_cond):
            extra = dict(extra)
            replaced = _replaced(extra, e_extra)
            for k in replaced:
                extra[k] = _rows_replaced(extra[k], e_extra[k], drop)
            if isinstance(extra.get(EQUAL_SAMPLES), EqualSamples):
                extra[EQUAL_SAMPLES] = extra[EQUAL_SAMPLES].dropped(replaced, drop)
            if isinstance(extra.get(HOST_ROWS), HostRows):
                extra[HOST_ROWS] = _host_rows_dropped(extra[HOST_ROWS], e_extra, replaced, drop)
            out.append([_rows_replaced(c, e_cond, drop), extra])
        elif drop[0]:
            n = c.shape[0]
            options = {k: _repeated(v, n, c) for k, v in e_extra.items() if k not in MARKERS}
            if EQUAL_SAMPLES in extra:  # every sample holds the empty caption's values
                options[EQUAL_SAMPLES] = EqualSamples(
                    {(k, None): (0,) * n for k, v in options.items() if isinstance(v, torch.Tensor)}, {})
            if isinstance(extra.get(HOST_ROWS), HostRows):
                names = [k for k in extra[HOST_ROWS].values if isinstance(options.get(k), torch.Tensor)]
                options[HOST_ROWS] = HostRows({k: _repeated(v, n, v) for k, v in _host_values(e_extra, names).items()})
            out.append([_repeated(e_cond, n, c), options])
        else:
            out.append([c, extra])
    return out


def _host_values(e_extra: Mapping[str, Any], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The empty caption's options ``names`` as the host holds them (:func:`keep_on_host`). A caption dropped where
    the empty caption has no host copy of an option the batch keeps on the host is refused: its value would then
    come from the device."""
    host = e_extra.get(HOST_ROWS)
    values = host.values if isinstance(host, HostRows) else {}
    missing = [k for k in names if k not in values]
    if missing:
        raise ValueError(f"the empty caption has no host copy of {', '.join(missing)}, which the batch keeps on the "
                         "host: prepare it with keep_on_host as the batch was")
    return {k: values[k] for k in names}


def _host_rows_dropped(rows: HostRows, e_extra: Mapping[str, Any], replaced: Sequence[str],
                       drop: Sequence[bool]) -> HostRows:
    """``rows`` with the samples marked in ``drop`` given the empty caption's host values of the options
    ``replaced`` (those :func:`drop_captions` replaces on the device)."""
    empty = _host_values(e_extra, [k for k in replaced if k in rows.values])
    return HostRows({k: _rows_replaced(v, empty[k], drop) if k in empty else v for k, v in rows.values.items()})


def _empty_class(value: torch.Tensor, empty: torch.Tensor, classes: Sequence[int]) -> int | None:
    """The class (of ``classes``, one per sample of ``value``) whose samples equal ``empty`` as it would replace a
    row of ``value`` (:func:`_rows_replaced`), a class of its own (-1) when none does; None where it cannot
    replace a row."""
    try:
        row = empty.to(value.dtype).expand(value.shape[1:])
    except RuntimeError:
        return None
    return next((classes[i] for i in range(value.shape[0]) if torch.equal(value[i], row)), -1)


def _mark_entry(c: torch.Tensor, extra: Mapping[str, Any], empty: Any) -> EqualSamples:
    """The :class:`EqualSamples` of one collated entry (tensor ``c``, options ``extra``, on the host), with the
    classes of the empty caption ``empty`` (None: no caption dropout) where it replaces options row by row."""
    classes: dict[Key, tuple[int, ...]] = {}
    for name, value in extra.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            classes[(name, None)] = _classes_of(value, None)
        elif isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            for k, v in enumerate(value):
                if v.dim() >= 1:
                    classes[(name, k)] = _classes_of(v, None)
    empty_classes: dict[str, int] = {}
    if empty is not None:
        (e_cond, e_extra), = empty
        if _row_by_row(c, e_cond):
            for name in _replaced(extra, e_extra):
                if (name, None) not in classes:
                    continue
                found = _empty_class(extra[name], e_extra[name], classes[(name, None)])
                if found is not None:
                    empty_classes[name] = found
    return EqualSamples(classes, empty_classes)


def mark_equal_samples(cond: Any, empty: Any = None) -> list:
    """``cond`` (a collated CONDITIONING on the host, before its copy to the device) with each entry's
    :class:`EqualSamples` among its options: which samples hold equal tensor options, and which the empty caption
    ``empty`` (as cached; None without caption dropout) equals where it would replace a sample. :func:`option_groups`,
    :func:`drop_captions` and :func:`batch_conditioning` then decide by them instead of comparing values on the
    device, which makes the host wait for it at every step. Comparing here costs host time only."""
    return [[c, {**extra, EQUAL_SAMPLES: _mark_entry(c, extra, empty)}] for c, extra in cond]
