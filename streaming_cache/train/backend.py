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
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch

from ..dataset import DatasetHandle
from ..group import Group
from ..loader import BatchLoader, Shard
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
        """``work(device)`` called with the model loaded on ``device`` and ready for training; its result."""


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


def train_with(backend: TrainBackend, dataset: DatasetHandle, spec: TrainSpec, *,
               resume: Mapping[str, Any] | None = None, hooks: TrainHooks | None = None,
               validation: DatasetHandle | None = None, validation_rows: int = 16,
               group: Group | None = None) -> TrainResult:
    """Train ``backend``'s parameters on ``dataset`` as ``spec`` says, from ``resume`` (a checkpoint) or from
    the start. Batches come from a :class:`~..loader.BatchLoader` (prefetched on threads; on a CUDA device
    pinned and copied on a side stream); sample ``j`` of micro-step ``m``'s global batch draws from its own
    generator (:class:`~.draws.Draws`), so a resumed run draws what the uninterrupted one would. With a
    ``validation`` set, its loss is scored every ``validate_every`` steps (``hooks.validate`` is then set).

    With a process ``group``, this process trains on its slice of every global batch of ``spec.batch_size`` x
    ``group.world_size`` rows, its loss weighted by the slice's share; gradients are summed over the ranks and
    stopping is decided together (``hooks.sync``), so the result is the one-process result with the global
    batch size. Every rank must call this with the same arguments; only ``hooks`` may differ (rank 0 saves)."""
    config = spec.loop_config(validating=validation is not None)
    hooks = hooks or TrainHooks()
    if validation is not None:
        hooks = TrainHooks(on_step=hooks.on_step, should_stop=hooks.should_stop, save=hooks.save,
                           validate=Validation(backend, validation, validation_rows, group), sync=hooks.sync)

    def loss(shard: Shard, micro: int) -> torch.Tensor:
        try:
            value = backend.loss(shard.batch, Draws(spec.seed, micro, shard.first))
        except Exception as exc:
            keys = [dataset[r].keys for r in shard.rows[:3]]
            _note(exc, f"while training on rows {list(shard.rows)} of the dataset (entries {keys})")
            raise
        return value if shard.samples == shard.total else value * (shard.samples / shard.total)

    def work(device: torch.device) -> TrainResult:
        loader = BatchLoader(dataset, spec.batch_size, seed=spec.seed, workers=spec.data.workers,
                             prefetch=spec.data.prefetch, device=device if device.type == "cuda" else None,
                             shares=True, rank=group.rank if group else 0,
                             world_size=group.world_size if group else 1)
        sync = DataParallel(list(backend.parameters().values()), group) if group is not None else None
        run_hooks = hooks if sync is None else TrainHooks(on_step=hooks.on_step, should_stop=hooks.should_stop,
                                                          save=hooks.save, validate=hooks.validate, sync=sync)
        with contextlib.closing(loader):
            try:
                result = train(backend.parameters(), loader, loss, config, resume=resume, hooks=run_hooks)
                result.sync_waits = list(sync.waits) if sync is not None else []
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
