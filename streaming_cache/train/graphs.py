"""A model's forward and backward passes replayed as CUDA graphs while a LoRA trains.

On a fast GPU a model of a thousand small layers spends most of a training step issuing kernels from Python: SDXL
at 1024 px issues about 27,000 a step, each costing tens of microseconds of host time, for a few tenths of a second
of kernels in a step of a second. A CUDA graph records the kernels of one forward pass and of its backward pass
once and replays each with one launch, so the step takes the time of its kernels.

:class:`GraphedForward` replaces a module's forward (the diffusion model's, for the whole model) for the length of
a run. The first call with a given signature (the shapes, dtypes and devices of its tensors and the structure of
its other arguments) runs eagerly a few times on a side stream (lazy initialisation, cuDNN's algorithm search),
then records the forward pass and the gradients of the trained parameters into graphs that share one memory pool;
later calls with that signature copy their tensors into the recorded inputs and replay. What replay needs:

* the kernels of a step do not depend on values read on the host (the model makes no decision from a tensor's
  value, no synchronisation); a recording that fails says why and the run goes on eagerly;
* the weights stay where they were recorded (checked at each replay: a moved weight drops the recording);
* one recorded forward pass is differentiated before another is replayed or recorded (the recordings share one
  memory pool): :meth:`begin_step` starts a micro-step, and a second forward pass in the same micro-step (a batch
  split into groups) runs eagerly;
* gradient checkpointing without saving the CUDA random state (PyTorch cannot read it while recording; the models
  train without dropout, so nothing random runs in a block).

Gradients reach the parameters as ordinary autograd results (fresh tensors, accumulated as usual), so gradient
accumulation, clipping and optimizer hooks see what they see without graphs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .forwards import replaced_forwards

log = logging.getLogger(__name__)

_SIMPLE = (bool, int, float, str, type(None))
_CONSTANT_NUMEL = 64
"""CPU tensors up to this size in a call (``sample_sigmas`` in ComfyUI's options) are constants of a recording;
a larger one makes the call run eagerly."""

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


def _signature(leaves: list[Any]) -> tuple:
    """What must be equal for a recording to serve a call: each device tensor's shape, dtype, device and whether it
    requires grad; small CPU tensors and simple values themselves (the recording holds them as constants); other
    objects by type (a run's options and patches are the same objects or equivalent ones at every step)."""
    out: list[Any] = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            meta = (tuple(v.shape), v.dtype, v.device, v.requires_grad)
            out.append((*meta, tuple(v.flatten().tolist())) if v.device.type == "cpu" else meta)
        elif isinstance(v, _SIMPLE):
            out.append((type(v), v))
        else:
            out.append(type(v))
    return tuple(out)


def _uncached_autocast() -> contextlib.AbstractContextManager[Any]:
    """Autocast as the caller set it, without its cache of cast weights: a cast the cache served would be missing
    from the recording, which would then read a copy freed when the caller's autocast ends."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


def _placements(module: torch.nn.Module, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Where the module's weights and the trained tensors are now (read anew: moving a model may replace its
    parameter objects as well as their storage)."""
    return tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers(), *params))


@dataclass
class _Recording:
    spec: Any
    signature: tuple
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    output_spec: Any
    grad_outputs: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    weights: tuple[int, ...]
    pending: bool = False


