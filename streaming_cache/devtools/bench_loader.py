"""Loader benchmark: does the training step ever wait on data, on fast storage and on slow?

Measured in one run, each figure against a baseline of the same run:

* **fast storage** (the page cache): ``reader.collate`` of the loader's batches in a loop, and the
  ``BatchLoader`` with worker threads draining the same batches: the loader's share of collate's throughput;
* **slow storage**, modelled at the reads: every read waits ``--latency-ms`` (in parallel with other reads, as a
  network drive or a disk's queue allows) and all reads share ``--storage-mbps`` of bandwidth (one device). The
  storage's own sequential bandwidth is measured through the same model (8 MiB requests, one at a time); the
  loader draining batches is its share of that; a training loop whose compute per step equals the storage time
  of a batch is timed against the compute alone (sequential load-then-compute, and the loader with prefetch).

On the CPU the compute step is a sleep, standing for a GPU step during which the CPU thread only waits. With
CUDA, a second part runs real matmuls and compares the host-to-device copy on the loader's dedicated copy stream
with the same copy on the default stream.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import reader as reader_module
from ..dataset import DatasetHandle
from ..loader import BatchLoader, _tensors
from ..reader import CacheReader
from ..writer import CacheWriter
from . import benchmark_main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=256, help="samples in the synthetic dataset")
    p.add_argument("--entry-kib", type=int, default=256, help="size of one sample's latent in KiB")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=48, help="steps timed per configuration")
    p.add_argument("--compute-ms", type=float, default=20.0, help="simulated compute per step (CUDA part)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=5.0, help="slow storage: latency of every read")
    p.add_argument("--storage-mbps", type=float, default=200.0, help="slow storage: bandwidth shared by all reads")


class SlowStorage:
    """A storage model at the reader's reads (``reader._pread``): each read waits ``latency`` seconds, in parallel
    with other reads, and then its bytes at ``bandwidth`` bytes/s, one read's bytes after another's (one device).
    While active, every tensor is read explicitly, as the reader does once it has seen slow reads."""

    def __init__(self, latency: float, bandwidth: float):
        self.latency, self.bandwidth = latency, bandwidth
        self.lock = threading.Lock()
        self.free_at = 0.0

    def pread(self, fd: int, dst: memoryview, offset: int) -> int:
        time.sleep(self.latency)
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + len(dst) / self.bandwidth
            done = self.free_at
        left = done - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return os.preadv(fd, [dst], offset)

    def __enter__(self) -> SlowStorage:
        self.saved = reader_module._pread, reader_module.PREAD_MIN_BYTES
        reader_module._pread, reader_module.PREAD_MIN_BYTES = self.pread, 0
        return self

    def __exit__(self, *exc: Any) -> None:
        reader_module._pread, reader_module.PREAD_MIN_BYTES = self.saved

    def sequential(self, paths: list[str], chunk: int = 8 << 20) -> float:
        """The storage's own sequential read bandwidth: the files in ``chunk``-byte requests, one at a time."""
        buf = bytearray(chunk)
        total, started = 0, time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = 0
                while got := self.pread(fd, memoryview(buf), offset):
                    total += got
                    offset += got
            finally:
                os.close(fd)
        return total / (time.perf_counter() - started)


def _make_dataset(path: str, rows: int, entry_kib: int) -> DatasetHandle:
    side = int((entry_kib * 1024 / 4 / 4) ** 0.5)
    with CacheWriter(path) as w:
        for i in range(rows):
            g = torch.Generator().manual_seed(i)
            w.put(f"s{i:05d}", {"samples": torch.randn(4, side, side, generator=g)})
    return DatasetHandle.from_cache(path)


def _loop(next_batch: Callable[[], Any], steps: int, compute: Callable[[Any], None]) -> dict[str, float]:
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        a = time.perf_counter()
        batch = next_batch()
        wait += time.perf_counter() - a
        compute(batch)
    total = time.perf_counter() - t0
    return {"step_ms": 1000 * total / steps, "wait_share": wait / total}


