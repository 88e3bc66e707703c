"""Scale benchmark: how a cache of 10 thousand to 10 million entries writes, opens, plans an epoch and serves.

For each size it writes a cache (``put_many`` of small tensors, or ``put`` of SDXL-shaped rows), then measures in
fresh processes, so each figure starts from nothing as a new training run does:

* **first batch**: from ``open_cache`` to the first batch of ``BatchLoader(handle, batch_size, workers=2)``:
  opening, the handle, the epoch's plan (signatures, buckets, shuffle) and the first read;
* **memory**: resident anonymous memory grown by then, per entry (the index and the shards are file mappings the
  kernel can drop, not counted);
* **steady state**: entries per second over ``--batches`` batches, after the first 100 (which open the shards);
* **a random entry**: ``handle[i].materialize()`` of random rows in a fresh process, its shards touched for the
  first time (cold) and again (warm); **a shard's first touch**: opening each shard for the first time;
* **2 ranks**: the same, two processes at once, each planning its own part (``rank``/``world_size``), with the
  rows of its plan;
* **baseline**, measured in the same run up to ``--baseline-max`` entries: the epoch's signatures computed entry by
  entry (what earlier releases did), against the plan from the index tables.

The goals of the 10-million-entry work are printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ..dataset import DatasetHandle
from ..loader import BatchLoader
from ..reader import CacheReader, open_cache
from ..writer import CacheWriter
from . import benchmark_main

GOALS = {"first_batch_s": 2.0, "bytes_per_entry": 100.0, "random_cold_us": 50.0, "shard_touch_ms": 10.0,
         "write_per_s": 100_000.0}
WARMUP_BATCHES = 100  # batches read before the steady state is timed
SDXL_DISTINCT = 1024  # distinct latents and conditionings the SDXL rows are made of (the disk holds no more)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="10k,100k,1M,10M", help="entries per cache, e.g. 10k,1M (default %(default)s)")
    p.add_argument("--row", choices=("small", "sdxl"), default="small",
                   help="small: one float32 tensor of 1x4x4x4; sdxl: a latent 1x4x128x128 fp16 with a conditioning "
                        f"1x77x2048 and pooled 1x1280, of {SDXL_DISTINCT} distinct values each")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default %(default)s)")
    p.add_argument("--batches", type=int, default=200, help="batches timed after the first (default %(default)s)")
    p.add_argument("--random", type=int, default=1000, help="random entries materialized (default %(default)s)")
    p.add_argument("--baseline-max", type=int, default=100_000,
                   help="largest size whose per-entry baseline is timed (default %(default)s)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)


def _count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _anon_bytes() -> int:
    """Resident anonymous memory of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------------------------ writing
def _write_small(path: str, n: int) -> float:
    """Entries per second of ``put_many`` of ``n`` distinct 1x4x4x4 float32 tensors (the commit included)."""
    chunk = 65_536
    started = time.perf_counter()
    with CacheWriter(path) as w:
        for lo in range(0, n, chunk):
            count = min(chunk, n - lo)
            values = torch.zeros(count, 1, 4, 4, 4)
            values.view(count, -1)[:, 0] = torch.arange(lo, lo + count, dtype=torch.float32)
            w.put_many([f"k{i:09d}" for i in range(lo, lo + count)], values)
    return n / (time.perf_counter() - started)


