"""The process group a job runs in (torch.distributed, launched by torchrun): which process this is, and the few
collectives the engine needs (sums, agreement, broadcast, barrier), each bounded by a timeout.

:func:`init_from_env` joins the group torchrun describes in the environment (NCCL on GPUs, gloo otherwise); the
launcher itself is torch's own (``torchrun``, or ``torch.distributed.run`` from Python). A collective waits at most
:func:`collective_timeout`, so a rank that died or hangs ends the job with an error rather than a hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import environment

log = logging.getLogger(__name__)

TIMEOUT_ENV = "STREAMING_CACHE_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0  # a preview or a validation on rank 0 keeps the others waiting that long at most


def collective_timeout() -> timedelta:
    """The timeout of every collective: ``$STREAMING_CACHE_COLLECTIVE_TIMEOUT`` seconds, default 30 minutes."""
    return timedelta(seconds=environment.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


@dataclass(frozen=True)
class Group:
    """The default process group as a training sees it: this process's ``rank`` among ``world_size``, and the
    collectives a training needs (on CPU tensors with gloo, on this rank's GPU with NCCL)."""

    rank: int
    world_size: int
    local_rank: int = 0

    @classmethod
    def current(cls) -> Group | None:
        """The running process group, or None when there is none or it has one process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and shows progress."""
        return self.rank == 0

    def device(self) -> torch.device:
        """Where this group's collectives take tensors: this rank's GPU with NCCL, else the CPU."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed element-wise over the ranks (float64)."""
        t = handed(torch.tensor(list(values), dtype=torch.float64, device=self.device()))
        dist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank (a picklable object; tensors are sent as they are). What a rank
        receives is made outside inference mode, even when called inside it (as ComfyUI runs nodes): a resume
        state sent to the other ranks is trained on and updated in place.

        The object travels as pickled bytes in tensors of the pack's own (:func:`handed`), not through
        ``broadcast_object_list``, whose internal tensors :func:`leave` could not wait for."""
        with torch.inference_mode(False):
            device = self.device()
            payload = _pickled(obj) if self.is_main else b""
            size = handed(torch.tensor([len(payload)], dtype=torch.int64, device=device))
            dist.broadcast(size, src=0)
            n = int(size.item())
            data = handed(_bytes_tensor(payload, device) if self.is_main else
                          torch.empty(n, dtype=torch.uint8, device=device))
            dist.broadcast(data, src=0)
            return obj if self.is_main else _unpickled(data, n)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, on every rank (made outside inference mode, as :meth:`broadcast`, and
        sent through the pack's own tensors the same way)."""
        with torch.inference_mode(False):
            device = self.device()
            payload = _pickled(obj)
            sizes = handed_all([torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size + 1)])
            sizes[-1].fill_(len(payload))
            dist.all_gather(sizes[:-1], sizes[-1])
            lengths = [int(n) for n in torch.cat(sizes[:-1]).tolist()]
            rows = handed_all([torch.zeros(max(lengths), dtype=torch.uint8, device=device)
                               for _ in range(self.world_size + 1)])
            rows[-1][:len(payload)] = _bytes_tensor(payload, device)
            dist.all_gather(rows[:-1], rows[-1])
            return [_unpickled(row, n) for row, n in zip(rows[:-1], lengths)]

    def barrier(self) -> None:
        """Wait until every rank is here (done as a sum: a barrier of its own has no timeout with NCCL)."""
        self.sum([0.0])


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _bytes_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    """``payload`` as a uint8 tensor on ``device``, over a copy of the bytes (the tensor keeps that copy alive)."""
    if not payload:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _unpickled(data: torch.Tensor, n: int) -> Any:
    """The object a rank of this job pickled into ``data``'s first ``n`` bytes (a peer's bytes, as with torch's
    own object collectives, never a file's)."""
    return pickle.loads(data[:n].cpu().numpy().tobytes())


def join(store: dist.Store, rank: int, world_size: int) -> Group:
    """Join the process group whose ranks meet on ``store`` (a ``TCPStore`` one of them hosts), as ``rank`` of
    ``world_size``, with NCCL on GPUs and gloo otherwise, and the collective timeout. Each process must already
    use its own GPU (``torch.cuda.set_device``)."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=collective_timeout())
    _register_leave_at_exit()
    group = Group.current()
    assert group is not None
    return group


RELEASE_WAIT_S = 10.0
"""How long :func:`leave` waits for the collectives' worker threads to let go of the tensors they were handed."""

_handed: list[tuple[torch.Tensor, int]] = []


def handed(t: torch.Tensor) -> torch.Tensor:
    """``t``, about to be handed to a collective, kept here until the backend's threads have let go of it.

    A gloo worker thread drops a collective's tensors after the caller has been told the work is done. When the
    caller's own reference is gone by then, the thread frees the Python side of the tensor and needs the GIL for it;
    a process group destroyed at that moment (its destructor waits for the thread, and holds the GIL on older
    PyTorch, 2.5 for one) never ends. Kept here, the caller's reference outlives the thread's, and :func:`leave`
    waits until the threads have let go of all of them. Tensors let go of are dropped at each call, so the list
    holds the few collectives still in flight."""
    return handed_all([t])[0]


