"""Optimizers and learning-rate schedules by name: the one table the node's drop-down and the loop share.

Optimizers from other packages (Prodigy, schedule-free AdamW, 8-bit AdamW) are imported only when chosen; a
missing package is an :class:`OptimizerUnavailableError` naming the ``pip`` command that installs it.

LoRA+ (Hayou et al. 2024): the "up" (B) matrices of LoRA adapters learn ``lora_plus_ratio`` times faster than
the rest. ComfyUI's LoRA adapters name their tensors ``diffusion_model.<module>.lora_up.weight``,
``.lora_down.weight``, ``.lora_mid.weight`` and ``.alpha`` (bias and norm differences: ``.diff``, ``.diff_b``);
PEFT-style names use ``lora_B`` / ``lora_A``. Only the up/B tensors are sped up (:func:`is_lora_up`). LoHa,
LoKr and OFT adapters have no up matrix, so the ratio applies to none of their tensors: training is then exactly
as without LoRA+.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

ParamGroups = list[dict[str, Any]]
OptimizerFactory = Callable[[ParamGroups, float, float], torch.optim.Optimizer]


class OptimizerUnavailableError(RuntimeError):
    """The chosen optimizer cannot run here: its package is missing, or it needs hardware this machine lacks."""


def _package(module: str, pip_name: str, optimizer: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise OptimizerUnavailableError(
            f"the optimizer {optimizer} needs the package {pip_name}, which is not installed: run "
            f"`python -m pip install {pip_name}` with ComfyUI's Python and restart ComfyUI, or choose another "
            f"optimizer ({type(exc).__name__}: {exc})") from exc


def _prodigy(p: ParamGroups, lr: float, wd: float) -> torch.optim.Optimizer:
    return _package("prodigyopt", "prodigyopt", "Prodigy").Prodigy(p, lr=lr, weight_decay=wd)


def _schedule_free(p: ParamGroups, lr: float, wd: float) -> torch.optim.Optimizer:
    # Warm-up comes from the loop's schedule (the same linear ramp as the package's own warmup_steps).
    return _package("schedulefree", "schedulefree", "AdamWScheduleFree").AdamWScheduleFree(p, lr=lr, weight_decay=wd)


def _adamw_8bit(p: ParamGroups, lr: float, wd: float) -> torch.optim.Optimizer:
    devices = {t.device.type for g in p for t in g["params"]}
    if devices - {"cuda"}:
        raise OptimizerUnavailableError(
            f"the optimizer AdamW8bit (bitsandbytes) runs on CUDA GPUs only, and these weights are on "
            f"{', '.join(sorted(devices - {'cuda'}))}; choose AdamW (or Adafactor, which also saves memory)")
    return _package("bitsandbytes", "bitsandbytes", "AdamW8bit").optim.AdamW8bit(p, lr=lr, weight_decay=wd)


def _fused(p: ParamGroups) -> bool | None:
    """True (Adam's fused step) where every weight is a floating-point CUDA tensor, else None (PyTorch's default):
    the fused step runs in a few kernels with its step counts on the GPU, where the default one spent about 20 ms
    of host time a step on the 1,500 tensors of an SDXL LoRA."""
    tensors = [t for g in p for t in g["params"]]
    return True if tensors and all(t.is_cuda and t.is_floating_point() for t in tensors) else None


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "AdamW": lambda p, lr, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd, fused=_fused(p)),
    "Adam": lambda p, lr, wd: torch.optim.Adam(p, lr=lr, weight_decay=wd, fused=_fused(p)),
    "SGD": lambda p, lr, wd: torch.optim.SGD(p, lr=lr, weight_decay=wd),
    "RMSprop": lambda p, lr, wd: torch.optim.RMSprop(p, lr=lr, weight_decay=wd),
    "Adafactor": lambda p, lr, wd: torch.optim.Adafactor(p, lr=lr, weight_decay=wd),
    "Prodigy": _prodigy,
    "AdamWScheduleFree": _schedule_free,
    "AdamW8bit": _adamw_8bit,
}
# Where each optimizer comes from (kohya's ``ss_optimizer`` names the class as ``module.Class``).
OPTIMIZER_CLASSES: dict[str, str] = {
    "AdamW": "torch.optim.adamw.AdamW", "Adam": "torch.optim.adam.Adam", "SGD": "torch.optim.sgd.SGD",
    "RMSprop": "torch.optim.rmsprop.RMSprop", "Adafactor": "torch.optim.Adafactor",
    "Prodigy": "prodigyopt.prodigy.Prodigy", "AdamWScheduleFree": "schedulefree.adamw_schedulefree.AdamWScheduleFree",
    "AdamW8bit": "bitsandbytes.optim.adamw.AdamW8bit",
}
# Packages an optimizer needs beyond torch: (module to import, pip name).
OPTIMIZER_PACKAGES: dict[str, tuple[str, str]] = {
    "Prodigy": ("prodigyopt", "prodigyopt"), "AdamWScheduleFree": ("schedulefree", "schedulefree"),
    "AdamW8bit": ("bitsandbytes", "bitsandbytes"),
}
# Optimizers that keep two sets of weights and must be switched between train() and eval() mode: the weights
# to save and to validate with are the eval-mode ones (see loop.py).
SCHEDULE_FREE = frozenset({"AdamWScheduleFree"})
# Prodigy estimates the step size itself: its learning rate is a multiplier of that estimate, normally 1.0, and
# one for all weights (it refuses parameter groups with different rates, so LoRA+ cannot be used with it).
ADAPTIVE_LR = frozenset({"Prodigy"})
SCHEDULES = ("constant", "cosine", "linear", "cosine_with_restarts")


def check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def check_schedule(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def missing_package(name: str) -> str | None:
    """The ``pip`` name of the package optimizer ``name`` needs and that is not installed, or None."""
    check_optimizer(name)
    if name not in OPTIMIZER_PACKAGES:
        return None
    module, pip_name = OPTIMIZER_PACKAGES[name]
    try:
        importlib.import_module(module)
    except ImportError:
        return pip_name
    return None


def is_lora_up(key: str) -> bool:
    """Whether ``key`` names a LoRA "up" (B) matrix: a ``lora_up`` / ``lora_B`` component (ComfyUI, kohya and
    PEFT names), or ``up`` right after a component ending in ``lora`` (``to_q_lora.up.weight``)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in ("lora_up", "lora_B", "lora_b"):
            return True
        if part == "up" and i > 0 and parts[i - 1].lower().endswith("lora"):
            return True
    return False


