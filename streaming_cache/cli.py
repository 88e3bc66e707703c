"""Command line: ``python -m streaming_cache info|verify|clean`` and the developer tools.

Every command takes ``--json`` for machine-readable output. Bad input exits non-zero with a one-line reason.
The developer tools (benchmarks, crash harness, fuzzer, demo) live in ``streaming_cache.devtools``; their
commands are listed here by name and their module is imported only when one of them runs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .clean import clean
from .errors import CacheError
from .format import FORMAT_VERSION
from .manifest import Manifest
from .reader import open_cache
from .writer import CacheWriter

DEV_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("bench_read", "benchmark read paths against raw disk bandwidth and ComfyUI's formats"),
    "bench-loader": ("bench_loader", "benchmark the batch loader: data-wait share of a training loop, sequential "
                                     "vs prefetch, throttled storage; copy stream vs default stream on CUDA"),
    "bench-scaling": ("bench_scaling", "benchmark data-parallel training: samples/s on 1..N processes (torchrun), "
                                       "the ratio to linear scaling and the all-reduce's share of a step"),
    "bench-scale": ("bench_scale", "benchmark a cache of 10k to 10M entries: write rate, time to the first batch, "
                                   "memory per entry, a random entry, a shard's first touch, 2 ranks"),
    "demo": ("demo", "build a cache from a generated sample dataset, rebuild it incrementally, verify it"),
    "crashtest": ("crashtest", "SIGKILL a build/rebuild/clean at many instants and check what survives"),
    "fuzz": ("fuzz", "coverage-guided fuzzing of the index and skeleton readers (exit 1 on findings)"),
}


class Progress:
    """A one-line progress bar on stderr; silent when stderr is not a terminal or ``--json`` is given."""

    def __init__(self, label: str, enabled: bool = True, unit: str = "B"):
        self.label, self.unit = label, unit
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        amount = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB" if self.unit == "B" else f"{done}/{total}"
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {amount}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def cmd_info(args: argparse.Namespace) -> int:
    with open_cache(args.path) as r:
        info = r.index.info
        shapes: collections.Counter[str] = collections.Counter()
        for i in range(min(len(r), 100_000)):
            shapes[" ".join(f"{t.dtype}{list(t.shape)}" for t in r.tensor_info(i))] += 1
        manifests: dict[str, dict[str, Any]] = {}
        for name in r.manifests:
            m = Manifest.from_json(r.manifest_bytes(name), f"{r.index.path}: manifest {name!r}")
            manifests[name] = {"rows": len(m.rows), "complete": m.complete, "columns": m.columns,
                               "failed": len(m.failed)}
        data: dict[str, Any] = {
            "path": r.path, "format_version": FORMAT_VERSION, "cache_id": r.cache_id,
            "generation": r.generation, "entries": len(r), "tensors": info.tensors,
            "shards": len(info.shards), "stored_bytes": r.stored_bytes(), "manifests": manifests,
            "tensor_layouts": dict(shapes.most_common(10)),
        }
    lines = [f"cache      {data['path']}",
             f"format     v{data['format_version']}, generation {data['generation']}",
             f"entries    {data['entries']} ({data['tensors']} distinct tensors in {data['shards']} shards, "
             f"{data['stored_bytes'] / 1e6:.1f} MB)"]
    for name, m in data["manifests"].items():
        lines.append(f"dataset    {name!r}: {m['rows']} rows, columns {m['columns']}, "
                     f"{'complete' if m['complete'] else 'INCOMPLETE (build stopped; run it again to resume)'}"
                     + (f", {m['failed']} failed items" if m["failed"] else ""))
    for layout, n in data["tensor_layouts"].items():
        lines.append(f"layout     {n:>7} x {layout}")
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with open_cache(args.path) as r:
        report = r.verify(progress=Progress("verify", not args.json))
    dropped = 0
    if args.drop_damaged and report.damaged:
        with CacheWriter(args.path) as w:  # entries whose index records are bad the writer drops by itself
            dropped = w.remove(report.damaged) + len(w.damaged)
    data = {"ok": report.ok, "entries": report.entries, "tensors": report.tensors, "bytes": report.bytes,
            "damaged": report.damaged, "problems": report.problems, "dropped": dropped}
    lines = [f"checked {report.entries} entries, {report.tensors} tensors, {report.bytes / 1e6:.1f} MB"]
    lines += [f"DAMAGED {k}: {why}" for k, why in report.damaged.items()]
    lines += [f"PROBLEM {p}" for p in report.problems]
    if dropped:
        lines.append(f"dropped {dropped} damaged entries; the next build re-encodes them")
    lines.append("OK" if report.ok else f"{len(report.damaged)} damaged entries, {len(report.problems)} problems")
    _emit(args, data, "\n".join(lines))
    return 0 if report.ok else 1


def cmd_clean(args: argparse.Namespace) -> int:
    report = clean(args.path, dry_run=not args.yes, progress=Progress("compact", not args.json))
    data = dict(report.__dict__, orphan_keys=report.orphan_keys[:1000], reclaimable_bytes=report.reclaimable_bytes)
    text = report.summary()
    if not args.yes and report.reclaimable_bytes:
        text += "\nnothing was deleted; run again with --yes to delete"
    _emit(args, data, text)
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    with CacheWriter(args.path) as w:
        stats = w.compact(progress=Progress("compact", not args.json))
    text = (f"rewrote {stats['shards_rewritten']} shards: {stats['bytes_before'] / 1e6:.1f} MB -> "
            f"{stats['bytes_after'] / 1e6:.1f} MB" if stats["shards_rewritten"] else "nothing to rewrite")
    _emit(args, stats, text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m streaming_cache",
                                description="Inspect, check, clean and benchmark streaming dataset caches.")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str, path_required: bool = True):
        sp = sub.add_parser(name, help=help, description=help)
        if path_required:
            sp.add_argument("path", help="cache directory")
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON")
        sp.set_defaults(func=func)
        return sp

    add("info", cmd_info, "summarise a cache: entries, shards, datasets, tensor layouts")
    v = add("verify", cmd_verify, "recompute every checksum and name each damaged entry (exit 1 if any)")
    v.add_argument("--drop-damaged", action="store_true",
                   help="remove damaged entries so the next build re-encodes them")
    c = add("clean", cmd_clean, "preview (default) or delete entries no dataset references, and compact shards")
    c.add_argument("--yes", action="store_true", help="really delete (without it, only the preview is printed)")
    add("compact", cmd_compact, "rewrite shards that hold unused bytes, too many tensors or are small; deletes no "
        "entry")
    for name, (_, help_text) in DEV_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # parsed by the tool itself (see main)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DEV_COMMANDS:
        tool = importlib.import_module(f"{__package__}.devtools.{DEV_COMMANDS[argv[0]][0]}")
        return _guarded(lambda: int(tool.main(argv[1:])))
    args = build_parser().parse_args(argv)
    return _guarded(lambda: int(args.func(args)))


def _guarded(run: Callable[[], int]) -> int:
    """Run a command; expected failures become a one-line reason and exit status 2."""
    try:
        return run()
    except CacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
