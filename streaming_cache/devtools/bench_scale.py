"""Scale benchmark: how a cache of 10 thousand to 10 million entries writes, opens, plans an epoch and serves, on
the path a training takes.

For each size it writes a cache the way most scripts and ``build`` do (a plain loop of ``CacheWriter.put``, one
commit), times ``put_many`` of the same entries into a second cache (then removed), and measures in fresh
processes, so each figure starts from nothing as a new training run does:

* **writing**: entries per second of each, the commit included, beside a raw write of the same bytes (one
  ``write`` a tensor into one file) measured in the same run;
* **first batch**: from ``open_cache`` to the first batch of the loader as Train LoRA makes it
  (``BatchLoader(handle, batch_size, seed=0, workers=2, prefetch=2, shares=True)``): opening, the handle, the
  epoch's plan (signatures, buckets, shuffle) and the first read;
* **memory**: the whole process's resident memory grown since before the open, per entry, as its anonymous part
  (``RssAnon``: what the reader, the handle, the plan and the loader keep) and the pages of mapped files
  (``RssFile``: the index and the shards, which the kernel can drop), after the open, the first batch, the
  batches and 1,000 random ``materialize()`` calls; and the bytes of the arrays the loader keeps for its rows;
* **steady state**: entries per second over ``--batches`` batches after the first 100, beside raw reads of the
  same rows' bytes (``np.frombuffer`` of each shard's mapping, stacked per batch) in the same process;
* **a random entry**: ``handle[i].materialize()`` of random rows in a fresh process, its shards touched for the
  first time (cold) and again (warm), beside raw reads of the same bytes (cold: each shard mapped anew);
* **2 ranks**: the first batch and memory of two processes at once, each planning its own share;
* **8-rank plan**: in a fresh process, the bytes a sampler and its epoch's plan keep for one process and for each
  rank of 8 (``--plan-ranks``), one after the other, and the most they held at once while planning;
* **signatures baseline**, up to ``--baseline-max`` entries: the epoch's signatures computed entry by entry (what
  earlier releases did), against those from the index tables.

On a busy machine the baselines slow down with the figures: compare the ratios. ``--repeat N`` measures each
fresh-process figure N times and keeps the best. The goals of the ten-million-entry work are printed beside the
figures.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from .. import format as fmt
from ..dataset import DatasetHandle
from ..loader import BatchLoader
from ..reader import CacheReader, open_cache
from ..sampler import BucketSampler
from ..writer import CacheWriter
from . import benchmark_main

GOALS = {"put_per_s": 50_000.0, "put_many_per_s": 150_000.0, "first_batch_s": 2.0, "anon_per_entry": 100.0,
         "random_warm_us": 50.0, "random_cold_us": 1000.0, "rank_plan_extra_bytes": 64 * 1024}
AT_LEAST = ("put_per_s", "put_many_per_s")  # goals that are lower bounds
WARMUP_BATCHES = 100  # batches read before the steady state is timed
SDXL_DISTINCT = 1024  # distinct latents and conditionings the SDXL rows are made of (the disk holds no more)
CHUNK = 65_536  # entries made (and given to put_many) at a time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="10k,100k,1M,10M", help="entries per cache, e.g. 10k,1M (default %(default)s)")
    p.add_argument("--row", choices=("small", "sdxl"), default="small",
                   help="small: one float32 tensor of 1x4x4x4; sdxl: a latent 1x4x128x128 fp16 with a conditioning "
                        f"1x77x2048 and pooled 1x1280, of {SDXL_DISTINCT} distinct values each (no put_many)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default %(default)s)")
    p.add_argument("--batches", type=int, default=200, help="batches timed after the first 100 (default %(default)s)")
    p.add_argument("--random", type=int, default=1000, help="random entries materialized (default %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="fresh-process measurements each, the best kept "
                                                        "(default %(default)s)")
    p.add_argument("--plan-ranks", type=int, default=8,
                   help="ranks whose plans are measured beside one process's (default %(default)s)")
    p.add_argument("--baseline-max", type=int, default=100_000,
                   help="largest size whose per-entry signatures baseline is timed (default %(default)s)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)


def _count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _resident() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process (Linux; zeros elsewhere)."""
    found = {"RssAnon:": 0, "RssFile:": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name = line.split(maxsplit=1)[0] if line.strip() else ""
                if name in found:
                    found[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found["RssAnon:"], found["RssFile:"]


class _Growth:
    """Resident memory grown since this was made, per entry, at named points: ``{point: [anon, file]}``."""

    def __init__(self) -> None:
        self.base = _resident()
        self.points: dict[str, list[float]] = {}

    def mark(self, point: str, entries: int) -> None:
        anon, file = _resident()
        self.points[point] = [(anon - self.base[0]) / max(entries, 1), (file - self.base[1]) / max(entries, 1)]


# ------------------------------------------------------------------------------------------------ writing
def _small_values(lo: int, count: int) -> torch.Tensor:
    """Entries ``lo`` to ``lo + count - 1``: distinct 1x4x4x4 float32 tensors, stacked."""
    values = torch.zeros(count, 1, 4, 4, 4)
    values.view(count, -1)[:, 0] = torch.arange(lo, lo + count, dtype=torch.float32)
    return values


def _write_put(path: str, n: int) -> float:
    """Entries per second of a plain loop of ``put``, one distinct 1x4x4x4 float32 tensor each, the commit
    included."""
    started = time.perf_counter()
    with CacheWriter(path) as w:
        for lo in range(0, n, CHUNK):
            values = _small_values(lo, min(CHUNK, n - lo))
            for i in range(len(values)):
                w.put(f"k{lo + i:09d}", values[i])
    return n / (time.perf_counter() - started)


def _write_put_many(path: str, n: int) -> float:
    """Entries per second of ``put_many`` of the same entries, ``CHUNK`` at a time, the commit included."""
    started = time.perf_counter()
    with CacheWriter(path) as w:
        for lo in range(0, n, CHUNK):
            count = min(CHUNK, n - lo)
            w.put_many([f"k{i:09d}" for i in range(lo, lo + count)], _small_values(lo, count))
    return n / (time.perf_counter() - started)


def _write_raw(path: str, n: int) -> float:
    """Entries per second of the baseline: each entry's key and bytes written to one file, one ``write`` each,
    then flushed to the disk."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        for lo in range(0, n, CHUNK):
            values = _small_values(lo, min(CHUNK, n - lo))
            for i in range(len(values)):
                f.write(f"k{lo + i:09d}".encode())
                f.write(values[i].numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
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


def _write(path: str, n: int, row: str) -> dict[str, Any]:
    """The cache at ``path`` written with ``put``, and the rates of each way of writing (put_many and the raw
    baseline into scratch files removed afterwards)."""
    if row == "sdxl":
        return {"put_per_s": _write_sdxl(path, n)}
    rates = {"put_many_per_s": _write_put_many(path + "-many", n)}
    shutil.rmtree(path + "-many", ignore_errors=True)
    rates["raw_write_per_s"] = _write_raw(path + "-raw", n)
    os.remove(path + "-raw")
    rates["put_per_s"] = _write_put(path, n)
    return rates


def _shard_count(path: str) -> int:
    return len(os.listdir(os.path.join(path, "shards")))


# ------------------------------------------------------------------------------------------------ raw reads
class _RawBytes:
    """The baseline reads: an entry's tensor bytes straight from a mapping of its shard, located through the
    index's records (``entry_record``, ``tensor_record``), each shard mapped on first use."""

    def __init__(self, reader: CacheReader):
        self.reader = reader
        self.maps: dict[int, tuple[mmap.mmap, int]] = {}

    def locate(self, handle: DatasetHandle, rows: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Per row, (shard, where in its data area, length in bytes) of each of its entry's tensors."""
        out = []
        for row in rows:
            entry = self.reader.index_of(str(handle[row].keys))
            assert entry is not None
            spans = []
            for r in self.reader.entry_record(entry).tensors:
                t = self.reader.tensor_record(r)
                spans.append((t.shard, t.begin, t.end - t.begin))
            out.append(spans)
        return out

    def _mapping(self, shard: int) -> tuple[mmap.mmap, int]:
        found = self.maps.get(shard)
        if found is None:
            name = self.reader.index.info.shards[shard][0]
            with open(os.path.join(self.reader.path, "shards", name), "rb") as f:
                found = self.maps[shard] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), fmt.shard_data_start(f))
        return found

    def array(self, shard: int, begin: int, length: int) -> np.ndarray:
        """The bytes, as a view of the shard's mapping."""
        mapping, start = self._mapping(shard)
        return np.frombuffer(mapping, dtype=np.uint8, count=length, offset=start + begin)

    def close(self) -> None:
        for mapping, _ in self.maps.values():
            mapping.close()
        self.maps.clear()


def _raw_entries(raw: _RawBytes, located: list[list[tuple[int, int, int]]]) -> float:
    """Microseconds an entry to copy each of ``located``'s tensors out of its shard's mapping."""
    started = time.perf_counter()
    for spans in located:
        for span in spans:
            raw.array(*span).copy()
    return (time.perf_counter() - started) / max(len(located), 1) * 1e6


def _raw_batches(raw: _RawBytes, batches: list[list[list[tuple[int, int, int]]]]) -> float:
    """Entries per second of stacking each batch's first tensors out of their shards' mappings."""
    started = time.perf_counter()
    served = 0
    for batch in batches:
        served += len(np.stack([raw.array(*spans[0]) for spans in batch]))
    return served / max(time.perf_counter() - started, 1e-9)


# ------------------------------------------------------------------------------------------------ phases
def _loader_phase(path: str, batch_size: int, batches: int, count: int, rank: int,
                  world_size: int) -> dict[str, Any]:
    """In a fresh process: open, plan and read the first batch as Train LoRA does; the steady state beside raw
    reads of the same rows; resident memory after each step and after ``count`` random ``materialize()``."""
    growth = _Growth()
    started = time.perf_counter()
    reader = open_cache(path)
    handle = DatasetHandle.from_reader(reader)  # what reader.dataset() gives
    n = len(handle)
    growth.mark("opened", n)
    loader = BatchLoader(handle, batch_size, seed=0, workers=2, prefetch=2, shares=True, rank=rank,
                         world_size=world_size)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - started
    growth.mark("first_batch", n)
    for _ in range(WARMUP_BATCHES):
        next(it, None)
    started = time.perf_counter()
    served = 0
    for _ in range(batches):
        shard = next(it, None)
        if shard is None:
            break
        served += shard.samples
    steady = served / max(time.perf_counter() - started, 1e-9)
    growth.mark("batches", n)
    kept, rows_held = loader.nbytes(), loader.rows_held()
    picks = random.Random(0).sample(range(n), min(count, n))
    started = time.perf_counter()
    for i in picks:
        handle[i].materialize()
    after_batches_us = (time.perf_counter() - started) / max(len(picks), 1) * 1e6
    growth.mark("random", n)
    loader.close()
    plan = loader.sampler.epoch_plan(0)  # the plan the loader served, made again for the raw reads
    timed = range(1 + WARMUP_BATCHES, min(1 + WARMUP_BATCHES + batches, len(plan)))
    raw = _RawBytes(reader)
    steady_raw = _raw_batches(raw, [raw.locate(handle, plan[k].rows.tolist()) for k in timed])
    raw.close()
    return {"first_batch_s": first, "steady_per_s": steady, "steady_raw_per_s": steady_raw,
            "memory": growth.points, "anon_per_entry": max(v[0] for v in growth.points.values()),
            "loader_bytes": kept, "plan_rows": rows_held, "rows": n, "random_after_batches_us": after_batches_us}


def _random_phase(path: str, count: int) -> dict[str, Any]:
    """In a fresh process: random rows materialized cold and warm, then the same bytes read raw, cold (each shard
    mapped anew) and warm."""
    reader = open_cache(path)
    handle = DatasetHandle.from_reader(reader)  # what reader.dataset() gives
    picks = random.Random(0).sample(range(len(handle)), min(count, len(handle)))
    timings = []
    for _ in ("cold", "warm"):
        started = time.perf_counter()
        for i in picks:
            handle[i].materialize()
        timings.append((time.perf_counter() - started) / max(len(picks), 1) * 1e6)
    raw = _RawBytes(reader)
    located = raw.locate(handle, picks)
    raw_cold, raw_warm = _raw_entries(raw, located), _raw_entries(raw, located)
    raw.close()
    return {"random_cold_us": timings[0], "random_warm_us": timings[1], "random_raw_cold_us": raw_cold,
            "random_raw_warm_us": raw_warm}


def _plan_held(signatures: np.ndarray, batch_size: int, rank: int, world_size: int) -> dict[str, Any]:
    """The bytes a sampler and its first epoch's plan keep for ``rank`` of ``world_size`` (numpy reports its
    buffers to tracemalloc), the most held at once while planning, and the time it took."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        started = time.perf_counter()
        sampler = BucketSampler(signatures, batch_size, seed=0, rank=rank, world_size=world_size)
        plan = sampler.epoch_plan(0)
        seconds = time.perf_counter() - started
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {"kept_bytes": kept - before, "peak_bytes": peak - before, "sampler_bytes": sampler.nbytes(),
            "plan_bytes": plan.nbytes(), "plan_s": seconds, "plan_rows": plan.rows_held(), "rows": len(signatures)}


def _plans_phase(path: str, batch_size: int, ranks: int) -> dict[str, Any]:
    """In a fresh process: the plan of one process, then of each of ``ranks`` ranks, one after the other."""
    signatures = DatasetHandle.from_reader(open_cache(path)).signatures()
    BucketSampler(signatures[:100], batch_size, rank=0, world_size=2).epoch_plan(0)  # imports done before
    one = _plan_held(signatures, batch_size, 0, 1)
    each = [_plan_held(signatures, batch_size, r, ranks) for r in range(ranks)]
    worst = max(r["kept_bytes"] for r in each)
    return {"one": one, "ranks": each, "worst_rank_bytes": worst,
            "rank_plan_extra_bytes": worst - one["kept_bytes"] / max(ranks, 1)}


def _signatures_baseline(path: str) -> dict[str, Any]:
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


def _phase(args: argparse.Namespace) -> dict[str, Any]:
    if args.phase == "loader":
        return _loader_phase(args.path, args.batch_size, args.batches, args.random, args.rank, args.world_size)
    if args.phase == "random":
        return _random_phase(args.path, args.random)
    if args.phase == "plans":
        return _plans_phase(args.path, args.batch_size, args.plan_ranks)
    return _signatures_baseline(args.path)


# ------------------------------------------------------------------------------------------------ driver
def _in_fresh_process(phase: str, path: str, args: argparse.Namespace, rank: int = 0,
                      world_size: int = 1) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "streaming_cache", "bench-scale", "--phase", phase, path,
           "--batch-size", str(args.batch_size), "--batches", str(args.batches), "--random", str(args.random),
           "--rank", str(rank), "--world-size", str(world_size), "--plan-ranks", str(args.plan_ranks)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"a measuring process failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _best(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The first result, with each timing the best of all of them (the least seconds, the most per second)."""
    best = dict(results[0])
    for key in best:
        values = [r[key] for r in results]
        if key.endswith("_per_s"):
            best[key] = max(values)
        elif key.endswith(("_s", "_us")):
            best[key] = min(values)
    return best


def _measure(phase: str, path: str, args: argparse.Namespace, world_size: int = 1) -> list[dict[str, Any]]:
    """``phase`` for each of ``world_size`` ranks (their processes run together), ``--repeat`` times; each rank's
    results the best of its runs."""
    runs = []
    for _ in range(max(args.repeat, 1)):
        procs = [_in_fresh_process(phase, path, args, k, world_size) for k in range(world_size)]
        runs.append([_result(p) for p in procs])
    return [_best([run[k] for run in runs]) for k in range(world_size)]


def _mark(value: float, goal: str) -> str:
    ok = value >= GOALS[goal] if goal in AT_LEAST else value <= GOALS[goal]
    return "" if ok else " (goal missed)"


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline > 0 else "n/a"


def _report(size: int, row: str, r: dict[str, Any], ranks: int, out: Any) -> None:
    write = f"put {r['put_per_s']:,.0f}/s{_mark(r['put_per_s'], 'put_per_s')}"
    if "put_many_per_s" in r:
        write += (f", put_many {r['put_many_per_s']:,.0f}/s{_mark(r['put_many_per_s'], 'put_many_per_s')}; raw "
                  f"write of the same bytes {r['raw_write_per_s']:,.0f}/s")
    out(f"{size:>10,} entries ({row}), {r['shards']} shards: {write}")
    out(f"    first batch {r['first_batch_s']:.3f} s{_mark(r['first_batch_s'], 'first_batch_s')}; steady "
        f"{r['steady_per_s']:,.0f} entries/s (raw reads of the same rows {r['steady_raw_per_s']:,.0f}/s, "
        f"{_ratio(r['steady_per_s'], r['steady_raw_per_s'])})")
    points = "; ".join(f"{name.replace('_', ' ')} {a:.0f} / {f:.0f}" for name, (a, f) in r["memory"].items())
    out(f"    resident B/entry, anonymous / mapped files: {points}{_mark(r['anon_per_entry'], 'anon_per_entry')}; "
        f"the loader's arrays {r['loader_bytes'] / max(r['rows'], 1):.2f} B/entry")
    out(f"    random entry {r['random_cold_us']:.0f} us cold{_mark(r['random_cold_us'], 'random_cold_us')} "
        f"(raw {r['random_raw_cold_us']:.0f} us), {r['random_warm_us']:.0f} us warm"
        f"{_mark(r['random_warm_us'], 'random_warm_us')} (raw {r['random_raw_warm_us']:.1f} us); after the "
        f"batches {r['random_after_batches_us']:.0f} us")
    out("    2 ranks: " + "; ".join(
        f"rank {k}: first batch {t['first_batch_s']:.3f} s{_mark(t['first_batch_s'], 'first_batch_s')}, "
        f"{t['anon_per_entry']:.0f} B/entry anonymous, plans {t['plan_rows'] / max(t['rows'], 1):.0%} of the rows"
        for k, t in enumerate(r["ranks"])))
    plans = r["plans"]
    one = plans["one"]
    out(f"    plan: one process keeps {one['kept_bytes'] / 1e6:.2f} MB ({one['kept_bytes'] / max(one['rows'], 1):.2f} "
        f"B/entry, {one['plan_s']:.2f} s, at most {one['peak_bytes'] / 1e6:.1f} MB while planning); each rank of "
        f"{ranks} at most {plans['worst_rank_bytes'] / 1e6:.2f} MB, {plans['rank_plan_extra_bytes'] / 1024:+.0f}"
        f" KiB beside 1/{ranks} of it{_mark(plans['rank_plan_extra_bytes'], 'rank_plan_extra_bytes')}")
    if "plan_per_entry_s" in r:
        ratio = r["plan_per_entry_s"] / max(r["plan_tables_s"], 1e-9)
        out(f"    signatures entry by entry {r['plan_per_entry_s']:.2f} s, from the index tables "
            f"{r['plan_tables_s']:.3f} s ({ratio:,.0f}x faster)")


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
            row: dict[str, Any] = {**_write(path, size, args.row), "shards": _shard_count(path)}
            row.update(_measure("loader", path, args)[0])
            row.update(_measure("random", path, args)[0])
            row["ranks"] = _measure("loader", path, args, 2)
            row["plans"] = _result(_in_fresh_process("plans", path, args))
            if size <= args.baseline_max:
                row.update(_result(_in_fresh_process("baseline", path, args)))
            results["sizes"][size] = row
            _report(size, args.row, row, args.plan_ranks, out)
            if own:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    out("goals: put >= 50k entries/s, put_many >= 150k/s, first batch <= 2 s (1 rank and each of 2), <= 100 B/entry "
        "anonymous, a random entry <= 50 us warm and <= 1 ms cold, each rank of 8 planning <= an eighth of one "
        "process's plan + 64 KiB")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main("bench-scale", add_arguments, run, argv)
