"""The manifest: one dataset of a cache (``docs/FORMAT.md`` section 6), as one typed value.

The builder writes it, the dataset handle reads its rows, ``clean`` keeps what it names alive, the CLI shows it.
It is stored as UTF-8 JSON in the index; :meth:`Manifest.from_json` validates every field (a cache may come
from anyone) and raises :class:`CacheFormatError` naming the manifest, and :meth:`Manifest.to_json` writes the
same bytes for the same value (an unchanged rebuild commits nothing).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import CacheFormatError

MANIFEST_VERSION = 1
MAX_REPEATS = 1000
"""Most times one sample may repeat per epoch (kohya ``N_name`` folders use 1 to about 100)."""
MAX_ROWS = 1 << 24
"""Most rows a dataset may have once every sample is repeated: a handle holds them as integers in memory."""


@dataclass(frozen=True)
class ManifestRow:
    """One training sample: its name (e.g. the image's relative path) and one entry key per column."""

    name: str
    keys: Mapping[str, str]
    repeats: int = 1


@dataclass(frozen=True)
class SourceRecord:
    """What the builder knew of a source file: its size and mtime when hashed, the content digest, and when."""

    size: int
    mtime_ns: int
    digest: str
    recorded_ns: int


@dataclass(frozen=True)
class Failure:
    """An item that could not be encoded, the column that failed and why."""

    item: str
    column: str
    error: str


@dataclass
class Manifest:
    columns: list[str]
    rows: list[ManifestRow] = field(default_factory=list)
    complete: bool = True
    encoders: dict[str, dict[str, Any]] = field(default_factory=dict)
    """column -> {"fingerprint": ..., "settings": {...}} of the encoders the keys were made with"""
    sources: dict[str, SourceRecord] = field(default_factory=dict)
    """absolute source path -> its record (the builder's stat cache)"""
    failed: list[Failure] = field(default_factory=list)
    pending_keys: list[str] | None = None
    """unfinished builds only: keys encoded but not yet part of a complete row (kept alive by ``clean``)"""

    def live_keys(self) -> set[str]:
        keys = {k for row in self.rows for k in row.keys.values()}
        keys.update(self.pending_keys or ())
        return keys

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "columns": list(self.columns),
            "complete": self.complete,
            "rows": [{"name": r.name, "keys": dict(r.keys), "repeats": r.repeats} for r in self.rows],
            "encoders": self.encoders,
            "sources": {p: [s.size, s.mtime_ns, s.digest, s.recorded_ns] for p, s in self.sources.items()},
            "failed": [{"item": f.item, "column": f.column, "error": f.error} for f in self.failed],
        }
        if self.pending_keys is not None:
            data["pending_keys"] = list(self.pending_keys)
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | Any, where: str) -> Manifest:
        """Parse and validate a manifest; ``where`` names it in errors (e.g. the index path and the name)."""
        if isinstance(raw, (bytes, bytearray, memoryview)):
            try:
                data = json.loads(bytes(raw))
            except (ValueError, RecursionError) as exc:
                raise CacheFormatError(f"{where}: manifest is not valid JSON ({exc}); rebuild the dataset") from exc
        else:
            data = raw
        try:
            return cls._parse(data)
        except CacheFormatError as exc:
            raise CacheFormatError(f"{where}: {exc}; rebuild the dataset") from exc

    @classmethod
    def _parse(cls, data: Any) -> Manifest:
        obj = _dict(data, "manifest")
        if obj.get("version") != MANIFEST_VERSION:
            raise CacheFormatError(f"manifest version {obj.get('version')!r} is not {MANIFEST_VERSION} "
                                   "(not a dataset manifest, or written by a newer version)")
        columns = [_str(c, "a column name") for c in _list(obj.get("columns"), "columns")]
        if not columns:
            raise CacheFormatError("manifest has no columns")
        if len(set(columns)) != len(columns):
            raise CacheFormatError(f"manifest names a column twice: {columns}")
        rows = []
        for r in _list(obj.get("rows", []), "rows"):
            r = _dict(r, "a row")
            keys = {_str(k, "a column name"): _str(v, "an entry key")
                    for k, v in _dict(r.get("keys"), "row keys").items()}
            if set(keys) != set(columns):
                raise CacheFormatError(f"row {r.get('name')!r} has columns {sorted(keys)}, the manifest {columns}")
            repeats = _int(r.get("repeats", 1), "repeats")
            if not 1 <= repeats <= MAX_REPEATS:
                raise CacheFormatError(f"row {r.get('name')!r:.100} repeats {repeats} times; at most {MAX_REPEATS}")
            rows.append(ManifestRow(_str(r.get("name"), "a row name"), keys, repeats))
        if sum(r.repeats for r in rows) > MAX_ROWS:
            raise CacheFormatError(f"the rows repeat to more than {MAX_ROWS} samples")
        encoders = {_str(k, "a column name"): _dict(v, "an encoder record")
                    for k, v in _dict(obj.get("encoders", {}), "encoders").items()}
        sources = {}
        for path, rec in _dict(obj.get("sources", {}), "sources").items():
            rec = _list(rec, "a source record")
            if len(rec) != 4:
                raise CacheFormatError(f"source record of {path!r} has {len(rec)} fields, not 4")
            sources[_str(path, "a source path")] = SourceRecord(_int(rec[0], "a size"), _int(rec[1], "an mtime"),
                                                               _str(rec[2], "a digest"), _int(rec[3], "a time"))
        failed = [Failure(_str(f.get("item"), "an item"), _str(f.get("column"), "a column"),
                          _str(f.get("error"), "an error"))
                  for f in (_dict(x, "a failure") for x in _list(obj.get("failed", []), "failed"))]
        pending = obj.get("pending_keys")
        pending_keys = None if pending is None else [_str(k, "a pending key") for k in _list(pending, "pending_keys")]
        complete = obj.get("complete", True)
        if type(complete) is not bool:
            raise CacheFormatError(f"'complete' is {complete!r}, not true or false")
        return cls(columns, rows, complete, encoders, sources, failed, pending_keys)


def _dict(v: Any, what: str) -> dict:
    if not isinstance(v, dict):
        raise CacheFormatError(f"{what} is a {type(v).__name__}, not an object")
    return v


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise CacheFormatError(f"{what} is a {type(v).__name__}, not a list")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise CacheFormatError(f"{what} is {v!r}, not a string")
    return v


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise CacheFormatError(f"{what} is {v!r}, not an integer")
    return v
