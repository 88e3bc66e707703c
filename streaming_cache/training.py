"""The training loop around a model-specific step: optimizer, LR schedule, gradient accumulation,
checkpoints that resume exactly, and a LoRA file written atomically.

The model-specific part (how a batch becomes a loss) is a callable; everything else is here so it is tested
without ComfyUI. Resuming restores the trainable tensors, optimizer and schedule state, the loss history and
the loader position, so a resumed run sees exactly the batches and noise the uninterrupted run would have seen
(noise is seeded per step by the caller: see :func:`step_generator`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from safetensors.torch import save_file

from .errors import CacheError

OPTIMIZERS = ("AdamW", "Adam", "SGD", "RMSprop", "Adafactor")
SCHEDULES = ("constant", "cosine", "linear")
CHECKPOINT_VERSION = 1


def make_optimizer(name: str, params: list[torch.Tensor], lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "Adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "RMSprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay)
    if name == "Adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def lr_factor(schedule: str, step: int, total: int, warmup: int) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based) of ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


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
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")


@dataclass
class TrainResult:
    step: int  # optimizer steps done in total (resumed ones included)
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    stopped: bool = False  # ended early by should_stop


class Batches:
    """Endless batches over epochs of a loader (anything with ``__iter__``, ``state_dict`` and ``load_state_dict``)."""

    def __init__(self, loader: Any):
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
    loader: Any,
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
        return checkpoint(params, optimizer, scheduler, loader, result.step, result.losses, config)

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


def checkpoint(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any, loader: Any,
               step: int, losses: list[float], config: TrainConfig) -> dict[str, Any]:
    """Everything an exact resume needs, as plain tensors and containers (loadable with ``weights_only``)."""
    return {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "losses": list(losses),
        "params": {k: v.detach().clone() for k, v in params.items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
        "cpu_rng": torch.get_rng_state(),
        "config": {"steps": config.steps, "seed": config.seed, "optimizer": config.optimizer,
                   "grad_accumulation": config.grad_accumulation},
    }


def restore(state: Mapping[str, Any], params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
            scheduler: Any, loader: Any) -> None:
    if state.get("version") != CHECKPOINT_VERSION:
        raise CacheError(f"training checkpoint version {state.get('version')!r} is not supported")
    saved = state["params"]
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved))[:3], sorted(set(saved) - set(params))[:3]
        raise CacheError(f"the checkpoint was made for a different LoRA layout (missing {missing}, unexpected "
                         f"{extra}); use the same model, rank and algorithm, or start a new run")
    with torch.no_grad():
        for k, v in params.items():
            if saved[k].shape != v.shape:
                raise CacheError(f"checkpoint tensor {k} has shape {tuple(saved[k].shape)}, the LoRA needs "
                                 f"{tuple(v.shape)}; use the same rank and model, or start a new run")
            v.copy_(saved[k])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["cpu_rng"])


def save_checkpoint(path: str, state: Mapping[str, Any]) -> None:
    """Write a training checkpoint atomically (temporary file, fsync, rename); creates the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a training checkpoint without executing code (``weights_only``)."""
    try:
        with torch.inference_mode(False):  # the optimizer updates these tensors in place later
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CacheError(f"{path}: not a readable training checkpoint ({type(exc).__name__}: {exc}); delete it "
                         "to start over") from exc
    if not isinstance(state, dict) or "step" not in state:
        raise CacheError(f"{path}: not a training checkpoint; delete it to start over")
    return state


def save_lora(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write a LoRA as safetensors atomically, contiguous and on the CPU, so a kill never leaves half a file;
    creates the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp,
                  metadata=dict(metadata or {}))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
