"""Memory & Precision's ``plan`` for a model loaded in ComfyUI: the memory the run may use on its device and the
estimate of a training step with given settings, for ``streaming_cache.train.memory_plan``.

The step estimated is the dataset's largest (the bucket whose row holds the most bytes: the highest resolution
or the most frames) at the run's batch size, with the run's LoRA, counted on the ``meta`` device
(``memory_estimate``). The memory is what the device has free now plus what ComfyUI's loaded models hold on it:
loading the model for training unloads every other model (``compat.load_models_for_training``).
``$STREAMING_CACHE_DEVICE_MEMORY`` gives it instead (to plan for a smaller GPU, and for tests on the CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...streaming_cache import environment
from ...streaming_cache.train import memory_plan
from ...streaming_cache.train.spec import TrainSpec
from . import compat, memory_estimate
from .compat import log

MAX_BUCKETS = 256
"""Buckets looked at for the largest row (one representative row each, read from the index, not the shards)."""


def device_memory(model: Any) -> tuple[int | None, str]:
    """(bytes the training may use on ``model``'s load device, or None with why there is nothing to fit)."""
    given = environment.device_memory()
    if given is not None:
        return given, ""
    device = torch.device(model.load_device)
    if device.type != "cuda":
        return None, f"training on the {device.type.upper()}: settings as set"
    return compat.memory_for_training(device), ""


def largest_row(dataset: Any) -> int:
    """The index of a row of the dataset's largest bucket (by the bytes its tensors hold)."""
    signatures = dataset.signatures()
    _, first = np.unique(signatures, return_index=True)
    if len(first) > MAX_BUCKETS:
        first = np.sort(first)[:MAX_BUCKETS]
    return int(max(first.tolist(), key=lambda i: dataset[int(i)].nbytes))


def plan(model: Any, spec: TrainSpec, dataset: Any) -> memory_plan.Plan:
    """The memory settings ``spec``'s run trains with (see ``memory_plan.plan_memory``). An estimate that cannot
    be made for this model (a model the estimator cannot build on ``meta``) leaves the settings as set, and the
    summary says why."""
    free, reason = device_memory(model)
    if free is None:
        return memory_plan.plan_memory(spec.memory, lambda m: 0, None, reason=reason)
    row = dataset.collate([largest_row(dataset)])
    graphs = torch.device(model.load_device).type == "cuda" and spec.devices == 1

    def count(depth: int) -> tuple[int, int]:
        counted = memory_estimate.training_step(model, row, spec, depth)
        return counted.peak, counted.weights

    def estimate(memory: Any) -> int:
        return memory_plan.step_peak(memory, count, graphs=graphs)

    try:
        return memory_plan.plan_memory(spec.memory, estimate, free, can_offload=compat.HAS_OFFLOADING)
    except ValueError as e:  # a model the estimate does not know
        reason = str(e)
    except Exception as e:  # noqa: BLE001 - the estimate is advice: a run never fails for want of it
        reason = f"the estimate failed ({type(e).__name__}: {e})"
    log.warning("memory plan: %s; training with the settings as set", reason)
    return memory_plan.plan_memory(spec.memory, lambda m: 0, None, reason=f"{reason}: settings as set")