class _Replay(torch.autograd.Function):
    """The recorded forward pass as one autograd node; its backward replays the recorded gradients."""

    @staticmethod
    def forward(ctx: Any, rec: _Recording, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rec = rec
        for static, value in zip(rec.inputs, tensors[:len(rec.inputs)]):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        rec.forward.replay()
        rec.pending = True
        outputs = tuple(o.detach().clone() for o in rec.outputs)
        ctx.mark_non_differentiable(*[o for o, static in zip(outputs, rec.outputs) if not static.requires_grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        rec: _Recording = ctx.rec
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
        param_grads = [None if g is None else next(fresh) for g in rec.grads]
        return (None, *([None] * len(rec.inputs)), *param_grads)


class GraphedForward:
    """``module``'s forward, replayed from CUDA graphs while gradients are computed; see the module docstring.

    ``params``: the trained tensors (they receive gradients; the module's other weights are frozen).
    ``max_recordings``: signatures recorded at most (each holds its own activations); calls with others, and every
    call after a recording failed, run eagerly. ``warmup``: eager runs before recording."""

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.Tensor], *, max_recordings: int = 2,
                 warmup: int = 2):
        self.module = module
        self.original: Callable[..., Any] = module.forward
        self.params = [p for p in params if p.requires_grad]  # what the optimizer changes; frozen ones are weights
        self.max_recordings, self.warmup = max_recordings, warmup
        self.recordings: list[_Recording] = []
        self.attempts = 0
        self.failed: str | None = None
        self.eager_calls = 0
        self.replays = 0
        self._pool: Any = None

    def begin_step(self) -> None:
        """A new micro-step: forward passes recorded in an earlier one will not be differentiated any more."""
        for rec in self.recordings:
            rec.pending = False

    def report(self) -> str:
        """One line for the node's summary: what the recordings did, or why there were none."""
        if self.failed is not None:
            return f"trained without CUDA graphs: the model's forward pass could not be recorded ({self.failed})"
        calls = self.replays + self.eager_calls
        if not self.replays:
            return "trained without CUDA graphs: no step could be replayed"
        return f"CUDA graphs: {self.replays} of {calls} model calls replayed ({self.attempts} recorded)"

    def release(self) -> None:
        """Drop the recordings and their memory (what they did stays in :data:`last_run`)."""
        last_run.clear()
        last_run.update(recorded=self.attempts - (self.failed is not None), replays=self.replays,
                        eager_calls=self.eager_calls, failed=self.failed)
        self.recordings.clear()
        self._pool = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self.failed is not None:
            return self._eager(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor) and v.is_cuda]
        if not tensors or any(t.requires_grad for t in tensors) or \
                any(isinstance(v, torch.Tensor) and not v.is_cuda and v.numel() > _CONSTANT_NUMEL for v in leaves):
            return self._eager(args, kwargs)
        if any(r.pending for r in self.recordings):  # its backward pass needs the pool's memory as it left it
            return self._eager(args, kwargs)
        signature = _signature(leaves)
        rec = next((r for r in self.recordings if r.signature == signature and r.spec == spec), None)
        if rec is not None and rec.weights != _placements(self.module, self.params):
            log.info("the model's weights moved since its CUDA graphs were recorded; recording again")
            self.recordings.remove(rec)
            rec = None
        if rec is None:
            if self.attempts >= self.max_recordings:
                return self._eager(args, kwargs)
            self.attempts += 1
            try:
                rec = self._record(leaves, spec, signature)
            except (RuntimeError, TypeError, ValueError, AssertionError, NotImplementedError) as e:
                # the run goes on without graphs and says why, once (a cancel or an interrupt is not caught)
                self.failed = f"{type(e).__name__}: {e}"
                self.release()
                log.warning("training without CUDA graphs: recording the model's forward pass failed (%s)",
                            self.failed)
                return self._eager(args, kwargs)
            self.recordings.append(rec)
        self.replays += 1
        out = _Replay.apply(rec, *tensors, *self.params)
        return pytree.tree_unflatten(list(out), rec.output_spec)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        self.eager_calls += 1
        return self.original(*args, **kwargs)

    def _record(self, leaves: list[Any], spec: Any, signature: tuple) -> _Recording:
        slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_cuda]
        inputs = [leaves[i].detach().clone() for i in slots]
        params = self.params

        def run() -> list[torch.Tensor]:
            filled = list(leaves)
            for i, t in zip(slots, inputs):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, spec)
            return self.original(*args, **kwargs)

        def differentiate(outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor | None]) -> list[Any]:
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
            return list(torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs],
                                            allow_unused=True))

        with _uncached_autocast():
            return self._record_uncached(run, differentiate, spec, signature, inputs)

    def _record_uncached(self, run: Callable[[], Any], differentiate: Callable[..., list[Any]], spec: Any,
                         signature: tuple, inputs: list[torch.Tensor]) -> _Recording:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                flat = pytree.tree_leaves(run())
                differentiate(flat, [torch.ones_like(o) if o.requires_grad else None for o in flat])
                del flat
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(forward, pool=self._pool, capture_error_mode="thread_local"):
            outputs, output_spec = pytree.tree_flatten(run())
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise TypeError("the forward pass returns something other than tensors")
        grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
        if all(g is None for g in grad_outputs):
            raise RuntimeError("the forward pass's output does not depend on the trained parameters")
        with torch.cuda.graph(backward, pool=self._pool, capture_error_mode="thread_local"):
            grads = differentiate(outputs, grad_outputs)
        torch.cuda.synchronize()
        # the recorded outputs must not keep the recording's autograd graph alive: its gradient accumulators
        # belong to the recording stream, and every replayed step would then synchronise each parameter's
        # gradient with the default stream
        outputs = [o.detach() for o in outputs]
        return _Recording(spec=spec, signature=signature, inputs=inputs, outputs=outputs,
                          output_spec=output_spec, grad_outputs=grad_outputs, grads=grads, forward=forward,
                          backward=backward, weights=_placements(self.module, self.params))


@contextlib.contextmanager
def graphed_forward(module: torch.nn.Module, params: Sequence[torch.Tensor], enabled: bool = True,
                    **options: Any) -> Iterator[GraphedForward | None]:
    """``module`` runs through a :class:`GraphedForward` while the block runs (yielded; None when not
    ``enabled`` or when something else already replaced its forward); its recordings are released on exit."""
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
