"""Optimizers and learning-rate schedules by name: the one table the node's drop-down and the loop share."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

OptimizerFactory = Callable[[Iterable[torch.Tensor], float, float], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "AdamW": lambda p, lr, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd),
    "Adam": lambda p, lr, wd: torch.optim.Adam(p, lr=lr, weight_decay=wd),
    "SGD": lambda p, lr, wd: torch.optim.SGD(p, lr=lr, weight_decay=wd),
    "RMSprop": lambda p, lr, wd: torch.optim.RMSprop(p, lr=lr, weight_decay=wd),
    "Adafactor": lambda p, lr, wd: torch.optim.Adafactor(p, lr=lr, weight_decay=wd),
}
SCHEDULES = ("constant", "cosine", "linear")


def check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def check_schedule(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def make_optimizer(name: str, params: list[torch.Tensor], lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    check_optimizer(name)
    return OPTIMIZERS[name](params, lr, weight_decay)


def lr_factor(schedule: str, step: int, total: int, warmup: int) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based) of ``total``."""
    check_schedule(schedule)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0
