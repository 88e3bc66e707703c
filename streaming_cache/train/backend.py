"""The contract between the training loop and a model runtime, and the one function that trains through it.

A :class:`TrainBackend` is what a model runtime gives the trainer: the trainable tensors, the loss of a batch,
and a way to run code with the model loaded and prepared for training. ComfyUI's implementation lives in the
node glue (``nodes/backend``); tests use toys. :func:`train_with` is everything between that contract and the
loop: the batch loader on the model's device, the random draws of each sample, the validation loss, the loop's
hooks, and, when the process is one of several (:class:`~.distributed.Group`), its slice of every global batch,
the gradient sum and stopping together.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

import torch

from ..dataset import DatasetHandle
from ..fallbacks import Fallbacks
from ..group import Group
from ..loader import BatchLoader, Shard
from ..mix import DatasetMix
from .distributed import DataParallel
from .draws import Draws
from .loop import TrainHooks, TrainResult, train
from .spec import TrainSpec

R = TypeVar("R")


class TrainBackend(Protocol):
    """A model that trains adapters."""

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """The trainable tensors by their key in the saved LoRA (``requires_grad`` set)."""

    def loss(self, batch: Any, draws: Draws, *, t: float | None = None) -> torch.Tensor:
        """The mean loss of one collated batch's samples: sample ``i`` draws its noise, noise level and
        per-sample choices (caption dropout, when ``draws.micro`` is set) from ``draws.generator(i)`` (see
        :mod:`.draws`), at noise levels drawn as the spec's objective says, or at the fixed level ``t``
        (validation)."""

    def run(self, work: Callable[[torch.device], R]) -> R:
        """``work(device)`` called with the model loaded on ``device`` and ready for training; its result.

        A backend may also have ``prepare(batch)``: the loader calls it on each collated batch on the host, before
        the batch's copy to the device (:class:`~..loader.BatchLoader`), so that a step decides from host data
        what it would otherwise read back from the device."""


class PreservingBackend(TrainBackend, Protocol):
    """A backend that can also train toward its base model's outputs (``preserves_outputs = True``)."""

    preserves_outputs: bool

    def loss(self, batch: Any, draws: Draws, *, t: float | None = None, preserve: bool = False) -> torch.Tensor:
        """As :meth:`TrainBackend.loss`; with ``preserve`` (given only for the batches of a mix's datasets that ask
        for it, :attr:`~..mix.MixPart.preserve`) the target is the model's own prediction with the adapters off,
        for the same noisy input and conditioning, instead of the latents."""


class Validation:
    """The validation loss: up to ``rows`` held-out samples, each scored at fixed noise levels with noise fixed
    per (sample, level), so values compare across steps and across runs on the same data. The loop calls it
    without gradients and restores the random state afterwards. With a process ``group`` each rank scores its
    share of the samples and the mean is taken over all of them."""

    LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9)

    def __init__(self, backend: TrainBackend, dataset: DatasetHandle, rows: int = 16, group: Group | None = None):
        self.backend, self.dataset, self.group = backend, dataset, group
        self.rows = list(range(min(rows, len(dataset))))

    def __call__(self) -> float:
        mine = self.rows if self.group is None else self.rows[self.group.rank::self.group.world_size]
        total, count = 0.0, 0
        for i in mine:
            batch = self.dataset.collate([i])
            for k, level in enumerate(self.LEVELS):
                draws = Draws(seed=1_000_003 * i + k, micro=None)
                total += float(self.backend.loss(batch, draws, t=level).detach())
                count += 1
        if self.group is not None:
            total, count_sum = self.group.sum([total, count])
            count = int(count_sum)
        return total / max(1, count)


class DatasetLosses:
    """Each dataset's loss in a mix, per step: the mean of the losses of the step's micro-batches from that
    dataset (each summed over the processes, as the step's loss is), for the steps that had any. Saved in every
    checkpoint (``dataset_losses``), so a resumed run keeps its series."""

    def __init__(self, names: list[str], group: Group | None, resume: Mapping[str, Any] | None):
        saved = (resume or {}).get("dataset_losses") or {}
        self.names, self.group = names, group
        self.series: dict[str, list[tuple[int, float]]] = {
            n: [(int(s), float(v)) for s, v in saved.get(n, [])] for n in names}
        self.pending: dict[int, dict[int, list[Any]]] = {}  # step -> source -> [summed loss, micro-batches]

    def add(self, step: int, source: int, value: torch.Tensor) -> None:
        """A micro-batch of optimizer step ``step`` (1-based) from dataset ``source`` had (this process's share of)
        loss ``value``: kept where it is, on the device, until the step is reported."""
        sums = self.pending.setdefault(step, {}).setdefault(source, [0.0, 0])
        sums[0] = value.detach().float() + sums[0]
        sums[1] += 1

    def step(self, step: int) -> None:
        """Record the steps up to ``step`` (reported: their losses were read, so reading these waits for nothing
        more)."""
        for done in sorted(s for s in self.pending if s <= step):
            pending = self.pending.pop(done)
            sources = sorted(pending)
            sums = [float(pending[s][0]) for s in sources]
            if self.group is not None:  # every process had micro-batches of the same datasets in this step
                sums = self.group.sum(sums)
            for s, total in zip(sources, sums):
                self.series[self.names[s]].append((done, total / pending[s][1]))

    def state(self) -> dict[str, list[list[float]]]:
        return {n: [[s, v] for s, v in values] for n, values in self.series.items()}


