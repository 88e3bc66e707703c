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

import ast
import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..fallbacks import FUSED_OPTIMIZER, Fallbacks, describe
from ..torch_build import is_rocm

ParamGroups = list[dict[str, Any]]
OptimizerFactory = Callable[..., torch.optim.Optimizer]
MAX_ARGUMENTS_TEXT = 4096
RESERVED_ARGUMENTS = {"params": "the trained weights", "lr": "learning_rate", "weight_decay": "weight_decay",
                      "fused": "the pack, which fuses Adam's step where the GPU has the kernels"}


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


def _prodigy(p: ParamGroups, lr: float, wd: float, **kw: Any) -> torch.optim.Optimizer:
    return _package("prodigyopt", "prodigyopt", "Prodigy").Prodigy(p, lr=lr, weight_decay=wd, **kw)


def _schedule_free(p: ParamGroups, lr: float, wd: float, **kw: Any) -> torch.optim.Optimizer:
    # Warm-up comes from the loop's schedule (the same linear ramp as the package's own warmup_steps).
    return _package("schedulefree", "schedulefree", "AdamWScheduleFree").AdamWScheduleFree(p, lr=lr, weight_decay=wd,
                                                                                           **kw)


def _adamw_8bit(p: ParamGroups, lr: float, wd: float, **kw: Any) -> torch.optim.Optimizer:
    devices = {t.device.type for g in p for t in g["params"]}
    if devices - {"cuda"}:
        raise OptimizerUnavailableError(
            f"the optimizer AdamW8bit (bitsandbytes) runs on CUDA GPUs only, and these weights are on "
            f"{', '.join(sorted(devices - {'cuda'}))}; choose AdamW (or Adafactor, which also saves memory)")
    return _package("bitsandbytes", "bitsandbytes", "AdamW8bit").optim.AdamW8bit(p, lr=lr, weight_decay=wd, **kw)


def _lion(p: ParamGroups, lr: float, wd: float, **kw: Any) -> torch.optim.Optimizer:
    # Lion's update is the sign of a momentum: its learning rate is 3-10x below AdamW's (the paper's advice).
    return _package("lion_pytorch", "lion-pytorch", "Lion").Lion(p, lr=lr, weight_decay=wd, **kw)


def _came(p: ParamGroups, lr: float, wd: float, **kw: Any) -> torch.optim.Optimizer:
    return _package("came_pytorch", "came-pytorch", "CAME").CAME(p, lr=lr, weight_decay=wd, **kw)


FUSED_DEVICES = frozenset({"cuda"})
"""Device types whose weights take Adam's fused step (PyTorch has a fused CPU step too; the CPU keeps the default)."""
FUSED_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
"""The dtypes PyTorch's fused Adam step takes (its documentation of ``fused``)."""
FUSED_ON_ROCM = True
"""Whether weights on AMD GPUs (PyTorch's ROCm build) take the fused step too: yes. PyTorch builds its fused Adam
kernels for ROCm from the CUDA source, lists "cuda" among the fused devices without an exception for ROCm
(``torch.utils._foreach_utils._get_fused_kernels_supported_devices``) and runs its fused-optimizer tests there;
and :class:`FusedSteps` checks the kernels on the machine before the first step (against the plain step, on
tiny weights of each device and dtype), so a ROCm build or GPU without them trains on the plain step, noted."""


def fused_choice(weights: Iterable[tuple[str, torch.dtype]], rocm: bool) -> bool | None:
    """Adam's ``fused`` argument for weights of these (device type, dtype) pairs, in a process that runs PyTorch's
    ROCm build or not (``rocm``, whose AMD GPUs are "cuda" devices: see :data:`FUSED_ON_ROCM`): True where every
    weight is on a CUDA device in a dtype the fused step takes, else None (PyTorch's default: foreach on CUDA, the
    for-loop elsewhere); weights on several kinds of device take the default. The fused step runs in a few kernels
    with its step counts on the GPU, where the default one spent about 20 ms of host time a step on the 1,500
    tensors of an SDXL LoRA."""
    pairs = list(weights)
    if rocm and not FUSED_ON_ROCM:
        return None
    if pairs and all(device in FUSED_DEVICES and dtype in FUSED_DTYPES for device, dtype in pairs):
        return True
    return None