def param_groups(params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], lr: float,
                 lora_plus_ratio: float = 1.0) -> ParamGroups:
    """Optimizer parameter groups: one with every tensor at ``lr``, or with LoRA+ (``lora_plus_ratio != 1``) the
    up matrices in a second group at ``lr * lora_plus_ratio``. Empty groups are left out, so a layout without up
    matrices (LoHa, LoKr, OFT) gives the single group it would give without LoRA+ and resumes alike. Tensor order
    within a group follows ``params``."""
    if lora_plus_ratio <= 0 or not math.isfinite(lora_plus_ratio):
        raise ValueError(f"lora_plus_ratio must be a positive number (1 = off), got {lora_plus_ratio}")
    if not isinstance(params, Mapping):
        if lora_plus_ratio != 1.0:
            raise ValueError("LoRA+ needs the tensors by name (a mapping name -> tensor) to find the up matrices")
        return [{"params": list(params), "lr": lr}]
    base = [t for k, t in params.items() if lora_plus_ratio == 1.0 or not is_lora_up(k)]
    up = [t for k, t in params.items() if lora_plus_ratio != 1.0 and is_lora_up(k)]
    groups = [{"params": base, "lr": lr}] if base or not up else []
    if up:
        groups.append({"params": up, "lr": lr * lora_plus_ratio})
    return groups


def make_optimizer(name: str, params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Iterable[torch.Tensor],
                   lr: float, weight_decay: float = 0.0, *, lora_plus_ratio: float = 1.0) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (a mapping name -> tensor, needed for LoRA+, or a sequence of
    tensors). Raises :class:`OptimizerUnavailableError` when its package is missing (naming the pip command) or
    it cannot run on the tensors' device (AdamW8bit off CUDA); ``ValueError`` for LoRA+ with Prodigy."""
    check_optimizer(name)
    if not isinstance(params, (Mapping, Sequence)):
        params = list(params)
    groups = param_groups(params, lr, lora_plus_ratio)
    if name in ADAPTIVE_LR and len(groups) > 1:
        raise ValueError(f"{name} uses one step size for all weights, so LoRA+ cannot be used with it; set "
                         "lora_plus_ratio to 1 or choose another optimizer")
    return OPTIMIZERS[name](groups, lr, weight_decay)


def lr_factor(schedule: str, step: int, total: int, warmup: int, cycles: int = 1) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based) of ``total``: a linear warm-up
    over ``warmup`` steps, then constant, cosine or linear decay to zero, or ``cosine_with_restarts``: ``cycles``
    cosine decays, each restarting at the full rate (hard restarts, as in diffusers/transformers)."""
    check_schedule(schedule)
    if cycles < 1:
        raise ValueError(f"cycles must be at least 1, got {cycles}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "cosine_with_restarts":
        if progress >= 1.0:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0)))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0
