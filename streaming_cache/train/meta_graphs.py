"""What CUDA graphs of a training step hold in device memory, counted on ``meta`` without a GPU.

:mod:`.graphs` records a step's forward and backward passes into graphs that share one memory pool. A CUDA pool
holds every block allocated while a capture runs; a block freed during a capture goes back to the pool (a later
capture into the same pool may reuse it), not to the device, and a replay writes into the blocks its capture
allocated without allocating anything. So the pool's size on the device is the high-water mark of the live
allocations of the captures into it, and it is held until the recordings are freed.

This module models that on ``meta`` (:mod:`.memory_count`'s device, where a full-size model's passes run in seconds
on a CPU with every tensor made, kept and freed as on the GPU):

* :class:`PooledStorages`, the live-storage counter with pools: a storage made while a capture runs is charged to
  the capture's :class:`MetaPool` instead of the device; the pool grows to its high-water mark and the device's
  count (:attr:`~.memory_count.LiveStorages.live`, the peak, the marks) holds the pool's size, not its storages;
  a storage made while a graph replays is the pool's memory written again and is charged to nothing. Once every
  graph of a pool is reset, the pool shrinks to the storages still live in it and gives each back as it is freed.
* :class:`MetaGraphDevice`, a :class:`~.graph_devices.GraphDevice` on ``meta`` whose capture runs the closure
  under that counter and whose replay runs it again into the capture's static results, as the CPU emulation of
  :mod:`.graph_devices` does.

A ``meta`` tensor has no values: a value read on the host outside a capture (the recording's check reads the
difference between the replay and the eager pass, and whether the eager pass is finite) reads 0 (True for a
boolean), so the check passes and what it allocates is counted; inside a capture or a replay such a read fails, as
it does in a CUDA capture. What the model leaves out: the caching allocator's rounding (blocks of 512 bytes, and
the pool's segments of 2 or 20 MiB) and its fragmentation, kernels' workspaces, the CUDA context.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from .launches import Launches
from .memory_count import LiveStorages

T = TypeVar("T")


class MetaPool:
    """A CUDA graph pool on ``meta``: :attr:`size`, the bytes it holds on the device (its high-water mark of live
    capture allocations while graphs use it); :attr:`used`, the bytes of its live storages; :attr:`graphs`, the
    graphs captured into it and not reset; :attr:`largest`, the most it held."""

    def __init__(self) -> None:
        self.size = 0
        self.used = 0
        self.graphs = 0
        self.largest = 0
        self.capturing = False

    @property
    def held(self) -> bool:
        """Whether graphs use it (or a capture into it runs): its free blocks stay reserved for them."""
        return self.capturing or self.graphs > 0


def _stand_in(t: torch.Tensor) -> Any:
    """The value a host read of a ``meta`` tensor gets: 0 of its kind, True for a boolean."""
    if t.dtype == torch.bool:
        return True
    if t.dtype.is_complex:
        return 0j
    return 0.0 if t.dtype.is_floating_point else 0


class PooledStorages(LiveStorages):
    """:class:`~.memory_count.LiveStorages` with CUDA graph pools (module docstring). :attr:`beside` is the most
    bytes that lived outside the pools while a pool was held: what a step keeps beside its recording (an eager
    pass run then shows here with all its activations)."""

    def __init__(self, device: str = "meta", existing: Iterable[torch.Tensor] = ()):
        super().__init__(device, existing)
        self.pools: list[MetaPool] = []
        self.capturing: MetaPool | None = None
        self.replaying = 0
        self.beside = 0
        self._pool_of: dict[int, tuple[MetaPool | None, int]] = {}  # storage -> (its pool, None: a replay's; bytes)

    def new_pool(self) -> MetaPool:
        pool = MetaPool()
        self.pools.append(pool)
        return pool

    @property
    def pooled(self) -> int:
        """Bytes the pools hold on the device now."""
        return sum(p.size for p in self.pools)

    @contextlib.contextmanager
    def capture(self, pool: MetaPool) -> Iterator[None]:
        """Storages made while the block runs are charged to ``pool``."""
        if self.capturing is not None:
            raise RuntimeError("a capture is already running")
        self.capturing, pool.capturing = pool, True
        try:
            yield
        finally:
            self.capturing, pool.capturing = None, False

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Storages made while the block runs are a pool's memory written again: charged to nothing."""
        self.replaying += 1
        try:
            yield
        finally:
            self.replaying -= 1

    def release(self, pool: MetaPool) -> None:
        """Every graph of ``pool`` is reset: it keeps only the storages still live in it."""
        with self._lock:
            self.live -= pool.size - pool.used
            pool.size = pool.used

    def _grow(self, pool: MetaPool, size: int) -> None:
        with self._lock:
            pool.used += size
            if pool.used > pool.size:
                grown = pool.used - pool.size
                pool.size = pool.used
                pool.largest = max(pool.largest, pool.size)
                self.live += grown
                self.allocated += grown
                self.peak = max(self.peak, self.live)
                self._since_mark = max(self._since_mark, self.live)

    def _pool_freed(self, cdata: int) -> None:
        with self._lock:
            pool, size = self._pool_of.pop(cdata, (None, 0))
            self._sizes.pop(cdata, None)
            if pool is not None:
                pool.used -= size
                if not pool.held:  # released: what it gives back leaves the device
                    pool.size -= size
                    self.live -= size
        self._finalizers.pop(cdata, None)

    def _made(self, t: Any) -> None:
        key = self._key(t)
        if key is None:
            return
        cdata, storage = key
        if cdata in self._pool_of:  # a pool's storage written in place: its memory is the pool's already
            return
        if cdata not in self._sizes and (self.capturing is not None or self.replaying):
            pool = None if self.replaying else self.capturing
            size = storage.nbytes()
            with self._lock:
                self._sizes[cdata] = 0  # known (not taken for a storage live from the start), counted by its pool
                self._pool_of[cdata] = (pool, size)
            self._finalizers[cdata] = weakref.finalize(storage, self._pool_freed, cdata)
            if pool is not None:
                self._grow(pool, size)
            return
        super()._made(t)
        if any(p.held for p in self.pools):
            outside = self.live - self.pooled
            with self._lock:
                self.beside = max(self.beside, outside)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and self._key(args[0]) is not None:
            if self.capturing is not None or self.replaying:
                raise RuntimeError("operation not permitted when stream is capturing: a device value read on the "
                                   "host")
            return _stand_in(args[0])
        return super().__torch_dispatch__(func, types, args, kwargs)


