"""Read-path benchmark: how close does collating a batch get to the disk's own read bandwidth?

One run builds a synthetic cache (entries of 16 KiB, 128 KiB, 1 MiB and 16 MiB, equal bytes per class) and
measures, for shuffled batches of 8 entries of one class:

* the limit: sequential ``readinto`` of the same shard files into a reused 16 MiB buffer (raw = 1.0x);
* ``reader.collate`` (what the loader runs: each entry's bytes straight into the batch) **warm**
  (reader open, its files read before) and **cold** (a freshly opened reader every pass, the data in the page
  cache: what a first epoch, a new process or another rank pays);
* the same through the shards' memory mappings instead of reads (how the reader read before: page faults on
  every first touch), warm and cold, and ``materialize`` + stack;
* with ``--from-disk``, where the operating system lets a process drop a file's pages
  (``posix_fadvise(DONTNEED)``): the raw read and cold collate from the disk itself;
* ComfyUI's own format (one ``torch.save``d dict per 1000 samples, all loaded with ``torch.load(...,
  weights_only=True)`` before use, as its LoadTrainingDataset does) and one ``.pt`` per entry;
* opening the cache: time and resident memory added, in a fresh process (so torch's own import is excluded).

Bandwidth counts the bytes copied into batches. Every figure is measured in this run; ratios compare methods
measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import reader as reader_module
from ..reader import CacheReader, open_cache
from ..writer import CacheWriter
from . import benchmark_main

CLASSES = {"16KiB": (4, 32, 64), "128KiB": (4, 128, 128), "1MiB": (4, 256, 512), "16MiB": (16, 512, 1024)}  # fp16
BATCH = 8


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)i?B?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 256MB, 1GB, 10GB)")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=parse_size, default=parse_size("1GB"), help="synthetic cache size (default 1GB)")
    p.add_argument("--open-size", type=parse_size, default=None,
                   help="also build a cache of this size and measure opening it (e.g. 10GB; default: --size)")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per method (the best is reported)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--skip-baselines", action="store_true", help="skip ComfyUI-format and .pt-per-entry baselines")
    p.add_argument("--from-disk", action="store_true",
                   help="also measure reads from the disk itself (drops the files' pages from the page cache)")


def _class_count(total: int) -> dict[str, int]:
    per_class = total // len(CLASSES)
    return {name: max(BATCH, per_class // (2 * _numel(shape))) for name, shape in CLASSES.items()}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _entries(total: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f"{name}-{i:07d}", name, shape) for name, shape in CLASSES.items()
            for i in range(_class_count(total)[name])]


def _make_tensor(pool: torch.Tensor, i: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct content per entry without generating random numbers per entry: slices of a random pool."""
    n = 2 * _numel(shape)
    start = ((i * 4098) % (pool.numel() - n)) & ~1  # even: fp16 views need 2-byte alignment
    return pool[start:start + n].view(torch.float16).reshape(shape)


def build_cache(path: str, total: int, out: Callable[..., None]) -> tuple[list, float]:
    entries = _entries(total)
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (64 * 1024 * 1024 + 4099,), dtype=torch.uint8, generator=g)
    pool[1::2] &= 0x3F  # keep fp16 values finite
    t = time.perf_counter()
    with CacheWriter(path) as w:
        for i, (key, _, shape) in enumerate(entries):
            w.put(key, {"samples": _make_tensor(pool, i, shape)})
    seconds = time.perf_counter() - t
    out(f"built {len(entries)} entries, {total / 2**30:.2f} GiB in {seconds:.1f} s "
        f"({total / seconds / 1e6:.0f} MB/s)")
    return entries, seconds


def raw_bandwidth(paths: list[str], repeats: int) -> float:
    buf = bytearray(16 * 1024 * 1024)
    best = 0.0
    for _ in range(repeats + 1):  # the first pass warms the page cache
        n = 0
        t = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while True:
                    got = f.readinto(buf)
                    if not got:
                        break
                    n += got
        best = max(best, n / (time.perf_counter() - t))
    return best