def _write_sdxl(path: str, n: int) -> float:
    """Entries per second of ``put`` of ``n`` SDXL rows (latent and conditioning as a training cache holds them)."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(SDXL_DISTINCT, 1, 4, 128, 128, generator=g).half()
    conds = torch.randn(SDXL_DISTINCT, 1, 77, 2048, generator=g).half()
    pooled = torch.randn(SDXL_DISTINCT, 1, 1280, generator=g).half()
    started = time.perf_counter()
    with CacheWriter(path) as w:
        for i in range(n):
            a, b = i % SDXL_DISTINCT, (i * 7 + i // SDXL_DISTINCT) % SDXL_DISTINCT
            w.put(f"k{i:09d}", {"samples": latents[a], "cond": [[conds[b], {"pooled_output": pooled[b]}]]})
    return n / (time.perf_counter() - started)


def _shard_headers(path: str) -> tuple[int, int]:
    """(shards, the longest header in bytes)."""
    folder = os.path.join(path, "shards")
    longest = 0
    names = os.listdir(folder)
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            longest = max(longest, int.from_bytes(f.read(8), "little"))
    return len(names), longest


# ------------------------------------------------------------------------------------------------ reading
def _first_batch(path: str, batch_size: int, batches: int, rank: int, world_size: int) -> dict[str, Any]:
    """In a fresh process: open, plan and read the first batch; memory; steady state."""
    base = _anon_bytes()
    started = time.perf_counter()
    reader = open_cache(path)
    handle = DatasetHandle.from_reader(reader)
    loader = BatchLoader(handle, batch_size, workers=2, rank=rank, world_size=world_size)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - started
    grown = _anon_bytes() - base
    epoch = loader._active
    plan_rows = epoch.batches.rows_held() if epoch is not None else 0  # type: ignore[attr-defined]
    for _ in range(WARMUP_BATCHES):  # by then each shard has been opened once
        next(it, None)
    started = time.perf_counter()
    served = 0
    for _ in range(batches):
        batch = next(it, None)
        if batch is None:
            break
        served += len(batch)
    steady = served / max(time.perf_counter() - started, 1e-9)
    loader.close()
    return {"first_batch_s": first, "bytes_per_entry": grown / len(reader), "steady_per_s": steady,
            "plan_rows": plan_rows, "rows": len(reader)}


def _random_entries(path: str, count: int) -> dict[str, Any]:
    """In a fresh process: random rows materialized cold and warm, and each shard's first touch."""
    reader = open_cache(path)
    handle = DatasetHandle.from_reader(reader)
    picks = random.Random(0).sample(range(len(handle)), min(count, len(handle)))
    timings = []
    for _ in ("cold", "warm"):
        started = time.perf_counter()
        for i in picks:
            handle[i].materialize()
        timings.append((time.perf_counter() - started) / len(picks) * 1e6)
    fresh = CacheReader(path)
    started = time.perf_counter()
    fresh._by_shard()  # once per reader: which records each shard holds
    table_ms = (time.perf_counter() - started) * 1e3
    touches = []
    for sid in range(min(16, len(fresh.index.info.shards))):
        started = time.perf_counter()
        fresh._shard(sid)
        touches.append((time.perf_counter() - started) * 1e3)
    return {"random_cold_us": timings[0], "random_warm_us": timings[1], "shard_touch_ms": max(touches),
            "shard_touch_mean_ms": sum(touches) / len(touches), "shard_table_ms": table_ms}


def _per_entry_plan(path: str) -> dict[str, Any]:
    """In a fresh process: the epoch's signatures as earlier releases computed them, entry by entry, and the same
    from the index tables."""
    reader = open_cache(path)
    started = time.perf_counter()
    tables = DatasetHandle.from_reader(reader).signatures()
    fast = time.perf_counter() - started
    started = time.perf_counter()
    out = np.empty(len(reader), dtype=np.uint64)
    for i in range(len(reader)):
        found = reader.index_of(reader.key_at(i))
        assert found is not None
        info = reader.tensor_info(found)
        sig = xxhash.xxh3_64_intdigest(repr([(t.dtype, t.shape) for t in info]).encode())
        out[i] = xxhash.xxh3_64_intdigest(sig.to_bytes(8, "little"))
    slow = time.perf_counter() - started
    if out.tolist() != tables.tolist():
        raise AssertionError("the signatures from the index tables differ from the per-entry ones")
    return {"plan_tables_s": fast, "plan_per_entry_s": slow}