def _fused(p: ParamGroups) -> bool | None:
    return fused_choice([(t.device.type, t.dtype) for g in p for t in g["params"]], is_rocm())


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "AdamW": lambda p, lr, wd, **kw: torch.optim.AdamW(p, lr=lr, weight_decay=wd, fused=_fused(p), **kw),
    "Adam": lambda p, lr, wd, **kw: torch.optim.Adam(p, lr=lr, weight_decay=wd, fused=_fused(p), **kw),
    "SGD": lambda p, lr, wd, **kw: torch.optim.SGD(p, lr=lr, weight_decay=wd, **kw),
    "RMSprop": lambda p, lr, wd, **kw: torch.optim.RMSprop(p, lr=lr, weight_decay=wd, **kw),
    "Adafactor": lambda p, lr, wd, **kw: torch.optim.Adafactor(p, lr=lr, weight_decay=wd, **kw),
    "Prodigy": _prodigy,
    "AdamWScheduleFree": _schedule_free,
    "AdamW8bit": _adamw_8bit,
    "Lion": _lion,
    "CAME": _came,
}
# Where each optimizer comes from (kohya's ``ss_optimizer`` names the class as ``module.Class``).
OPTIMIZER_CLASSES: dict[str, str] = {
    "AdamW": "torch.optim.adamw.AdamW", "Adam": "torch.optim.adam.Adam", "SGD": "torch.optim.sgd.SGD",
    "RMSprop": "torch.optim.rmsprop.RMSprop", "Adafactor": "torch.optim.Adafactor",
    "Prodigy": "prodigyopt.prodigy.Prodigy", "AdamWScheduleFree": "schedulefree.adamw_schedulefree.AdamWScheduleFree",
    "AdamW8bit": "bitsandbytes.optim.adamw.AdamW8bit", "Lion": "lion_pytorch.lion_pytorch.Lion",
    "CAME": "came_pytorch.CAME.CAME",
}
# Packages an optimizer needs beyond torch: (module to import, pip name).
OPTIMIZER_PACKAGES: dict[str, tuple[str, str]] = {
    "Prodigy": ("prodigyopt", "prodigyopt"), "AdamWScheduleFree": ("schedulefree", "schedulefree"),
    "AdamW8bit": ("bitsandbytes", "bitsandbytes"), "Lion": ("lion_pytorch", "lion-pytorch"),
    "CAME": ("came_pytorch", "came-pytorch"),
}
# Optimizers that keep two sets of weights and must be switched between train() and eval() mode: the weights
# to save and to validate with are the eval-mode ones (see loop.py).
SCHEDULE_FREE = frozenset({"AdamWScheduleFree"})
# Prodigy estimates the step size itself: its learning rate is a multiplier of that estimate, normally 1.0, and
# one for all weights (it refuses parameter groups with different rates, so LoRA+ cannot be used with it).
ADAPTIVE_LR = frozenset({"Prodigy"})
SCHEDULES = ("constant", "cosine", "linear", "cosine_with_restarts", "polynomial")


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


