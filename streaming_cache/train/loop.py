"""The training loop around a model-specific step: optimizer, LR schedule, gradient accumulation, and
checkpoints (``checkpoint.py``) that resume exactly.

The model-specific part (how a batch becomes a loss) is a callable; everything else is here so it is tested
without ComfyUI. Resuming restores the trainable tensors, optimizer and schedule state, the loss and validation
histories, the EMA and the loader position, so a resumed run sees exactly the batches and noise the
uninterrupted run would have seen (noise is seeded per step by the caller: see :func:`step_generator`) and ends
with bit-identical weights.

fp16 training (``TrainConfig.grad_scaling``) multiplies the loss by a large factor before the backward pass, so
gradients too small for fp16 do not flush to zero, and divides the gradients by it before clipping and the
optimizer step (``torch.amp.GradScaler``). A step whose gradients overflow is skipped and the factor halved; the
factor grows again after a run of good steps. Its state is part of every checkpoint, so resumes stay exact.

Schedule-free optimizers (``optim.SCHEDULE_FREE``) keep training weights (y) and the averaged weights to use
(x); they are switched to train mode for the steps and to eval mode for validation and for the weights to save.
Switching back and forth is not exact in floating point, so the loop copies the training weights aside and
puts them back bit for bit after each eval-mode use: saving and validating never change the trained result.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import CacheError
from ..fallbacks import Fallbacks
from .checkpoint import Stateful, checkpoint, restore
from .ema import EMA
from .optim import (
    SCHEDULE_FREE,
    FusedSteps,
    check_optimizer,
    check_schedule,
    lr_factor,
    make_optimizer,
)


def step_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random generator for one micro-step: a function of (seed, step) only, so resumes are exact."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


@dataclass
class TrainConfig:
    """What the loop needs to know; :meth:`record` is saved with every checkpoint.

    ``lora_plus_ratio``: learning-rate multiplier of LoRA up matrices (1 = off; see ``optim``). ``cycles``: cosine
    restarts of the ``cosine_with_restarts`` schedule. ``ema_decay``: keep an :class:`~.ema.EMA` of the weights
    (0 = off). ``validate_every``: call ``train``'s ``validate`` every N optimizer steps and at the end (0 = off).
    ``grad_scaling``: scale the loss for fp16 training (see the module docstring).
    """

    steps: int
    learning_rate: float = 1e-4
    optimizer: str = "AdamW"
    schedule: str = "constant"
    warmup_steps: int = 0
    grad_accumulation: int = 1
    max_grad_norm: float = 0.0
    seed: int = 0
    save_every: int = 0
    lora_plus_ratio: float = 1.0
    cycles: int = 1
    ema_decay: float = 0.0
    validate_every: int = 0
    grad_scaling: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.grad_accumulation < 1:
            raise ValueError(f"grad_accumulation must be at least 1, got {self.grad_accumulation}")
        if not (self.lora_plus_ratio > 0 and math.isfinite(self.lora_plus_ratio)):
            raise ValueError(f"lora_plus_ratio must be a positive number (1 = off), got {self.lora_plus_ratio}")
        if self.cycles < 1:
            raise ValueError(f"cycles must be at least 1, got {self.cycles}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) (0 = off), got {self.ema_decay}")
        if self.validate_every < 0 or self.save_every < 0:
            raise ValueError("validate_every and save_every must be 0 (off) or positive")
        check_optimizer(self.optimizer)
        check_schedule(self.schedule)

    def record(self) -> dict[str, Any]:
        """The settings saved with a checkpoint."""
        return {"steps": self.steps, "seed": self.seed, "optimizer": self.optimizer,
                "grad_accumulation": self.grad_accumulation, "learning_rate": self.learning_rate,
                "schedule": self.schedule, "warmup_steps": self.warmup_steps, "cycles": self.cycles,
                "max_grad_norm": self.max_grad_norm, "lora_plus_ratio": self.lora_plus_ratio,
                "ema_decay": self.ema_decay, "validate_every": self.validate_every,
                "grad_scaling": self.grad_scaling}


class StepSync(Protocol):
    """What a loop shared by several processes asks of them (``distributed.DataParallel``): each backward pass
    runs inside ``backward(last)`` (``last``: the step's last micro-step, whose gradients are combined); ``step``
    combines the gradients before they are clipped and applied and returns the step's loss over all processes
    (each process's loss is its share); ``stop`` says whether any process wants to stop before the next step."""

    def backward(self, last: bool) -> contextlib.AbstractContextManager[Any]: ...

    def step(self, loss: float) -> float: ...

    def stop(self, wanted: bool) -> bool: ...


@dataclass(frozen=True)
class TrainHooks:
    """What the caller of :func:`train` is told, and asked, as training goes on.

    ``on_step(step, loss)`` runs after every optimizer step (it may raise to cancel, as ComfyUI's interrupt
    does). ``should_stop()`` is asked before every step; True ends the run early (``TrainResult.stopped``).
    ``save(checkpoint, final)`` receives a :func:`~.checkpoint.checkpoint` dict every ``save_every`` steps, at
    the end, and when the loop is left by an exception after progress was made (the exception is then
    re-raised), so no finished step is ever lost; its ``weights`` and ``ema_weights`` are the LoRA and EMA LoRA
    to write. ``validate()`` returns a validation loss (see :func:`train`). ``sync``: the processes this loop
    runs in (see :class:`StepSync`; None for one process). ``fallbacks``: where the loop notes the device
    optimizations it switched off (the fused optimizer step: :class:`~.optim.FusedSteps`), for the caller to
    report; None: the loop keeps its own."""

    on_step: Callable[[int, float], None] | None = None
    should_stop: Callable[[], bool] | None = None
    save: Callable[[dict[str, Any], bool], None] | None = None
    validate: Callable[[], float] | None = None
    sync: StepSync | None = None
    fallbacks: Fallbacks | None = None


@dataclass
class TrainResult:
    step: int  # optimizer steps done in total (resumed ones included)
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    stopped: bool = False  # ended early by should_stop
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, value), resumed ones included
    # After a run that returns normally: the weights to use and save (the trained tensors themselves, detached;
    # for a schedule-free optimizer its eval-mode weights, which the trained tensors are then set to) and the
    # EMA's averaged weights (copies; None without EMA).
    weights: dict[str, torch.Tensor] | None = None
    ema_weights: dict[str, torch.Tensor] | None = None
    overflow_steps: int = 0  # steps the gradient scaler skipped (fp16 overflow), resumed ones included
    sync_waits: list[float] = field(default_factory=list)  # per step of this run: seconds waiting on the other
    # processes (several processes only; see distributed.DataParallel)
    dataset_losses: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # a mix: each dataset's
    # loss, (step, value) for the steps that trained on it, resumed ones included


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


def _rng_devices() -> list[int]:
    """CUDA devices whose RNG state a validation must leave as it found it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def train(
    params: Mapping[str, torch.Tensor],
    loader: Stateful,
    loss_fn: Callable[[Any, int], torch.Tensor],
    config: TrainConfig,
    *,
    resume: Mapping[str, Any] | None = None,
    hooks: TrainHooks = TrainHooks(),
) -> TrainResult:
    """Train ``params`` (name -> tensor with ``requires_grad``) for ``config.steps`` optimizer steps.

    ``loss_fn(batch, micro_step)`` returns the loss of one micro-batch (the caller seeds its noise from
    ``micro_step``). ``hooks`` report progress, save checkpoints, validate and stop early (:class:`TrainHooks`).

    ``hooks.validate()`` (used when ``config.validate_every > 0``) returns a validation loss computed with fixed
    timesteps and noise; it runs without gradients, with a schedule-free optimizer's eval-mode weights in place,
    and leaves the CPU (and CUDA) RNG as it found it. It is called after every ``validate_every``-th step (before
    ``on_step``, so ``on_step`` can show it) and after the last step of a run that reaches ``config.steps``; the
    values are in ``TrainResult.validation`` and in the checkpoints. A run resumed from a checkpoint taken at a
    validation step that was not validated (an interrupt during validation) validates it first.
    """
    on_step, should_stop, save, validate, sync = hooks.on_step, hooks.should_stop, hooks.save, hooks.validate, \
        hooks.sync
    tensors = list(params.values())
    optimizer = make_optimizer(config.optimizer, params, config.learning_rate, lora_plus_ratio=config.lora_plus_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(config.schedule, s, config.steps, config.warmup_steps, config.cycles))
    schedule_free = config.optimizer in SCHEDULE_FREE
    ema = EMA(params, config.ema_decay) if config.ema_decay > 0 else None
    device = tensors[0].device.type if tensors else "cpu"
    scaler = torch.amp.GradScaler(device) if config.grad_scaling else None
    validating = validate is not None and config.validate_every > 0
    result = TrainResult(step=0)
    if resume is not None:
        restore(resume, params, optimizer, scheduler, loader, ema, scaler)
        result.step, result.losses = int(resume["step"]), [float(x) for x in resume["losses"]]
        result.overflow_steps = int(resume.get("overflow_steps") or 0)
        result.validation = [(int(s), float(v)) for s, v in resume.get("validation") or []]
    steps = FusedSteps(optimizer, hooks.fallbacks if hooks.fallbacks is not None else Fallbacks(),
                       scaled=scaler is not None)
    if schedule_free:
        optimizer.train()  # type: ignore[attr-defined]
    batches = Batches(loader)
    last_saved = result.step

    @contextlib.contextmanager
    def eval_weights() -> Iterator[None]:
        """A schedule-free optimizer's eval-mode weights in place for the block; the training weights are
        restored bit for bit afterwards."""
        if not schedule_free:
            yield
            return
        kept = {k: v.detach().clone() for k, v in params.items()}
        optimizer.eval()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            optimizer.train()  # type: ignore[attr-defined]
            with torch.no_grad():
                for k, v in params.items():
                    v.copy_(kept[k])

    def snapshot() -> dict[str, Any]:
        weights = None
        if schedule_free:
            with eval_weights():
                weights = {k: v.detach().clone() for k, v in params.items()}
        return checkpoint(params, optimizer, scheduler, loader, result.step, result.losses, config.record(),
                          validation=result.validation, ema=ema, weights=weights, scaler=scaler,
                          overflow_steps=result.overflow_steps)

    def run_validation() -> None:
        assert validate is not None
        with eval_weights(), torch.no_grad(), torch.random.fork_rng(devices=_rng_devices()):
            value = float(validate())
        result.validation.append((result.step, value))

    def validated(step: int) -> bool:
        return bool(result.validation) and result.validation[-1][0] == step

    try:
        if validating and 0 < result.step < config.steps and result.step % config.validate_every == 0 \
                and not validated(result.step):
            run_validation()
        while result.step < config.steps:
            stop = should_stop is not None and should_stop()
            if sync is not None:
                stop = sync.stop(stop)
            if stop:
                result.stopped = True
                break
            total = 0.0
            for micro in range(config.grad_accumulation):
                loss = loss_fn(next(batches), result.step * config.grad_accumulation + micro)
                # the step's one wait for the device, before the backward pass is queued: the host prepares the
                # next micro-step while the device runs this one's backward pass and the optimizer step
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(f"loss is {value} at step {result.step + 1}; lower the "
                                             "learning rate or train in bf16 or fp32")
                part = loss / config.grad_accumulation
                last = micro == config.grad_accumulation - 1
                with contextlib.nullcontext() if sync is None else sync.backward(last):
                    (part if scaler is None else scaler.scale(part)).backward()
                total += value / config.grad_accumulation
            if sync is not None:
                total = sync.step(total)
            if scaler is not None:
                scaler.unscale_(optimizer)
            if config.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(tensors, config.max_grad_norm)
            if scaler is None:
                steps.step(optimizer.step)
            else:
                scale = scaler.get_scale()
                steps.step(lambda: scaler.step(optimizer))  # skipped when a gradient overflowed
                scaler.update()
                result.overflow_steps += int(scaler.get_scale() < scale)
            optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped first step makes torch warn about the call order
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
                scheduler.step()
            result.step += 1
            result.losses.append(total)
            if ema is not None:
                ema.update()
            if validating and result.step % config.validate_every == 0:
                run_validation()
            if on_step is not None:
                on_step(result.step, total)
            if save is not None and config.save_every > 0 and result.step % config.save_every == 0 \
                    and result.step < config.steps:
                save(snapshot(), False)
                last_saved = result.step
        if validating and result.step >= config.steps and not validated(result.step):
            run_validation()
    except BaseException:
        if save is not None and result.step > last_saved:
            save(snapshot(), False)
        raise
    if save is not None:
        save(snapshot(), True)
    if schedule_free:
        optimizer.eval()  # type: ignore[attr-defined]
    result.weights = {k: v.detach() for k, v in params.items()}
    result.ema_weights = None if ema is None else ema.averaged()
    return result
