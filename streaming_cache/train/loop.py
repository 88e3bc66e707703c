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
factor grows again after a run of good steps. Its state is part of every checkpoint, so resumes stay exact. The
skipped steps are counted on the device and read when a checkpoint is taken and when the run ends.

No host read of device values inside a step. Each step's loss stays on the device; the losses of the steps since
the last read are read together (one wait) when ``TrainHooks.report_seconds`` have passed, before a checkpoint,
and at the end, and only then are the steps reported (``on_step``). A non-finite loss cannot wait for that read
to keep its step from changing a weight, so the step is skipped on the device: its flag is handed to a fused
optimizer step as the ``found_inf`` a gradient scaler hands it (and folded into the scaler's own when one runs),
the EMA leaves it out, and the run stops with ``FloatingPointError`` when the loss is read, its weights those of
the steps before and after the skipped one. Where no step can be skipped on the device (an optimizer without a
fused step, or several processes, whose steps agree on the loss each step), each step's loss
is read before its last backward pass is queued and a non-finite one is refused there: the one wait of a step.
Anything else that read a device value at each step (the gradient scaler's scale, say) would make the host wait.

Schedule-free optimizers (``optim.SCHEDULE_FREE``) keep training weights (y) and the averaged weights to use
(x); they are switched to train mode for the steps and to eval mode for validation and for the weights to save.
Switching back and forth is not exact in floating point, so the loop copies the training weights aside and
puts them back bit for bit after each eval-mode use: saving and validating never change the trained result.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import CacheError
from ..fallbacks import Fallbacks
from .checkpoint import Stateful, checkpoint, restore
from .ema import EMA
from .inplace import InputUpdatedLater
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
    ``grad_scaling``: scale the loss for fp16 training (see the module docstring). ``weight_decay``: the
    optimizer's (decoupled for AdamW: each step shrinks the weights by ``learning rate x weight_decay``; 0 = off).
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
    weight_decay: float = 0.0
    lr_power: float = 1.0
    min_lr_ratio: float = 0.0
    optimizer_args: Mapping[str, Any] = field(default_factory=dict)

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
        if not (0.0 <= self.weight_decay and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be 0 (off) or positive, got {self.weight_decay}")
        if self.validate_every < 0 or self.save_every < 0:
            raise ValueError("validate_every and save_every must be 0 (off) or positive")
        check_optimizer(self.optimizer)
        check_schedule(self.schedule)
        lr_factor(self.schedule, self.steps, self.steps, 0, self.cycles, power=self.lr_power, floor=self.min_lr_ratio)

    def lr_factor(self, step: int) -> float:
        """The schedule's multiplier of the learning rate at optimizer step ``step`` (0-based)."""
        return lr_factor(self.schedule, step, self.steps, self.warmup_steps, self.cycles, power=self.lr_power,
                         floor=self.min_lr_ratio)

    def record(self) -> dict[str, Any]:
        """The settings saved with a checkpoint."""
        return {"steps": self.steps, "seed": self.seed, "optimizer": self.optimizer,
                "grad_accumulation": self.grad_accumulation, "learning_rate": self.learning_rate,
                "schedule": self.schedule, "warmup_steps": self.warmup_steps, "cycles": self.cycles,
                "max_grad_norm": self.max_grad_norm, "lora_plus_ratio": self.lora_plus_ratio,
                "ema_decay": self.ema_decay, "validate_every": self.validate_every,
                "grad_scaling": self.grad_scaling, "weight_decay": self.weight_decay, "lr_power": self.lr_power,
                "min_lr_ratio": self.min_lr_ratio, "optimizer_args": dict(self.optimizer_args)}


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

    ``on_step(step, loss)`` runs for every optimizer step, in order, when its loss has been read (it may raise to
    cancel, as ComfyUI's interrupt does): the losses of the steps since the last read are read together at most
    every ``report_seconds`` (0: after every step), so several calls can come at once, a few steps after their
    steps; ``on_read()`` follows each such group, for a display to show the latest step once. ``should_stop()``
    is asked before every step; True ends the run early (``TrainResult.stopped``), as reaching step ``stop_at``
    does.
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
    stop_at: int | None = None
    on_read: Callable[[], None] | None = None
    report_seconds: float = 0.5


MOST_UNREAD = 64
"""Steps whose losses may wait on the device for a read: the read comes after this many steps, however fast."""


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
    overflow_steps: int = 0  # steps the gradient scaler skipped (fp16 overflow), resumed ones included; counted
    # on the device and added here when a checkpoint is taken and when the run ends
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


def _scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """A copy of ``scaler``'s scale where it is, on the device (None before its first scaled loss, or when it is
    off): ``get_scale()`` would read it on the host."""
    scale = scaler._get_scale_async()
    return None if scale is None else scale.detach().clone()


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s next step takes a ``found_inf`` flag and leaves every weight and state as it was
    where the flag is set, with no read on the host: a fused step of an optimizer that takes a gradient scaler's
    flags (PyTorch's fused Adam, AdamW and SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        any(g.get("fused") for g in optimizer.param_groups)


def _step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """``optimizer.step()``, skipped where the device flag ``bad`` is set: by a fused step on the device, by any
    other (a fused step that fell back to the plain one) after reading the flag on the host."""
    if _skips_on_device(optimizer):
        optimizer.grad_scale, optimizer.found_inf = None, bad.float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(bad):
        optimizer.step()


def _fold_into_scaler(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> bool:
    """Add the flag ``bad`` to the overflow flags ``scaler.unscale_(optimizer)`` set, so that ``scaler.step``
    skips the step (on the device for a fused optimizer) and ``update`` lowers the scale; False where the scaler
    keeps no such flags."""
    found = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {}).get("found_inf_per_device")
    if not found:
        return False
    for flag in found.values():
        torch.maximum(flag, bad.to(flag.device, flag.dtype), out=flag)
    return True


def _rng_devices() -> list[int]:
    """CUDA devices whose RNG state a validation must leave as it found it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def _versions(value: Any) -> list[int]:
    """The version counters of the tensors in ``value`` (a batch: in dicts, lists and tuples), in order; inference
    tensors have none (and cannot be updated outside inference mode)."""
    if isinstance(value, torch.Tensor):
        return [] if value.is_inference() else [value._version]
    if isinstance(value, Mapping):
        return [v for item in value.values() for v in _versions(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _versions(item)]
    return []


class _Run:
    """One call of :func:`train`: the optimizer, schedule, EMA and gradient scaler over ``params``, the result so
    far, and the parts of a step."""

    def __init__(self, params: Mapping[str, torch.Tensor], loader: Stateful,
                 loss_fn: Callable[[Any, int], torch.Tensor], config: TrainConfig, hooks: TrainHooks):
        self.params, self.loader, self.loss_fn, self.config, self.hooks = params, loader, loss_fn, config, hooks
        self.tensors = list(params.values())
        self.optimizer = make_optimizer(config.optimizer, params, config.learning_rate, config.weight_decay,
                                        lora_plus_ratio=config.lora_plus_ratio, arguments=config.optimizer_args)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: config.lr_factor(s))
        self.schedule_free = config.optimizer in SCHEDULE_FREE
        self.ema = EMA(params, config.ema_decay) if config.ema_decay > 0 else None
        device = self.tensors[0].device.type if self.tensors else "cpu"
        self.scaler = torch.amp.GradScaler(device) if config.grad_scaling else None
        self.validating = hooks.validate is not None and config.validate_every > 0
        self.result = TrainResult(step=0)
        self.skipped: torch.Tensor | None = None  # steps the scaler skipped, on the device, not yet in the result
        self.unread: list[torch.Tensor | float] = []  # losses of finished steps not yet in result.losses
        self.reported = 0  # steps handed to on_step
        self.last_read = time.monotonic()
        self.bad: torch.Tensor | None = None  # the step's non-finite-loss flag, where it is skipped on the device

    def restore(self, resume: Mapping[str, Any]) -> None:
        """Continue from the checkpoint ``resume``: the tensors, optimizer, schedule, loader, EMA and scaler, and
        the histories."""
        restore(resume, self.params, self.optimizer, self.scheduler, self.loader, self.ema, self.scaler)
        result = self.result
        result.step, result.losses = int(resume["step"]), [float(x) for x in resume["losses"]]
        result.overflow_steps = int(resume.get("overflow_steps") or 0)
        result.validation = [(int(s), float(v)) for s, v in resume.get("validation") or []]

    @contextlib.contextmanager
    def eval_weights(self) -> Iterator[None]:
        """A schedule-free optimizer's eval-mode weights in place for the block; the training weights are
        restored bit for bit afterwards."""
        if not self.schedule_free:
            yield
            return
        kept = {k: v.detach().clone() for k, v in self.params.items()}
        self.optimizer.eval()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.optimizer.train()  # type: ignore[attr-defined]
            with torch.no_grad():
                for k, v in self.params.items():
                    v.copy_(kept[k])

    def count_skipped(self) -> None:
        """Add the steps the gradient scaler skipped since the last count to ``result.overflow_steps``: a read of the
        device, for checkpoints and the end of the run only."""
        if self.skipped is not None:
            self.result.overflow_steps += int(self.skipped)
            self.skipped = None

    def deferring(self) -> bool:
        """Whether this step's loss can wait on the device for a later read (see the module docstring): one
        process, and an optimizer step that a flag on the device skips (with a gradient scaler too, which an
        optimizer without such a step makes read its own flag on the host at every step)."""
        if self.hooks.sync is not None or not _skips_on_device(self.optimizer):
            return False
        return self.scaler is None or self.scaler.is_enabled()

    def read(self) -> None:
        """Move the unread losses into ``result.losses``: one wait for the device, whatever their number."""
        tensors = [v for v in self.unread if isinstance(v, torch.Tensor)]
        values = iter(torch.stack(tensors).tolist() if tensors else [])
        self.result.losses.extend(next(values) if isinstance(v, torch.Tensor) else v for v in self.unread)
        self.unread = []
        self.last_read = time.monotonic()

    def report_due(self) -> bool:
        """Whether to read and report now: a loss already read (a step that was not deferred), the most unread
        steps, or ``report_seconds`` since the last read."""
        return bool(self.unread) and (not isinstance(self.unread[-1], torch.Tensor) or len(self.unread) >= MOST_UNREAD
                                      or time.monotonic() - self.last_read >= self.hooks.report_seconds)

    def report(self) -> None:
        """Read the unread losses and hand each step to ``on_step``, in order, then call ``on_read``. A non-finite
        loss (a step skipped on the device) stops the run here, with ``FloatingPointError``."""
        self.read()
        result, hooks = self.result, self.hooks
        if self.reported >= result.step:
            return
        while self.reported < result.step:
            step = self.reported + 1
            value = result.losses[step - 1]
            self.reported = step
            if not math.isfinite(value):
                after = "" if step == result.step else f", and the run went on to step {result.step}"
                raise FloatingPointError(f"loss is {value} at step {step} (that step changed no weight{after}); "
                                         "lower the learning rate or train in bf16 or fp32")
            if hooks.on_step is not None:
                hooks.on_step(step, value)
        if hooks.on_read is not None:
            hooks.on_read()

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of the run as it stands (:func:`~.checkpoint.checkpoint`)."""
        self.read()
        self.count_skipped()
        weights = None
        if self.schedule_free:
            with self.eval_weights():
                weights = {k: v.detach().clone() for k, v in self.params.items()}
        result = self.result
        return checkpoint(self.params, self.optimizer, self.scheduler, self.loader, result.step, result.losses,
                          self.config.record(), validation=result.validation, ema=self.ema, weights=weights,
                          scaler=self.scaler, overflow_steps=result.overflow_steps)

    def validate(self) -> None:
        """Record the validation loss at the current step: without gradients, with the eval-mode weights, the RNG
        left as it was."""
        assert self.hooks.validate is not None
        with self.eval_weights(), torch.no_grad(), torch.random.fork_rng(devices=_rng_devices()):
            value = float(self.hooks.validate())
        self.result.validation.append((self.result.step, value))

    def validated(self, step: int) -> bool:
        return bool(self.result.validation) and self.result.validation[-1][0] == step

    def wants_stop(self) -> bool:
        """Whether to stop before the next step (the caller's wish, agreed with the other processes)."""
        sync, until = self.hooks.sync, self.hooks.stop_at
        stop = until is not None and self.result.step >= until
        stop = (self.hooks.should_stop is not None and self.hooks.should_stop()) or stop
        if sync is not None:
            stop = sync.stop(stop)
        return stop

    def backward(self, batches: Batches) -> torch.Tensor | float:
        """The forward and backward passes of one optimizer step's micro-batches, gradients accumulated; returns
        the step's loss (over all processes): on the device where it can wait for a later read (its non-finite
        flag in ``bad``, for :meth:`apply`), else read."""
        config, sync, scaler, step = self.config, self.hooks.sync, self.scaler, self.result.step
        deferred = self.deferring()
        self.bad = None
        summed: torch.Tensor | None = None
        total = 0.0
        for micro in range(config.grad_accumulation):
            loss = self.micro_loss(next(batches), step * config.grad_accumulation + micro)
            part = loss / config.grad_accumulation
            last = micro == config.grad_accumulation - 1
            kept = part.detach().float()  # summed in fp32 whatever the loss's dtype
            summed = kept if summed is None else summed + kept
            if last and not deferred:
                # the step's one wait for the device (the micro-steps before it queue theirs without one), before
                # the last backward pass is queued: the host prepares the next step while the device runs that
                # backward pass and the optimizer step. A non-finite loss in any micro-step makes the sum one, so
                # it is refused here, before the optimizer changes a weight.
                total = float(summed)
                if not math.isfinite(total):
                    raise FloatingPointError(f"loss is {total} at step {step + 1}; lower the "
                                             "learning rate or train in bf16 or fp32")
            with contextlib.nullcontext() if sync is None else sync.backward(last):
                (part if scaler is None else scaler.scale(part)).backward()
        assert summed is not None
        if deferred:
            self.bad = summed.isfinite().logical_not()
            return summed
        if sync is not None:
            total = sync.step(total)
        return total

    def micro_loss(self, batch: Any, micro_step: int) -> torch.Tensor:
        """``loss_fn(batch, micro_step)``, run again once where a recomputed block's learnt copies gave out
        (:class:`~.inplace.InputUpdatedLater`: the copies are off from then on, and the forward pass that raised
        left nothing behind but the tensors it changed). Its noise is seeded from ``micro_step``, so the second run
        is the micro-step a run without the learnt copies makes; it runs only where no tensor of the batch changed
        (by their version counters), else the error stands, with its message."""
        versions = _versions(batch)
        try:
            return self.loss_fn(batch, micro_step)
        except InputUpdatedLater:
            if _versions(batch) != versions:
                raise
        return self.loss_fn(batch, micro_step)

    def apply(self, steps: FusedSteps) -> None:
        """Apply the accumulated gradients: unscaled, clipped, the optimizer and schedule stepped (a step whose
        scaled gradients overflowed is skipped and counted), the gradients cleared."""
        optimizer, scaler, bad = self.optimizer, self.scaler, self.bad
        if scaler is not None:
            scaler.unscale_(optimizer)
            if bad is not None and not _fold_into_scaler(scaler, optimizer, bad) and bool(bad):
                raise FloatingPointError(f"the loss is not finite at step {self.result.step + 1}; lower the "
                                         "learning rate or train in bf16 or fp32")
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.tensors, self.config.max_grad_norm)
        if scaler is None:
            steps.step(optimizer.step if bad is None else lambda: _step_unless(optimizer, bad))
        else:
            before = _scale(scaler)
            steps.step(lambda: scaler.step(optimizer))  # skipped when a gradient overflowed
            scaler.update()
            self.note_skipped(before, _scale(scaler))
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped first step makes torch warn about the call order
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()

    def note_skipped(self, before: torch.Tensor | None, after: torch.Tensor | None) -> None:
        """Count the step as skipped where the scaler lowered its scale from ``before`` to ``after`` (it does so for
        a step whose gradients overflowed): compared and counted on the device, nothing read on the host."""
        if before is None or after is None:  # no scale: the scaler is off and skips nothing
            return
        if self.skipped is None:
            self.skipped = torch.zeros((), dtype=torch.int64, device=after.device)
        self.skipped += after < before

    def finished_step(self, loss: torch.Tensor | float) -> bool:
        """Record a finished step with loss ``loss`` (read or not): EMA (which leaves out a step skipped on the
        device), validation, the report when due (:meth:`report`), a periodic checkpoint. Returns whether a
        checkpoint was saved."""
        result, config, hooks = self.result, self.config, self.hooks
        result.step += 1
        self.unread.append(loss)
        if self.ema is not None:
            self.ema.update(keep=None if self.bad is None else self.bad.logical_not())
        validated = self.validating and result.step % config.validate_every == 0
        if validated:
            self.validate()
        saving = hooks.save is not None and config.save_every > 0 and result.step % config.save_every == 0 \
            and result.step < config.steps
        if validated or saving or self.report_due():  # a validation has waited for the device already
            self.report()
        if saving:
            assert hooks.save is not None
            hooks.save(self.snapshot(), False)
            return True
        return False

    def run(self) -> None:
        """The steps up to ``config.steps`` or a stop, validating a resumed step left unvalidated first and the
        last step at the end; a checkpoint is saved when an exception leaves after unsaved steps."""
        result, config, save = self.result, self.config, self.hooks.save
        steps = FusedSteps(self.optimizer, self.hooks.fallbacks if self.hooks.fallbacks is not None else Fallbacks(),
                           scaled=self.scaler is not None)
        if self.schedule_free:
            self.optimizer.train()  # type: ignore[attr-defined]
        batches = Batches(self.loader)
        last_saved = self.reported = result.step
        self.last_read = time.monotonic()
        try:
            if self.validating and 0 < result.step < config.steps and result.step % config.validate_every == 0 \
                    and not self.validated(result.step):
                self.validate()
            while result.step < config.steps:
                if self.wants_stop():
                    result.stopped = True
                    break
                total = self.backward(batches)
                self.apply(steps)
                if self.finished_step(total):
                    last_saved = result.step
            self.report()
            if self.validating and result.step >= config.steps and not self.validated(result.step):
                self.validate()
        except BaseException:
            if save is not None and result.step > last_saved:
                save(self.snapshot(), False)
            raise

    def finish(self) -> TrainResult:
        """The final checkpoint, and the result with the weights to use."""
        if self.hooks.save is not None:
            self.hooks.save(self.snapshot(), True)
        if self.schedule_free:
            self.optimizer.eval()  # type: ignore[attr-defined]
        self.count_skipped()
        result = self.result
        result.weights = {k: v.detach() for k, v in self.params.items()}
        result.ema_weights = None if self.ema is None else self.ema.averaged()
        return result


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
    run = _Run(params, loader, loss_fn, config, hooks)
    if resume is not None:
        run.restore(resume)
    run.run()
    return run.finish()
