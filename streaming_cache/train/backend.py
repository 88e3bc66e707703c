"""The contract between the training loop and a model runtime, and the one function that trains through it.

A :class:`TrainBackend` is what a model runtime gives the trainer: the trainable tensors, the loss of a batch,
and a way to run code with the model loaded and prepared for training. ComfyUI's implementation lives in the
node glue (``nodes/backend``); tests use toys. :func:`train_with` is everything between that contract and the
loop: the batch loader on the model's device, the noise seeded per micro-step, the validation loss, and the
loop's hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch

from ..dataset import DatasetHandle
from ..loader import BatchLoader
from .loop import TrainHooks, TrainResult, step_generator, train
from .spec import TrainSpec

R = TypeVar("R")


class TrainBackend(Protocol):
    """A model that trains adapters."""

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """The trainable tensors by their key in the saved LoRA (``requires_grad`` set)."""

    def loss(self, batch: Any, generator: torch.Generator, *, micro: int | None = None,
             t: float | None = None) -> torch.Tensor:
        """The loss of one collated batch, its noise drawn from ``generator``: at noise levels drawn as the
        spec's objective says, or at the fixed level ``t`` (validation). ``micro`` (the micro-step) decides
        per-sample random choices such as caption dropout; without it there are none."""

    def run(self, work: Callable[[torch.device], R]) -> R:
        """``work(device)`` called with the model loaded on ``device`` and ready for training; its result."""


class Validation:
    """The validation loss: up to ``rows`` held-out samples, each scored at fixed noise levels with noise fixed
    per (sample, level), so values compare across steps and across runs on the same data. The loop calls it
    without gradients and restores the random state afterwards."""

    LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9)

    def __init__(self, backend: TrainBackend, dataset: DatasetHandle, rows: int = 16):
        self.backend, self.dataset = backend, dataset
        self.rows = list(range(min(rows, len(dataset))))

    def __call__(self) -> float:
        values = []
        for i in self.rows:
            batch = self.dataset.collate([i])
            for k, level in enumerate(self.LEVELS):
                g = torch.Generator().manual_seed(1_000_003 * i + k)
                values.append(float(self.backend.loss(batch, g, t=level).detach()))
        return sum(values) / max(1, len(values))


def train_with(backend: TrainBackend, dataset: DatasetHandle, spec: TrainSpec, *,
               resume: Mapping[str, Any] | None = None, hooks: TrainHooks = TrainHooks(),
               validation: DatasetHandle | None = None, validation_rows: int = 16) -> TrainResult:
    """Train ``backend``'s parameters on ``dataset`` as ``spec`` says, from ``resume`` (a checkpoint) or from
    the start. Batches come from a :class:`~..loader.BatchLoader` (prefetched on threads; on a CUDA device
    pinned and copied on a side stream); the noise of micro-step ``m`` is drawn from
    ``step_generator(spec.seed, m)``, so a resumed run draws what the uninterrupted one would. With a
    ``validation`` set, its loss is scored every ``validate_every`` steps (``hooks.validate`` is then set)."""
    config = spec.loop_config(validating=validation is not None)
    if validation is not None:
        hooks = TrainHooks(on_step=hooks.on_step, should_stop=hooks.should_stop, save=hooks.save,
                           validate=Validation(backend, validation, validation_rows))

    def loss(batch: Any, micro: int) -> torch.Tensor:
        return backend.loss(batch, step_generator(spec.seed, micro), micro=micro)

    def work(device: torch.device) -> TrainResult:
        loader = BatchLoader(dataset, spec.batch_size, seed=spec.seed, workers=spec.data.workers,
                             prefetch=spec.data.prefetch, device=device if device.type == "cuda" else None)
        with contextlib.closing(loader):
            return train(backend.parameters(), loader, loss, config, resume=resume, hooks=hooks)

    return backend.run(work)
