"""Batches for training: background prefetch on threads, pinned memory, and a dedicated CUDA copy stream.

Pipeline per batch: the sampler picks rows (this process's slice of a global batch when several processes
train together) -> a worker thread reads zero-copy views of their tensors and stacks
them into one (optionally pinned) CPU batch -> the consuming thread starts the host-to-device copy on one
long-lived copy stream per device and records an event -> when the batch is handed out, the consumer's current
stream waits on that event (a GPU-side wait, the CPU never stalls) and every tensor gets ``record_stream`` on
the consumer stream, so the caching allocator never reuses its memory while the copy or the step still uses it.
The device calls go through :mod:`.transfers` (``torch.cuda``, or its CPU emulation in tests and in runs with
``STREAMING_CACHE_EMULATE_DEVICE=1``).

None of this may fail a run: where the copy stream's machinery raises (making the stream, a copy, an event, the
wait, ``record_stream``), that batch and every later one are copied the plain way (``to(device)`` on the current
stream), and where pinning raises, buffers are ordinary memory from then on; each is noted once in the run's
:class:`~.fallbacks.Fallbacks` with its reason. The batches are the same either way, in the same order.

Threads, not processes: nothing is pickled per batch, nothing breaks on Windows' spawn start method or its
locked files, and the copying itself (``torch.stack``) runs outside the GIL. Worker threads never call CUDA
kernels; they only allocate pinned host memory. At most ``prefetch`` batches are in flight (being built or
ready) plus the one the consumer holds, whatever the dataset size.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .buffers import DEFAULT_MAX_FREE_BYTES, BufferPool
from .collate import collate  # noqa: F401  (re-exported: loader users collate their own samples)
from .dataset import DatasetHandle
from .errors import CacheError
from .fallbacks import COPY_STREAM, PINNED_MEMORY, Fallbacks, describe
from .mix import DatasetMix
from .sampler import BucketSampler, LazyPlan, SamplingOptions, Slice
from .transfers import CudaTransfers, Transfers, for_device

if TYPE_CHECKING:
    from typing_extensions import Unpack


class LoaderError(CacheError):
    """A worker failed to build a batch; the message names the row's keys and holds the worker's traceback."""


class Shard(NamedTuple):
    """What a loader made with ``shares=True`` yields: this process's collated rows of a global batch (``batch``),
    where they start in it (``first``), how many are samples (``samples``; 0 for a stand-in row when the process
    has no share of a short batch) and the rows of the global batch (``total``). Training weighs each process's
    loss by ``samples / total`` so the processes together compute the global batch's mean. ``rows``: the
    dataset rows collated (for error messages); ``source``: the dataset of a mix they come from."""

    batch: Any
    first: int
    samples: int
    total: int
    rows: tuple[int, ...] = ()
    source: int = 0  # which dataset of a mix (``mix.DatasetMix``) the rows come from


def effective_workers(requested: int) -> int:
    """``min(requested, os.cpu_count() or 1)``; 0 means no threads (batches are built in the caller)."""
    if requested < 0:
        raise ValueError(f"workers must be >= 0, got {requested}")
    return min(int(requested), os.cpu_count() or 1)


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def _map_tensors(batch: Any, fn: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, list):
        return [_map_tensors(v, fn) for v in batch]
    if isinstance(batch, tuple) and not isinstance(batch, torch.Size):
        mapped = [_map_tensors(v, fn) for v in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else tuple(mapped)  # a Shard stays a Shard
    return batch


class _Staged(NamedTuple):
    """Batch ``k`` on its way to the device: the host batch, the device batch and the event its copy completes
    (None where the batch was copied the plain way, or stays on the host)."""

    k: int
    cpu: Any
    batch: Any
    event: Any


class _Epoch:
    """One pass over a list of batches, with background workers and the GPU staging step."""

    def __init__(self, handle: DatasetHandle | DatasetMix, batches: Sequence[Slice], start: int, *, workers: int,
                 prefetch: int, device: torch.device | None, transfers: Transfers | None, shares: bool,
                 pool: BufferPool, fallbacks: Fallbacks, prepare: Callable[[Any], Any] | None = None):
        # Deliberately no reference to the BatchLoader: an abandoned loader must stay collectable, and its
        # finalizer closes this epoch and its threads.
        self.handle, self.prefetch, self.device, self.transfers = handle, prefetch, device, transfers
        self.batches, self.shares, self.pool, self.fallbacks = batches, shares, pool, fallbacks
        self.prepare = prepare
        self.wait_seconds = 0.0
        self.next_yield = start
        self.next_task = start
        self.results: dict[int, tuple[bool, Any]] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.staged: _Staged | None = None
        self.threads: list[threading.Thread] = []
        for i in range(workers):
            t = threading.Thread(target=self._work, name=f"streaming-cache-loader-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    # ---------------------------------------------------------------------------------- CPU side
    def _build(self, k: int) -> Any:
        rows, first, samples, total, group = self.batches[k]
        try:
            batch = self._collate(rows.tolist())
            if self.prepare is not None:
                batch = self.prepare(batch)
            return Shard(batch, first, samples, total, tuple(rows.tolist()), group) if self.shares else batch
        except Exception as exc:
            keys = [self.handle[r].keys for r in rows.tolist()]
            raise LoaderError(f"batch {k}: reading rows {rows.tolist()} (keys {keys}) failed: "
                              f"{type(exc).__name__}: {exc}\n--- worker traceback ---\n"
                              f"{traceback.format_exc()}") from exc

    def _collate(self, rows: list[int]) -> Any:
        """Rows collated into the pool's buffers. Rows the handle must stack one by one are not collated into the
        pool: torch pins those itself, where the pool pins with no budget to ask (the bytes are not known
        beforehand); a pin that raises there is retried without."""
        pool = self.pool
        if not (pool.pinning and pool.pin_budget is None and pool.transfers is not None
                and pool.transfers.torch_pins):
            return self.handle.collate(rows, False, pool.empty)
        try:
            return self.handle.collate(rows, True, pool.empty)
        except CacheError:
            raise
        except Exception as exc:
            batch = self.handle.collate(rows, False, pool.empty)  # if this fails too, the entry is at fault
            self.fallbacks.note(PINNED_MEMORY, f"pinning host memory for a batch failed ({describe(exc)})")
            return batch

    def _work(self) -> None:
        depth = self.prefetch
        while True:
            with self.cond:
                while not self.stopped and self.next_task < len(self.batches) \
                        and self.next_task - self.next_yield >= depth:
                    self.cond.wait()
                if self.stopped or self.next_task >= len(self.batches):
                    return
                k = self.next_task
                self.next_task += 1
            try:
                item: tuple[bool, Any] = (True, self._build(k))
            except BaseException as exc:  # handed to the consumer, raised there
                item = (False, exc)
            with self.cond:
                if self.stopped:
                    return
                self.results[k] = item
                self.cond.notify_all()
            del item  # the consumer owns it now; a stale reference here would break the memory bound

    def _take_cpu(self, k: int, block: bool = True) -> Any | None:
        """The CPU batch ``k``; None if ``block`` is False and it is not ready."""
        started = time.perf_counter()
        if not self.threads:
            item = self._build(k)
            self.wait_seconds += time.perf_counter() - started
            return item
        with self.cond:
            while k not in self.results:
                if not block:
                    return None
                if self.stopped:
                    raise LoaderError("loader was closed")
                self.cond.wait()
            ok, item = self.results.pop(k)
            self.cond.notify_all()
        self.wait_seconds += time.perf_counter() - started
        if not ok:
            raise item
        return item

    # ---------------------------------------------------------------------------------- GPU side
    def _streaming(self) -> bool:
        """Whether batches go to the device on the copy stream (off for the rest of the run once it failed)."""
        return self.transfers is not None and self.device is not None \
            and self.fallbacks.reason(COPY_STREAM) is None

    def _plain(self, cpu: Any) -> Any:
        """``cpu`` on the device the plain way: a copy on the current stream that has ended when it returns."""
        device = self.device
        if device is None or device.type == "cpu":
            return cpu
        return _map_tensors(cpu, lambda t: t.to(device))

    def _off(self, doing: str, exc: Exception) -> None:
        self.fallbacks.note(COPY_STREAM, f"{doing} failed ({describe(exc)})")

    def _stage(self, k: int, cpu: Any) -> _Staged:
        """Start batch ``k``'s copy to the device on the copy stream (the plain way once that failed)."""
        if not self._streaming():
            return _Staged(k, cpu, self._plain(cpu), None)
        transfers, device = self.transfers, self.device
        assert transfers is not None and device is not None
        try:
            stream = transfers.copy_stream(device)
            with transfers.using(stream):
                gpu = _map_tensors(cpu, lambda t: transfers.copy(t, device))
                event = transfers.event()
                event.record(stream)
        except Exception as exc:
            self._off("copying a batch on the copy stream", exc)
            return _Staged(k, cpu, self._plain(cpu), None)
        self.pool.fence(list(_tensors(cpu)), event)  # its buffers are reused only once the copy is done
        return _Staged(k, cpu, gpu, event)

    def _hand_out(self, staged: _Staged) -> Any:
        """The staged batch, for use on the consumer's stream: that stream waits for its copy (on the device, the
        host does not wait) and its memory is kept until the work queued there has run. Should that raise, the
        batch is copied again the plain way."""
        if staged.event is None:
            return staged.batch
        transfers = self.transfers
        assert transfers is not None and self.device is not None
        try:
            consumer = transfers.current_stream(self.device)
            consumer.wait_event(staged.event)
            for t in _tensors(staged.batch):
                transfers.record_stream(t, consumer)
        except Exception as exc:
            self._off("handing a copied batch to the training stream", exc)
            return self._plain(staged.cpu)
        return staged.batch

    def __next__(self) -> Any:
        if self.stopped:
            raise StopIteration
        k = self.next_yield
        if k >= len(self.batches):
            self.close()
            raise StopIteration
        try:
            staged = self.staged if self.staged is not None else self._stage(k, self._take_cpu(k))
            self.staged = None
            with self.cond:
                self.next_yield = k + 1
                self.cond.notify_all()
            batch = self._hand_out(staged)
            del staged  # its host batch goes back to the pool
            if self._streaming() and k + 1 < len(self.batches):
                # Start the next copy now if its CPU batch is ready, so it overlaps this step's compute.
                cpu = self._take_cpu(k + 1, block=False)
                if cpu is not None:
                    self.staged = self._stage(k + 1, cpu)
        except BaseException:
            self.close()
            raise
        return batch

    def __iter__(self) -> _Epoch:
        return self

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.results.clear()
            self.cond.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        self.threads = []
        self.staged = None