def train_with(backend: TrainBackend, dataset: DatasetHandle | DatasetMix, spec: TrainSpec, *,
               resume: Mapping[str, Any] | None = None, hooks: TrainHooks | None = None,
               validation: DatasetHandle | None = None, validation_rows: int = 16,
               group: Group | None = None, pin_budget: Callable[[int], bool] | None = None,
               fallbacks: Fallbacks | None = None) -> TrainResult:
    """Train ``backend``'s parameters on ``dataset`` as ``spec`` says, from ``resume`` (a checkpoint) or from
    the start. Batches come from a :class:`~..loader.BatchLoader` (prefetched on threads; on a CUDA device
    pinned and copied on a side stream); sample ``j`` of micro-step ``m``'s global batch draws from its own
    generator (:class:`~.draws.Draws`), so a resumed run draws what the uninterrupted one would. With a
    ``validation`` set, its loss is scored every ``validate_every`` steps (``hooks.validate`` is then set).

    With a process ``group``, this process trains on its slice of every global batch of ``spec.batch_size`` x
    ``group.world_size`` rows, its loss weighted by the slice's share; gradients are summed over the ranks and
    stopping is decided together (``hooks.sync``), so the result is the one-process result with the global
    batch size. Every rank must call this with the same arguments; only ``hooks`` may differ (rank 0 saves).

    ``pin_budget(nbytes)`` may refuse pinning more host memory for batches (the host's budget, e.g.
    ComfyUI's); refused buffers are ordinary memory. ``fallbacks``: where the loader and the loop note a device
    optimization they turn off (the copy stream, pinned memory, the fused optimizer); ``hooks.fallbacks``, or a
    fresh record, when None.

    ``dataset`` may be a :class:`~..mix.DatasetMix`: each batch comes from one of its datasets, batched and with
    the caption dropout that dataset asks for, and each dataset's loss is kept (``TrainResult.dataset_losses``,
    also in the checkpoints)."""
    config = spec.loop_config(validating=validation is not None)
    hooks = hooks or TrainHooks()
    if fallbacks is None:
        fallbacks = hooks.fallbacks if hooks.fallbacks is not None else Fallbacks()
    mix = dataset if isinstance(dataset, DatasetMix) else None
    preserving = [p.name for p in mix.parts if p.preserve] if mix is not None else []
    if preserving and not getattr(backend, "preserves_outputs", False):
        raise ValueError(f"{', '.join(preserving)}: this model runtime ({type(backend).__name__}) cannot preserve "
                         "the base model's outputs (it cannot run the model without its adapters); turn "
                         "preserve_outputs off on that Dataset Mix")
    per_dataset = DatasetLosses([p.name for p in mix.parts], group, resume) if mix and len(mix.parts) > 1 else None
    user_step, user_save = hooks.on_step, hooks.save

    def on_step(step: int, value: float) -> None:
        if per_dataset is not None:
            per_dataset.step(step)
        if user_step is not None:
            user_step(step, value)

    def save(state: dict[str, Any], final: bool) -> None:
        if per_dataset is not None:
            if group is None:  # an error's checkpoint comes before the last steps are reported
                per_dataset.step(int(state["step"]))
            state["dataset_losses"] = per_dataset.state()
        if user_save is not None:
            user_save(state, final)

    hooks = dataclasses.replace(hooks, on_step=on_step, save=save if user_save else None, fallbacks=fallbacks,
                                validate=Validation(backend, validation, validation_rows, group)
                                if validation is not None else hooks.validate)

    def loss(shard: Shard, micro: int) -> torch.Tensor:
        dropout = mix.parts[shard.source].caption_dropout if mix is not None else None
        draws = Draws(spec.seed, micro, shard.first, dropout)
        try:
            if mix is not None and mix.parts[shard.source].preserve:
                value = cast(PreservingBackend, backend).loss(shard.batch, draws, preserve=True)
            else:
                value = backend.loss(shard.batch, draws)
        except Exception as exc:
            keys = [dataset[r].keys for r in shard.rows[:3]]
            _note(exc, f"while training on rows {list(shard.rows)} of the dataset (entries {keys})")
            raise
        value = value if shard.samples == shard.total else value * (shard.samples / shard.total)
        if per_dataset is not None:  # each dataset's own loss, before its weight: comparable across datasets
            per_dataset.add(micro // config.grad_accumulation + 1, shard.source, value)
        weight = mix.parts[shard.source].loss_weight if mix is not None else 1.0
        return value if weight == 1.0 else value * weight

    def work(device: torch.device) -> TrainResult:
        if per_dataset is not None:  # a pass run again from the start (ComfyBackend.run) counts its steps anew
            per_dataset.pending = {}
        # the CPU too: with the device emulated (environment.emulated_device) its batches take the GPU's path
        loader = BatchLoader(dataset, spec.batch_size, seed=spec.seed, workers=spec.data.workers,
                             prefetch=spec.data.prefetch, device=device if device.type in ("cuda", "cpu") else None,
                             shares=True, rank=group.rank if group else 0,
                             world_size=group.world_size if group else 1, pin_budget=pin_budget,
                             fallbacks=fallbacks, prepare=getattr(backend, "prepare", None))
        sync = DataParallel(list(backend.parameters().values()), group) if group is not None else None
        run_hooks = hooks if sync is None else dataclasses.replace(hooks, sync=sync)
        with contextlib.closing(loader):
            try:
                result = train(backend.parameters(), loader, loss, config, resume=resume, hooks=run_hooks)
                result.sync_waits = list(sync.waits) if sync is not None else []
                result.dataset_losses = per_dataset.series if per_dataset is not None else {}
                return result
            except Exception as exc:
                if group is not None:
                    _note(exc, f"on rank {group.rank} of {group.world_size}")
                raise
            finally:
                if sync is not None:
                    sync.close()

    return backend.run(work)


def _note(exc: BaseException, text: str) -> None:
    """Add ``text`` to the exception's traceback report (Python 3.11+; earlier versions show the error alone)."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