def _drain(loader: BatchLoader, batches: int) -> float:
    """Bytes per second the loader hands out over ``batches`` batches (after the first, which fills the pipe)."""
    it = iter(loader)
    first = next(it)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(first))
    started = time.perf_counter()
    for _ in range(batches):
        next(it)
    return nbytes * batches / (time.perf_counter() - started)


def _cpu_part(handle: DatasetHandle, args: argparse.Namespace, out: Callable[..., None]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    reader = CacheReader(handle.caches[0])
    order = BatchLoader(handle, args.batch_size, seed=1, workers=0, repeats=8).sampler.epoch_batches(0)
    batch_bytes = handle[0].nbytes * args.batch_size
    started = time.perf_counter()
    for rows in order[:args.steps]:
        reader.collate(rows.tolist())
    collate_bps = batch_bytes * args.steps / (time.perf_counter() - started)
    loader_bps = _drain(BatchLoader(handle, args.batch_size, seed=1, workers=args.workers, prefetch=args.prefetch,
                                    repeats=8), args.steps)
    results["fast"] = {"collate_MBps": collate_bps / 1e6, "loader_MBps": loader_bps / 1e6,
                       "loader_vs_collate": loader_bps / collate_bps}
    out(f"fast storage (page cache): reader.collate {collate_bps / 1e6:.0f} MB/s, BatchLoader ({args.workers} workers) "
        f"{loader_bps / 1e6:.0f} MB/s = {loader_bps / collate_bps:.2f}x collate")

    shards = [os.path.join(handle.caches[0], "shards", n) for n in sorted(os.listdir(os.path.join(
        handle.caches[0], "shards"))) if n.endswith(".safetensors")]
    storage = SlowStorage(args.latency_ms / 1000, args.storage_mbps * 1e6)
    with storage:
        seq = storage.sequential(shards)
        drained = _drain(BatchLoader(handle, args.batch_size, seed=1, workers=args.workers, prefetch=args.prefetch,
                                     repeats=8), args.steps)
        per_batch = batch_bytes / seq
        compute = lambda _batch: time.sleep(per_batch)  # noqa: E731
        alone = _loop(itertools.repeat(None).__next__, args.steps, compute)
        plain = BatchLoader(handle, args.batch_size, seed=1, workers=0, repeats=8)
        sequential = _loop(iter(plain).__next__, args.steps, compute)
        loader = BatchLoader(handle, args.batch_size, seed=1, workers=args.workers, prefetch=args.prefetch, repeats=8)
        it = iter(loader)
        next(it)  # pipeline fill, as in training where the first step also pays it
        prefetch = _loop(it.__next__, args.steps, compute)
        loader.close()
    slow = {"latency_ms": args.latency_ms, "storage_MBps": args.storage_mbps, "sequential_MBps": seq / 1e6,
            "loader_MBps": drained / 1e6, "loader_vs_sequential": drained / seq,
            "compute_ms": per_batch * 1000, "compute_only": alone, "sequential": sequential, "prefetch": prefetch}
    for k in ("sequential", "prefetch"):
        slow[k]["vs_compute_only"] = slow[k]["step_ms"] / alone["step_ms"]
    results["slow"] = slow
    out(f"\nslow storage ({args.latency_ms:g} ms per read, {args.storage_mbps:g} MB/s shared): sequential read "
        f"{seq / 1e6:.0f} MB/s; BatchLoader {drained / 1e6:.0f} MB/s = {drained / seq:.2f}x the storage's sequential "
        "bandwidth")
    out(f"  training loop, compute {per_batch * 1000:.1f} ms per step (the storage time of a batch):")
    out(f"  {'':<14}{'step ms':>10}{'x compute':>11}{'data-wait':>11}")
    for k, r in (("compute_only", alone), ("sequential", sequential), ("prefetch", prefetch)):
        out(f"  {k:<14}{r['step_ms']:>10.2f}{r['step_ms'] / alone['step_ms']:>11.3f}{r['wait_share']:>10.1%}")
    return results


def _gpu_part(handle: DatasetHandle, args: argparse.Namespace, out: Callable[..., None]) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # warm-up: cuBLAS handle, kernel selection, clocks
        a @ a
    torch.cuda.synchronize()
    # Calibrate a matmul count that takes about compute-ms on this GPU.
    t = time.perf_counter()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 50
    reps = max(1, int(args.compute_ms / 1000 / per))

    def compute(batch: Any) -> None:
        x = a
        for _ in range(reps):
            x = a @ a
        (x.sum() + batch["samples"].float().sum()).item()  # the step uses the batch and syncs, like a loss

    results: dict[str, Any] = {"matmuls_per_step": reps}
    resident = next(iter(BatchLoader(handle, args.batch_size, workers=0, device=device)))
    compute(resident)
    results["compute_only"] = _loop(lambda: resident, args.steps, compute)
    with BatchLoader(handle, args.batch_size, workers=args.workers, prefetch=args.prefetch, device=device,
                     repeats=8) as loader:
        it = iter(loader)
        next(it)
        results["copy_stream"] = _loop(lambda: next(it), args.steps, compute)
    with BatchLoader(handle, args.batch_size, workers=args.workers, prefetch=args.prefetch, pin_memory=True,
                     repeats=8) as loader:
        it = iter(loader)
        next(it)

        def default_stream_batch() -> Any:
            b = next(it)
            return {"samples": b["samples"].to(device, non_blocking=True)}

        results["default_stream"] = _loop(default_stream_batch, args.steps, compute)
    floor = results["compute_only"]["step_ms"]
    out(f"\nGPU ({torch.cuda.get_device_name(device)}): {reps} bf16 {n}x{n} matmuls per step")
    for k in ("compute_only", "copy_stream", "default_stream"):
        r = results[k]
        r["vs_compute_only"] = r["step_ms"] / floor
        out(f"  {k:<15}{r['step_ms']:>10.2f} ms{r['vs_compute_only']:>9.3f}x{r['wait_share']:>10.1%} data-wait")
    return results


def run(args: argparse.Namespace, out: Callable[..., None] = print) -> dict[str, Any]:
    workdir = args.path or tempfile.mkdtemp(prefix="streaming-cache-bench-loader-")
    path = os.path.join(workdir, "loader-cache")
    try:
        if os.path.exists(path):
            shutil.rmtree(path)
        handle = _make_dataset(path, args.rows, args.entry_kib)
        out(f"dataset: {len(handle)} rows of {handle[0].nbytes / 1024:.0f} KiB, batch {args.batch_size}, "
            f"{args.workers} workers, prefetch {args.prefetch}, {os.cpu_count()} CPUs")
        results: dict[str, Any] = {"cpu": _cpu_part(handle, args, out)}
        if torch.cuda.is_available():
            results["gpu"] = _gpu_part(handle, args, out)
        else:
            out("\nGPU part skipped: no CUDA device")
            results["gpu"] = None
        cpu = results["cpu"]
        checks = [("BatchLoader >= 0.9x reader.collate (page cache)", cpu["fast"]["loader_vs_collate"], 0.9, True),
                  ("slow storage: BatchLoader >= 0.8x sequential bandwidth", cpu["slow"]["loader_vs_sequential"],
                   0.8, True),
                  ("slow storage: step <= 1.1x compute alone", cpu["slow"]["prefetch"]["vs_compute_only"], 1.1,
                   False)]
        if results["gpu"]:
            checks.append(("GPU step <= 1.03x compute-only", results["gpu"]["copy_stream"]["vs_compute_only"], 1.03,
                           False))
        out("\ntargets")
        for label, value, bound, above in checks:
            ok = value >= bound if above else value <= bound
            out(f"  {label:<56}{value:>7.3f}x  {'PASS' if ok else 'MISS'}")
        results["targets"] = [{"target": t, "value": v, "pass": (v >= b) if a else (v <= b)}
                              for t, v, b, a in checks]
        return results
    finally:
        if not args.path:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main("bench-loader", add_arguments, run, argv)
