"""Where a training step's graphs are recorded and replayed: a CUDA device, or its CPU emulation.

:mod:`.graphs` records a model's forward pass and the gradients of its trained tensors once and replays them. The
device calls that takes (streams, synchronisation, a memory pool, capture and replay) are here, behind one small
interface, :class:`GraphDevice`, with two implementations:

* :class:`CudaGraphDevice`: ``torch.cuda.CUDAGraph`` capture and replay, warm-up on a side stream, one memory
  pool shared by the recordings.
* :class:`EmulatedGraphDevice`: the same contract on the CPU, so every line of :mod:`.graphs` around the device
  calls runs in the CPU test suite. A capture runs its closure once (refusing what a CUDA capture refuses: a
  device value read on the host, a copy to or from the host: :class:`HostWaits`) and keeps what it returned as the
  static results; a replay runs the closure again, under the autocast settings of the capture, and copies its
  results into those same static tensors, as a CUDA replay rewrites the memory it recorded. The closures read the
  recording's static inputs, so a replay whose inputs were not copied in, an output marked wrongly, or a gradient
  left in a static buffer shows in the emulated run as it would on a GPU. Its pools count the bytes captured into
  them, it counts the graphs held (captured, not reset), and a test's model tells it of each pass
  (:meth:`EmulatedGraphDevice.model_pass`), so a test sees an eager pass that runs beside a held recording: the memory
  peak :mod:`.graphs` must not make.

:class:`HostWaits` also counts those calls outside a capture, so the CPU suite checks that a training step makes the
host wait for the device nowhere but where it means to (``tests/train/test_host_waits.py``).

What the emulation cannot show: a kernel that reads memory the allocator gave to something else (the recordings'
weights and pool), and the speed. Those are checked on a GPU (``tests/train/test_graph_replay.py``, its ``cuda`` cases).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

T = TypeVar("T")


class Graph(Protocol):
    """A recorded piece of work: :meth:`replay` runs it again into the tensors it produced when recorded."""

    def replay(self) -> None: ...

    def reset(self) -> None:
        """Free what the graph holds in its pool (it cannot replay after): its pool's memory goes back to the
        allocator once no graph uses the pool."""


class GraphDevice(Protocol):
    """The device calls of recording and replaying a step (see the module docstring)."""

    name: str
    """How the summary names it (``CUDA graphs``, ``emulated graphs``)."""
    device_type: str
    """The device type of its tensors and of the autocast that applies to them."""

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on this device: a tensor a recording reads as an input (others are constants)."""

    def synchronize(self) -> None:
        """Wait until the device has run everything queued."""

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        """A context whose work runs on a stream of its own, joined with the current one on exit."""

    def new_pool(self) -> Any:
        """A memory pool for recordings to share."""

    def capture(self, work: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        """``work()`` recorded into ``pool``: the graph that replays it and what it returned (the static results a
        replay writes again)."""

    def pool_bytes(self, pool: Any) -> int:
        """Bytes ``pool`` holds on the device now, its free blocks included (they are kept for its recordings): what
        a recording added to it shows here, and nothing else does (not the allocator's cache, which a capture
        empties, nor what other threads allocate meanwhile)."""

    def budget(self) -> int | None:
        """Bytes the recordings of a run may hold together by default (None: no limit but their count)."""


BUDGET_SHARE = 0.25
"""The share of a CUDA device's memory a run's recordings may hold together (a single one is kept whatever its
size: it holds about what an eager step holds for the length of the step)."""


class CudaGraphDevice:
    """CUDA graphs on the current CUDA device."""

    name = "CUDA graphs"
    device_type = "cuda"

    def holds(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, work: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            result = work()
        return graph, result

    def pool_bytes(self, pool: Any) -> int:
        wanted = tuple(pool)
        return sum(int(segment["total_size"]) for segment in torch.cuda.memory_snapshot()
                   if tuple(segment.get("segment_pool_id", ())) == wanted)

    def budget(self) -> int | None:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * BUDGET_SHARE)


READ, TO_HOST, FROM_HOST = "reads a value on the host", "copies to the host", "copies from the host"
"""What makes the host wait for the device (the kinds :class:`HostWaits` counts): a device value read on the host,
or sized by it; a copy from the device to the host; a copy from the host to the device (memory it may change)."""

_HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.__array__, torch.equal, torch.Tensor.equal,
    torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
    torch.Tensor.masked_select,
})
"""Calls that read a device tensor's values on the host, or size their result by them (``nonzero``)."""

