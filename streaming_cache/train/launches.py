"""A step's kernel launches counted without a GPU: the ATen operations it dispatches.

Each ATen operation a training step dispatches is, on a GPU, a kernel launch (or a few), except those that launch
nothing: views (a new shape over the same memory), allocations (``empty``...), and the read of one value on the host
(``_local_scalar_dense``: ``.item()``, ``bool()`` of a tensor), which makes the host wait for the device and is
counted apart. The count does not depend on the device (a model on ``meta`` at full size dispatches what it would
on a GPU, attention aside: ``memory_count.FusedAttention`` routes it to the fused kernels a GPU runs) nor on the
width of the layers, so it is made on the CPU. ``scripts/bench_memory.py --count-ops`` counts whole optimizer steps
with these rules; ``nodes/backend/memory_estimate.py`` counts the full-size models' forward and backward passes.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_LAUNCHED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                          "_local_scalar_dense", "lift_fresh"})
"""Operations that launch no kernel: allocations, a host read (counted apart), a constant made a tensor."""
HOST_READ = "_local_scalar_dense"
PASSES = ("forward", "backward")


def is_launch(func: Any) -> bool:
    """Whether the ATen operation ``func`` launches a kernel on a GPU (see the module docstring)."""
    return not func.is_view and func.overloadpacket.__name__ not in NOT_LAUNCHED


def in_backward() -> bool:
    """Whether this thread runs autograd's backward pass now."""
    return torch._C._current_graph_task_id() != -1


GRAPH_REPLAY = "graph replay"
"""How :attr:`Launches.ops` names a recorded graph's replay (one launch)."""


class Launches(TorchDispatchMode):
    """A dispatch mode counting the operations that launch a kernel (:func:`is_launch`) while it is active, by pass
    (``forward``: everything outside autograd's backward pass; ``backward``), each operation's name, and the host
    reads by pass. The backward pass runs on the thread that calls it for CPU and ``meta`` tensors, which the mode
    is active on. A recorded graph's replay is one launch (:meth:`replay`); :meth:`mark` keeps the launches since the
    previous mark under a name (a step's passes)."""

    def __init__(self) -> None:
        super().__init__()
        self.passes: collections.Counter[str] = collections.Counter({p: 0 for p in PASSES})
        self.host_reads: collections.Counter[str] = collections.Counter({p: 0 for p in PASSES})
        self.ops: collections.Counter[str] = collections.Counter()
        self.marks: dict[str, int] = {}
        self._at_mark = 0
        self._replaying = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self._replaying:
            where = PASSES[1] if in_backward() else PASSES[0]
            if func.overloadpacket.__name__ == HOST_READ:
                self.host_reads[where] += 1
            elif is_launch(func):
                self.passes[where] += 1
                self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """A recorded graph replayed while the block runs (on ``meta`` or the CPU, by operations that stand for its
        kernels): one launch, in the pass it runs in, and none of those operations."""
        self.passes[PASSES[1] if in_backward() else PASSES[0]] += 1
        self.ops[GRAPH_REPLAY] += 1
        self._replaying += 1
        try:
            yield
        finally:
            self._replaying -= 1

    def mark(self, name: str) -> None:
        """Keep the launches since the previous mark under ``name``."""
        self.marks[name] = self.total - self._at_mark
        self._at_mark = self.total

    @property
    def total(self) -> int:
        return sum(self.passes.values())

    def summary(self, top: int = 8) -> dict[str, Any]:
        """The counts as plain values: launches by pass and in all, host reads by pass, the ``top`` most frequent
        operations."""
        return {**{p: self.passes[p] for p in PASSES}, "total": self.total, "host_reads": dict(self.host_reads),
                "top": self.ops.most_common(top)}
