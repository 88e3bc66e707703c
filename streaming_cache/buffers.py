"""Host buffers for batches, reused: a fresh allocation per batch costs a page fault and a page of zeros per 4 KiB
on its first write (for a batch of 16 MiB entries that is most of the time a read takes), and pinned memory is
slow to allocate.

A :class:`BufferPool` hands out tensors whose memory comes back to it when the caller is done with them: each is
a tensor of its own (not a view) over a pooled storage, so it and every view made of it keep it alive, and a
finalizer returns the storage once the last of them is gone. Anything else still sharing the storage (a numpy
array made with ``.numpy()``, a storage object) shows in the storage's use count, and such a buffer is not
reused until it is free again: nothing a caller still holds is ever written. (Where torch does not expose the
use count, buffers are not reused at all.) A buffer a CUDA copy still reads from is fenced with that copy's
event and reused only once the event completes.
Free buffers are kept up to ``max_free_bytes``; pinned ones only while a budget callback allows (ComfyUI's pinned
memory budget, where the version has one), beyond which buffers are ordinary memory. Pinned memory comes from a
:class:`~.transfers.Transfers` (CUDA's, or the CPU emulation's counted allocations). A pin that raises (the host
is out of pinned memory) never fails a batch: the buffer is ordinary memory, and pinning stays off for the rest of
the run (noted in the run's :class:`~.fallbacks.Fallbacks` as ``PINNED_MEMORY``); so does a fence's event whose
query raises (noted as ``COPY_STREAM``), whose buffer is then left to the garbage collector, never reused.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .fallbacks import COPY_STREAM, PINNED_MEMORY, Fallbacks, describe
from .transfers import CudaTransfers, Transfers

DEFAULT_MAX_FREE_BYTES = 256 * 1024 * 1024


class BufferPool:
    """Reused host memory for batch tensors (see the module docstring). ``pin``: buffers are pinned through
    ``transfers`` (by default CUDA's, where there is CUDA; without one nothing is pinned). ``fallbacks``: the run's
    record of optimizations switched off (one of its own when None)."""

    def __init__(self, *, pin: bool = False, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES,
                 pin_budget: Callable[[int], bool] | None = None, transfers: Transfers | None = None,
                 fallbacks: Fallbacks | None = None):
        if pin and transfers is None and torch.cuda.is_available():
            transfers = CudaTransfers()
        self.pin = bool(pin) and transfers is not None
        """Whether buffers are pinned when the budget allows (see :attr:`pinning` for whether they still are)."""
        self.transfers = transfers
        self.max_free_bytes = int(max_free_bytes)
        self.pin_budget = pin_budget
        self.fallbacks = fallbacks if fallbacks is not None else Fallbacks()
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._free_bytes = 0
        self._returned: list[tuple[torch.UntypedStorage, Any]] = []  # with the event of a copy reading it
        self._returned_bytes = 0
        self._fences: dict[int, Any] = {}  # storage address -> the event of a copy that still reads it
        self._lock = threading.Lock()
        self.allocated = 0
        """Buffers allocated (not reused) so far: flat over epochs when the pool works."""
        self.pinned_bytes = 0

    @property
    def pinning(self) -> bool:
        """Whether new buffers are pinned (within the budget): asked for, and no pin of the run failed."""
        return self.pin and self.fallbacks.reason(PINNED_MEMORY) is None

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` in a pooled buffer."""
        nbytes = math.prod(shape) * _itemsize(dtype)
        storage = self._take(nbytes) or self._allocate(nbytes)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(1, int(shape[i + 1]))
        out = torch.empty(0, dtype=dtype, device="cpu").set_(storage, 0, tuple(shape), tuple(strides))
        weakref.finalize(out, self._give_back, storage)
        return out

    def fence(self, tensors: Sequence[torch.Tensor], event: Any) -> None:
        """The buffers of ``tensors`` are read by an asynchronous copy that ``event`` completes: they are not
        reused before it has."""
        with self._lock:
            for t in tensors:
                self._fences[t.untyped_storage().data_ptr()] = event

    def _allocate(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            self.allocated += 1
        if self.pinning and self.transfers is not None:
            try:
                if self.pin_budget is None or self.pin_budget(nbytes):
                    storage = self.transfers.pinned(max(1, nbytes))
                    with self._lock:
                        self.pinned_bytes += nbytes
                    return storage
            except Exception as exc:  # out of pinned memory, a budget that fails: ordinary memory from now on
                self.fallbacks.note(PINNED_MEMORY, f"pinning {nbytes} bytes of host memory for a batch failed "
                                                   f"({describe(exc)})")
        return torch.empty(max(1, nbytes), dtype=torch.uint8).untyped_storage()

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        with self._lock:
            self._settle()
            for size in [max(1, nbytes)] + sorted(k for k in self._free if nbytes < k <= 2 * nbytes):
                stack = self._free.get(size)
                if stack:
                    self._free_bytes -= size
                    return stack.pop()
        return None

    def _give_back(self, storage: torch.UntypedStorage) -> None:
        """A finalizer: the tensor over ``storage`` is gone (its views too); the storage is checked at the next
        :meth:`_take` (a copy may still read it; something else may still share it)."""
        with self._lock:
            self._returned.append((storage, self._fences.pop(storage.data_ptr(), None)))
            self._returned_bytes += storage.nbytes()
            while self._returned_bytes > self.max_free_bytes and self._returned:  # held elsewhere too long
                dropped, _ = self._returned.pop(0)
                self._returned_bytes -= dropped.nbytes()

    def _settle(self) -> None:
        """Free the returned buffers no copy reads and nothing else shares any more."""
        waiting = []
        for storage, event in self._returned:
            done = self._completed(event)
            if done is None:
                continue  # nobody can say when the copy ends: never reused
            if not done or _use_count(storage) != 1:
                waiting.append((storage, event))
                continue
            size = storage.nbytes()
            if self._free_bytes + size <= self.max_free_bytes:
                self._free.setdefault(size, []).append(storage)
                self._free_bytes += size
        self._returned = waiting
        self._returned_bytes = sum(s.nbytes() for s, _ in waiting)

    def _completed(self, event: Any) -> bool | None:
        """Whether the copy ``event`` completes is done (no event: True); None if asking raised."""
        if event is None:
            return True
        try:
            return bool(event.query())
        except Exception as exc:
            self.fallbacks.note(COPY_STREAM, f"asking whether a batch's copy to the device ended failed "
                                             f"({describe(exc)})")
            return None


def _use_count(storage: torch.UntypedStorage) -> int | None:
    """How many owners the storage's memory has (this reference included), or None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(storage._cdata))


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty(0, dtype=dtype).element_size()
    return size


_shared: dict[bool, BufferPool] = {}
_shared_lock = threading.Lock()


def shared_pool(pin: bool = False) -> BufferPool:
    """The process's pool for batches collated without one of their own (``CacheReader.collate``)."""
    with _shared_lock:
        pool = _shared.get(pin)
        if pool is None:
            pool = _shared[pin] = BufferPool(pin=pin)
        return pool