def parse_optimizer_args(text: str) -> dict[str, Any]:
    """The optimizer arguments of a text as sd-scripts' ``--optimizer_args`` takes them: ``name=value`` items
    separated by spaces or new lines (``betas=0.9,0.99 eps=1e-8``), each value a Python literal (a number, a
    tuple as ``0.9,0.99``, True, None, a quoted string) or else kept as text. Read with ``ast.literal_eval``:
    nothing in the text runs."""
    if len(text or "") > MAX_ARGUMENTS_TEXT:
        raise ValueError(f"optimizer_args is {len(text)} characters long; at most {MAX_ARGUMENTS_TEXT} are read")
    out: dict[str, Any] = {}
    for item in (text or "").split():
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"optimizer_args: {item!r} is not name=value (for example betas=0.9,0.99 eps=1e-8; "
                             "items are separated by spaces)")
        if key in RESERVED_ARGUMENTS:
            raise ValueError(f"optimizer_args: {key} is set by {RESERVED_ARGUMENTS[key]}, not here")
        if key in out:
            raise ValueError(f"optimizer_args: {key} is given twice")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = raw
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def make_optimizer(name: str, params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Iterable[torch.Tensor],
                   lr: float, weight_decay: float = 0.0, *, lora_plus_ratio: float = 1.0,
                   arguments: Mapping[str, Any] | None = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (a mapping name -> tensor, needed for LoRA+, or a sequence of
    tensors), given ``arguments`` beyond the learning rate and weight decay (:func:`parse_optimizer_args`).
    Raises :class:`OptimizerUnavailableError` when its package is missing (naming the pip command) or it cannot
    run on the tensors' device (AdamW8bit off CUDA); ``ValueError`` for LoRA+ with Prodigy, or arguments the
    optimizer does not take."""
    check_optimizer(name)
    if not isinstance(params, (Mapping, Sequence)):
        params = list(params)
    groups = param_groups(params, lr, lora_plus_ratio)
    if name in ADAPTIVE_LR and len(groups) > 1:
        raise ValueError(f"{name} uses one step size for all weights, so LoRA+ cannot be used with it; set "
                         "lora_plus_ratio to 1 or choose another optimizer")
    extra = dict(arguments or {})
    try:
        return OPTIMIZERS[name](groups, lr, weight_decay, **extra)
    except (TypeError, ValueError) as exc:
        if not extra:
            raise
        raise ValueError(f"the optimizer {name} refused optimizer_args {extra} ({type(exc).__name__}: {exc}); "
                         "see its documentation for the arguments it takes") from exc


def _plain_step_dtype() -> torch.dtype:
    """The dtype of the step counters PyTorch's plain Adam step keeps (on the CPU)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def use_plain_step(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` from the fused step to PyTorch's plain one (foreach or for-loop) in place, its state as
    the plain step keeps it: the ``fused`` flags of its groups None (what :func:`make_optimizer` gives off CUDA),
    the step counters on the CPU, the gradient scaler told to skip overflowing steps itself. Idempotent; an
    optimizer without a fused step is left as it is. A ``load_state_dict`` takes the saved groups' ``fused`` flags,
    so a state saved after a fallback loads as plain; this makes the rest of the optimizer agree."""
    if not any("fused" in g for g in optimizer.param_groups):
        return
    for group in optimizer.param_groups:
        if group["fused"]:
            group["fused"] = None
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer._step_supports_amp_scaling = False  # type: ignore[attr-defined]
    for name in ("grad_scale", "found_inf"):  # left by a GradScaler whose fused step raised
        if name in vars(optimizer):
            delattr(optimizer, name)
    dtype = _plain_step_dtype()
    for group in optimizer.param_groups:
        if group.get("capturable"):
            continue
        for p in group["params"]:
            state: dict[str, Any] = optimizer.state.get(p) or {}
            step = state.get("step")
            if isinstance(step, torch.Tensor) and (step.device.type != "cpu" or step.dtype != dtype):
                state["step"] = step.detach().to("cpu", dtype)


def _trial(optimizer: torch.optim.Optimizer, scaled: bool) -> str | None:
    """Why the fused step of ``optimizer``'s class and settings cannot train its weights here, or None: one step
    on a tiny weight of each device and dtype among its fused groups' weights, compared with the plain step's
    (throwaway optimizers: nothing of ``optimizer`` is read or changed but its settings), with one wait for the
    device per device and dtype. ``scaled``: the step gets a gradient scaler's overflow flag, as
    ``GradScaler.step`` hands a fused optimizer."""
    groups = [g for g in optimizer.param_groups if g.get("fused")]
    if not groups:
        return None
    settings = {k: v for k, v in groups[0].items() if k not in ("params", "param_names")}
    kinds = sorted({(p.device, p.dtype) for g in groups for p in g["params"]}, key=str)
    make: Any = type(optimizer)
    for device, dtype in kinds:
        where = f"a trial step on {device} {str(dtype).removeprefix('torch.')} before the first step"
        weights = []
        try:
            for fused in (True, None):
                ramp = torch.arange(4, device=device, dtype=dtype)  # made on the device: no copy to wait for
                weight = ramp - 1.5
                weight.grad = ramp * 0.75 - 1.0
                trial = make([{**settings, "params": [weight], "fused": fused}])
                if fused and scaled:
                    trial.found_inf = torch.zeros((), device=device)
                trial.step()
                weights.append(weight.detach())
            # the trial's one wait for the device: the kernel's errors surface here too
            fused_result, plain_result = torch.stack(weights).to("cpu", torch.float64)
        except Exception as exc:
            return f"{describe(exc)} ({where})"
        tolerance = 16 * torch.finfo(dtype).eps
        if not torch.allclose(fused_result, plain_result, rtol=tolerance, atol=tolerance * float(settings["lr"])):
            return (f"the fused step computed {fused_result.tolist()} where the plain step computes "
                    f"{plain_result.tolist()} ({where})")
    return None


class FusedSteps:
    """The steps of an optimizer on its fused implementation while that works, and on PyTorch's plain one
    (foreach or for-loop) for the rest of the run from the first fused step that fails: a kernel missing on this
    platform or GPU, a device or dtype the fused step does not take. The reason is noted in ``fallbacks``
    (``FUSED_OPTIMIZER``), once.

    A fallback trains what the plain step trains. Before the first step the fused step is tried on tiny weights
    of each device and dtype among the optimizer's weights and compared with the plain step (:func:`_trial`): a
    failure there touches nothing of the run, which is then the run a plain optimizer makes from the start. A
    real step that raises after the trial passed is done again on the plain path with the optimizer's state as it
    was before it (the fused step counts a step before its kernel runs, and creates the state of a first step):
    exact when it failed before changing a weight, as a kernel that cannot run does. After a fallback the state
    is the plain step's (:func:`use_plain_step`), so checkpoints are plain ones and resume plain.

    ``scaled``: the steps run through a ``torch.amp.GradScaler``. An optimizer without a fused step runs its
    steps as they are; one whose loaded state is plain is made to agree (:func:`use_plain_step`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, fallbacks: Fallbacks, *, scaled: bool = False) -> None:
        self.optimizer, self.fallbacks, self.scaled = optimizer, fallbacks, scaled
        self._tried = False
        if not self.fused:
            use_plain_step(optimizer)

    @property
    def fused(self) -> bool:
        """Whether the next step runs the fused implementation."""
        return any(g.get("fused") for g in self.optimizer.param_groups)

    def step(self, run: Callable[[], object]) -> None:
        """One optimizer step: ``run`` makes it (``optimizer.step``, or a gradient scaler's ``step(optimizer)``),
        and makes it again on the plain path if it fails on the fused one."""
        if not self.fused:
            run()
            return
        if not self._tried:
            self._tried = True
            failure = _trial(self.optimizer, self.scaled)
            if failure is not None:
                self._fall_back(failure)
                run()
                return
        counters = self._counters()
        try:
            run()
        except Exception as exc:
            state = self.optimizer.state
            for p in [p for p in state if p not in counters]:  # made by the failed step
                del state[p]
            for p, step in counters.items():
                state[p]["step"] = step
            self._fall_back(f"{describe(exc)} (a fused step; it was done again on the plain path)")
            run()

    def _counters(self) -> dict[torch.Tensor, torch.Tensor]:
        """A copy of each weight's step counter (weights with a state only)."""
        state = self.optimizer.state
        owners = [p for g in self.optimizer.param_groups for p in g["params"] if "step" in state.get(p, ())]
        steps = [state[p]["step"] for p in owners]
        return dict(zip(owners, torch._foreach_mul(steps, 1.0))) if steps else {}

    def _fall_back(self, reason: str) -> None:
        use_plain_step(self.optimizer)
        self.fallbacks.note(FUSED_OPTIMIZER, reason)


def lr_factor(schedule: str, step: int, total: int, warmup: int, cycles: int = 1, *, power: float = 1.0,
              floor: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based) of ``total``: a linear warm-up
    over ``warmup`` steps, then constant, or a decay from 1 to ``floor`` (the minimum-LR ratio; 0: to zero):
    cosine, linear, ``polynomial`` (``(1 - progress) ** power``: sd-scripts' ``--lr_scheduler_power``,
    transformers' polynomial decay with ``lr_end = floor x lr``; power 1 is linear), or ``cosine_with_restarts``:
    ``cycles`` cosine decays, each restarting at the full rate (hard restarts, as in diffusers/transformers)."""
    check_schedule(schedule)
    if cycles < 1:
        raise ValueError(f"cycles must be at least 1, got {cycles}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"the minimum-LR ratio must be between 0 and 1, got {floor}")
    if not (power > 0 and math.isfinite(power)):
        raise ValueError(f"the polynomial schedule's power must be positive, got {power}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "cosine_with_restarts":
        decay = 0.0 if progress >= 1.0 else 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0)))
    elif schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "polynomial":
        decay = (1.0 - progress) ** power
    else:
        return 1.0
    return floor + (1.0 - floor) * decay
