"""A model's forward and backward passes replayed as CUDA graphs while a LoRA trains.

On a fast GPU a model of a thousand small layers spends most of a training step issuing kernels from Python: SDXL
at 1024 px issues about 27,000 a step, each costing tens of microseconds of host time, for a few tenths of a second
of kernels in a step of a second. A CUDA graph records the kernels of one forward pass and of its backward pass
once and replays each with one launch, so the step takes the time of its kernels.

:class:`GraphedForward` replaces a module's forward (the diffusion model's, for the whole model) for the length of
a run. The first call with a given signature (the shapes, dtypes and devices of its tensors, the autocast in force
and the structure of its other arguments) runs eagerly a few times on a side stream (lazy initialisation, cuDNN's
algorithm search), then records the forward pass and the gradients of the trained parameters into graphs that
share one memory pool; later calls with that signature copy their tensors into the recorded inputs and replay.
The device calls go through :mod:`.graph_devices`, whose CPU emulation runs all of this in the CPU test suite.

Replay never changes what a run learns, and never ends it:

* the first replay of each recording is checked against the eager step: the same call also runs eagerly, and the
  outputs and the trained tensors' gradients must agree within :data:`TOLERANCE` (relative to their norms). The
  call that records runs eagerly, so the first replay is of other inputs than the recorded ones;
* a recording, replay or backward replay that raises, or a check that disagrees, turns graphs off for the rest of
  the run: that call (or that gradient) is computed eagerly and every later one too, and the reason is noted in the
  run's :class:`~..fallbacks.Fallbacks` (the node's summary shows it);
* recordings are kept for the signatures that recur most (aspect buckets give several), at most
  ``max_recordings`` of them within ``memory_budget``; one evicted gives its memory back to the pool.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..fallbacks import GRAPHS, Fallbacks, describe
from .forwards import replaced_forwards
from .graph_devices import CudaGraphDevice, Graph, GraphDevice
from .inplace import is_inplace_update

log = logging.getLogger(__name__)

_SIMPLE = (bool, int, float, str, type(None))
_CONSTANT_NUMEL = 64
"""Host tensors up to this size in a call (``sample_sigmas`` in ComfyUI's options) are constants of a recording;
a larger one makes the call run eagerly."""

TOLERANCE = {"fp32": 1e-3, "half": 2e-2}
"""How far the first replay of a recording may be from the eager step: the norm of the difference of the outputs
(and of the gradients) over the norm of the eager ones, for fp32 and for bf16/fp16 steps. Replay runs the kernels
the eager step runs, so only reductions whose order is not fixed differ (the attention's backward pass); a stale
input or a wrong gradient is off by the order of the values themselves."""

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
    anything not finite: infinity)."""
    diff, norm = 0.0, 0.0
    for v, r in zip(values, reference):
        if v is None and r is None:
            continue
        a = torch.zeros(()) if v is None else v.detach().double()
        b = torch.zeros(()) if r is None else r.detach().double()
        if v is not None and r is not None:
            diff += float((a - b).square().sum())
        else:
            diff += float((a if v is not None else b).square().sum())
        norm += float(b.square().sum())
    if not (math.isfinite(diff) and math.isfinite(norm)):
        return math.inf
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else math.sqrt(diff)


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
    nbytes: int = 0  # what recording it added to the device's memory
    pending: bool = False  # replayed forward, backward not yet
    checked: bool = False  # the first replay agreed with the eager step
    call: tuple[tuple, dict] | None = field(default=None, repr=False)  # the call whose gradients the check compares


class _Replay(torch.autograd.Function):
    """The recorded forward pass as one autograd node; its backward replays the recorded gradients."""

    @staticmethod
    def forward(ctx: Any, rec: _Recording, call: tuple[tuple, dict],
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rec, ctx.call = rec, call
        for static, value in zip(rec.inputs, tensors[:len(rec.inputs)]):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        rec.forward.replay()
        rec.pending = True
        outputs = tuple(o.detach().clone() for o in rec.outputs)
        ctx.mark_non_differentiable(*[o for o, grad in zip(outputs, rec.differentiable) if not grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        rec: _Recording = ctx.rec
        owner = rec.owner
        try:
            param_grads = owner._replay_backward(rec, grads)
        except RECOVERABLE as e:
            owner._fail(f"replaying the backward pass failed ({describe(e)})")
            param_grads = owner._eager_gradients(rec, ctx.call, grads)
        else:
            if rec.call is not None:  # the first replay of this recording: checked against the eager step
                param_grads = owner._checked(rec, ctx.call, grads, param_grads)
        return (None, None, *([None] * len(rec.inputs)), *param_grads)


class GraphedForward:
    """``module``'s forward, replayed from recorded graphs while gradients are computed; see the module docstring.

    ``params``: the trained tensors (they receive gradients; the module's other weights are frozen).
    ``device``: where recordings are made (:mod:`.graph_devices`; CUDA by default). ``fallbacks``: where turning
    graphs off is noted. ``max_recordings``: signatures recorded at once; ``memory_budget``: bytes the recordings
    together may add to the device's memory (None: no limit but the count; a single recording is kept whatever its
    size). ``warmup``: eager runs before recording."""

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
        self.attempts = 0
        self.evicted = 0
        self.failed: str | None = self.fallbacks.reason(GRAPHS)  # an earlier pass of the run turned graphs off
        self.eager_calls = 0
        self.replays = 0
        self.steps = 0
        self.replayed_steps = 0
        self._step_replayed = False
        self._pool: Any = None

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
        """Drop the recordings and their memory (what they did stays in :data:`last_run`)."""
        last_run.clear()
        last_run.update(recorded=self.attempts, replays=self.replays, eager_calls=self.eager_calls,
                        failed=self.failed, steps=self.steps, replayed_steps=self.replayed_steps,
                        evicted=self.evicted)
        self.recordings.clear()
        self._pool = None

    def _fail(self, reason: str) -> None:
        """Graphs off for the rest of the run (this pass and any later one that shares ``fallbacks``)."""
        if self.failed is None:
            self.failed = reason
            self.fallbacks.note(GRAPHS, reason)
        self.recordings.clear()
        self._pool = None

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
            rec = None
        if rec is None:
            if key in self.too_large or not self._make_room(key):
                return self._eager(args, kwargs)
            self.attempts += 1
            try:
                rec = self._record(leaves, spec, key, autocast)
            except RECOVERABLE as e:
                if is_inplace_update(e):  # the model's own trait, which the eager pass meets too: the caller's
                    self.attempts -= 1    # to handle (it trains such blocks another way and may record then)
                    raise
                self._fail(f"recording the model's forward pass failed ({describe(e)})")
                return self._eager(args, kwargs)
            # this call's own result comes from the eager pass: its inputs are the ones recorded, so a replay of them
            # would not show whether a replay reads its own call's inputs; the next call's replay is checked
            self._within_budget(rec)
            return self._eager(args, kwargs)
        return self._replay(rec, tensors, args, kwargs)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        self.eager_calls += 1
        return self.original(*args, **kwargs)

    def _replay(self, rec: _Recording, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        try:
            out = _Replay.apply(rec, (args, kwargs), *tensors, *self.params)
        except RECOVERABLE as e:
            self._fail(f"replaying the model's forward pass failed ({describe(e)})")
            return self._eager(args, kwargs)
        if not rec.checked and rec.call is None:
            with torch.no_grad(), _autocast_as(self.device.device_type, rec.autocast):
                eager = pytree.tree_leaves(self.original(*args, **kwargs))
            if _finite(eager):  # else nothing to compare (the step fails or is skipped either way): the next is
                off = relative_difference(out, eager)
                limit = tolerance(rec.autocast, eager)
                if not off <= limit:
                    self._fail(f"the first replayed step's output is {off:.1e} off the eager step's (tolerance "
                               f"{limit:.0e})")
                    return self._eager(args, kwargs)
                rec.call = (args, kwargs)  # the gradients are compared in the backward pass
        self.replays += 1
        if not self._step_replayed:
            self._step_replayed = True
            self.replayed_steps += 1
        return pytree.tree_unflatten(list(out), rec.output_spec)

    def _replay_backward(self, rec: _Recording, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        for static, grad in zip(rec.grad_outputs, grads):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        rec.backward.replay()
        rec.pending = False
        present = [g for g in rec.grads if g is not None]
        fresh = iter(torch._foreach_mul(present, 1.0) if present else [])
        return [None if g is None else next(fresh) for g in rec.grads]

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

    def _checked(self, rec: _Recording, call: tuple[tuple, dict], grads: Sequence[torch.Tensor | None],
                 replayed: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The gradients of a recording's first replay, compared with the eager step's: the replayed ones if they
        agree, else the eager ones (and graphs off)."""
        rec.call = None
        eager = self._eager_gradients(rec, call, grads)
        if not _finite(eager):  # fp16 gradients that overflowed: the scaler skips the step; the next replay is checked
            return eager
        off = relative_difference(replayed, eager)
        limit = tolerance(rec.autocast, eager)
        if not off <= limit:
            self._fail(f"the first replayed step's gradients are {off:.1e} off the eager step's (tolerance "
                       f"{limit:.0e})")
            return eager
        rec.checked = True
        return replayed

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
        self.evicted += 1

    def _within_budget(self, rec: _Recording) -> bool:
        """Keep ``rec`` if the recordings fit ``memory_budget``, evicting recordings called less often first; a
        recording alone is kept whatever its size (it holds what an eager step holds for the time of the step)."""
        self.recordings.append(rec)
        if self.memory_budget is None or len(self.recordings) == 1:
            return True
        others = sorted((r for r in self.recordings if r is not rec), key=lambda r: self.calls.get(r.key, 0))
        while self._held() > self.memory_budget and others and \
                self.calls.get(others[0].key, 0) < self.calls[rec.key]:
            self._evict(others.pop(0))
        if self._held() > self.memory_budget and len(self.recordings) > 1:
            self.recordings.remove(rec)
            self.too_large.add(rec.key)
            return False
        return True

    def _held(self) -> int:
        return sum(r.nbytes for r in self.recordings)

    def _record(self, leaves: list[Any], spec: Any, key: tuple, autocast: tuple[bool, torch.dtype]) -> _Recording:
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

        before = device.reserved()
        with _autocast_as(device.device_type, autocast):
            device.synchronize()
            with device.side_stream():
                for _ in range(self.warmup):
                    flat = run()
                    differentiate([torch.ones_like(o) if o.requires_grad else None for o in flat])
                    del flat
            if self._pool is None:
                self._pool = device.new_pool()
            forward, outputs = device.capture(run, self._pool)
            if not all(isinstance(o, torch.Tensor) for o in outputs):
                raise TypeError("the forward pass returns something other than tensors")
            differentiable = [o.requires_grad for o in outputs]
            grad_outputs = [torch.empty_like(o) if d else None for o, d in zip(outputs, differentiable)]
            if not any(differentiable):
                raise RuntimeError("the forward pass's output does not depend on the trained parameters")
            backward, grads = device.capture(lambda: differentiate(grad_outputs), self._pool)
            device.synchronize()
        # the recorded outputs must not keep the recording's autograd graph alive: its gradient accumulators
        # belong to the recording stream, and every replayed step would then synchronise each parameter's
        # gradient with the default stream
        live.clear()
        outputs = [o.detach() for o in outputs]
        return _Recording(key=key, inputs=inputs, outputs=outputs, output_spec=structure[0],
                          differentiable=differentiable, grad_outputs=grad_outputs, grads=grads, forward=forward,
                          backward=backward, weights=_placements(self.module, self.params), autocast=autocast,
                          owner=self, nbytes=max(0, device.reserved() - before))


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
