"""The training loop around a model-specific step: optimizer, LR schedule, gradient accumulation, and
checkpoints (``checkpoint.py``) that resume exactly.

The model-specific part (how a batch becomes a loss) is a callable; everything else is here so it is tested
without ComfyUI. Resuming restores the trainable tensors, optimizer and schedule state, the loss history and
the loader position, so a resumed run sees exactly the batches and noise the uninterrupted run would have seen
(noise is seeded per step by the caller: see :func:`step_generator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import CacheError
from .checkpoint import Stateful, checkpoint, restore
from .optim import check_optimizer, check_schedule, lr_factor, make_optimizer


def step_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random generator for one micro-step: a function of (seed, step) only, so resumes are exact."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


@dataclass
class TrainConfig:
    steps: int
    learning_rate: float = 1e-4
    optimizer: str = "AdamW"
    schedule: str = "constant"
    warmup_steps: int = 0
    grad_accumulation: int = 1
    max_grad_norm: float = 0.0
    seed: int = 0
    save_every: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.grad_accumulation < 1:
            raise ValueError(f"grad_accumulation must be at least 1, got {self.grad_accumulation}")
        check_optimizer(self.optimizer)
        check_schedule(self.schedule)

    def record(self) -> dict[str, Any]:
        """The settings saved with a checkpoint."""
        return {"steps": self.steps, "seed": self.seed, "optimizer": self.optimizer,
                "grad_accumulation": self.grad_accumulation}


@dataclass
class TrainResult:
    step: int  # optimizer steps done in total (resumed ones included)
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    stopped: bool = False  # ended early by should_stop


class Batches:
    """Endless batches over epochs of a loader."""

    def __init__(self, loader: Stateful):
        self.loader = loader
        self._it: Iterator[Any] | None = None

    def __next__(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        raise CacheError("the dataset produced no batches (is it empty, or smaller than one batch with drop_last?)")


def train(
    params: Mapping[str, torch.Tensor],
    loader: Stateful,
    loss_fn: Callable[[Any, int], torch.Tensor],
    config: TrainConfig,
    *,
    resume: Mapping[str, Any] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    save: Callable[[dict[str, Any], bool], None] | None = None,
) -> TrainResult:
    """Train ``params`` (tensors with ``requires_grad``) for ``config.steps`` optimizer steps.

    ``loss_fn(batch, micro_step)`` returns the loss of one micro-batch (the caller seeds its noise from
    ``micro_step``). ``on_step(step, loss)`` runs after every optimizer step (it may raise to cancel, as
    ComfyUI's interrupt does). ``save(checkpoint, final)`` receives a :func:`checkpoint` dict every
    ``save_every`` steps, at the end, and when the loop is left by an exception after progress was made (the
    exception is then re-raised), so no finished step is ever lost.
    """
    tensors = list(params.values())
    optimizer = make_optimizer(config.optimizer, tensors, config.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(config.schedule, s, config.steps, config.warmup_steps))
    result = TrainResult(step=0)
    if resume is not None:
        restore(resume, params, optimizer, scheduler, loader)
        result.step, result.losses = int(resume["step"]), [float(x) for x in resume["losses"]]
    batches = Batches(loader)
    last_saved = result.step

    def snapshot() -> dict[str, Any]:
        return checkpoint(params, optimizer, scheduler, loader, result.step, result.losses, config.record())

    try:
        while result.step < config.steps:
            if should_stop is not None and should_stop():
                result.stopped = True
                break
            total = 0.0
            for micro in range(config.grad_accumulation):
                loss = loss_fn(next(batches), result.step * config.grad_accumulation + micro)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss.item()} at step {result.step + 1}; lower the "
                                             "learning rate or train in fp32")
                (loss / config.grad_accumulation).backward()
                total += float(loss.detach()) / config.grad_accumulation
            if config.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(tensors, config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            result.step += 1
            result.losses.append(total)
            if on_step is not None:
                on_step(result.step, total)
            if save is not None and config.save_every > 0 and result.step % config.save_every == 0 \
                    and result.step < config.steps:
                save(snapshot(), False)
                last_saved = result.step
    except BaseException:
        if save is not None and result.step > last_saved:
            save(snapshot(), False)
        raise
    if save is not None:
        save(snapshot(), True)
    return result