_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
"""Calls that make a tensor of host data (Python values, arrays): given a device, a copy from the host."""

_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})


def _is_mask(index: Any) -> bool:
    """Whether ``index`` selects by a boolean mask (a bool tensor, or a list of bools): the result's size is the
    number of True values, which the host must read."""
    if isinstance(index, tuple):
        return any(_is_mask(i) for i in index)
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool and index.dim() > 0
    return isinstance(index, list) and any(isinstance(i, bool) for i in index)


class CaptureError(RuntimeError):
    """What an emulated capture raises where a CUDA capture would fail."""


_LEGACY_WATCHERS: list[HostWaits] = []
"""The active :class:`HostWaits`, which the legacy constructor's tensors are reported to (:func:`_legacy_new`)."""
_TENSOR_NEW = torch._C.TensorBase.__new__


def _legacy_new(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor(...)`` (the legacy constructor, which no torch function mode sees): always a host tensor."""
    made = _TENSOR_NEW(cls, *args, **kwargs)
    for watcher in _LEGACY_WATCHERS:
        watcher._mark_host(made)
    return made


def _watch_legacy(watcher: HostWaits) -> None:
    if not _LEGACY_WATCHERS:
        torch.Tensor.__new__ = _legacy_new  # type: ignore[method-assign]
    _LEGACY_WATCHERS.append(watcher)


def _unwatch_legacy(watcher: HostWaits) -> None:
    if watcher in _LEGACY_WATCHERS:
        _LEGACY_WATCHERS.remove(watcher)
    if not _LEGACY_WATCHERS and "__new__" in vars(torch.Tensor):
        del torch.Tensor.__new__


_DEVICE_GETTER = torch._C.TensorBase.device
"""The descriptor of ``Tensor.device``: reading it is a torch function call, whose result names where that tensor is."""
MOST_DEVICES = 4096
"""The ``torch.device`` objects :class:`HostWaits` remembers at once (the most recent): enough for a training step."""


class HostWaits(TorchFunctionMode):
    """The calls that would make the host wait for the device on a GPU, or copy host memory to it: a device
    value read on the host (``item``, ``bool``, ``tolist``, ``torch.equal``, ``nonzero``, a boolean mask as an
    index), a copy to the host (``.cpu()``, ``.to("cpu")``), a copy from the host (``torch.tensor(data,
    device=...)``, a host tensor moved to a device, a list or a host tensor as an index of a device tensor). A CUDA
    capture refuses each of them; with ``refuse`` so does this mode (:class:`CaptureError`); otherwise it counts
    them by kind (:attr:`counts`, :attr:`calls`), for tests of code that must not wait in a training step.

    The emulated device is the CPU, so the host's tensors are told apart by where they came from: those given in
    ``host``, those made here of host data or without a device (``torch.tensor(data)``, ``torch.zeros(n)``, the
    legacy ``torch.Tensor([...])``), drawn by a CPU generator (``torch.rand(n, generator=g, device=g.device)``: a
    GPU's step draws there too) or copied to the host, and what is computed from them alone. Every other tensor is
    on the device. A ``torch.device`` read from a tensor (``t.to(x.device)``) names where ``x`` is: a copy to the host
    for a device tensor moved to a host tensor's device, from the host the other way round. Any other ``torch.device``
    of the CPU stands for both: a move to it is a copy from the host for a host tensor and no copy for a device
    tensor; a copy to the host is named as such (``"cpu"``, ``.cpu()``)."""

    def __init__(self, *, refuse: bool = False, host: Any = ()) -> None:
        super().__init__()
        self.refuse = refuse
        self.counts: collections.Counter[str] = collections.Counter()
        self.calls: list[str] = []
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}
        self._devices: collections.OrderedDict[int, tuple[torch.device, str]] = collections.OrderedDict()
        for t in pytree.tree_leaves(host):
            if isinstance(t, torch.Tensor):
                self._mark_host(t)

    def __enter__(self) -> HostWaits:
        _watch_legacy(self)
        try:
            return super().__enter__()
        except BaseException:
            _unwatch_legacy(self)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _unwatch_legacy(self)

    @property
    def total(self) -> int:
        """The calls counted, of every kind."""
        return sum(self.counts.values())

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host tensor (see the class docstring)."""
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark_host(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_GETTER and args and isinstance(args[0], torch.Tensor):
            return self._named(func(*args, **kwargs), "host" if self.on_host(args[0]) else "device")
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            name = getattr(func, "__name__", repr(func))
            if self.refuse:
                raise CaptureError(f"operation not permitted when stream is capturing: {name} {kind}")
            self.counts[kind] += 1
            self.calls.append(f"{name} {kind}")
        result = func(*args, **kwargs)
        if kind in (TO_HOST, FROM_HOST) and args and result is args[0]:  # the CPU moved nothing: a copy, as a GPU's
            result = result.clone()
        if self._made_on_host(func, args, kwargs):
            for t in pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self._mark_host(t)
        return result

    def _named(self, device: torch.device, where: str) -> torch.device:
        """``device``, remembered as naming ``where`` (``host`` or ``device``)."""
        self._devices[id(device)] = (device, where)
        if len(self._devices) > MOST_DEVICES:
            self._devices.popitem(last=False)
        return device

    def _tensors(self, value: Any) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]

    def _on_device(self, value: Any) -> bool:
        """Whether ``value`` holds a device tensor."""
        return any(not self.on_host(t) for t in self._tensors(value))

    def _target(self, where: Any) -> str | None:
        """Where a device argument moves a tensor: ``host``, ``device``, ``named`` (a ``torch.device`` of the
        CPU not read from a tensor, which stands for both here), or None (not a device)."""
        if isinstance(where, torch.Tensor):
            return "host" if self.on_host(where) else "device"
        if isinstance(where, str):
            return "host" if torch.device(where).type == "cpu" else "device"
        if isinstance(where, torch.device):
            named = self._devices.get(id(where))
            if named is not None and named[0] is where:
                return named[1]
            return "named" if where.type == "cpu" else "device"
        if isinstance(where, int) and not isinstance(where, bool):
            return "device"
        return None

    def _move(self, func: Any, args: Any, kwargs: Any) -> str | None:
        """Where a copying call moves its tensor (see :meth:`_target`), or None."""
        if func is torch.Tensor.cpu:
            return "host"
        if func is torch.Tensor.cuda:
            return "device"
        if func is torch.Tensor.to:
            return self._target(kwargs.get("device", args[1] if len(args) > 1 else None))
        if func in _FROM_DATA:
            return self._target(kwargs.get("device"))
        return None

    def _kind(self, func: Any, args: Any, kwargs: Any) -> str | None:
        """What ``func`` called with ``args`` makes the host wait for, or None."""
        if func in _HOST_READS:
            return READ if self._on_device((args, kwargs)) else None
        if func in _INDEXING:
            return self._indexing(args)
        if func is torch.Tensor.copy_:
            dst, src = self._on_device(args[0]), self._on_device(args[1])
            return FROM_HOST if dst and not src else TO_HOST if src and not dst else None
        move = self._move(func, args, kwargs)
        if move is None:
            return None
        data = args[0] if args else kwargs.get("data")
        if func in _FROM_DATA and not isinstance(data, torch.Tensor):
            return FROM_HOST if move in ("device", "named") else None
        source = self._on_device(data)
        if source and move == "host":
            return TO_HOST
        return FROM_HOST if not source and move in ("device", "named") else None

    def _indexing(self, args: Any) -> str | None:
        """What indexing a tensor (``args``: the tensor, the index, and the value set) waits for, or None."""
        if not self._on_device(args[0]):
            return None
        index, value = args[1], (args[2] if len(args) > 2 else None)
        if _is_mask(index) and not self._scalar(value):  # a scalar set through a mask is a masked fill
            return READ
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, list) or (isinstance(i, torch.Tensor) and i.dim() > 0 and self.on_host(i))
               for i in parts):
            return FROM_HOST
        if isinstance(value, torch.Tensor) and value.dim() > 0 and self.on_host(value):
            return FROM_HOST
        return None

    def _scalar(self, value: Any) -> bool:
        """Whether ``value`` (set through an index) is one number on the host."""
        if isinstance(value, torch.Tensor):
            return value.dim() == 0 and self.on_host(value)
        return isinstance(value, (bool, int, float, complex))

    def _made_on_host(self, func: Any, args: Any, kwargs: Any) -> bool:
        """Whether what ``func`` returns is on the host: a copy to it, something made without a device (or of host
        data without one), or computed from host tensors alone."""
        move = self._move(func, args, kwargs)
        if move is not None:
            return move == "host"
        tensors = self._tensors((args, kwargs))
        if not tensors:
            generator = kwargs.get("generator")
            if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
                return True  # drawn by a host generator (on its device, the CPU): host memory on a GPU too
            return self._target(kwargs.get("device")) in (None, "host")
        return all(self.on_host(t) for t in tensors)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _leaves(value: Any) -> list[Any]:
    """``value``'s leaves, None included (a gradient that does not exist keeps its place)."""
    return pytree.tree_flatten(value, is_leaf=lambda v: v is None)[0]


