"""Data-parallel training on torch.distributed: the gradient sum over the processes of a
:class:`~..group.Group`, and the decisions they take together.

Every process (rank) holds the same trainable tensors and computes the loss of its slice of each global batch
(:mod:`..sampler`), weighted by the slice's share of the batch; the gradients are then summed over the ranks, so
each rank ends a step with the gradient of the global batch's mean loss and takes the same optimizer step. The
sum runs in buckets launched while the backward pass is still running: each tensor's post-accumulate-grad hook
marks it ready, and the buckets go out in one fixed order on every rank (the reverse of the tensors' order,
roughly the order in which the backward pass finishes them), as DDP's reducer does. A tensor that got no
gradient in a step contributes zeros. Stopping (Cancel on any rank) is decided together before each step, so
every rank stops after the same step.

Collectives run with the process group's timeout (:mod:`..group`), so a rank that died or hangs ends the job
with an error rather than a hang (torchrun then stops the other ranks at once).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..group import Group, handed

BUCKET_BYTES = 25 * 1024 * 1024


class GradientSum:
    """Sums the gradients of ``params`` over the ranks, in buckets of about ``bucket_bytes`` launched during the
    backward pass (see the module docstring). Use :meth:`backward` around each backward pass (only the last
    micro-step's pass sums: earlier ones accumulate locally) and :meth:`finish` before the optimizer step."""

    def __init__(self, params: Sequence[torch.Tensor], group: Group, bucket_bytes: int = BUCKET_BYTES):
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[int]] = []
        open_buckets: dict[tuple[torch.dtype, torch.device], tuple[int, int]] = {}  # kind -> (bucket, bytes)
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            kind, size = (p.dtype, p.device), p.numel() * p.element_size()
            b, used = open_buckets.get(kind, (-1, 0))
            if b < 0 or used + size > bucket_bytes:
                b, used = len(self.buckets), 0
                self.buckets.append([])
            self.buckets[b].append(i)
            open_buckets[kind] = (b, used + size)
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.device = group.device()
        self.hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                      for i, p in enumerate(self.params)]
        self.armed = False
        self._reset()

    def _reset(self) -> None:
        self.waiting = [len(b) for b in self.buckets]
        self.seen: set[int] = set()
        self.next = 0
        self.inflight: list[tuple[int, torch.Tensor, Any]] = []

    @contextlib.contextmanager
    def backward(self, last: bool) -> Iterator[None]:
        """Around one backward pass: ``last`` (the step's last micro-step) sums its gradients as they arrive."""
        self.armed = last
        try:
            yield
        finally:
            self.armed = False

    def _ready(self, i: int, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if i in self.seen:  # would change a bucket already sent; autograd accumulates a leaf once per pass
            raise RuntimeError(f"the gradient of trainable tensor {i} arrived twice in one backward pass; "
                               "data-parallel training needs one backward pass per micro-step")
        self.seen.add(i)
        b = self.bucket_of[i]
        self.waiting[b] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._launch(self.next)

    def _launch(self, b: int) -> None:
        parts = []
        for i in self.buckets[b]:
            p = self.params[i]
            parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
        flat = handed(torch.cat(parts).to(self.device))  # a tensor offloaded to the CPU is summed where NCCL can
        self.inflight.append((b, flat, dist.all_reduce(flat, async_op=True)))
        self.next = b + 1

    def finish(self) -> None:
        """Send the buckets not sent yet, wait for all, and put the sums in place of the local gradients."""
        while self.next < len(self.buckets):
            self._launch(self.next)
        for b, flat, work in self.inflight:
            work.wait()
            offset = 0
            for i in self.buckets[b]:
                p = self.params[i]
                summed = flat[offset:offset + p.numel()].view_as(p).to(p.device)
                offset += p.numel()
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
        self._reset()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


class DataParallel:
    """What the training loop asks of the process group (``loop.StepSync``): gradients summed over the ranks,
    the step's loss summed over them (each rank's loss is its share of the global batch's mean), and stopping
    decided together."""

    def __init__(self, params: Sequence[torch.Tensor], group: Group, bucket_bytes: int = BUCKET_BYTES):
        self.group = group
        self.grads = GradientSum(params, group, bucket_bytes)
        self.waits: list[float] = []
        """Per step, the seconds spent waiting on the other processes (the gradient sum the backward pass did not
        hide, the loss and stop sums)."""
        self._stop_wait = 0.0

    def backward(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return self.grads.backward(last)

    def step(self, loss: float) -> float:
        started = time.perf_counter()
        self.grads.finish()
        total = self.group.sum([loss])[0]
        self.waits.append(self._stop_wait + time.perf_counter() - started)
        return total

    def stop(self, wanted: bool) -> bool:
        started = time.perf_counter()
        stop = self.group.any(wanted)
        self._stop_wait = time.perf_counter() - started
        return stop

    def close(self) -> None:
        self.grads.close()
