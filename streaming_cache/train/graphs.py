"""A model's forward and backward passes replayed as CUDA graphs while a LoRA trains.

On a fast GPU a model of a thousand small layers spends most of a training step issuing kernels from Python: SDXL
at 1024 px issues about 27,000 a step, each costing tens of microseconds of host time, for a few tenths of a second
of kernels in a step of a second. A CUDA graph records the kernels of one forward pass and of its backward pass
once and replays each with one launch, so the step takes the time of its kernels.

:class:`GraphedForward` replaces a module's forward (the diffusion model's, for the whole model) for the length of
a run. The first call with a given signature (the shapes, dtypes and devices of its tensors, the autocast in force
and the structure of its other arguments) runs eagerly a few times on a side stream (lazy initialisation, cuDNN's
algorithm search), then records the forward pass and the gradients of the trained parameters into graphs that
share one memory pool; that call, once its recording is checked, and later ones with that signature copy their
tensors into the recorded inputs and replay.
The device calls go through :mod:`.graph_devices`, whose CPU emulation runs all of this in the CPU test suite.

Replay never changes what a run learns, never ends it, and never costs more memory than the recordings hold:

* each recording is checked before it serves a call, against an eager pass that runs before the recording exists:
  the last warm-up pass, of the recording call's inputs, differentiated with fixed pseudo-random gradients of its
  outputs, is kept; the recording is captured over other values in its inputs (the call's own, shuffled), then
  replayed once with the call's inputs copied in and the warm-up's output gradients, and its outputs and the
  trained tensors' gradients must agree with the warm-up's within :data:`TOLERANCE` (relative to their norms). A
  replay that does not run, reads stale inputs or gives wrong gradients is caught there, before any step uses it;
  the recording call itself is then served by a replay, so no eager pass of a step runs beside its recording (the
  pool would hold a whole recorded step beside the eager pass's own memory: twice a step's activations);
* a recording, replay, backward replay or check that raises (an out-of-memory error too), or a check that
  disagrees, turns graphs off for the rest of the run: the recordings are freed first, then that call (or that
  gradient) is computed eagerly and every later one too, and the reason is noted in the run's
  :class:`~..fallbacks.Fallbacks` (the node's summary shows it). An eager call that runs out of memory while
  recordings are held (another signature's, a second pass of a micro-step) frees them the same way and runs again;
* recordings are kept for the signatures that recur most (aspect buckets give several), at most
  ``max_recordings`` of them within ``memory_budget``, counted as what each added to the graphs' memory pool (the
  device's own figure for the pool, :meth:`~.graph_devices.GraphDevice.pool_bytes`, plus the static buffers it
  keeps outside it); one evicted gives its memory back to the pool. Calls of other signatures run eagerly beside
  the recordings kept, which then cost what they hold: the budget bounds that (a single recording is kept whatever
  its size: alone, it holds about what an eager step would).

What replay needs of the model:

* the kernels of a step do not depend on values read on the host (the model makes no decision from a tensor's
  value, no synchronisation); a recording that fails says why and the run goes on eagerly;
* the weights stay where they were recorded (checked at each replay: a moved weight drops the recording);
* one recorded forward pass is differentiated before another is replayed or recorded (the recordings share one
  memory pool): :meth:`GraphedForward.begin_step` starts a micro-step, and a second forward pass in the same
  micro-step (a batch split into groups) runs eagerly;
* gradient checkpointing without saving the CUDA random state (PyTorch cannot read it while recording; the models
  train without dropout, so nothing random runs in a block).

Gradients reach the parameters as ordinary autograd results (fresh tensors, accumulated as usual), so gradient
accumulation, clipping and optimizer hooks see what they see without graphs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..fallbacks import GRAPHS, Fallbacks, describe
from .forwards import replaced_forwards
from .graph_devices import CudaGraphDevice, Graph, GraphDevice
from .inplace import InputUpdatedLater, is_inplace_update

log = logging.getLogger(__name__)

_SIMPLE = (bool, int, float, str, type(None))
_CONSTANT_NUMEL = 64
"""Host tensors up to this size in a call (``sample_sigmas`` in ComfyUI's options) are constants of a recording;
a larger one makes the call run eagerly."""

TOLERANCE = {"fp32": 1e-3, "half": 2e-2}
"""How far the first replay of a recording (its check) may be from the eager pass of the same inputs: the norm of
the difference of the outputs (and of the gradients) over the norm of the eager ones, for fp32 and bf16/fp16 steps.
Replay runs the kernels the eager pass runs, so only reductions whose order is not fixed differ (the attention's
backward pass); a stale input or a wrong gradient is off by the order of the values themselves."""

RECOVERABLE = (RuntimeError, TypeError, ValueError, AssertionError, NotImplementedError)
"""What a recording or a replay may raise and the run survive (a cancel or an interrupt is not among them)."""

last_run: dict[str, Any] = {}
"""What the last released :class:`GraphedForward` did (recordings, replays, eager calls, why recording failed):
for benchmarks and diagnostics."""


def requested(setting: bool = True) -> bool:
    """Whether to record CUDA graphs: ``setting`` (the run's ``cuda_graphs``) unless ``STREAMING_CACHE_CUDA_GRAPHS``
    says ``1`` or ``0`` (benchmarks compare both)."""
    value = os.environ.get("STREAMING_CACHE_CUDA_GRAPHS", "").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    if value == "":
        return setting
    raise ValueError(f"STREAMING_CACHE_CUDA_GRAPHS={value!r}: use 1 (on) or 0 (off)")


def _signature(leaves: list[Any], holds: Callable[[torch.Tensor], bool] = lambda t: t.device.type != "cpu") -> tuple:
    """What must be equal for a recording to serve a call: each device tensor's shape, dtype, device and whether it
    requires grad; small host tensors and simple values themselves (the recording holds them as constants); other
    objects by type (a run's options and patches are the same objects or equivalent ones at every step).
    ``holds``: whether a tensor is on the recording's device."""
    out: list[Any] = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            meta = (tuple(v.shape), v.dtype, v.device, v.requires_grad)
            out.append(meta if holds(v) else (*meta, tuple(v.flatten().tolist())))
        elif isinstance(v, _SIMPLE):
            out.append((type(v), v))
        else:
            out.append(type(v))
    return tuple(out)


def _autocast(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast_as(device_type: str, state: tuple[bool, torch.dtype]) -> contextlib.AbstractContextManager[Any]:
    """Autocast as ``state`` says, without its cache of cast weights: a cast the cache served would be missing
    from a recording, which would then read a copy freed when the caller's autocast ends."""
    enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def _placements(module: torch.nn.Module, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Where the module's weights and the trained tensors are now (read anew: moving a model may replace its
    parameter objects as well as their storage)."""
    return tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers(), *params))


def relative_difference(values: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]) -> float:
    """``|values - reference| / |reference|`` over all the tensors together (None counts as zeros; both zero: 0;
    anything not finite: infinity). Each tensor's norms are taken where it is, in fp32 at least: no fp64 copy of a
    step's outputs or gradients beside the recording (a consumer GPU runs fp64 at a small fraction of its fp32
    rate), and one read on the host for all of them. fp32 is ample for :data:`TOLERANCE`."""
    parts: list[torch.Tensor] = []
    for v, r in zip(values, reference):
        if v is None and r is None:
            continue
        if v is not None and r is not None:
            off = _norm(v.detach() - r.detach())
        else:
            off = _norm((v if v is not None else r).detach())  # type: ignore[union-attr]
        parts.append(torch.stack([off, _norm(r.detach()) if r is not None else torch.zeros_like(off)]))
    if not parts:
        return 0.0
    device = parts[0].device
    diff, norm = torch.stack([p.to(device) for p in parts]).double().square().sum(0)
    off = torch.where(norm > 0, (diff / norm).sqrt(), diff.sqrt())
    return float(torch.where(torch.isfinite(diff) & torch.isfinite(norm), off, math.inf))


def _norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``t`` as an fp32 (or fp64) scalar on ``t``'s device."""
    dtype = torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32
    return torch.linalg.vector_norm(t if t.is_floating_point() else t.float(), dtype=dtype)


def _finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether every value of ``tensors`` is finite (one read on the host for all of them)."""
    present = [t.detach().float().abs().sum() for t in tensors if t is not None and t.numel()]
    return not present or bool(torch.isfinite(torch.stack(present).sum()))


def tolerance(autocast: tuple[bool, torch.dtype], tensors: Sequence[torch.Tensor | None]) -> float:
    """:data:`TOLERANCE` for a step under ``autocast`` whose results are ``tensors``."""
    half = (torch.float16, torch.bfloat16)
    if (autocast[0] and autocast[1] in half) or any(t is not None and t.dtype in half for t in tensors):
        return TOLERANCE["half"]
    return TOLERANCE["fp32"]


def _failure(what: str, e: BaseException) -> str:
    """Why graphs went off: ``what`` raised ``e``; an out-of-memory error is named as such."""
    if isinstance(e, torch.OutOfMemoryError):
        return f"{what} ran out of device memory ({describe(e)})"
    return f"{what} failed ({describe(e)})"


def _probe_gradients(outputs: Sequence[Any]) -> list[torch.Tensor | None]:
    """The gradients of ``outputs`` the warm-up passes and the check use: pseudo-random from a fixed seed (a gradient
    routed to the wrong output or element shows), of norm at most 1 for each output (about a loss's, so that an
    fp16 backward pass does not overflow); None for what carries no gradient."""
    g = torch.Generator().manual_seed(0)
    probes: list[torch.Tensor | None] = []
    for o in outputs:
        if not (isinstance(o, torch.Tensor) and o.requires_grad):
            probes.append(None)
            continue
        r = torch.randn(o.shape, generator=g)
        probes.append((r / max(float(r.norm()), 1.0)).to(device=o.device, dtype=o.dtype))
    return probes


def _shuffle_(t: torch.Tensor) -> None:
    """``t``'s values moved one place along its flattened order: other values of the same kind than the check's, for
    the capture to run over (a replay that reads them instead of its call's inputs gives other outputs)."""
    with torch.no_grad():
        t.copy_(t.flatten().roll(1).view_as(t))


def _nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


_CHECK_TRIES = 3
"""How many calls of a signature may try to record it while the eager pass its check compares with is not finite
(an fp16 overflow, a batch of infinities); after that the signature runs eagerly for the rest of the run."""


@dataclass
class _Reference:
    """The eager pass a recording's check compares with: its outputs, the gradients of the outputs it was
    differentiated with, and the trained tensors' gradients it gave."""
    outputs: list[torch.Tensor]
    grad_outputs: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]

    def finite(self) -> bool:
        return _finite(self.outputs) and _finite(self.grads)


@dataclass(eq=False)
class _Recording:
    key: tuple
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    output_spec: Any
    differentiable: list[bool]  # which outputs carry gradients, read before the outputs were detached
    grad_outputs: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]
    forward: Graph
    backward: Graph
    weights: tuple[int, ...]
    autocast: tuple[bool, torch.dtype]
    owner: GraphedForward
    nbytes: int = 0  # what recording added to the graphs' pool, and its static buffers outside the pool
    pending: bool = False  # replayed forward, backward not yet
    checked: bool = False  # its first replay agreed with the eager pass
    released: bool = False  # its graphs and buffers are freed: it replays no more

    def replay_forward(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into the recorded inputs and replay the forward pass into :attr:`outputs`."""
        for static, value in zip(self.inputs, tensors):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        self.forward.replay()
        self.pending = True

    def replay_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The trained tensors' gradients of the last forward replay given ``grads`` of its outputs (fresh tensors:
        the recorded ones are rewritten at the next replay)."""
        for static, grad in zip(self.grad_outputs, grads):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        self.backward.replay()
        self.pending = False
        present = [g for g in self.grads if g is not None]
        fresh = iter(torch._foreach_mul(present, 1.0) if present else [])
        return [None if g is None else next(fresh) for g in self.grads]

    def release(self) -> None:
        """Free the graphs and the static buffers (a pending replay's gradients are then computed eagerly)."""
        if self.released:
            return
        self.released, self.pending = True, False
        self.forward.reset()
        self.backward.reset()
        self.inputs, self.outputs, self.grad_outputs, self.grads = [], [], [], []


class _Replay(torch.autograd.Function):
    """The recorded forward pass as one autograd node; its backward replays the recorded gradients."""

    @staticmethod
    def forward(ctx: Any, rec: _Recording, call: tuple[tuple, dict],
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rec, ctx.call, ctx.inputs = rec, call, len(rec.inputs)
        rec.replay_forward(tensors[:len(rec.inputs)])
        outputs = tuple(o.detach().clone() for o in rec.outputs)
        ctx.mark_non_differentiable(*[o for o, grad in zip(outputs, rec.differentiable) if not grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        param_grads = ctx.rec.owner._backward(ctx.rec, ctx.call, grads)
        return (None, None, *([None] * ctx.inputs), *param_grads)


class GraphedForward:
    """``module``'s forward, replayed from recorded graphs while gradients are computed; see the module docstring.

    ``params``: the trained tensors (they receive gradients; the module's other weights are frozen).
    ``device``: where recordings are made (:mod:`.graph_devices`; CUDA by default). ``fallbacks``: where turning
    graphs off is noted. ``max_recordings``: signatures recorded at once; ``memory_budget``: bytes the recordings
    together may hold (:attr:`held`; None: no limit but the count; a single recording is kept whatever its size).
    ``warmup``: eager runs before recording (at least one: the last is what the recording's check compares with)."""

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.Tensor], *,
                 device: GraphDevice | None = None, fallbacks: Fallbacks | None = None, max_recordings: int = 4,
                 memory_budget: int | None = None, warmup: int = 2):
        self.module = module
        self.original: Callable[..., Any] = module.forward
        self.params = [p for p in params if p.requires_grad]  # what the optimizer changes; frozen ones are weights
        self.device: GraphDevice = device if device is not None else CudaGraphDevice()
        self.fallbacks = fallbacks if fallbacks is not None else Fallbacks()
        self.max_recordings, self.memory_budget, self.warmup = max_recordings, memory_budget, warmup
        self.recordings: list[_Recording] = []
        self.calls: dict[tuple, int] = {}  # signature -> calls seen: which recordings to keep
        self.too_large: set[tuple] = set()  # signatures whose recording did not fit the budget
        self.unchecked: dict[tuple, int] = {}  # signature -> recordings not made: the eager pass was not finite
        self.attempts = 0
        self.evicted = 0
        self.failed: str | None = self.fallbacks.reason(GRAPHS)  # an earlier pass of the run turned graphs off
        self.eager_calls = 0
        self.replays = 0
        self.steps = 0
        self.replayed_steps = 0
        self._step_replayed = False
        self._pool: Any = None

    @property
    def held(self) -> int:
        """Bytes the recordings kept now hold (what ``memory_budget`` counts; 0 once they are freed)."""
        return sum(r.nbytes for r in self.recordings)

    def begin_step(self) -> None:
        """A new micro-step: forward passes recorded in an earlier one will not be differentiated any more."""
        for rec in self.recordings:
            rec.pending = False
        if torch.is_grad_enabled():
            self.steps += 1
            self._step_replayed = False

    def report(self) -> str:
        """One line for the node's summary: how many micro-steps (forward and backward passes of the model for one
        micro-batch) replayed, or why none did."""
        name = self.device.name
        if self.failed is not None and not self.replayed_steps:
            return f"trained without {name}: {self.failed}"
        if not self.replayed_steps:
            return f"trained without {name}: no step could be replayed"
        kept = f"{self.attempts} recorded" + (f", {self.evicted} evicted" if self.evicted else "")
        line = f"{name}: {self.replayed_steps} of {self.steps} micro-steps replayed ({kept})"
        return line if self.failed is None else f"{line}, then off: {self.failed}"

    def release(self) -> None:
        """Free the recordings and their memory (what they did stays in :data:`last_run`)."""
        last_run.clear()
        last_run.update(recorded=self.attempts, replays=self.replays, eager_calls=self.eager_calls,
                        failed=self.failed, steps=self.steps, replayed_steps=self.replayed_steps,
                        evicted=self.evicted)
        self._release_all()

    def _release_all(self) -> None:
        for rec in self.recordings:
            rec.release()
        self.recordings.clear()
        self._pool = None

    def _fail(self, reason: str) -> None:
        """Graphs off for the rest of the run (this pass and any later one that shares ``fallbacks``); the
        recordings are freed, so that the eager passes from here on have their memory."""
        if self.failed is None:
            self.failed = reason
            self.fallbacks.note(GRAPHS, reason)
        self._release_all()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self.failed is not None:
            return self._eager(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        holds = self.device.holds
        tensors = [v for v in leaves if isinstance(v, torch.Tensor) and holds(v)]
        if not tensors or any(t.requires_grad for t in tensors) or \
                any(isinstance(v, torch.Tensor) and not holds(v) and v.numel() > _CONSTANT_NUMEL for v in leaves):
            return self._eager(args, kwargs)
        if any(r.pending for r in self.recordings):  # its backward pass needs the pool's memory as it left it
            return self._eager(args, kwargs)
        autocast = _autocast(self.device.device_type)
        key = (_signature(leaves, holds), repr(spec), autocast)  # a TreeSpec is hashable from PyTorch 2.8 only
        self.calls[key] = self.calls.get(key, 0) + 1
        rec = next((r for r in self.recordings if r.key == key), None)
        if rec is not None and rec.weights != _placements(self.module, self.params):
            log.info("the model's weights moved since its graphs were recorded; recording again")
            self.recordings.remove(rec)
            rec.release()
            rec = None
        if rec is None:
            rec = self._new_recording(leaves, spec, key, autocast, tensors)
            if rec is None:
                return self._eager(args, kwargs)
        return self._replay(rec, tensors, args, kwargs)

    def _new_recording(self, leaves: list[Any], spec: Any, key: tuple, autocast: tuple[bool, torch.dtype],
                       tensors: list[torch.Tensor]) -> _Recording | None:
        """A checked recording of ``key`` to replay this call from, kept; or None, the call to run eagerly: no room
        for it, over the budget, its eager pass not finite (a later call tries again), or graphs went off (its
        recording or its check failed: the recordings are freed by then)."""
        if key in self.too_large or self.unchecked.get(key, 0) >= _CHECK_TRIES or not self._make_room(key):
            return None
        reason = None
        try:
            made = self._record(leaves, spec, key, autocast)
        except RECOVERABLE as e:
            if is_inplace_update(e):  # the model's own trait, which the eager pass meets too: the caller's to
                raise                 # handle (it trains such blocks another way and may record then)
            if isinstance(e, InputUpdatedLater):  # the learnt copies gave out, not graphs: the loop runs the
                raise                             # micro-step again, and records then
            reason = _failure("recording the model's forward pass", e)
        if reason is not None:  # out of the except block: its traceback would keep the recording's memory
            self.attempts += 1
            self._fail(reason)
            return None
        if made is None:
            self.unchecked[key] = self.unchecked.get(key, 0) + 1
            log.info("the eager pass a recording is checked against was not finite; recording at a later call")
            return None
        rec, reference = made
        self.attempts += 1
        if not self._within_budget(rec):
            return None
        reason = self._check(rec, reference, tensors)
        if reason is not None:
            self._fail(reason)
            return None
        return rec

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        """The call run eagerly. One that runs out of memory while recordings are held frees them (graphs off, the
        reason noted) and runs again, in the memory they held."""
        self.eager_calls += 1
        if not self.recordings:
            return self.original(*args, **kwargs)
        try:
            return self.original(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            reason = _failure("an eager pass beside the recorded graphs", e)
        self._fail(reason)
        return self.original(*args, **kwargs)

    def _replay(self, rec: _Recording, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        reason = None
        try:
            out = _Replay.apply(rec, (args, kwargs), *tensors, *self.params)
        except RECOVERABLE as e:
            reason = _failure("replaying the model's forward pass", e)
        if reason is not None:
            self._fail(reason)
            return self._eager(args, kwargs)
        self.replays += 1
        if not self._step_replayed:
            self._step_replayed = True
            self.replayed_steps += 1
        return pytree.tree_unflatten(list(out), rec.output_spec)

    def _backward(self, rec: _Recording, call: tuple[tuple, dict],
                  grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The trained tensors' gradients of a replayed ``call``: the recorded backward pass replayed; or, where that
        raises or the recording was freed since (graphs went off while the call was pending), computed eagerly once
        the recordings are freed."""
        if not rec.released:
            try:
                return rec.replay_backward(grads)
            except RECOVERABLE as e:
                reason = _failure("replaying the backward pass", e)
            self._fail(reason)
        return self._eager_gradients(rec, call, grads)

    def _eager_gradients(self, rec: _Recording, call: tuple[tuple, dict],
                         grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The trained tensors' gradients of ``call`` computed eagerly, given the gradients of its outputs."""
        args, kwargs = call
        with torch.enable_grad(), _autocast_as(self.device.device_type, rec.autocast):
            outputs = pytree.tree_leaves(self.original(*args, **kwargs))
        pairs = [(o, g) for o, g, d in zip(outputs, grads, rec.differentiable) if d and g is not None]
        if not pairs:
            return [None] * len(self.params)
        return list(torch.autograd.grad([o for o, _ in pairs], self.params, [g for _, g in pairs],
                                        allow_unused=True))

    def _check(self, rec: _Recording, ref: _Reference, tensors: list[torch.Tensor]) -> str | None:
        """Why ``rec`` may not serve calls, or None: replayed with ``tensors`` (the recording call's inputs, copied
        over the other values the capture ran with) and ``ref``'s gradients of the outputs, it must give ``ref``'s
        outputs and gradients (the eager pass of the same inputs and weights, before the recording existed).
        Replays only: no eager pass runs beside the recording."""
        try:
            rec.replay_forward(tensors)
            off, limit = relative_difference(rec.outputs, ref.outputs), tolerance(rec.autocast, ref.outputs)
        except RECOVERABLE as e:
            return _failure("checking the first replay's output", e)
        if not off <= limit:
            return f"the first replayed step's output is {off:.1e} off the eager step's (tolerance {limit:.0e})"
        try:
            replayed = rec.replay_backward(ref.grad_outputs)
            off, limit = relative_difference(replayed, ref.grads), tolerance(rec.autocast, ref.grads)
        except RECOVERABLE as e:
            return _failure("checking the first replay's gradients", e)
        if not off <= limit:
            return f"the first replayed step's gradients are {off:.1e} off the eager step's (tolerance {limit:.0e})"
        rec.checked = True
        return None

    def _make_room(self, key: tuple) -> bool:
        """Whether a recording of ``key`` may be made now: there is room, or the least called recording is called
        less than ``key`` and is evicted for it."""
        if len(self.recordings) < self.max_recordings:
            return True
        victim = min(self.recordings, key=lambda r: self.calls.get(r.key, 0))
        if self.calls[key] <= self.calls.get(victim.key, 0):
            return False
        self._evict(victim)
        return True

    def _evict(self, rec: _Recording) -> None:
        self.recordings.remove(rec)
        rec.release()
        self.evicted += 1

    def _within_budget(self, rec: _Recording) -> bool:
        """Keep ``rec`` if the recordings fit ``memory_budget``, evicting recordings called less often first; a
        recording alone is kept whatever its size (it holds what an eager step holds for the time of the step)."""
        self.recordings.append(rec)
        if self.memory_budget is None or len(self.recordings) == 1:
            return True
        others = sorted((r for r in self.recordings if r is not rec), key=lambda r: self.calls.get(r.key, 0))
        while self.held > self.memory_budget and others and \
                self.calls.get(others[0].key, 0) < self.calls[rec.key]:
            self._evict(others.pop(0))
        if self.held > self.memory_budget and len(self.recordings) > 1:
            self.recordings.remove(rec)
            rec.release()
            self.too_large.add(rec.key)
            return False
        return True

    def _record(self, leaves: list[Any], spec: Any, key: tuple,
                autocast: tuple[bool, torch.dtype]) -> tuple[_Recording, _Reference] | None:
        """``key``'s forward pass and the trained tensors' gradients recorded from this call, with the warm-up pass
        its check compares with; None, with nothing recorded, where that pass is not finite. Graphs captured before
        an error are freed before it propagates."""
        device = self.device
        slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and device.holds(v)]
        inputs = [leaves[i].detach().clone() for i in slots]
        params = self.params
        live: list[torch.Tensor] = []  # the outputs of the last run of the forward pass, for its backward pass
        structure: list[Any] = []  # how the outputs are nested

        def run() -> list[torch.Tensor]:
            filled = list(leaves)
            for i, t in zip(slots, inputs):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, spec)
            outputs, nesting = pytree.tree_flatten(self.original(*args, **kwargs))
            structure[:] = [nesting]
            live[:] = outputs
            return outputs

        def differentiate(grad_outputs: list[torch.Tensor | None]) -> list[Any]:
            pairs = [(o, g) for o, g in zip(live, grad_outputs) if g is not None]
            live.clear()
            return list(torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs],
                                            allow_unused=True))

        captured: list[Graph] = []
        try:
            with _autocast_as(device.device_type, autocast):
                device.synchronize()
                with device.side_stream():
                    reference = self._warm_up(run, differentiate)
                if not reference.finite():
                    return None
                for t in inputs:
                    _shuffle_(t)
                if self._pool is None:
                    self._pool = device.new_pool()
                before = device.pool_bytes(self._pool)
                forward, outputs = device.capture(run, self._pool)
                captured.append(forward)
                if not all(isinstance(o, torch.Tensor) for o in outputs):
                    raise TypeError("the forward pass returns something other than tensors")
                differentiable = [o.requires_grad for o in outputs]
                grad_outputs = [torch.zeros_like(o) if d else None for o, d in zip(outputs, differentiable)]
                if not any(differentiable):
                    raise RuntimeError("the forward pass's output does not depend on the trained parameters")
                backward, grads = device.capture(lambda: differentiate(grad_outputs), self._pool)
                captured.append(backward)
                device.synchronize()
        except BaseException:
            for graph in captured:
                graph.reset()
            raise
        finally:
            # the recorded outputs must not keep the recording's autograd graph alive: its gradient accumulators
            # belong to the recording stream, and every replayed step would then synchronise each parameter's
            # gradient with the default stream
            live.clear()
        grown = device.pool_bytes(self._pool) - before
        rec = _Recording(key=key, inputs=inputs, outputs=[o.detach() for o in outputs], output_spec=structure[0],
                         differentiable=differentiable, grad_outputs=grad_outputs, grads=grads, forward=forward,
                         backward=backward, weights=_placements(self.module, self.params), autocast=autocast,
                         owner=self, nbytes=max(0, grown) + _nbytes([*inputs, *grad_outputs]))
        return rec, reference

    def _warm_up(self, run: Callable[[], list[Any]],
                 differentiate: Callable[[list[torch.Tensor | None]], list[Any]]) -> _Reference:
        """The pass run eagerly ``warmup`` times (at least once) before anything is recorded (lazy initialisation,
        cuDNN's algorithm search), differentiated with :func:`_probe_gradients`; the last run is the reference."""
        flat = run()
        if not all(isinstance(o, torch.Tensor) for o in flat):
            raise TypeError("the forward pass returns something other than tensors")
        probes = _probe_gradients(flat)
        grads = differentiate(probes)
        for _ in range(self.warmup - 1):
            flat = run()
            grads = differentiate(probes)
        return _Reference([o.detach() for o in flat], probes, grads)


@contextlib.contextmanager
def graphed_forward(module: torch.nn.Module, params: Sequence[torch.Tensor], enabled: bool = True,
                    **options: Any) -> Iterator[GraphedForward | None]:
    """``module`` runs through a :class:`GraphedForward` while the block runs (yielded; None when not
    ``enabled`` or when something else already replaced its forward); its recordings are released on exit.
    ``options``: :class:`GraphedForward`'s."""
    graphed: list[GraphedForward] = []

    def make(m: torch.nn.Module) -> GraphedForward:
        graphed.append(GraphedForward(m, params, **options))
        return graphed[-1]

    with replaced_forwards([module] if enabled else [], make):
        try:
            yield graphed[0] if graphed else None
        finally:
            for g in graphed:
                g.release()