class _EmulatedPool:
    """An emulated memory pool: the bytes of the static results captured into it. Like a CUDA pool it keeps them
    while it lives (a reset graph gives its memory back to the pool, not to the device)."""

    def __init__(self) -> None:
        self.nbytes = 0


def _storage_bytes(value: Any) -> int:
    """The bytes of the storages of ``value``'s tensors, each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pytree.tree_leaves(value)
                if isinstance(t, torch.Tensor)}
    return sum(storages.values())


class _EmulatedGraph:
    """A capture's closure, run again at each replay into the static results of the capture."""

    def __init__(self, work: Callable[[], Any], static: Any, device: EmulatedGraphDevice):
        self.work: Callable[[], Any] | None = work
        self.static, self.device = static, device
        self.autocast = _autocast_state(device.device_type)
        self.replays = 0

    def replay(self) -> None:
        if self.work is None:
            raise RuntimeError("replay of a graph that was reset: record it again to replay it")
        enabled, dtype = self.autocast
        with self.device.running_graphs(), torch.enable_grad(), \
                torch.autocast(self.device.device_type, dtype=dtype, enabled=enabled, cache_enabled=False):
            fresh = self.work()
        for static, value in zip(_leaves(self.static), _leaves(fresh)):
            if isinstance(static, torch.Tensor) and isinstance(value, torch.Tensor):
                static.detach().copy_(value.detach())
        self.replays += 1

    def reset(self) -> None:
        if self.work is not None:
            self.work = self.static = None
            self.device.held -= 1