def handed_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`handed` for the tensors of one collective together (its outputs and its input): handed one by one,
    each hand would drop the ones before it, which the collective does not hold yet."""
    _drop_released()
    _handed.extend((t, _references(t)) for t in tensors)
    return tensors


def _drop_released() -> None:
    _handed[:] = [(kept, refs) for kept, refs in _handed if _references(kept) > refs]


def _references(t: torch.Tensor) -> int:
    """How many references the tensor's C++ object has: the Python side holds one, a collective's worker thread
    others until it lets go."""
    return int(t._use_count())  # type: ignore[attr-defined]


def _await_release(timeout_s: float) -> bool:
    """Wait, with the GIL released, until the backend's threads have let go of every tensor :func:`handed` kept;
    False when some are still held after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        _drop_released()
        if not _handed:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def leave(finished: bool) -> None:
    """Leave the process group this process joined (destroy it), once the backend's threads have let go of what
    the collectives handed them (see :func:`handed`). When this rank finished its work the ranks meet in one last
    collective first, so that no earlier collective is still in flight. After a failure they do not meet, since the
    rank that failed may never come; the group is destroyed either way."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        group = Group.current()
        if finished and group is not None:
            group.barrier()
        if not _await_release(RELEASE_WAIT_S):
            log.warning("a collective's worker thread still holds its tensors after %.0f s; leaving the process "
                        "group anyway (older PyTorch can hang here)", RELEASE_WAIT_S)
    finally:
        dist.destroy_process_group()


_exit_registered = False


def _register_leave_at_exit() -> None:
    """Make sure the group is left before the interpreter shuts down, however the process ends.

    A process that exits with a collective's tensors still held by a gloo worker thread aborts
    ("terminate called without an active exception", SIGABRT) after its work is done: the thread lets go of a
    tensor once Python is finalizing, asks for the GIL to free its Python side, and Python ends a thread that asks
    then, which C++ turns into ``std::terminate``. :func:`leave` in a ``finally`` covers the pack's own processes;
    this covers any other way out (an uncaught error before the ``try``, ``sys.exit`` in a caller, code that joined
    and never left). ``atexit`` handlers run while the interpreter is whole; after a :func:`leave` this one does
    nothing."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(leave, finished=False)
        _exit_registered = True


def local_device(local_rank: int) -> int | None:
    """The GPU a process with this ``LOCAL_RANK`` uses: the ``local_rank``-th of the GPUs it sees, counted round
    (``cuda:0`` when each process sees only its own), or None on a machine without CUDA."""
    if not torch.cuda.is_available():
        return None
    return local_rank % torch.cuda.device_count()


def use_local_device(environ: Mapping[str, str] = os.environ) -> int | None:
    """Make this process's GPU (:func:`local_device` of ``$LOCAL_RANK``, 0 when unset) its current CUDA device,
    before anything else takes the current device as its own (ComfyUI does, at start); the GPU, or None without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    index = local_device(int(environ.get("LOCAL_RANK", "0")))
    if index is not None:
        torch.cuda.set_device(index)
    return index


def worker_gpus(devices: int, mine: int | None) -> list[int | None]:
    """The GPU of each of the ``devices - 1`` worker processes of a training led by a process on GPU ``mine``
    (None: it runs on the CPU, and so do the workers, None each): the other GPUs this process sees, in order.
    A ``ValueError`` that says what to change when there are too few."""
    if mine is None:
        return [None] * (devices - 1)
    visible = torch.cuda.device_count()
    others = [i for i in range(visible) if i != mine]
    if len(others) < devices - 1:
        raise ValueError(f"devices is {devices} but this machine has {visible} GPU(s) visible to ComfyUI; lower "
                         "devices (or start ComfyUI without --cuda-device)")
    return list(others[:devices - 1])


def worker_environments(gpus: Sequence[int | None], port: int, timeout: timedelta) -> dict[int, dict[str, str]]:
    """The environment torch's process launcher gives each worker of :func:`worker_gpus` (by position): rank
    1.. of ``len(gpus) + 1``, meeting on ``127.0.0.1:port``, with the collective ``timeout``. Its ``LOCAL_RANK``
    is its GPU's index (the workers see the GPUs this process sees, so :func:`use_local_device` selects that GPU),
    or its position without CUDA."""
    world = str(len(gpus) + 1)
    return {i: {"RANK": str(i + 1), "WORLD_SIZE": world, "LOCAL_RANK": str(gpu if gpu is not None else i),
                "LOCAL_WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                TIMEOUT_ENV: str(timeout.total_seconds())}
            for i, gpu in enumerate(gpus)}


def init_from_env() -> Group | None:
    """Join the process group torchrun describes in the environment (``WORLD_SIZE`` > 1, ``RANK``,
    ``MASTER_ADDR``...), with NCCL on GPUs and gloo otherwise, and the collective timeout; None for one process.
    Each rank uses its ``LOCAL_RANK``-th GPU (:func:`use_local_device`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not dist.is_available():
        return None
    if not dist.is_initialized():
        cuda = use_local_device() is not None
        dist.init_process_group("nccl" if cuda else "gloo", timeout=collective_timeout())
        _register_leave_at_exit()
    return Group.current()
