"""The lazy dataset handle: a selection of a cache's rows that holds keys, never tensor bytes.

A handle is what flows between ComfyUI nodes and into the loader. It is picklable, and copying, slicing,
filtering and concatenating it only touch small integer arrays. A row is one training sample: either a single
entry, or (for datasets built by :func:`streaming_cache.build`) one entry per column, e.g. ``latent`` and
``cond``; identical captions are one entry shared by many rows.

Handles refer to entries by key, and keys are content hashes, so a handle stays valid while the cache grows:
it is resolved against the cache's current index when used. If a key it needs was removed (by ``clean``), use
raises :class:`StaleCacheError` with the first missing keys.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from . import layout
from .collate import collate
from .errors import CacheError, StaleCacheError
from .manifest import Manifest
from .reader import CacheReader, TensorInfo
from .records import factorize, first_of, ranges

_readers: collections.OrderedDict[str, tuple[tuple[int, int, int], CacheReader]] = collections.OrderedDict()
_readers_lock = threading.Lock()
_checked: dict[str, tuple[float, int]] = {}  # path -> (when its index was last looked at, commits seen then)
MAX_SHARED_READERS = 32  # caches used by one process at a time; the least recently used reader is dropped
RECHECK_SECONDS = 1.0  # how stale the per-entry path's reader may be when another process commits


def _index_stamp(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(layout.index_path(path))
    except FileNotFoundError as exc:
        raise CacheError(f"{path}: not a streaming cache (no {layout.INDEX_NAME}); was it moved or deleted?") from exc
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def shared_reader(path: str, *, recent: bool = False) -> CacheReader:
    """One reader per cache and process, reopened when the cache's index file has been replaced.

    ``recent=True`` (the per-entry path: materializing one row, a preview) skips looking at the index file when
    it was looked at less than :data:`RECHECK_SECONDS` ago and no writer of this process has committed to the cache
    since: no filesystem call per entry, and a commit by another process is seen within that time."""
    if recent:
        with _readers_lock:
            cached, checked = _readers.get(path), _checked.get(path)
            if cached is not None and checked is not None and checked[1] == layout.commits(path) \
                    and time.monotonic() - checked[0] < RECHECK_SECONDS:
                return cached[1]
    commits = layout.commits(path)
    stamp = _index_stamp(path)
    with _readers_lock:
        _checked[path] = (time.monotonic(), commits)
        cached = _readers.get(path)
        if cached is not None and cached[0] == stamp:
            _readers.move_to_end(path)
            return cached[1]
        reader = CacheReader(path)
        _remember(path, stamp, reader)
        return reader


def _remember(path: str, stamp: tuple[int, int, int], reader: CacheReader) -> None:
    _readers[path] = (stamp, reader)
    _readers.move_to_end(path)
    while len(_readers) > MAX_SHARED_READERS:
        _checked.pop(_readers.popitem(last=False)[0], None)


def _adopt(reader: CacheReader) -> None:
    """Let handles of ``reader``'s cache use this reader rather than open a second one, while it is current."""
    st = reader.index.stat
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    with _readers_lock:
        if _index_stamp(reader.path) == stamp:
            _remember(reader.path, stamp, reader)


_FINGERPRINT_ROWS = 1 << 16