class _MetaGraph:
    """A capture's closure, run again at each replay (under :meth:`PooledStorages.replay`) into the static results
    of the capture."""

    def __init__(self, work: Callable[[], Any], static: Any, device: MetaGraphDevice, pool: MetaPool):
        self.work: Callable[[], Any] | None = work
        self.static, self.device, self.pool = static, device, pool
        self.autocast = (torch.is_autocast_enabled(device.device_type), torch.get_autocast_dtype(device.device_type))

    def replay(self) -> None:
        if self.work is None:
            raise RuntimeError("replay of a graph that was reset: record it again to replay it")
        enabled, dtype = self.autocast
        autocast = torch.autocast(self.device.device_type, dtype=dtype, cache_enabled=False) if enabled else \
            contextlib.nullcontext()
        launched = self.device.launches.replay() if self.device.launches is not None else contextlib.nullcontext()
        with self.device.storages.replay(), launched, torch.enable_grad(), autocast:
            fresh = self.work()
            for static, value in zip(_leaves(self.static), _leaves(fresh)):
                if isinstance(static, torch.Tensor) and isinstance(value, torch.Tensor):
                    static.detach().copy_(value.detach())
        self.device.replays += 1

    def reset(self) -> None:
        if self.work is None:
            return
        self.work = self.static = None
        self.pool.graphs -= 1
        if not self.pool.held:
            self.device.storages.release(self.pool)


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_flatten(value, is_leaf=lambda v: v is None)[0]


class MetaGraphDevice:
    """Graphs recorded and replayed on ``meta``, their pools counted by ``storages`` (the counter the step runs
    under). ``device_type`` is CUDA's: the device the count stands for (``meta`` has no autocast; a step counted
    on it runs without one, as :mod:`nodes.backend.memory_estimate` counts it).

    What it counts: ``captures``, ``replays`` and, for a module given to :meth:`watch`, ``eager_beside``: the
    module's calls outside a capture or a replay while a pool was held (on a GPU, an eager pass needing its own
    memory beside the recording's). With ``launches`` (the step's :class:`~.launches.Launches`), each replay counts
    as one kernel launch there, as a CUDA graph's replay is one."""

    name = "graphs on meta"
    device_type = "cuda"

    def __init__(self, storages: PooledStorages, launches: Launches | None = None):
        self.storages, self.launches = storages, launches
        self.captures = 0
        self.replays = 0
        self.eager_beside = 0

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta"

    def synchronize(self) -> None:
        pass

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_pool(self) -> Any:
        return self.storages.new_pool()

    def capture(self, work: Callable[[], T], pool: Any) -> tuple[_MetaGraph, T]:
        with self.storages.capture(pool):
            result = work()
        pool.graphs += 1
        self.captures += 1
        static = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
        return _MetaGraph(work, static, self, pool), result

    def pool_bytes(self, pool: Any) -> int:
        return int(pool.size)

    def budget(self) -> int | None:
        return None

    def watch(self, module: torch.nn.Module) -> Any:
        """Count ``module``'s calls that run eagerly while a pool is held (:attr:`eager_beside`); returns the hook's
        handle (``remove()`` it)."""
        storages = self.storages

        def called(*_: Any) -> None:
            if storages.capturing is None and not storages.replaying and any(p.held for p in storages.pools):
                self.eager_beside += 1

        return module.register_forward_pre_hook(called)