def disk_bandwidth(paths: list[str], repeats: int) -> float:
    """Sequential ``readinto`` of the files, their pages dropped from the page cache before each pass."""
    buf = bytearray(16 * 1024 * 1024)
    best = 0.0
    for _ in range(max(1, repeats // 2)):
        drop_pages(paths)
        n = 0
        t = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while got := f.readinto(buf):
                    n += got
        best = max(best, n / (time.perf_counter() - t))
    return best


def _timed(fn: Callable[[], int], repeats: int, min_seconds: float = 0.3) -> float:
    """Best of ``repeats`` samples, each running ``fn`` until ``min_seconds`` passed (short passes are noisy)."""
    fn()  # warm-up: page cache and page tables, for every method alike
    best = 0.0
    for _ in range(repeats):
        n = 0
        t = time.perf_counter()
        while True:
            n += fn()
            elapsed = time.perf_counter() - t
            if elapsed >= min_seconds:
                break
        best = max(best, n / elapsed)
    return best


def ours(reader: CacheReader | str, order: list[int], shape: tuple[int, ...], mode: str,
         before: Callable[[], object] = lambda: None) -> Callable[[], int]:
    """One pass over ``order`` in batches. ``reader`` a path: a fresh reader every pass (cold). ``mode``:
    ``collate`` (the reader's own choice: small tensors copied from the mappings while reads are fast, large
    ones and slow storage read explicitly), ``mapped`` (collate through the mappings only, how it was done
    before), ``materialize`` (+ stack). ``before()`` runs untimed before each pass (e.g. dropping the page cache)."""

    def run() -> int:
        before()
        r = CacheReader(reader) if isinstance(reader, str) else reader
        reads = reader_module._HAS_PREADV
        reader_module._HAS_PREADV = mode != "mapped"
        try:
            n = 0
            for b in range(0, len(order) - BATCH + 1, BATCH):
                ids = order[b:b + BATCH]
                if mode == "materialize":
                    batch = torch.stack([r.materialize(i)["samples"] for i in ids])
                else:
                    batch = r.collate(ids)["samples"]
                n += batch.numel() * 2
            return n
        finally:
            reader_module._HAS_PREADV = reads
            if r is not reader:
                r.close()

    return run


def drop_pages(paths: list[str]) -> bool:
    """Ask the kernel to forget the files' cached pages, so the next read comes from the disk; False where it
    cannot be done (no ``posix_fadvise``, or the pages stay: checked by timing is not possible here, so this
    reports only whether the call was accepted)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        finally:
            os.close(fd)
    return True


def comfyui_format(dirpath: str, keys: list[str], tensors: Callable[[int], torch.Tensor],
                   buf: torch.Tensor) -> Callable[[], int]:
    """One ``torch.save`` per 1000 samples; loading reads every shard into RAM first, as ComfyUI does."""
    os.makedirs(dirpath, exist_ok=True)
    for s in range(0, len(keys), 1000):
        torch.save({"latents": [{"samples": tensors(i).clone()} for i in range(s, min(s + 1000, len(keys)))],
                    "conditioning": []}, os.path.join(dirpath, f"shard_{s // 1000:04d}.pkl"))
    files = sorted(os.listdir(dirpath))
    order = list(range(len(keys)))
    random.Random(1).shuffle(order)

    def run() -> int:
        latents: list[Any] = []
        for name in files:
            latents.extend(torch.load(os.path.join(dirpath, name), weights_only=True)["latents"])
        n = 0
        for b in range(0, len(order) - BATCH + 1, BATCH):
            n += torch.stack([latents[i]["samples"] for i in order[b:b + BATCH]], out=buf).numel() * 2
        return n

    return run


def pt_per_entry(dirpath: str, keys: list[str], tensors: Callable[[int], torch.Tensor],
                 buf: torch.Tensor) -> Callable[[], int]:
    os.makedirs(dirpath, exist_ok=True)
    for i in range(len(keys)):
        torch.save({"samples": tensors(i).clone()}, os.path.join(dirpath, f"{i:07d}.pt"))
    order = list(range(len(keys)))
    random.Random(1).shuffle(order)

    def run() -> int:
        n = 0
        for b in range(0, len(order) - BATCH + 1, BATCH):
            samples = [torch.load(os.path.join(dirpath, f"{i:07d}.pt"), weights_only=True)["samples"]
                       for i in order[b:b + BATCH]]
            n += torch.stack(samples, out=buf).numel() * 2
        return n

    return run


_OPEN_PROBE = """
import json, os, sys, time
import torch, streaming_cache
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) * 1024
    return 0
before = rss()
t = time.perf_counter()
r = streaming_cache.open_cache(sys.argv[1])
n = len(r)
hit = r.index_of(sys.argv[2])
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "rss_delta": rss() - before, "entries": n, "found": hit is not None}))
"""


def open_cost(path: str, probe_key: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    # Twice: the first run pays the cold page cache of the index file.
    result: dict[str, Any] = {}
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _OPEN_PROBE, path, probe_key], capture_output=True, text=True,
                              env=env, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stored_bytes"] = open_cache(path).stored_bytes()
    return result


def run(args: argparse.Namespace, out: Callable[..., None] = print) -> dict[str, Any]:
    workdir = args.path or tempfile.mkdtemp(prefix="streaming-cache-bench-")
    os.makedirs(workdir, exist_ok=True)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"size": args.size, "batch": BATCH}
    try:
        cache = os.path.join(workdir, "cache")
        shutil.rmtree(cache, ignore_errors=True)
        entries, build_s = build_cache(cache, args.size, out)
        results["build_MBps"] = args.size / build_s / 1e6
        reader = open_cache(cache)
        shards = [os.path.join(cache, "shards", s["name"]) for s in reader.index.header["shards"]]
        raw = raw_bandwidth(shards, args.repeats)
        results["raw_GBps"] = raw / 1e9
        out(f"limit: raw sequential read of the shard files (page cache warm): {raw / 1e9:.2f} GB/s")
        out(f"\n{'class':<8}{'entries':>8}  {'method':<34}{'GB/s':>7}{'x raw':>7}")
        pool = torch.randint(0, 256, (64 * 1024 * 1024 + 4099,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
        pool[1::2] &= 0x3F
        results["classes"] = {}
        fadvise = args.from_disk and drop_pages(shards)
        disk_raw = None
        if args.from_disk:
            if fadvise:
                disk_raw = disk_bandwidth(shards, args.repeats)
                results["disk_raw_GBps"] = disk_raw / 1e9
                out(f"limit from the disk: raw sequential read after dropping the files' pages: "
                    f"{disk_raw / 1e9:.2f} GB/s")
            else:
                out("from the disk: not measured (this system does not let a process drop a file's pages)")
        out(f"\n{'class':<8}{'entries':>8}  {'method':<38}{'GB/s':>7}{'x raw':>7}")
        for cname, shape in CLASSES.items():
            idx = [i for i, (_, c, _) in enumerate(entries) if c == cname]
            order = [int(reader.index_of(entries[i][0])) for i in idx]  # type: ignore[arg-type]
            random.Random(0).shuffle(order)
            row: dict[str, float] = {}
            methods: list[tuple[str, str, CacheReader | str]] = [
                ("reader.collate, warm", "collate", reader), ("reader.collate, cold (fresh open)", "collate", cache),
                ("through the mappings, warm", "mapped", reader),
                ("through the mappings, cold (fresh open)", "mapped", cache),
                ("materialize + stack, warm", "materialize", reader)]
            for label, mode, source in methods:
                key = f"{mode}_{'warm' if source is reader else 'cold'}"
                row[key] = _timed(ours(source, order, shape, mode), args.repeats) / 1e9
                out(f"{cname:<8}{len(idx):>8}  {label:<38}{row[key]:>7.2f}{row[key] * 1e9 / raw:>7.2f}")
            if disk_raw:
                key = "collate_disk"
                row[key] = _timed(ours(cache, order, shape, "collate", lambda: drop_pages(shards)), 1, 0.0) / 1e9
                out(f"{'':<16}  {'reader.collate from the disk':<38}{row[key]:>7.2f}{row[key] * 1e9 / disk_raw:>7.2f}"
                    "  (x the disk's raw read)")
            if not args.skip_baselines:
                keys = [entries[i][0] for i in idx]
                tensors = lambda j, idx=idx, shape=shape: _make_tensor(pool, idx[j], shape)  # noqa: E731
                base = os.path.join(workdir, f"baseline-{cname}")
                shutil.rmtree(base, ignore_errors=True)
                buf = torch.empty((BATCH, *shape), dtype=torch.float16)  # a reused batch: loading only counts
                row["comfyui"] = _timed(comfyui_format(os.path.join(base, "comfyui"), keys, tensors, buf),
                                        args.repeats) / 1e9
                out(f"{'':<16}  {'ComfyUI format (load all + stack)':<38}{row['comfyui']:>7.2f}"
                    f"{row['comfyui'] * 1e9 / raw:>7.2f}")
                row["pt"] = _timed(pt_per_entry(os.path.join(base, "pt"), keys, tensors, buf), args.repeats) / 1e9
                out(f"{'':<16}  {'.pt per entry (torch.load + stack)':<38}{row['pt']:>7.2f}"
                    f"{row['pt'] * 1e9 / raw:>7.2f}")
                shutil.rmtree(base, ignore_errors=True)
            results["classes"][cname] = row
        reader.close()
        open_path, open_size = cache, args.size
        if args.open_size and args.open_size != args.size:
            open_path, open_size = os.path.join(workdir, "open-cache"), args.open_size
            if not os.path.exists(os.path.join(open_path, "index.scc")):
                out(f"\nbuilding a {open_size / 2**30:.1f} GiB cache to measure opening it")
                build_cache(open_path, open_size, out)
        cost = open_cost(open_path, _entries(open_size)[-1][0])
        results["open"] = cost
        out(f"\nopen a {cost['stored_bytes'] / 2**30:.2f} GiB cache of {cost['entries']} entries "
            f"(+ len + one lookup): {cost['seconds'] * 1000:.1f} ms, RSS +{cost['rss_delta'] / 2**20:.1f} MiB")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        results["peak_rss_bytes"] = peak
        out(f"peak RSS of this benchmark process: {peak / 2**20:.0f} MiB")
        out("\ntargets")
        checks = []
        for cname in CLASSES:
            for key, label in (("collate_warm", "collate warm"), ("collate_cold", "collate cold")):
                ratio = results["classes"][cname][key] * 1e9 / raw
                checks.append((f"{cname}: {label} >= 0.9x raw", f"{ratio:.2f}x", ratio >= 0.9))
        if not args.skip_baselines:
            for cname, row in results["classes"].items():
                for base in ("comfyui", "pt"):
                    ratio = row["collate_warm"] / row[base]
                    checks.append((f"{cname}: >= 5x {base} baseline", f"{ratio:.1f}x", ratio >= 5))
        checks.append(("open < 0.5 s", f"{cost['seconds']:.3f} s", cost["seconds"] < 0.5))
        checks.append(("open <= 64 MiB RSS", f"{cost['rss_delta'] / 2**20:.1f} MiB", cost["rss_delta"] <= 64 * 2**20))
        for label, value, ok in checks:
            out(f"  {label:<44}{value:>10}  {'PASS' if ok else 'MISS'}")
        results["targets"] = [{"target": t, "value": v, "pass": ok} for t, v, ok in checks]
        return results
    finally:
        if not args.keep and not args.path:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main("bench", add_arguments, run, argv)