class EmulatedGraphDevice:
    """The CPU standing in for a CUDA device (see the module docstring). ``refuse_host_reads``: captures fail where
    the host would wait for the device (:class:`HostWaits`), as CUDA's do.

    What it counts, for tests: ``captures``; ``held``, the graphs captured and not reset; ``eager_passes``, the
    passes of the model (told by :meth:`model_pass`) that ran outside a capture or a replay, and ``eager_beside``,
    those of them that ran while a graph was held."""

    name = "emulated graphs"
    device_type = "cpu"

    def __init__(self, refuse_host_reads: bool = True):
        self.refuse_host_reads = refuse_host_reads
        self.captures = 0
        self.held = 0
        self.eager_passes = 0
        self.eager_beside = 0
        self._running = 0

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def synchronize(self) -> None:
        pass

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_pool(self) -> Any:
        return _EmulatedPool()

    def capture(self, work: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        with self.running_graphs(), HostWaits(refuse=True) if self.refuse_host_reads else contextlib.nullcontext():
            result = work()
        self.captures += 1
        self.held += 1
        pool.nbytes += _storage_bytes(result)
        # the graph keeps what the capture returned as plain tensors over the same memory (a replay writes there),
        # not the autograd graph of the capture
        static = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
        return _EmulatedGraph(work, static, self), result

    def pool_bytes(self, pool: Any) -> int:
        """The bytes of what every capture into ``pool`` returned (the static results a CUDA pool would hold)."""
        return int(pool.nbytes)

    def budget(self) -> int | None:
        return None

    @contextlib.contextmanager
    def running_graphs(self) -> Iterator[None]:
        """A capture or a replay runs: the model's passes meanwhile are the graph's, not eager ones."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1

    def model_pass(self) -> None:
        """Called by a test's model at the start of each forward pass: counts it as eager unless a capture or a
        replay runs it, and as beside a recording if a graph is held meanwhile (on a GPU, the two would need memory
        at once)."""
        if self._running:
            return
        self.eager_passes += 1
        if self.held:
            self.eager_beside += 1


def graph_device(device: torch.device, emulate: bool = False) -> GraphDevice | None:
    """Where a training on ``device`` records its steps: CUDA graphs on a CUDA device, the emulation on the CPU
    when ``emulate`` (``environment.emulated_device()``), else None (no recording)."""
    if device.type == "cuda":
        return CudaGraphDevice()
    if device.type == "cpu" and emulate:
        return EmulatedGraphDevice()
    return None
