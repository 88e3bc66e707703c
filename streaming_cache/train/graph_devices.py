"""Where a training step's graphs are recorded and replayed: a CUDA device, or its CPU emulation.

:mod:`.graphs` records a model's forward pass and the gradients of its trained tensors once and replays them. The
device calls that takes (streams, synchronisation, a memory pool, capture and replay) are here, behind one small
interface, :class:`GraphDevice`, with two implementations:

* :class:`CudaGraphDevice`: ``torch.cuda.CUDAGraph`` capture and replay, warm-up on a side stream, one memory
  pool shared by the recordings.
* :class:`EmulatedGraphDevice`: the same contract on the CPU, so every line of :mod:`.graphs` around the device
  calls runs in the CPU test suite. A capture runs its closure once (refusing what a CUDA capture refuses: reading
  a tensor's value on the host) and keeps what it returned as the static results; a replay runs the closure again,
  under the autocast settings of the capture, and copies its results into those same static tensors, as a CUDA
  replay rewrites the memory it recorded. The closures read the recording's static inputs, so a replay whose
  inputs were not copied in, an output marked wrongly, or a gradient left in a static buffer shows in the
  emulated run as it would on a GPU.

What the emulation cannot show: a kernel that reads memory the allocator gave to something else (the recordings'
weights and pool), and the speed. Those are checked on a GPU (``tests/train/test_graph_replay.py``, its ``cuda`` cases).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

T = TypeVar("T")


class Graph(Protocol):
    """A recorded piece of work: :meth:`replay` runs it again into the tensors it produced when recorded."""

    def replay(self) -> None: ...


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

    def reserved(self) -> int:
        """Bytes the device's allocator holds now (what a recording added to the pool shows here)."""

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

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved())

    def budget(self) -> int | None:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * BUDGET_SHARE)


_HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu, torch.Tensor.numpy,
})
"""Calls that read a device tensor's value on the host: a CUDA capture refuses them (the stream is capturing, the
value does not exist yet), so an emulated capture does too."""


class CaptureError(RuntimeError):
    """What an emulated capture raises where a CUDA capture would fail."""


class _RefuseHostReads(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _HOST_READS:
            raise CaptureError(f"operation not permitted when stream is capturing: {func.__name__} reads a value "
                               "on the host")
        return func(*args, **(kwargs or {}))


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _leaves(value: Any) -> list[Any]:
    """``value``'s leaves, None included (a gradient that does not exist keeps its place)."""
    return pytree.tree_flatten(value, is_leaf=lambda v: v is None)[0]


class _EmulatedGraph:
    """A capture's closure, run again at each replay into the static results of the capture."""

    def __init__(self, work: Callable[[], Any], static: Any, device_type: str):
        self.work, self.static, self.device_type = work, static, device_type
        self.autocast = _autocast_state(device_type)
        self.replays = 0

    def replay(self) -> None:
        enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled, cache_enabled=False):
            fresh = self.work()
        for static, value in zip(_leaves(self.static), _leaves(fresh)):
            if isinstance(static, torch.Tensor) and isinstance(value, torch.Tensor):
                static.detach().copy_(value.detach())
        self.replays += 1


class EmulatedGraphDevice:
    """The CPU standing in for a CUDA device (see the module docstring). ``refuse_host_reads``: captures fail on
    host reads, as CUDA's do."""

    name = "emulated graphs"
    device_type = "cpu"

    def __init__(self, refuse_host_reads: bool = True):
        self.refuse_host_reads = refuse_host_reads
        self.captures = 0
        self.captured_bytes = 0

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def synchronize(self) -> None:
        pass

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_pool(self) -> Any:
        return object()

    def capture(self, work: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        with _RefuseHostReads() if self.refuse_host_reads else contextlib.nullcontext():
            result = work()
        self.captures += 1
        self.captured_bytes += sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(result)
                                   if isinstance(t, torch.Tensor))
        # the graph keeps what the capture returned as plain tensors over the same memory (a replay writes there),
        # not the autograd graph of the capture
        static = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
        return _EmulatedGraph(work, static, self.device_type), result

    def reserved(self) -> int:
        """The bytes of what every capture so far returned (the static results a CUDA pool would hold)."""
        return self.captured_bytes

    def budget(self) -> int | None:
        return None


def graph_device(device: torch.device, emulate: bool = False) -> GraphDevice | None:
    """Where a training on ``device`` records its steps: CUDA graphs on a CUDA device, the emulation on the CPU
    when ``emulate`` (``environment.emulated_device()``), else None (no recording)."""
    if device.type == "cuda":
        return CudaGraphDevice()
    if device.type == "cpu" and emulate:
        return EmulatedGraphDevice()
    return None