def _in_fresh_process(phase: str, path: str, args: argparse.Namespace, rank: int = 0,
                      world_size: int = 1) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "streaming_cache", "bench-scale", "--phase", phase, path,
           "--batch-size", str(args.batch_size), "--batches", str(args.batches), "--random", str(args.random),
           "--rank", str(rank), "--world-size", str(world_size)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"a measuring process failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _phase(args: argparse.Namespace) -> dict[str, Any]:
    if args.phase == "first":
        return _first_batch(args.path, args.batch_size, args.batches, args.rank, args.world_size)
    if args.phase == "random":
        return _random_entries(args.path, args.random)
    return _per_entry_plan(args.path)


def _mark(value: float, goal: str, lower: bool = True) -> str:
    ok = value <= GOALS[goal] if lower else value >= GOALS[goal]
    return "" if ok else " (goal missed)"


def run(args: argparse.Namespace, out: Any = print) -> dict[str, Any]:
    if args.phase:
        result = _phase(args)
        print(json.dumps(result))
        return result
    own = args.path is None
    root = args.path or tempfile.mkdtemp(prefix="streaming-cache-scale-")
    results: dict[str, Any] = {"row": args.row, "sizes": {}}
    try:
        for size in [_count(s) for s in args.sizes.split(",") if s.strip()]:
            path = os.path.join(root, f"{args.row}-{size}")
            shutil.rmtree(path, ignore_errors=True)
            write = (_write_small if args.row == "small" else _write_sdxl)(path, size)
            shards, longest = _shard_headers(path)
            one = _result(_in_fresh_process("first", path, args))
            rnd = _result(_in_fresh_process("random", path, args))
            ranks = [_in_fresh_process("first", path, args, rank, 2) for rank in range(2)]
            two = [_result(p) for p in ranks]
            row = {"write_per_s": write, "shards": shards, "longest_header": longest, **one, **rnd,
                   "ranks": two}
            if size <= args.baseline_max:
                row.update(_result(_in_fresh_process("baseline", path, args)))
            results["sizes"][size] = row
            out(f"{size:>10,} entries ({args.row}): write {write:,.0f}/s{_mark(write, 'write_per_s', False)}; "
                f"{shards} shards, longest header {longest / 1e6:.1f} MB")
            out(f"    first batch {one['first_batch_s']:.3f} s{_mark(one['first_batch_s'], 'first_batch_s')}, "
                f"{one['bytes_per_entry']:.0f} B/entry{_mark(one['bytes_per_entry'], 'bytes_per_entry')}, "
                f"steady {one['steady_per_s']:,.0f} entries/s")
            out(f"    random entry {rnd['random_cold_us']:.0f} us cold{_mark(rnd['random_cold_us'], 'random_cold_us')}"
                f", {rnd['random_warm_us']:.0f} us warm; shard first touch {rnd['shard_touch_ms']:.2f} ms at most"
                f"{_mark(rnd['shard_touch_ms'], 'shard_touch_ms')} ({rnd['shard_touch_mean_ms']:.2f} mean, after "
                f"{rnd['shard_table_ms']:.0f} ms once per reader to find each shard's records)")
            out("    2 ranks: " + "; ".join(
                f"rank {r}: first batch {t['first_batch_s']:.3f} s, {t['bytes_per_entry']:.0f} B/entry, plans "
                f"{t['plan_rows'] / max(t['rows'], 1):.0%} of the rows" for r, t in enumerate(two)))
            if "plan_per_entry_s" in row:
                ratio = row["plan_per_entry_s"] / max(row["plan_tables_s"], 1e-9)
                out(f"    baseline: signatures entry by entry {row['plan_per_entry_s']:.2f} s, from the index "
                    f"tables {row['plan_tables_s']:.3f} s ({ratio:,.0f}x faster)")
            if own:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    out("goals: first batch <= 2 s, <= 100 B/entry, a random entry <= 50 us, a shard's first touch <= 10 ms, "
        "write >= 100k entries/s")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main("bench-scale", add_arguments, run, argv)