def _keys_and_digests(blob: np.ndarray, offsets: np.ndarray, keys: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """For each key number of ``keys`` in turn: the key's bytes, a zero byte and its row of ``digests``."""
    length = offsets[keys + 1] - offsets[keys]
    piece = length + 1 + digests.shape[1]
    ends = np.cumsum(piece)
    starts = ends - piece
    out = np.zeros(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    out[ranges(starts, length)] = blob[ranges(offsets[keys], length)]
    out[(starts + length + 1)[:, None] + np.arange(digests.shape[1])] = digests
    return out


def _hashed_codes(table: np.ndarray) -> np.ndarray:
    """Per signature of ``table``, the signature of a row of one column that has it (the xxh3 of its eight
    little-endian bytes, as :meth:`DatasetHandle.signatures` hashes the signatures of a row's columns)."""
    return np.array([xxhash.xxh3_64_intdigest(v.to_bytes(8, "little")) for v in table.tolist()], dtype=np.uint64)


def _take(table: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = table[codes]`` for codes known to be in range, :data:`_FINGERPRINT_ROWS` at a time: no
    temporary array as long as ``codes``."""
    for lo in range(0, len(codes), _FINGERPRINT_ROWS):
        np.take(table, codes[lo:lo + _FINGERPRINT_ROWS], out=out[lo:lo + _FINGERPRINT_ROWS], mode="clip")


class _KeyTable:
    """Immutable list of keys stored as one UTF-8 blob plus offsets (no Python object per key). A table of every
    key of a cache (:meth:`of_reader`) is the index's own key sections, not a copy of them."""

    __slots__ = ("blob", "offsets", "_resolved", "_source")

    def __init__(self, keys: Iterable[str]):
        encoded = [k.encode("utf-8") for k in keys]
        self.blob: bytes | np.ndarray = b"".join(encoded)
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self._resolved: tuple[CacheReader, np.ndarray] | None = None
        self._source: tuple[str, int] | None = None  # (cache id, generation) whose entry k has key k

    @classmethod
    def of_reader(cls, reader: CacheReader) -> _KeyTable:
        """Every key of ``reader``'s cache, in entry order (entry ``k`` has key ``k``)."""
        reader.index.check_tables()
        table = cls.__new__(cls)
        table.blob, table.offsets = reader.index.section("keys.blob"), reader.index.section("keys.offsets")
        table._source = (reader.cache_id, reader.generation)
        table._resolved = None
        return table

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def key(self, i: int) -> str:
        return bytes(self.blob[int(self.offsets[i]):int(self.offsets[i + 1])]).decode("utf-8")

    def is_entry_order(self, reader: CacheReader) -> bool:
        """Whether key ``k`` is ``reader``'s entry ``k`` for every key: the table is the index's own, of the
        generation ``reader`` reads. Then a key number is its entry number, and nothing is looked up or kept."""
        return self._source == (reader.cache_id, reader.generation)

    def resolve(self, reader: CacheReader) -> np.ndarray:
        """Entry numbers in ``reader`` for every key (-1 for a key it lacks): ``0..n-1`` where
        :meth:`is_entry_order`, otherwise looked up all at once (:meth:`CacheReader.indices_of`) and kept for that
        reader."""
        if self.is_entry_order(reader):
            return np.arange(len(self), dtype=np.int64)
        done = self._resolved
        if done is not None and done[0] is reader:
            return done[1]
        out = reader.indices_of(self.blob, self.offsets)
        self._resolved = (reader, out)
        return out

    def __getstate__(self) -> tuple[bytes, np.ndarray, tuple[str, int] | None]:
        return bytes(self.blob), np.asarray(self.offsets, dtype=np.int64), self._source

    def __setstate__(self, state: tuple) -> None:
        self.blob, self.offsets = state[0], state[1]
        self._source = state[2] if len(state) > 2 else None  # handles pickled by earlier releases hold two
        self._resolved = None


def _key_dtype(keys: int) -> np.dtype:
    """The dtype of arrays of key numbers below ``keys``: four bytes a number where they fit."""
    return np.dtype(np.int32 if keys <= np.iinfo(np.int32).max else np.int64)


class _Selection:
    """Rows of one cache: ``rows[i, c]`` indexes ``keys`` for column ``c``. A selection of every key in order, one
    column (row ``i`` is key ``i``: a handle on a whole cache), keeps no array per row (``_rows`` is None) and
    makes ``rows`` only when asked for all of them at once."""

    __slots__ = ("cache", "columns", "keys", "_rows")

    def __init__(self, cache: str, columns: tuple[str, ...] | None, keys: _KeyTable, rows: np.ndarray | None):
        """``rows`` None: every key of ``keys`` in order, one column."""
        self.cache, self.columns, self.keys, self._rows = cache, columns, keys, rows

    def __len__(self) -> int:
        return len(self.keys) if self._rows is None else len(self._rows)

    @property
    def rows(self) -> np.ndarray:
        """The key numbers of every row, shape ``(rows, columns)`` (made on each call for every key in order)."""
        return self.key_rows()

    def every_key_in_order(self) -> bool:
        """Whether row ``i`` is key ``i`` for every key, one column."""
        return self._rows is None

    def key_rows(self, idx: np.ndarray | slice | None = None) -> np.ndarray:
        """The key numbers of rows ``idx`` (valid row numbers, or a slice; all rows if None), shape
        ``(rows, columns)``."""
        if self._rows is not None:
            return self._rows if idx is None else self._rows[idx]
        dtype = _key_dtype(len(self.keys))
        if idx is None or isinstance(idx, slice):
            start, stop, step = (idx or slice(None)).indices(len(self.keys))
            return np.arange(start, stop, step, dtype=dtype).reshape(-1, 1)
        return np.asarray(idx).astype(dtype).reshape(-1, 1)

    def row(self, j: int) -> tuple[int, ...]:
        """The key numbers of row ``j`` (a valid row number), one per column."""
        return (j,) if self._rows is None else tuple(self._rows[j].tolist())

    def entries(self, reader: CacheReader, rows: np.ndarray | None = None) -> np.ndarray:
        """The entry numbers in ``reader`` of ``rows`` (key numbers, shape ``(rows, columns)``; all rows if
        None); a key the cache no longer has raises :class:`StaleCacheError` naming it."""
        rows = self.key_rows() if rows is None else rows
        if self.keys.is_entry_order(reader):
            return rows
        found = self.keys.resolve(reader)[rows]
        if len(found) and (int(found.min()) if found.size > 8 else min(found.flat)) < 0:
            missing = np.unique(rows[found < 0])
            raise StaleCacheError(
                f"{reader.path}: the dataset refers to {len(missing)} entries the cache no longer has (e.g. "
                f"{', '.join(self.keys.key(int(k)) for k in missing[:3])}); they were removed by clean or the cache "
                "was replaced. Re-run the step that built the dataset")
        return found

    def row_entries(self, reader: CacheReader, row: Sequence[int]) -> list[int]:
        """:meth:`entries` of one row (key numbers, one per column), as a list."""
        if self.keys.is_entry_order(reader):
            return list(row)
        return self.entries(reader, np.array([row], dtype=np.int64)).reshape(-1).tolist()

    def with_rows(self, rows: np.ndarray) -> _Selection:
        return _Selection(self.cache, self.columns, self.keys, rows)

    def __getstate__(self) -> tuple:
        return self.cache, self.columns, self.keys, self._rows

    def __setstate__(self, state: tuple) -> None:
        self.cache, self.columns, self.keys, self._rows = state


class Row:
    """One sample of a handle, still lazy: keys and metadata now, tensors on :meth:`materialize`."""

    __slots__ = ("_part", "_row")

    def __init__(self, part: _Selection, row: Sequence[int]):
        """``row``: the sample's key numbers in ``part``, one per column."""
        self._part, self._row = part, row

    @property
    def keys(self) -> str | dict[str, str]:
        ks = [self._part.keys.key(int(k)) for k in self._row]
        return ks[0] if self._part.columns is None else dict(zip(self._part.columns, ks))

    def _entries(self) -> tuple[CacheReader, list[int]]:
        reader = shared_reader(self._part.cache, recent=True)
        return reader, self._part.row_entries(reader, self._row)

    def materialize(self, *, check: bool = False) -> Any:
        """The sample's value(s) with caller-owned tensors; a dict by column for multi-column datasets."""
        reader, entries = self._entries()
        if self._part.columns is None:
            return reader.materialize(entries[0], check=check)
        return {c: reader.materialize(e, check=check) for c, e in zip(self._part.columns, entries)}

    def views(self) -> Any:
        """Like :meth:`materialize` but with shared zero-copy views: only for code that copies them at once."""
        reader, entries = self._entries()
        values = [reader.views(e) for e in entries]
        return values[0] if self._part.columns is None else dict(zip(self._part.columns, values))

    @property
    def tensors(self) -> list[TensorInfo]:
        reader, entries = self._entries()
        return [t for e in entries for t in reader.tensor_info(e)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __repr__(self) -> str:
        return f"Row({self.keys!r})"


class DatasetHandle:
    """A lazy, immutable selection of rows from one or more caches. See the module docstring."""

    __slots__ = ("_parts", "_starts", "_length")

    def __init__(self, parts: Sequence[_Selection] = ()):
        self._parts = tuple(p for p in parts if len(p))
        lengths = [len(p) for p in self._parts]
        self._starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        self._length = sum(lengths)

    # ------------------------------------------------------------------------------------------ making
    @classmethod
    def from_cache(cls, path: str | os.PathLike[str], manifest: str | None = None, *,
                   repeats: bool = True) -> DatasetHandle:
        """All entries of a cache (one column), or the rows of one of its manifests.

        With a manifest, each row is a dict by column and is repeated ``row.repeats`` times unless
        ``repeats=False`` (kohya-style ``N_name`` folders weight concepts this way).
        """
        return cls.from_reader(shared_reader(os.path.abspath(os.fspath(path))), manifest, repeats=repeats)

    @classmethod
    def from_reader(cls, reader: CacheReader, manifest: str | None = None, *,
                    repeats: bool = True) -> DatasetHandle:
        """Like :meth:`from_cache` for an open reader, which the handle then uses instead of opening another."""
        _adopt(reader)
        if manifest is None:
            return cls([_Selection(reader.path, None, _KeyTable.of_reader(reader), None)])
        data = Manifest.from_json(reader.manifest_bytes(manifest), f"{reader.index.path}: manifest {manifest!r}")
        table: dict[str, int] = {}
        matrix = [[table.setdefault(row.keys[c], len(table)) for c in data.columns] for row in data.rows]
        counts = [max(1, row.repeats) if repeats else 1 for row in data.rows]
        rows = np.array(matrix, dtype=_key_dtype(len(table))).reshape(-1, len(data.columns))
        rows = np.repeat(rows, counts, axis=0) if counts and max(counts) > 1 else rows
        return cls([_Selection(reader.path, tuple(data.columns), _KeyTable(table), rows)])

    # ------------------------------------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return self._length

    def _locate(self, i: int) -> tuple[_Selection, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range (dataset has {n} rows)")
        if len(self._parts) == 1:
            return self._parts[0], i
        p = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._parts[p], i - int(self._starts[p])

    def __getitem__(self, item: int | slice | Sequence[int] | np.ndarray) -> Any:
        if isinstance(item, (int, np.integer)):
            part, j = self._locate(int(item))
            return Row(part, part.row(j))
        if isinstance(item, slice):
            idx = np.arange(*item.indices(len(self)), dtype=np.int64)
        else:
            idx = np.asarray(item, np.int64)
        if idx.ndim != 1:
            raise TypeError("index with an int, a slice or a 1-d sequence of ints")
        return self.select(idx)

    def __iter__(self) -> Iterator[Row]:
        for part in self._parts:
            for j in range(len(part)):
                yield Row(part, part.row(j))

    def select(self, indices: np.ndarray | Sequence[int]) -> DatasetHandle:
        """The rows at ``indices`` (any order, repeats allowed), keeping runs from one part together."""
        idx = np.asarray(indices, dtype=np.int64)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"row index out of range (dataset has {n} rows)")
        if idx.size and idx.min() < 0:
            idx = np.where(idx < 0, idx + n, idx)
        if len(self._parts) == 1:
            return DatasetHandle([self._parts[0].with_rows(self._parts[0].key_rows(idx))])
        which = np.searchsorted(self._starts, idx, side="right") - 1
        parts: list[_Selection] = []
        if idx.size:
            breaks = np.flatnonzero(np.diff(which)) + 1
            for run_idx, run_part in zip(np.split(idx, breaks), np.split(which, breaks)):
                p = self._parts[int(run_part[0])]
                parts.append(p.with_rows(p.key_rows(run_idx - self._starts[int(run_part[0])])))
        return DatasetHandle(parts)

    def filter(self, predicate: Callable[[Row], bool]) -> DatasetHandle:
        """Rows for which ``predicate(row)`` is true; the predicate sees lazy rows (metadata is free)."""
        keep = [i for i, row in enumerate(self) if predicate(row)]
        return self.select(keep)

    def __add__(self, other: DatasetHandle) -> DatasetHandle:
        if not isinstance(other, DatasetHandle):
            return NotImplemented
        return DatasetHandle.concat([self, other])

    @staticmethod
    def concat(handles: Iterable[DatasetHandle]) -> DatasetHandle:
        parts = [p for h in handles for p in h._parts]
        cols = {p.columns for p in parts}
        if len(cols) > 1:
            raise CacheError(f"cannot concatenate datasets with different columns: {sorted(map(str, cols))}")
        return DatasetHandle(parts)

    def repeat(self, times: int) -> DatasetHandle:
        return DatasetHandle.concat([self] * int(times))

    # ------------------------------------------------------------------------------------------ facts
    @property
    def columns(self) -> tuple[str, ...] | None:
        return self._parts[0].columns if self._parts else None

    @property
    def caches(self) -> list[str]:
        return sorted({p.cache for p in self._parts})

    def keys(self) -> Iterator[str | dict[str, str]]:
        return (row.keys for row in self)

    def fingerprint(self) -> str:
        """Changes exactly when the selected data changes, not when it moves: it covers the rows' keys and each
        entry's content (skeleton and tensor checksums, from the index), so a key given a new value counts.

        The bytes hashed are, row after row and column after column, the key, a zero byte and the entry's digest
        (:meth:`CacheReader.entry_digest`); they are laid out with numpy 65,536 rows at a time and hashed in
        one call each, so the memory used does not grow with the dataset."""
        h = xxhash.xxh3_128()
        for p in self._parts:
            reader = shared_reader(p.cache)
            if not p.keys.is_entry_order(reader):
                p.entries(reader)  # a key the cache lost raises here, naming the first ones, before any hashing
            blob = np.frombuffer(p.keys.blob, dtype=np.uint8)
            offsets = np.asarray(p.keys.offsets, dtype=np.int64)
            h.update(repr(p.columns).encode())
            for lo in range(0, len(p), _FINGERPRINT_ROWS):
                keys = p.key_rows(slice(lo, lo + _FINGERPRINT_ROWS))
                used, where = np.unique(p.entries(reader, keys), return_inverse=True)
                digests = reader.entry_digests(used)
                laid = _keys_and_digests(blob, offsets, keys.reshape(-1), digests[where.reshape(-1)])
                h.update(laid.data)
        return h.hexdigest()

    def collate(self, indices: Sequence[int], pin: bool = False,
                allocate: Callable[[tuple[int, ...], Any], Any] | None = None) -> Any:
        """Rows ``indices`` as one batch (see :meth:`CacheReader.collate`, which also says what ``pin`` and
        ``allocate`` do); a dict by column if there are columns.

        Rows of one cache take the reader's one-copy path; a batch mixing caches is viewed and stacked per row.
        """
        if len(indices) == 0:
            raise CacheError("cannot collate an empty batch: give at least one row")
        located = [self._locate(int(i)) for i in indices]
        part = located[0][0]
        if any(p is not part for p, _ in located):
            return collate([Row(p, p.row(j)).views() for p, j in located], pin)
        reader = shared_reader(part.cache)
        entries = part.entries(reader, part.key_rows(np.array([j for _, j in located], dtype=np.int64)))
        if part.columns is None:
            return reader.collate(entries[:, 0].tolist(), pin, allocate)
        return {c: reader.collate(entries[:, k].tolist(), pin, allocate) for k, c in enumerate(part.columns)}

    def signatures(self) -> np.ndarray:
        """Per row, a hash of its tensors' dtypes and shapes: rows with equal signatures can be stacked.

        From the index tables (:meth:`CacheReader.signature_codes`), with one hash per distinct combination of
        its columns' signatures: no Python work per row, and nothing per row made but the result."""
        out = np.empty(len(self), dtype=np.uint64)
        for p, start in zip(self._parts, self._starts.tolist()):
            reader = shared_reader(p.cache)
            codes, table = reader.signature_codes()
            if p.every_key_in_order() and p.keys.is_entry_order(reader):  # row i is entry i
                _take(_hashed_codes(table), codes, out[start:start + len(p)])
                continue
            columns = codes[p.entries(reader)]
            if columns.shape[1] == 1:
                _take(_hashed_codes(table), columns[:, 0], out[start:start + len(p)])
                continue
            combination = factorize(columns)
            example = first_of(combination)
            hashes = np.array([xxhash.xxh3_64_intdigest(table[columns[e]].astype("<u8").tobytes())
                               for e in example.tolist()], dtype=np.uint64)
            out[start:start + len(p)] = hashes[0] if len(hashes) == 1 else hashes[combination]
        return out

    def key_hashes(self, column: str | None = None) -> np.ndarray:
        """Per row, the 64-bit xxh3 of its key in ``column`` (the only one where the dataset has no columns), from
        the caches' index tables."""
        out = np.empty(len(self), dtype=np.uint64)
        for p, start in zip(self._parts, self._starts.tolist()):
            c = 0 if p.columns is None else p.columns.index(column)
            reader = shared_reader(p.cache)
            if p.every_key_in_order() and p.keys.is_entry_order(reader):
                out[start:start + len(p)] = reader.key_hashes()
            else:
                out[start:start + len(p)] = reader.key_hashes()[p.entries(reader, p.key_rows()[:, c])]
        return out

    def __repr__(self) -> str:
        cols = f", columns={list(self.columns)}" if self.columns else ""
        return f"DatasetHandle({len(self)} rows from {', '.join(self.caches) or 'nothing'}{cols})"

    def __getstate__(self) -> tuple[_Selection, ...]:
        return self._parts

    def __setstate__(self, state: tuple[_Selection, ...]) -> None:
        DatasetHandle.__init__(self, state)