class BatchLoader:
    """Iterable of collated batches from a :class:`DatasetHandle`, or from a :class:`~.mix.DatasetMix` (each batch
    of one of its datasets, batched as that dataset's settings say); one ``iter()`` is one epoch.

    See the module docstring for the pipeline. ``sampling`` options (shuffle, seed, drop_last, rank,
    world_size, repeats) choose the batches: see :class:`SamplingOptions`. ``workers=0`` builds batches in the
    caller's thread.
    ``device``: where batches go; ``transfers`` (:mod:`.transfers`): how, None choosing by ``device`` (the copy
    stream on CUDA; on the CPU the emulation of it with ``STREAMING_CACHE_EMULATE_DEVICE=1``, else nothing to
    copy). ``pin_memory=None`` pins when batches go through ``transfers``; batches are collated into reused
    buffers (``pool``), and ``pin_budget(nbytes)`` (e.g. ComfyUI's pinned-memory budget) may refuse pinning more,
    in which case the buffer is ordinary memory. ``fallbacks``: the run's record of device optimizations that
    failed and are off (the copy stream, pinned memory; one of the loader's own when None), also read: an
    optimization a run noted before stays off here. ``prepare(batch)``: called on each collated batch on the host,
    on the worker's thread, before its copy to the device; what it returns is the batch (a trainer marks there what
    the step would otherwise read back from the device). ``state_dict()`` records (epoch, batches consumed), and
    ``load_state_dict()`` makes the next iteration resume with exactly the batches the run would have seen.
    With ``world_size`` > 1 each process gets its slice of every global batch (``batch_size`` rows of
    ``batch_size * world_size``; see :mod:`.sampler`); ``shares=True`` yields :class:`Shard` s that say which.
    """

    def __init__(self, handle: DatasetHandle | DatasetMix, batch_size: int, *, workers: int = 1, prefetch: int = 2,
                 device: str | torch.device | None = None, pin_memory: bool | None = None, shares: bool = False,
                 pin_budget: Callable[[int], bool] | None = None, transfers: Transfers | None = None,
                 fallbacks: Fallbacks | None = None, prepare: Callable[[Any], Any] | None = None,
                 **sampling: Unpack[SamplingOptions]):
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        self.handle = handle
        if isinstance(handle, DatasetMix):
            self.sampler = BucketSampler(handle.signatures(), batch_size, groups=handle.groups(),
                                         group_options=handle.group_options(batch_size), **sampling)
        else:
            self.sampler = BucketSampler(handle.signatures(), batch_size, **sampling)
        self.workers = effective_workers(workers)
        self.prefetch = int(prefetch)
        self.shares = bool(shares)
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.transfers = transfers if transfers is not None else for_device(self.device)
        """How batches reach ``device`` (None: they stay where they are collated)."""
        self.fallbacks = fallbacks if fallbacks is not None else Fallbacks()
        self.prepare = prepare
        pins = self.transfers
        if pins is None and pin_memory and torch.cuda.is_available():
            pins = CudaTransfers()  # pinned batches for a caller who copies them itself
        self.pin_memory = bool(self.transfers is not None if pin_memory is None else pin_memory) and pins is not None
        """Whether batches are collated into pinned host memory (the default when batches go to a device through
        ``transfers``); ``pool.pinning`` says whether they still are (a failed pin turns it off)."""
        self.pool = BufferPool(pin=self.pin_memory, pin_budget=pin_budget, max_free_bytes=DEFAULT_MAX_FREE_BYTES,
                               transfers=pins, fallbacks=self.fallbacks)
        """The host buffers batches are collated into, reused once the consumer drops a batch (and, on CUDA, its
        copy to the device is done); ``pool.allocated`` stays flat over epochs."""
        self.epoch = 0
        self._position = 0
        self._fingerprint: str | None = None
        self.wait_seconds = 0.0
        """Time the consumer spent waiting for batches (data-wait), summed over finished iterations."""
        self._active: _Epoch | None = None
        self._finalizer = weakref.finalize(self, BatchLoader._close_epoch, [None])

    @staticmethod
    def _close_epoch(holder: list[_Epoch | None]) -> None:
        if holder[0] is not None:
            holder[0].close()

    def __len__(self) -> int:
        """Batches in the current epoch (see ``BucketSampler.epoch_length``)."""
        return self.sampler.epoch_length(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        self.close()
        if self._position >= len(self):
            self.epoch += 1
            self._position = 0
        # the batches the workers build first come before the rest of the plan, which a worker makes after them
        batches = self.sampler.lazy_plan(self.epoch, self._position, self.prefetch + 1)
        epoch = _Epoch(self.handle, batches, self._position, workers=self.workers, prefetch=self.prefetch,
                       device=self.device, transfers=self.transfers, shares=self.shares, pool=self.pool,
                       fallbacks=self.fallbacks, prepare=self.prepare)
        self._active = epoch
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, BatchLoader._close_epoch, [epoch])
        return self._run(epoch)

    def _run(self, epoch: _Epoch) -> Iterator[Any]:
        try:
            for batch in epoch:
                self._position = epoch.next_yield
                yield batch
                del batch  # release it before the next one is taken: the memory bound counts on it
        finally:
            self.wait_seconds += epoch.wait_seconds
            epoch.wait_seconds = 0.0
            epoch.close()
        if self._position >= len(self):
            self.epoch += 1
            self._position = 0

    def nbytes(self) -> int:
        """Bytes of the arrays the loader keeps for its rows: the sampler's tables and the running epoch's plan
        (the batches in flight not counted)."""
        plan = self._active.batches if self._active is not None else None
        return self.sampler.nbytes() + (plan.nbytes() if isinstance(plan, LazyPlan) else 0)

    def rows_held(self) -> int:
        """Rows of the running epoch's plan (this process's share of the epoch; 0 when no epoch runs)."""
        plan = self._active.batches if self._active is not None else None
        return plan.rows_held() if isinstance(plan, LazyPlan) else 0

    def set_epoch(self, epoch: int) -> None:
        self.close()
        self.epoch, self._position = int(epoch), 0

    def fingerprint(self) -> str:
        """The dataset's fingerprint (computed once: it reads the index for every entry)."""
        if self._fingerprint is None:
            self._fingerprint = self.handle.fingerprint()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """Position (epoch, batches consumed), the sampler's settings and the dataset's fingerprint."""
        return {"epoch": self.epoch, "position": self._position, **self.sampler.state_dict(),
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.check_state(state)
        self.sampler.resume_order(state)
        if "fingerprint" in state and state["fingerprint"] != self.fingerprint():
            raise CacheError("loader state was saved for a different dataset; resume with the same dataset")
        epoch, position = state.get("epoch"), state.get("position")
        if type(epoch) is not int or type(position) is not int or epoch < 0 or not 0 <= position <= len(self):
            raise CacheError(f"loader state holds epoch {epoch!r} and position {position!r}; a position must be a "
                             f"batch number from 0 to {len(self)}. The saved state is damaged: start over")
        self.close()
        self.epoch, self._position = epoch, position

    def close(self) -> None:
        """Stop and join every worker thread of the running epoch (also done on garbage collection)."""
        if self._active is not None:
            self._active.close()
            self._active = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
