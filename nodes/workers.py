"""Train LoRA on several GPUs of this machine from the graph (its ``devices`` input), through torch.distributed.

This process (ComfyUI's) is rank 0: it trains on its own GPU and does everything a one-GPU training does (the
run's files, previews, progress, Cancel, the outputs). Ranks 1..N-1 are worker processes started with torch's
own process launcher (``torch.distributed.elastic.multiprocessing``, what torchrun uses), each on another GPU:
``scripts/train_worker.py`` boots ComfyUI there, loads the model from its file as its loader did (with the same
patches), and runs the same training as a rank other than 0. The processes meet on a ``TCPStore`` this process
hosts; the workers' output goes to ComfyUI's console.

Limits, said in the input's tooltip and docs/multi-gpu.md: the model must come from a loader that records its file
(ComfyUI 0.4+ Load Checkpoint / Load Diffusion Model); every worker loads its own copy, so the machine needs the
RAM and disk reads for N copies while they load.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from comfy_api.latest import io
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.group import collective_timeout, join, leave, worker_environments, worker_gpus
from ..streaming_cache.train.spec import TrainSpec
from .backend import compat
from .folders import temp_folder
from .training_run import train_lora
from .ui import log

PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(PACK_DIR, "scripts", "train_worker.py")
READY_POLL_S = 0.5


def worker_devices(devices: int) -> list[int | None]:
    """The GPU of each worker (this process keeps ComfyUI's own), or None each where ComfyUI runs on the CPU (the
    processes then share the CPU, as the tests do): :func:`~..streaming_cache.group.worker_gpus`."""
    return worker_gpus(devices, compat.device_index())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _failure(context: Any) -> str | None:
    """The first failed worker's error (rank and message), if one has failed."""
    result = context.wait(timeout=0)
    if result is None or not result.is_failed():
        return None
    local, failure = min(result.failures.items())
    tail = ""
    stderr = result.stderrs.get(local)
    if stderr and os.path.exists(stderr):
        with open(stderr, encoding="utf-8", errors="replace") as f:
            tail = "".join(f.readlines()[-15:])
    return f"rank {local + 1}: {failure.message}\n{tail}".strip()


def _wait_ready(store: dist.TCPStore, context: Any, workers: int) -> None:
    """Wait until every worker has loaded the model (or one failed, or Cancel was pressed)."""
    keys = [f"ready/{rank}" for rank in range(1, workers + 1)]
    deadline = time.monotonic() + collective_timeout().total_seconds()
    while True:
        failed = _failure(context)
        if failed:
            raise RuntimeError(f"a training worker failed while starting: {failed}")
        if compat.interrupt_requested():
            compat.check_interrupt()  # raises: an ordinary cancel, nothing trained yet
        try:
            store.wait(keys, timedelta(seconds=READY_POLL_S))
            return
        except (RuntimeError, dist.DistStoreError):  # not ready yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the training workers did not start within {collective_timeout()}") from None


def train_on_devices(node_id: str | None, model: Any, dataset: DatasetHandle, spec: TrainSpec, *, clip: Any = None,
                     vae: Any = None, validation_dataset: DatasetHandle | None = None,
                     notes: Sequence[str] = ()) -> io.NodeOutput:
    """:func:`~.training_run.train_lora` on ``spec.devices`` processes: this one (rank 0) and workers."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this ComfyUI; wait for it to finish")
    gpus = worker_devices(spec.devices)
    portable = compat.portable_model(model)
    work = tempfile.mkdtemp(prefix="streaming-cache-devices-", dir=temp_folder() if os.path.isdir(temp_folder())
                            else None)
    job = os.path.join(work, "job.pkl")
    with open(job, "wb") as f:  # two pickles: where ComfyUI is and its arguments, then what needs the pack loaded
        pickle.dump({"comfyui": compat.comfyui_dir(), "argv": sys.argv[1:]}, f)
        pickle.dump({"model": portable, "dataset": dataset, "validation_dataset": validation_dataset, "spec": spec},
                    f)
    port = _free_port()
    timeout = collective_timeout()
    store = dist.TCPStore("127.0.0.1", port, spec.devices, True, timeout, wait_for_workers=False)
    envs = worker_environments(gpus, port, timeout)
    log.info("training on %d devices: starting %d worker process(es)", spec.devices, len(gpus))
    context = start_processes(name="streaming-cache-train", entrypoint=sys.executable,
                              args={i: (WORKER, job) for i in envs}, envs=envs,
                              logs_specs=DefaultLogsSpecs(log_dir=os.path.join(work, "logs"), redirects=Std.ALL,
                                                          tee=Std.ALL))
    try:
        _wait_ready(store, context, len(gpus))
        if compat.device_index() is not None:
            torch.cuda.set_device(compat.device_index())
        hook = sys.excepthook
        join(store, 0, spec.devices)
        sys.excepthook = hook  # torch prefixes tracebacks with the rank; ComfyUI's own stay as they were
        finished = False
        try:
            result = train_lora(node_id, model, dataset, spec, clip=clip, vae=vae,
                                validation_dataset=validation_dataset, notes=notes)
            finished = True
            return result
        except Exception as exc:
            time.sleep(1.0)  # a worker that failed first is reported as the cause
            failed = _failure(context)
            if failed:
                raise RuntimeError(f"training on {spec.devices} devices failed on {failed}") from exc
            raise
        finally:
            leave(finished)
    finally:
        with contextlib.suppress(Exception):
            context.wait(timeout=30)
        context.close()
        del store
        shutil.rmtree(work, ignore_errors=True)
