"""Training checkpoints and LoRA files: written atomically (a kill never leaves half a file), read without
executing code.

A checkpoint holds everything an exact resume needs (trainable tensors, optimizer and schedule state, loss and
validation history, loader position, CPU RNG, EMA weights, the fp16 gradient scaler) as plain tensors and
containers, loadable with ``weights_only``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Protocol

import torch
from safetensors.torch import save

from .. import layout
from ..errors import CacheError

CHECKPOINT_VERSION = 1


class Stateful(Protocol):
    """What the loop needs of a loader: epochs of batches, and a position it can save and restore."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


Scheduler = torch.optim.lr_scheduler.LRScheduler


# Keys of a checkpoint dict that are derived from the rest, for the ``save`` callback (the weights to write as
# the LoRA and its EMA copy); :func:`save_checkpoint` leaves them out of the file.
DERIVED_KEYS = ("weights", "ema_weights")


def checkpoint(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Scheduler,
               loader: Stateful, step: int, losses: list[float], settings: Mapping[str, Any], *,
               validation: Sequence[tuple[int, float]] = (), ema: Any = None,
               weights: Mapping[str, torch.Tensor] | None = None, scaler: Any = None,
               overflow_steps: int = 0) -> dict[str, Any]:
    """Everything an exact resume needs, as plain tensors and containers (loadable with ``weights_only``):
    ``params`` (the trainable tensors as the optimizer sees them), ``optimizer``, ``scheduler``, ``loader``,
    ``cpu_rng``, the ``losses`` and ``validation`` histories, ``ema`` (an :class:`~.ema.EMA` state, or
    None), ``scaler`` (a ``torch.amp.GradScaler`` state, or None) and the ``overflow_steps`` it skipped. Also
    the derived ``weights`` (what to save as the LoRA: ``weights`` if given, e.g. a schedule-free optimizer's
    eval-mode weights, else ``params``) and ``ema_weights`` (the EMA's averaged weights, or None)."""
    saved = {k: v.detach().clone() for k, v in params.items()}
    return {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "losses": list(losses),
        "validation": [[int(s), float(v)] for s, v in validation],
        "params": saved,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader": loader.state_dict(),
        "cpu_rng": torch.get_rng_state(),
        "config": dict(settings),
        "ema": None if ema is None else ema.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "overflow_steps": int(overflow_steps),
        "weights": saved if weights is None else {k: v.detach().clone() for k, v in weights.items()},
        "ema_weights": None if ema is None else ema.averaged(),
    }


def restore(state: Mapping[str, Any], params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
            scheduler: Scheduler, loader: Stateful, ema: Any = None, scaler: Any = None) -> None:
    """Put ``params``, the optimizer, schedule, loader, CPU RNG, ``ema`` and ``scaler`` (if given) back as
    ``state`` saved them. An EMA but no EMA state in ``state`` (a checkpoint made without one) starts the average
    from the restored weights; a scaler without a saved state starts from its initial scale."""
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
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ValueError as exc:
        raise CacheError(f"the checkpoint's optimizer state does not fit this optimizer ({exc}); use the same "
                         "optimizer and LoRA+ ratio, or start a new run") from exc
    scheduler.load_state_dict(state["scheduler"])
    if state.get("loader") is not None:
        loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["cpu_rng"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if ema is not None:
        if state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        else:
            with torch.no_grad():
                for k, v in ema.shadow.items():
                    v.copy_(params[k].detach().to(torch.float32))


def write_atomically(path: str, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a new temporary file (created exclusively, never through a link), then fsync and
    rename over ``path``: readers see the old file or the new one, never half of one. Creates the folder;
    removes the temporary file on failure."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with layout.create_file(tmp) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            layout.remove_file(tmp)


def save_checkpoint(path: str, state: Mapping[str, Any]) -> None:
    """Write a training checkpoint atomically (without the derived keys, :data:`DERIVED_KEYS`)."""
    kept = {k: v for k, v in state.items() if k not in DERIVED_KEYS}
    write_atomically(path, lambda f: torch.save(kept, f))


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
    """Write a LoRA as safetensors (contiguous, on the CPU) atomically."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    write_atomically(path, lambda f: f.write(save(cpu, metadata=dict(metadata or {}))))
