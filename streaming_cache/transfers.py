"""Host-to-device copies of batches: a CUDA device, or its CPU emulation.

The loader copies each batch on a long-lived side stream, records an event after the copy, makes the training
stream wait on that event and marks every copied tensor as used there (``record_stream``); its host buffers are
pinned, and reused only once the copy's event completed. Those device calls are here, behind one small
interface, :class:`Transfers`, with two implementations:

* :class:`CudaTransfers`: ``torch.cuda`` streams and events, ``non_blocking`` copies, pinned host memory.
* :class:`EmulatedTransfers`: the same contract on the CPU, so the code around the device calls (the loader's
  staging of the next batch, its fallbacks, the buffer pool's fences and pin accounting) runs in the CPU test
  suite. Streams and events are CPU objects that keep what was recorded, waited on and copied; a copy is a
  ``clone()`` (new memory, as a device copy is); pinned memory is ordinary memory, counted; a test may hold
  events incomplete (:meth:`EmulatedTransfers.hold`) and make any device call raise (``fail``).

What the emulation cannot show: a kernel reading host memory after it changed (an emulated copy reads its
source at once), and the speed. Those are checked on a GPU (``tests/gpu/test_gpu_copy_stream.py``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from . import environment


class Transfers(Protocol):
    """The device calls of copying batches to a device (see the module docstring). Streams have
    ``wait_event(event)``; events have ``record(stream)``, ``query()`` and ``synchronize()``, as CUDA's do."""

    name: str
    torch_pins: bool
    """Whether torch's own ``pin_memory`` allocates pinned memory here (what a batch collated outside the buffer
    pool is pinned with)."""

    def copy_stream(self, device: torch.device) -> Any:
        """The one long-lived side stream for copies to ``device`` (the same object at every call)."""

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A context in which copies and recorded events go to ``stream``."""

    def current_stream(self, device: torch.device) -> Any:
        """The stream work on ``device`` is queued on now (the training's)."""

    def event(self) -> Any:
        """A new event, not yet recorded."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (made on another stream) is used on ``stream``: its memory is not reused before the work
        queued there so far has run."""

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` copied to ``device`` on the current stream, without making the host wait for it."""

    def pinned(self, nbytes: int) -> torch.UntypedStorage:
        """``nbytes`` of pinned (page-locked) host memory."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of the host ``tensor`` in pinned memory."""


_copy_streams: dict[torch.device, Any] = {}
_copy_streams_lock = threading.Lock()


class CudaTransfers:
    """Copies to a CUDA device through ``torch.cuda``."""

    name = "CUDA"
    torch_pins = True

    def copy_stream(self, device: torch.device) -> Any:
        with _copy_streams_lock:
            stream = _copy_streams.get(device)
            if stream is None:
                stream = _copy_streams[device] = torch.cuda.Stream(device=device)
            return stream

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    def pinned(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()


class EmulatedFailure(RuntimeError):
    """What an emulated device call raises where a test asked it to fail."""


class EmulatedEvent:
    """An event of :class:`EmulatedTransfers`: complete once recorded, unless held. ``copies``: the copies queued
    on its stream before it was recorded (since the stream's previous event)."""

    def __init__(self, owner: EmulatedTransfers, held: bool):
        self.owner, self.held = owner, held
        self.stream: EmulatedStream | None = None
        self.copies: list[EmulatedCopy] = []

    def record(self, stream: EmulatedStream) -> None:
        self.owner.call("record")
        with self.owner.lock:
            self.stream, self.copies, stream.queued = stream, stream.queued, []

    def query(self) -> bool:
        self.owner.call("query")
        with self.owner.lock:
            return self.stream is not None and not self.held

    def synchronize(self) -> None:
        """The host waits until the event is reached: a held event is then complete."""
        self.owner.call("synchronize")
        with self.owner.lock:
            self.held = False


class EmulatedCopy:
    """One emulated copy: the address of the host memory it read and the tensor it made."""

    def __init__(self, source: int, made: torch.Tensor):
        self.source = source
        self.made = weakref.ref(made)


class EmulatedStream:
    """A stream of :class:`EmulatedTransfers`: what was queued on it, waited on by it and used on it."""

    def __init__(self, name: str, owner: EmulatedTransfers):
        self.name, self.owner = name, owner
        self.queued: list[EmulatedCopy] = []  # copies since the last event recorded here
        self.waited: list[EmulatedEvent] = []
        self.used: list[weakref.ref[torch.Tensor]] = []  # tensors given ``record_stream`` on this stream

    def wait_event(self, event: EmulatedEvent) -> None:
        """Wait for ``event``; one never recorded is refused (CUDA would not wait at all: a silent race)."""
        self.owner.call("wait_event")
        with self.owner.lock:
            if event.stream is None:
                raise RuntimeError("waiting on an event that was never recorded: the wait does nothing")
            self.waited.append(event)

    def uses(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was given ``record_stream`` on this stream."""
        return any(r() is tensor for r in self.used)

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name!r})"


class EmulatedTransfers:
    """The CPU standing in for a CUDA device's copies (see the module docstring).

    ``fail``: device calls that raise :class:`EmulatedFailure` from their n-th call on (``{"copy": 3}``: the third
    copy and every later one), by name: ``copy_stream``, ``copy``, ``event``, ``record``, ``query``,
    ``synchronize``, ``wait_event``, ``record_stream``, ``pinned``, ``pin``. ``torch_pins``: what the CUDA
    implementation says (False: the CPU has no pinned memory of torch's)."""

    name = "emulated"

    def __init__(self, fail: Mapping[str, int] | None = None, torch_pins: bool = False):
        self.fail = dict(fail or {})
        self.torch_pins = torch_pins
        self.lock = threading.RLock()
        self.calls: dict[str, int] = {}
        self.copy_streams: dict[torch.device, EmulatedStream] = {}
        self.streams: dict[torch.device, EmulatedStream] = {}  # the current (training) stream of each device
        self.events: list[EmulatedEvent] = []
        self.copies: list[EmulatedCopy] = []
        self.pins = 0
        """Pinned allocations made (``pinned`` and ``pin``)."""
        self.pinned_bytes = 0
        self.pinned_addresses: set[int] = set()
        self.holding = False
        self._current = threading.local()

    def call(self, name: str) -> None:
        """Count a call of the device operation ``name``; raise if the test asked it to fail from here on."""
        with self.lock:
            n = self.calls[name] = self.calls.get(name, 0) + 1
            at = self.fail.get(name)
        if at is not None and n >= at:
            raise EmulatedFailure(f"CUDA error: emulated failure of {name} (call {n})")

    def hold(self) -> None:
        """Events made from now on stay incomplete until :meth:`release` (a copy the device has not run yet)."""
        with self.lock:
            self.holding = True

    def release(self) -> None:
        """Every event complete again, and those made from now on complete once recorded."""
        with self.lock:
            self.holding = False
            for e in self.events:
                e.held = False

    def copy_stream(self, device: torch.device) -> EmulatedStream:
        self.call("copy_stream")
        with self.lock:
            stream = self.copy_streams.get(device)
            if stream is None:
                stream = self.copy_streams[device] = EmulatedStream(f"copy {device}", self)
            return stream

    @contextlib.contextmanager
    def using(self, stream: EmulatedStream) -> Iterator[EmulatedStream]:
        saved = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            self._current.stream = saved

    def current_stream(self, device: torch.device) -> EmulatedStream:
        current = getattr(self._current, "stream", None)
        if current is not None:
            return current
        with self.lock:
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = EmulatedStream(f"default {device}", self)
            return stream

    def event(self) -> EmulatedEvent:
        self.call("event")
        with self.lock:
            event = EmulatedEvent(self, self.holding)
            self.events.append(event)
            return event

    def record_stream(self, tensor: torch.Tensor, stream: EmulatedStream) -> None:
        self.call("record_stream")
        with self.lock:
            stream.used.append(weakref.ref(tensor))

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.call("copy")
        made = tensor.clone()
        record = EmulatedCopy(tensor.untyped_storage().data_ptr(), made)
        stream = self.current_stream(device)
        with self.lock:
            self.copies.append(record)
            stream.queued.append(record)
        return made

    def pinned(self, nbytes: int) -> torch.UntypedStorage:
        self.call("pinned")
        storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        self._count(storage.data_ptr(), nbytes)
        return storage

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        self.call("pin")
        out = tensor.clone()
        self._count(out.untyped_storage().data_ptr(), out.untyped_storage().nbytes())
        return out

    def _count(self, address: int, nbytes: int) -> None:
        with self.lock:
            self.pins += 1
            self.pinned_bytes += nbytes
            self.pinned_addresses.add(address)


def for_device(device: torch.device | None) -> Transfers | None:
    """How batches reach ``device``: through ``torch.cuda`` on a CUDA device, through the emulation on the CPU when
    ``environment.emulated_device()`` (``STREAMING_CACHE_EMULATE_DEVICE=1``), else None (a plain ``to``)."""
    if device is None:
        return None
    if device.type == "cuda":
        return CudaTransfers()
    if device.type == "cpu" and environment.emulated_device():
        return EmulatedTransfers()
    return None
