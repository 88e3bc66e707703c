"""Loader benchmark: does the training step ever wait on data?

A training-like loop takes a batch and runs a compute step. It is timed three ways in one run:

* compute alone (batches taken from memory): the floor;
* sequential: load the batch, then compute (what a loop without prefetch does);
* prefetch: :class:`BatchLoader` with background workers.

Storage is throttled to a set bandwidth (one shared device: reads are serialised, as on one disk) so the two
regimes can be shown on any machine: storage faster than compute (prefetch should hide it completely) and
slower (the step is bound by storage; prefetch overlaps what it can). On the CPU the compute step is a sleep,
standing for a GPU step during which the CPU thread only waits. With CUDA, a second part runs real matmuls and
compares the host-to-device copy on the loader's dedicated copy stream with the same copy on the default stream.
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

from ..dataset import DatasetHandle
from ..loader import BatchLoader
from ..writer import CacheWriter
from . import benchmark_main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=256, help="samples in the synthetic dataset")
    p.add_argument("--entry-kib", type=int, default=256, help="size of one sample's latent in KiB")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=48, help="steps timed per configuration")
    p.add_argument("--compute-ms", type=float, default=20.0, help="simulated compute per step")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)


class ThrottledHandle:
    """A dataset handle whose batch reads take at least their bytes / ``bandwidth`` seconds, one read at a time
    (a slow disk): ``collate`` is what the loader's workers call, so every batch pays it."""

    def __init__(self, handle: DatasetHandle, bandwidth: float):
        self.handle, self.bandwidth = handle, bandwidth
        self.lock = threading.Lock()
        self.row_bytes = handle[0].nbytes if len(handle) else 0

    def collate(self, indices: Sequence[int], pin: bool = False) -> Any:
        with self.lock:
            started = time.perf_counter()
            batch = self.handle.collate(indices, pin)
            left = len(indices) * self.row_bytes / self.bandwidth - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)
        return batch

    def __len__(self) -> int:
        return len(self.handle)

    def __getitem__(self, item: Any) -> Any:
        return self.handle[item]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


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


def _cpu_part(handle: DatasetHandle, args: argparse.Namespace, out: Callable[..., None]) -> dict[str, Any]:
    batch_bytes = handle[0].nbytes * args.batch_size
    compute_s = args.compute_ms / 1000

    def compute(_: Any) -> None:
        time.sleep(compute_s)

    results: dict[str, Any] = {}
    speeds = (("storage faster than compute", compute_s / 4), ("storage slower than compute", compute_s * 2))
    for label, load_s in speeds:
        bandwidth = batch_bytes / load_s
        row: dict[str, Any] = {"storage_MBps": bandwidth / 1e6, "load_ms_per_batch": load_s * 1000}
        with BatchLoader(handle, args.batch_size, workers=0, seed=1) as warm:
            cached = [next(iter(warm))] * 4
        row["compute_only"] = _loop(itertools.repeat(cached[0]).__next__, args.steps, compute)
        slow = ThrottledHandle(handle, bandwidth)
        loader = BatchLoader(slow, args.batch_size, workers=0, seed=1, repeats=8)  # type: ignore[arg-type]
        it = iter(loader)
        row["sequential"] = _loop(it.__next__, args.steps, compute)
        loader.close()
        loader = BatchLoader(slow, args.batch_size, workers=args.workers,  # type: ignore[arg-type]
                             prefetch=args.prefetch, seed=1, repeats=8)
        it = iter(loader)
        next(it)  # pipeline fill, as in training where the first step also pays it
        row["prefetch"] = _loop(it.__next__, args.steps, compute)
        loader.close()
        floor = row["compute_only"]["step_ms"]
        for k in ("sequential", "prefetch"):
            row[k]["vs_compute_only"] = row[k]["step_ms"] / floor
        results[label] = row
        out(f"\n{label}: storage {row['storage_MBps']:.0f} MB/s ({row['load_ms_per_batch']:.1f} ms per batch), "
            f"compute {args.compute_ms:.1f} ms per step")
        out(f"  {'':<14}{'step ms':>10}{'x compute':>11}{'data-wait':>11}")
        for k in ("compute_only", "sequential", "prefetch"):
            r = row[k]
            out(f"  {k:<14}{r['step_ms']:>10.2f}{r['step_ms'] / floor:>11.3f}{r['wait_share']:>10.1%}")
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
        fast = results["cpu"]["storage faster than compute"]["prefetch"]
        out(f"\ntarget: data-wait <= 2% when storage keeps up -> {fast['wait_share']:.2%} "
            f"{'PASS' if fast['wait_share'] <= 0.02 else 'MISS'}")
        if results["gpu"]:
            ratio = results["gpu"]["copy_stream"]["vs_compute_only"]
            out(f"target: GPU step <= 1.03x compute-only -> {ratio:.3f}x {'PASS' if ratio <= 1.03 else 'MISS'}")
        return results
    finally:
        if not args.path:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main("bench-loader", add_arguments, run, argv)
