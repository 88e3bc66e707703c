"""Garbage collection: preview and remove entries no manifest references, then compact the shards.

An entry is live if a manifest row or a manifest's ``pending_keys`` (an unfinished build's work) names it.
A cache with no manifest at all (filled with :class:`CacheWriter` directly) has no orphans: every entry is
kept, and only bytes no entry references are reclaimed. Nothing is deleted unless ``dry_run=False``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import format as fmt
from . import layout
from .errors import CacheError
from .manifest import Manifest
from .reader import CacheReader, open_cache
from .writer import CacheWriter


@dataclass
class CleanReport:
    entries: int
    orphan_entries: int
    orphan_bytes: int
    unreferenced_bytes: int
    stored_bytes: int
    orphan_keys: list[str] = field(default_factory=list)
    deleted: bool = False
    stored_bytes_after: int | None = None

    @property
    def reclaimable_bytes(self) -> int:
        return self.orphan_bytes + self.unreferenced_bytes

    def summary(self) -> str:
        verb = "removed" if self.deleted else "would remove"
        s = (f"{verb} {self.orphan_entries} orphan entries ({_mb(self.orphan_bytes)}) and "
             f"{_mb(self.unreferenced_bytes)} of unreferenced tensor bytes; {self.entries} entries, "
             f"{_mb(self.stored_bytes)} on disk")
        if self.stored_bytes_after is not None:
            s += f" -> {_mb(self.stored_bytes_after)}"
        return s


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def live_keys(reader: CacheReader) -> set[str] | None:
    """Keys referenced by any manifest, or None if the cache has no manifest (then all entries are live)."""
    if not reader.manifests:
        return None
    keys: set[str] = set()
    for name in reader.manifests:
        keys |= Manifest.from_json(reader.manifest_bytes(name), f"{reader.index.path}: manifest {name!r}").live_keys()
    return keys


def preview(path: str | os.PathLike[str]) -> CleanReport:
    """What :func:`clean` would remove, computed from the index alone (no tensor bytes are read)."""
    with open_cache(path) as reader:
        live = live_keys(reader)
        rows = reader.index.section("tensors.rows")
        sizes = (rows["end"] - rows["begin"]).astype(np.int64) if len(rows) else np.zeros(0, np.int64)
        used_live = np.zeros(len(rows), dtype=bool)
        used_orphan = np.zeros(len(rows), dtype=bool)
        orphans: list[str] = []
        for i, key in enumerate(reader.keys()):
            mine = list(reader.entry_record(i).tensors)
            if live is None or key in live:
                used_live[mine] = True
            else:
                used_orphan[mine] = True
                orphans.append(key)
        stored = reader.stored_bytes()
        referenced = int(sizes[used_live | used_orphan].sum())
        data_bytes = _shard_data_bytes(reader)
        return CleanReport(
            entries=len(reader),
            orphan_entries=len(orphans),
            orphan_bytes=int(sizes[used_orphan & ~used_live].sum()),
            unreferenced_bytes=max(0, data_bytes - referenced),
            stored_bytes=stored,
            orphan_keys=orphans,
        )


def _shard_data_bytes(reader: CacheReader) -> int:
    total = 0
    for name, nbytes in reader.index.info.shards:
        try:
            with layout.open_reader(layout.shard_path(reader.path, name), "shard") as f:
                total += nbytes - fmt.shard_data_start(f)
        except (OSError, CacheError):
            continue
    return total


def clean(path: str | os.PathLike[str], *, dry_run: bool = True,
          progress: Callable[[int, int], None] | None = None) -> CleanReport:
    """Preview (default) or remove orphan entries and compact the shards. Holds the writer lock while deleting."""
    report = preview(path)
    if dry_run:
        return report
    with CacheWriter(path) as writer:
        # Recompute under the lock: a build may have committed between the preview and now.
        with open_cache(path) as reader:
            live = live_keys(reader)
        if live is not None:
            writer.remove([k for k in writer.keys() if k not in live])
        writer.commit()
        writer.compact(progress=progress)
    report.deleted = True
    with open_cache(path) as reader:
        report.stored_bytes_after = reader.stored_bytes()
    return report
