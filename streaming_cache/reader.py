"""Reading a cache: open the index only, materialize entries from memory-mapped shards on demand.

Opening maps the index file and parses its small JSON header; nothing else is read until used. Shards are
opened on first use, their safetensors headers validated against the index, and mapped privately
(copy-on-write), so no caller can ever write to the files.

Two ways to get tensors out:

* :meth:`CacheReader.views` returns zero-copy views of the shared per-shard mapping, for code that reads them
  once into a buffer of its own, such as collating a batch (the loader): one copy from the page cache in all.
* :meth:`LazyEntry.materialize` returns tensors the caller owns, made with exactly one copy. Handing out views
  would not be safe: a caller writing into one would change what later reads of that entry see in this
  process. Giving each entry a private mapping of its own avoids that, but was measured slower than the copy
  (the page faults of a fresh mapping cost more than a memcpy), so the copy it is.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from . import format as fmt
from . import layout, leases
from .buffers import shared_pool
from .collate import collate, replicate
from .errors import CacheError, CacheFormatError, DamagedEntryError, StaleCacheError
from .records import RecordTable, ShardRecords, factorize, ranges, record_table, shard_records
from .skeleton import Builder, compile_skeleton, decode_skeleton

log = logging.getLogger("streaming_cache")
_MEMO_BYTES = 16 * 1024 * 1024
_MAX_FORMS = 4096  # distinct (dtype, shape) records and skeletons the per-entry path remembers; cleared when full
_ROW = struct.Struct("<IBBHQQQQQ")  # one tensors.rows record, field for field as fmt.TENSOR_ROW
_U32 = struct.Struct("<I")
_U64_PAIR = struct.Struct("<QQ")
assert _ROW.size == fmt.TENSOR_ROW.itemsize


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor as the index describes it: safetensors dtype name, shape and size; also its checksum
    (hex xxh3-128, docs/FORMAT.md section 4) and the shard file holding it, which equality and repr leave out."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str = field(default="", compare=False, repr=False)
    shard: str = field(default="", compare=False, repr=False)


class TensorRecord(NamedTuple):
    """A decoded ``tensors.rows`` record (docs/FORMAT.md section 3), bounds-checked against the index."""

    shard: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    digest: str


class EntryRecord(NamedTuple):
    """An entry's key, skeleton bytes and tensor record numbers (one per skeleton leaf)."""

    key: str
    skeleton: bytes
    tensors: tuple[int, ...]


@dataclass
class VerifyReport:
    """What :meth:`CacheReader.verify` found. ``damaged`` maps entry keys to the reason."""

    entries: int = 0
    tensors: int = 0
    bytes: int = 0
    damaged: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.problems


_HAS_PREADV = hasattr(os, "preadv")


def _max_open_shards() -> int:
    """Shard files a reader keeps open for reading (the least recently used are closed): a quarter of the
    process's limit on open files, from 128 to 8192, so random reads over a large cache find their shard open
    (reopening one costs more than the read) while other files still have room."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 128
    if soft == resource.RLIM_INFINITY or soft < 0:
        return 8192
    return max(128, min(8192, soft // 4))


MAX_OPEN_SHARDS = _max_open_shards()
IO_DEPTH = 16  # reads in flight at once on slow storage
PREAD_MIN_BYTES = 1 << 20  # tensors this large are always read, never copied from the mapping
SLOW_READ_S = 300e-6  # reads this much slower than a copy from the page cache are slow storage
PAGE_CACHE_BYTES_PER_S = 4e9  # a conservative copy rate from the page cache
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _io_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The I/O threads that keep reads in flight on slow storage (shared by every reader, started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(IO_DEPTH, thread_name_prefix="streaming-cache-io")
        return _pool


def _pread(fd: int, dst: memoryview, offset: int) -> int:
    """``os.preadv`` (the GIL is released while the kernel copies): the benchmarks wrap it to model slow storage."""
    return os.preadv(fd, [dst], offset)


class _Shard:
    """An open shard: its header checked against the index. Tensor bytes are read with explicit positioned reads
    straight into the caller's buffer (one copy from the page cache, no page faults on a mapping, and many reads
    in flight on slow storage); :meth:`mapping` maps the file privately (copy-on-write: nothing done through the
    mapping can ever reach the file) for zero-copy views, on first use. A shard truncated in place while in use
    (``cp`` or ``rsync --inplace`` over it) is noticed: a read comes back short, and a mapping is checked before
    bytes are copied out of it, which would otherwise kill the process with SIGBUS.

    ``bad`` names the records of this shard that its header does not describe as the index does; whether a
    record's bytes lie inside the data area (``data_len`` bytes) is checked by every read (:meth:`outside`), so a
    shard whose header is the one the index recorded opens without looking at its records at all."""

    def __init__(self, path: str, rows: np.ndarray, shapes: np.ndarray, mine: Callable[[], np.ndarray],
                 header_digest: str | None = None):
        """``mine()`` gives the index records of this shard; it is called only where the header must be compared
        record by record (the index records no digest of it, or another one)."""
        self.path = path
        self.name = os.path.basename(path)
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.users = 0
        with layout.open_reader(path, "shard") as f:
            st = os.fstat(f.fileno())
            self.size = size = st.st_size
            self.inode = (st.st_dev, st.st_ino)
            n = fmt.read_header_length(f, size, path)
            self.data_start = 8 + n
            known = header_digest is not None and fmt.header_digest_matches(f, n, header_digest)
            if not known:
                raw = fmt.read_header_bytes(f, size, path)
        self.data_len = size - self.data_start
        self.map: mmap.mmap | None = None
        self.bad: dict[int, str] = {}
        if not known:
            # The header the index was written with agrees with the index by construction (its length is not
            # limited here: an earlier release wrote headers longer than safetensors allows); any other one is
            # compared with the index's records, with numpy over this shard's records.
            _, tensors = fmt.parse_shard_header(raw, size, path)
            self.bad = _disagreements(self.name, tensors, rows, shapes, mine())

    def outside(self, end: int) -> bool:
        """Whether bytes ending at ``end`` of the data area lie past its end (the index may be hostile too)."""
        return end > self.data_len

    def _open(self) -> int:
        """A descriptor of the same file that was checked at open (a file put in its place is refused; one removed
        since, by a writer while this reader held no lease, says to open the cache again)."""
        try:
            fd = layout.open_file(self.path, "shard")
        except FileNotFoundError:
            raise StaleCacheError(f"{self.path}: the shard file was removed by a later write since the cache was "
                                  "opened; open the cache again") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.inode:
            os.close(fd)
            raise StaleCacheError(f"{self.path}: the shard file was replaced since the cache was opened; open the "
                                  "cache again")
        return fd

    def mapping(self) -> mmap.mmap | None:
        """The private mapping of the whole file (None for an empty file), made on first use."""
        if self.map is None and self.size:
            with self.lock:
                if self.map is None:
                    fd = self._open()
                    try:
                        self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                    finally:
                        os.close(fd)
        return self.map

    def acquire(self) -> int:
        """The open descriptor for reads, opened if needed; :meth:`release` after use (while in use it is never
        closed)."""
        with self.lock:
            if self.fd is None:
                self.fd = self._open()
            self.users += 1
            return self.fd

    def release(self) -> None:
        with self.lock:
            self.users -= 1

    def close_idle(self) -> bool:
        """Close the descriptor if no read uses it; whether it is closed now."""
        with self.lock:
            if self.fd is not None and self.users == 0:
                os.close(self.fd)
                self.fd = None
            return self.fd is None

    def read_into(self, begin: int, dst: memoryview, fd: int) -> None:
        """Fill ``dst`` with the bytes at ``begin`` of the data section (``fd`` from :meth:`acquire`)."""
        offset, want = self.data_start + begin, len(dst)
        done = _pread(fd, dst, offset)  # the whole of it, but for a read cut short
        while 0 < done < want:
            got = _pread(fd, dst[done:], offset + done)
            if got <= 0:
                break
            done += got
        if done < want:
            raise CacheFormatError(f"{self.path}: shard ends before the tensor at byte {offset + max(done, 0)}; it "
                                   "was truncated or overwritten while in use. Open the cache again (and do not "
                                   "copy over shards in place)")

    def check_size(self) -> None:
        """Refuse to copy from a mapping whose file shrank since it was mapped (a file replaced by another one
        is harmless: the mapping keeps the old one)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self.inode and st.st_size < self.size:
            raise CacheFormatError(f"{self.path}: shard was truncated or overwritten while in use; open the "
                                   "cache again (and do not copy over shards in place)")

    def __del__(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass


_DIGEST = re.compile(r"[0-9a-f]{32}")


def _disagreements(name: str, tensors: dict[str, fmt.ShardTensor], rows: np.ndarray, shapes: np.ndarray,
                   mine: np.ndarray) -> dict[int, str]:
    """The index records ``mine`` (those of one shard) that the shard's own header does not describe as the index
    does (missing, or another dtype, shape or place), by record number, with the reason. Compared with numpy over
    all records at once: opening a shard of many small tensors costs no Python work per record."""
    if not len(mine):
        return {}
    listed = [t for t in tensors.values() if _DIGEST.fullmatch(t.name)]  # other names name no record
    his = np.array([int(t.name[:16], 16) for t in listed], dtype=np.uint64)
    los = np.array([int(t.name[16:], 16) for t in listed], dtype=np.uint64)
    recs = _gather(rows, mine)
    order = np.argsort(his, kind="stable")
    pos = np.minimum(np.searchsorted(his[order], recs["digest_hi"]), max(0, len(order) - 1))
    at = order[pos] if len(order) else np.zeros(len(mine), np.int64)
    found = (his[at] == recs["digest_hi"]) & (los[at] == recs["digest_lo"]) if len(order) else \
        np.zeros(len(mine), bool)
    codes = np.array([fmt.DTYPE_CODE[t.dtype] for t in listed], dtype=np.int64)
    begins = np.array([t.begin for t in listed], dtype=np.uint64)
    ends = np.array([t.end for t in listed], dtype=np.uint64)
    ndims = np.array([len(t.shape) for t in listed], dtype=np.int64)
    same = found.copy()
    if len(order):
        same &= (codes[at] == recs["dtype"]) & (begins[at] == recs["begin"]) & (ends[at] == recs["end"]) & \
            (ndims[at] == recs["ndim"])
    for ndim in np.unique(recs["ndim"][same]).tolist():  # the shapes, one dimension count at a time
        sel = np.flatnonzero(same & (recs["ndim"] == ndim))
        if not ndim:
            continue
        raw = recs["shape_start"][sel]  # unsigned: compared as such, a huge value stays huge
        inside = (raw <= np.uint64(len(shapes) - ndim)) if ndim <= len(shapes) else np.zeros(len(sel), bool)
        index_shapes = shapes[np.where(inside, raw, 0).astype(np.int64)[:, None] + np.arange(ndim)]
        header_shapes = np.array([listed[i].shape for i in at[sel].tolist()], dtype=np.uint64).reshape(-1, ndim)
        same[sel] &= inside & (index_shapes == header_shapes).all(axis=1)
    out = {}
    for k in np.flatnonzero(~same).tolist():
        r = recs[k]
        if not found[k]:
            out[int(mine[k])] = f"tensor {_digest_hex(r)} is missing from shard {name}"
        else:
            out[int(mine[k])] = f"tensor {_digest_hex(r)} in shard {name} disagrees with the index"
    return out


def _gather(rows: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """``rows[mine]`` for ascending record numbers ``mine``: a view where they are one range (a shard's records as
    the writer orders them), else gathered field by field (numpy gathers whole structured records slowly)."""
    if not len(mine) or int(mine[-1]) - int(mine[0]) + 1 == len(mine):
        return rows[int(mine[0]) if len(mine) else 0:int(mine[-1]) + 1 if len(mine) else 0]
    out = np.empty(len(mine), dtype=rows.dtype)
    for name in rows.dtype.names or ():
        out[name] = rows[name][mine]
    return out


def _same_bytes(a: np.ndarray, a_bounds: np.ndarray, a_rows: np.ndarray, b: np.ndarray, b_bounds: np.ndarray,
                b_rows: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """Whether the byte string ``a[a_bounds[i]:a_bounds[i + 1]]`` equals ``b[b_bounds[j]:b_bounds[j + 1]]`` for
    each pair (``i``, ``j``) of ``a_rows`` and ``b_rows``: compared with numpy, ``chunk`` pairs at a time."""
    out = np.zeros(len(a_rows), dtype=bool)
    for lo in range(0, len(a_rows), chunk):
        i, j = a_rows[lo:lo + chunk], b_rows[lo:lo + chunk]
        length = a_bounds[i + 1] - a_bounds[i]
        same = length == b_bounds[j + 1] - b_bounds[j]
        rows = np.flatnonzero(same & (length > 0))
        if len(rows):
            size = length[rows]
            differ = a[ranges(a_bounds[i[rows]], size)] != b[ranges(b_bounds[j[rows]], size)]
            same[rows[np.unique(np.repeat(np.arange(len(rows)), size)[differ])]] = False
        out[lo:lo + chunk] = same
    return out


def _first_outside(begins: np.ndarray, mine: np.ndarray | None, limit: int) -> int | None:
    """The first position among ``mine`` (all if None) whose begin is past ``limit`` (the last begin that leaves
    a tensor's bytes inside its shard's data area), or None."""
    if limit < 0:
        outside = np.ones(len(begins), dtype=bool)
    else:
        outside = begins > np.uint64(limit)
    if mine is not None:
        outside &= mine
    return int(np.argmax(outside)) if outside.any() else None


DIGEST_CHUNK = 1 << 16  # entries whose digests are laid out at once


class _Tables(NamedTuple):
    """The index sections the per-entry path reads field by field (``struct`` over the mapped index: no copy and
    no numpy call per field), with their lengths. Made once the tables were checked against each other."""

    leaf_offsets: memoryview
    skeletons: memoryview
    leaves: memoryview
    rows: memoryview
    records: int
    skeleton_count: int
    shards: int


class _Form(NamedTuple):
    """How the tensors of one (dtype, shape) record are read: into a numpy array of ``array_dtype`` (numpy's own,
    or an integer of the same size for dtypes numpy lacks, then viewed as ``view``), of ``nbytes`` bytes, and the
    ``prefix`` their checksum starts with (:func:`~.format.digest_prefix`). Made once per distinct record layout."""

    array_dtype: np.dtype
    view: torch.dtype | None
    shape: tuple[int, ...]
    nbytes: int
    prefix: bytes


def _array_dtypes() -> dict[int, tuple[np.dtype, torch.dtype | None]]:
    """Per on-disk dtype code: the numpy dtype a tensor's bytes are read as, and the torch dtype to view the
    tensor as where numpy has no equivalent (None where it has)."""
    out: dict[int, tuple[np.dtype, torch.dtype | None]] = {}
    same_size: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype("<i2"), 4: np.dtype("<i4"),
                                      8: np.dtype("<i8")}
    for name, dtype in fmt.TORCH_DTYPE.items():
        if dtype in fmt.NUMPY_DTYPES:
            out[fmt.DTYPE_CODE[name]] = (torch.empty(0, dtype=dtype).numpy().dtype, None)
        elif fmt.ITEMSIZE[name] in same_size:
            out[fmt.DTYPE_CODE[name]] = (same_size[fmt.ITEMSIZE[name]], dtype)
    return out


_ARRAY_DTYPES = _array_dtypes()


class _Slow(Exception):
    """Raised inside the per-entry fast path for anything but a healthy record in an open shard: the entry is then
    read by the general path, which names the problem exactly as it always has."""


def _narrowest(top: int) -> np.dtype:
    """The smallest signed integer dtype holding -1 to ``top``."""
    for dtype in (np.int8, np.int16, np.int32):
        if top <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _narrowed(codes: np.ndarray) -> np.ndarray:
    """``codes`` (integers of -1 and up) in :func:`_narrowest` dtype for its largest value: a byte or two per item
    where a table has few distinct values, rather than eight."""
    dtype = _narrowest(int(codes.max()) if len(codes) else 0)
    return codes if codes.dtype == dtype else codes.astype(dtype)


FIRST_CHUNK = 1 << 16  # codes scanned at once by _first_positions


def _first_positions(codes: np.ndarray, top: int) -> np.ndarray:
    """For each code from 0 to ``top - 1``, the position of an item of ``codes`` that has it (-1 for a code no item
    has); found a chunk at a time, so the memory used does not grow with ``codes``."""
    out = np.full(top, -1, dtype=np.int64)
    for lo in range(0, len(codes), FIRST_CHUNK):
        part = codes[lo:lo + FIRST_CHUNK]
        valid = np.flatnonzero(part >= 0)
        found = np.full(top, -1, dtype=np.int64)
        found[part[valid]] = lo + valid
        out = np.where(out < 0, found, out)
        if int(out.min(initial=0)) >= 0:  # every code found: the rest cannot change the answer
            break
    return out


def _digest_hex(row: np.void) -> str:
    return (int(row["digest_hi"]).to_bytes(8, "big") + int(row["digest_lo"]).to_bytes(8, "big")).hex()


class CacheReader:
    """A read-only view of one committed generation of a cache. Thread-safe; cheap to open."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.path.abspath(os.fspath(path))
        index_path = layout.index_path(self.path)
        if not os.path.isfile(index_path):
            if not os.path.isdir(self.path):
                raise CacheError(f"{self.path}: no such cache directory")
            raise CacheError(f"{self.path}: not a streaming cache (no {layout.INDEX_NAME}); build one first")
        self.index, self._lease = self._open_leased(index_path)
        info = self.index.info
        self.cache_id, self.generation, self._n = info.cache_id, info.generation, info.entries
        self._shard_names = [name for name, _ in info.shards]
        self._manifest_sections = info.manifests
        layout.check_dir(layout.shard_dir(self.path), "shards folder")
        self._shards: dict[int, _Shard | BaseException] = {}
        self._lock = threading.Lock()
        self._open_order: collections.OrderedDict[int, _Shard] = collections.OrderedDict()
        self._excess = 0.0  # moving average of how much longer than a page-cache copy a read takes (seconds)
        self._records: RecordTable | None = None
        self._shard_records: ShardRecords | None = None
        self._last_used: _Shard | None = None
        self._signature_table: tuple[np.ndarray, np.ndarray] | None = None
        self._tables: _Tables | None = None
        # What the per-entry path decodes once and reuses, bounded (cleared when full), never one item per entry:
        # how to read each (dtype code, dimension count, shape start) of records, and each skeleton's builder.
        self._forms: dict[tuple[int, int, int], _Form] = {}
        self._builders: dict[tuple[int, int], Builder] = {}
        self._skeleton_memo: dict[int, bytes] = {}  # by skeleton number: entries sharing one share its bytes
        self._skeleton_bytes = 0

    def _open_leased(self, index_path: str) -> tuple[fmt.IndexFile, leases.Lease | None]:
        """The committed index and a lease on its generation (:mod:`.leases`): the lease is taken after the index
        is read, then the index is looked at again; a commit in between (which may have deleted shards of the
        generation read) means the new generation is opened instead."""
        index = fmt.IndexFile(index_path)
        for _ in range(8):
            lease = leases.take(self.path, index.info.generation, [name for name, _ in index.info.shards])
            if lease is None:
                return index, None
            now = fmt.IndexFile(index_path)
            if now.info.generation == index.info.generation and now.info.cache_id == index.info.cache_id:
                return index, lease
            lease.release()
            index = now
        return index, None

    @property
    def leased(self) -> bool:
        """Whether this reader holds a lease: writers keep the shards of its generation while it is open."""
        return self._lease is not None and self._lease.held

    # ------------------------------------------------------------------------------------------ keys
    def __len__(self) -> int:
        return self._n

    def _sec(self, name: str) -> np.ndarray:
        return self.index.section(name)

    def key_at(self, i: int) -> str:
        self.index.check_tables()
        off = self._sec("keys.offsets")
        a, b = int(off[i]), int(off[i + 1])
        try:
            return self._sec("keys.blob")[a:b].tobytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CacheFormatError(f"{self.index.path}: key of entry {i} is not UTF-8") from exc

    def keys(self) -> Iterator[str]:
        return (self.key_at(i) for i in range(self._n))

    __iter__ = keys

    def index_of(self, key: str) -> int | None:
        """The entry number of ``key``, or None. A binary search over key hashes: no dict is ever built."""
        if not isinstance(key, str) or self._n == 0:
            return None
        self.index.check_tables()
        h = np.uint64(fmt.key_hash(key))
        hashes = self._sec("keys.hash_sorted")
        order = self._sec("keys.hash_order")
        pos = int(np.searchsorted(hashes, h, side="left"))
        while pos < self._n and hashes[pos] == h:
            i = int(order[pos])
            if i < self._n and self.key_at(i) == key:
                return i
            pos += 1
        return None

    def indices_of(self, blob: Any, offsets: np.ndarray) -> np.ndarray:
        """The entry number of each key ``blob[offsets[k]:offsets[k + 1]]`` (UTF-8), -1 where the cache lacks it.

        The keys' hashes are looked up in the index's sorted hash table all at once and every match is confirmed
        by comparing the key's bytes (numpy over all of them); only keys whose hash matches another key's go the
        one-at-a-time way (:meth:`index_of`)."""
        n = len(offsets) - 1
        out = np.full(n, -1, dtype=np.int64)
        if n == 0 or self._n == 0:
            return out
        self.index.check_tables()
        bounds = np.asarray(offsets, dtype=np.int64)
        raw = np.frombuffer(blob, dtype=np.uint8)
        hashes = fmt.key_hashes((raw[a:b].tobytes() for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())), n)
        table, order = self._sec("keys.hash_sorted"), self._sec("keys.hash_order")
        at = np.minimum(np.searchsorted(table, hashes), self._n - 1)
        hit = np.flatnonzero(table[at] == hashes)
        found = order[at[hit]].astype(np.int64)
        mine = self._sec("keys.offsets").astype(np.int64)
        same = _same_bytes(raw, bounds, hit, self._sec("keys.blob"), mine, found)
        out[hit[same]] = found[same]
        for k in hit[~same].tolist():  # another key with the same hash was found first
            i = self.index_of(raw[bounds[k]:bounds[k + 1]].tobytes().decode("utf-8"))
            out[k] = -1 if i is None else i
        return out

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.index_of(key) is not None

    def __getitem__(self, key: str) -> LazyEntry:
        i = self.index_of(key)
        if i is None:
            raise KeyError(key)
        return LazyEntry(self, i, key)

    def entry(self, i: int) -> LazyEntry:
        if not 0 <= i < self._n:
            raise IndexError(f"entry {i} out of range (cache has {self._n})")
        return LazyEntry(self, i, self.key_at(i))

    # ------------------------------------------------------------------------------------------ metadata
    def entry_record(self, i: int) -> EntryRecord:
        """Key, skeleton bytes and tensor record numbers of entry ``i``, bounds-checked against the index."""
        if not 0 <= i < self._n:
            raise IndexError(f"entry {i} out of range (cache has {self._n})")
        key = self.key_at(i)
        tables = self._index_tables()
        lo, hi = _U64_PAIR.unpack_from(tables.leaf_offsets, 8 * i)
        records = struct.unpack_from(f"<{hi - lo}I", tables.leaves, 4 * lo)
        if records and max(records) >= tables.records:
            raise DamagedEntryError(f"{self.path}: entry {key!r} refers to a tensor the index lacks")
        (sid,) = _U32.unpack_from(tables.skeletons, 4 * i)
        if sid >= tables.skeleton_count:
            raise DamagedEntryError(f"{self.path}: entry {key!r} refers to a skeleton the index lacks")
        return EntryRecord(key, self._skeleton(sid), records)

    def _skeleton(self, sid: int) -> bytes:
        """The bytes of skeleton ``sid`` (a valid number), kept while their total stays under a bound."""
        skeleton = self._skeleton_memo.get(sid)
        if skeleton is None:
            off = self._sec("skeletons.offsets")
            skeleton = self._sec("skeletons.blob")[int(off[sid]):int(off[sid + 1])].tobytes()
            if self._skeleton_bytes + len(skeleton) > _MEMO_BYTES:  # bounded in bytes, not only in count
                self._skeleton_memo.clear()
                self._skeleton_bytes = 0
            self._skeleton_memo[sid] = skeleton
            self._skeleton_bytes += len(skeleton)
        return skeleton

    def _index_tables(self) -> _Tables:
        """The sections the per-entry path reads, checked once (:meth:`~.format.IndexFile.check_tables`)."""
        tables = self._tables
        if tables is None:
            self.index.check_tables()
            rows = self._sec("tensors.rows")
            tables = self._tables = _Tables(
                self._sec("entries.leaf_offsets").data, self._sec("entries.skeleton").data,
                self._sec("leaves.tensor").data, rows.data, len(rows), max(0, len(self._sec("skeletons.offsets")) - 1),
                len(self._shard_names))
        return tables

    def tensor_record(self, r: int) -> TensorRecord:
        """Tensor record ``r`` of the index (docs/FORMAT.md section 3), checked against the shape table and shards."""
        shard, dtype, shape, begin, end, digest = fmt.decode_tensor_record(
            self._sec("tensors.rows")[r], self._sec("tensors.shapes"), len(self._shard_names),
            f"{self.index.path}: tensor record {r}")
        return TensorRecord(shard, fmt.TORCH_DTYPE[dtype], shape, begin, end, digest.hex())

    def entry_digest(self, i: int) -> bytes:
        """xxh3-128 of entry ``i``'s skeleton and tensor checksums, from the index: changes whenever its value
        does, also when a key is given a new value."""
        meta = self.entry_record(i)
        h = xxhash.xxh3_128(meta.skeleton)
        for r in meta.tensors:
            h.update(self.tensor_record(r).digest.encode())
        return h.digest()

    def shape_signature(self, i: int) -> int:
        """A hash of entry ``i``'s tensors' dtypes and shapes, in skeleton order: entries whose tensors can be
        stacked together have equal ones."""
        return xxhash.xxh3_64_intdigest(repr([(t.dtype, t.shape) for t in self.tensor_info(i)]).encode())

    def shape_signatures(self) -> np.ndarray:
        """:meth:`shape_signature` of every entry, from the index tables (see :meth:`signature_codes`)."""
        codes, table = self.signature_codes()
        return table[codes]

    def signature_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per entry a small integer code, and per code a :meth:`shape_signature`: entry ``i``'s signature is
        ``table[codes[i]]``. Found once per reader from the index tables (:mod:`.records`), one signature per
        distinct layout, and entry by entry only for the entries the tables leave out (more than
        :data:`~.records.MAX_FAST_LEAVES` tensors, or a damaged record, which raises here naming the entry).

        The codes are the record table's own (a byte or two per entry); no array of signatures is kept, so a
        caller that needs one per entry makes it (``table[codes]``) and owns it."""
        if self._signature_table is None:
            self.index.check_tables()
            shapes = self._table().shapes
            top = int(shapes.max()) + 1 if len(shapes) else 0
            example = _first_positions(shapes, top)
            table = np.zeros(top, dtype=np.uint64)
            for layout_id in np.flatnonzero(example >= 0).tolist():  # any entry of a layout stands for all
                table[layout_id] = self.shape_signature(int(example[layout_id]))
            slow = np.flatnonzero(shapes < 0) if len(shapes) and int(shapes.min()) < 0 else np.zeros(0, np.int64)
            codes = shapes
            if len(slow):
                codes = shapes.astype(_narrowest(top + len(slow)))
                codes[slow] = top + np.arange(len(slow))
                table = np.concatenate([table, np.array([self.shape_signature(i) for i in slow.tolist()],
                                                        dtype=np.uint64)])
            self._signature_table = (codes, table)
        return self._signature_table

    def key_hashes(self) -> np.ndarray:
        """Per entry, the 64-bit xxh3 of its key (:func:`~.format.key_hash`), from the index's hash tables."""
        self.index.check_tables()
        out = np.zeros(self._n, dtype=np.uint64)
        out[self._sec("keys.hash_order").astype(np.int64)] = self._sec("keys.hash_sorted")
        return out

    def entry_digests(self, entries: np.ndarray) -> np.ndarray:
        """:meth:`entry_digest` of each of ``entries`` (valid entry numbers), as rows of 16 bytes: the messages of
        entries with one skeleton and tensor count are laid out side by side with numpy (at most
        :data:`DIGEST_CHUNK` at a time, so the memory used does not grow with the index), and each entry costs
        one hash call."""
        self.index.check_tables()
        entries = np.asarray(entries, dtype=np.int64)
        out = np.empty((len(entries), 16), dtype=np.uint8)
        for lo in range(0, len(entries), DIGEST_CHUNK):
            out[lo:lo + DIGEST_CHUNK] = self._entry_digests(entries[lo:lo + DIGEST_CHUNK])
        return out

    def _entry_digests(self, entries: np.ndarray) -> np.ndarray:
        out = np.empty((len(entries), 16), dtype=np.uint8)
        skeleton = self._sec("entries.skeleton")[entries].astype(np.int64)
        lo = self._sec("entries.leaf_offsets")[entries].astype(np.int64)
        count = self._sec("entries.leaf_offsets")[entries + 1].astype(np.int64) - lo
        rows = self._sec("tensors.rows")
        hex_digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
        group = factorize(np.stack([skeleton, count], axis=1))
        for g in range(int(group.max()) + 1 if len(group) else 0):
            sel = np.flatnonzero(group == g)
            first = int(entries[sel[0]])
            meta = self.entry_record(first)  # checks the skeleton and records of one entry of the group
            n = len(meta.tensors)
            records = self._sec("leaves.tensor")[lo[sel][:, None] + np.arange(n)].astype(np.int64)
            if n and int(records.max()) >= len(rows):
                raise DamagedEntryError(f"{self.path}: an entry refers to a tensor the index lacks")
            words = np.stack([rows["digest_hi"][records], rows["digest_lo"][records]], axis=2).astype(">u8")
            nibbles = words.view(np.uint8).reshape(len(sel), n * 16, 1) >> np.array([4, 0], dtype=np.uint8) & 15
            message = np.empty((len(sel), len(meta.skeleton) + n * 32), dtype=np.uint8)
            message[:, :len(meta.skeleton)] = np.frombuffer(meta.skeleton, dtype=np.uint8)
            message[:, len(meta.skeleton):] = hex_digits[nibbles.reshape(len(sel), n * 32)]
            hashed = b"".join([xxhash.xxh3_128_digest(m.data) for m in message])
            out[sel] = np.frombuffer(hashed, dtype=np.uint8).reshape(-1, 16)
        return out

    def tensor_info(self, i: int) -> list[TensorInfo]:
        """Dtype, shape, size, checksum and shard of entry ``i``'s tensors, in skeleton order, from the index."""
        out = []
        for r in self.entry_record(i).tensors:
            t = self.tensor_record(r)
            out.append(TensorInfo(fmt.SAFETENSORS_NAME[t.dtype], t.shape, t.end - t.begin, t.digest,
                                  self._shard_names[t.shard]))
        return out

    @property
    def manifests(self) -> list[str]:
        return sorted(self._manifest_sections)

    def manifest(self, name: str) -> Any:
        """Manifest ``name`` as parsed JSON (a dataset manifest is a dict, docs/FORMAT.md section 6)."""
        try:
            return json.loads(self.manifest_bytes(name))
        except (ValueError, RecursionError) as exc:
            raise CacheFormatError(f"{self.index.path}: manifest {name!r} is not valid JSON") from exc

    def manifest_bytes(self, name: str) -> bytes:
        """The raw JSON of manifest ``name`` (see :class:`streaming_cache.manifest.Manifest` to parse it)."""
        sec = self._manifest_sections.get(name)
        if sec is None:
            raise KeyError(f"{self.path}: no manifest named {name!r} (have: {', '.join(self.manifests) or 'none'})")
        return self.index.section(sec).tobytes()

    def stored_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.index.info.shards)

    # ------------------------------------------------------------------------------------------ tensors
    def _shard(self, sid: int) -> _Shard:
        shard = self._shards.get(sid)
        if shard is None:
            with self._lock:
                shard = self._shards.get(sid)
                if shard is None:
                    if not 0 <= sid < len(self._shard_names):
                        shard = CacheFormatError(f"{self.path}: index refers to shard #{sid}, which it does not list")
                    else:
                        path = layout.shard_path(self.path, self._shard_names[sid])
                        try:
                            shard = _Shard(path, self._sec("tensors.rows"), self._sec("tensors.shapes"),
                                           lambda: self._by_shard().of(sid),
                                           self.index.info.shard_headers.get(self._shard_names[sid]))
                        except FileNotFoundError:
                            shard = self._missing_shard_error(path)
                        except CacheFormatError as exc:
                            shard = exc
                        except (OSError, ValueError) as exc:
                            shard = CacheFormatError(f"{path}: shard cannot be read ({exc}); the cache is "
                                                     "damaged, run verify and rebuild the affected entries")
                    self._shards[sid] = shard
        if isinstance(shard, BaseException):
            raise shard
        return shard

    def _missing_shard_error(self, path: str) -> CacheError:
        try:
            now = fmt.IndexFile(layout.index_path(self.path)).header.get("generation")
        except (OSError, CacheFormatError):
            now = None
        if now is not None and now != self.generation:
            return StaleCacheError(f"{self.path}: shard {os.path.basename(path)} was removed by a later write "
                                   f"(generation {self.generation} -> {now}); open the cache again")
        return CacheFormatError(f"{path}: shard file is missing; the cache is damaged, rebuild the affected entries")

    def _source(self, r: int, key: str | None) -> tuple[_Shard, TensorRecord]:
        """The shard and record of tensor record ``r``, checked against each other before any byte is read or
        any buffer allocated. Problems with it damage the entry ``key`` (named in the error); a cache rewritten
        since this reader opened raises StaleCacheError."""
        try:
            record = self.tensor_record(r)
            shard = self._shards.get(record.shard)
            if not isinstance(shard, _Shard):
                shard = self._shard(record.shard)
            if shard.bad and r in shard.bad:
                raise CacheFormatError(shard.bad[r])
            if shard.outside(record.end):
                raise CacheFormatError(f"tensor {record.digest} lies outside shard {shard.name}")
        except StaleCacheError:
            raise
        except CacheError as exc:
            if key is None:
                raise
            raise DamagedEntryError(f"{self.path}: entry {key!r}: {exc}") from exc
        return shard, record

    def _tensor(self, r: int, key: str | None, copy: bool) -> torch.Tensor:
        shard, t = self._source(r, key)
        nbytes = t.end - t.begin
        if nbytes == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        if copy and _HAS_PREADV:  # one copy from the page cache into memory the caller owns, by one read
            raw = torch.empty(nbytes, dtype=torch.uint8)
            self._read([(shard, t.begin, raw.numpy().data)], key)
            return raw.view(t.dtype).reshape(t.shape)
        mapping = shard.mapping()
        raw = torch.frombuffer(mapping, dtype=torch.uint8, offset=shard.data_start + t.begin, count=nbytes)
        if copy:
            self._check_sizes([shard], key)
            raw = raw.clone()
        return raw.view(t.dtype).reshape(t.shape)

    def _reads(self, nbytes: int) -> bool:
        """Whether tensors of ``nbytes`` are read with explicit reads rather than copied from the mappings: large
        ones always (no page faults, no page-table churn), and any while reads are slow (a disk, a network drive:
        a read releases the GIL and runs beside others, a page fault holds it and runs alone). Small tensors in
        the page cache are copied from the mapping, which costs no system call per tensor."""
        return _HAS_PREADV and (nbytes >= PREAD_MIN_BYTES or self._excess > SLOW_READ_S)

    def _copy_mapped(self, shards: list[_Shard], begins: np.ndarray, dst: np.ndarray, key: str) -> None:
        """Copy each row of ``dst`` from its shard's mapping at its offset, timing the copies as reads are."""
        self._check_sizes(list(dict.fromkeys(shards)), key)
        started = time.perf_counter()
        width = dst.shape[1]
        arrays: dict[int, np.ndarray] = {}
        for k, shard in enumerate(shards):
            array = arrays.get(id(shard))
            if array is None:
                array = arrays[id(shard)] = np.frombuffer(shard.mapping(), dtype=np.uint8)  # type: ignore[arg-type]
            a = shard.data_start + int(begins[k])
            dst[k] = array[a:a + width]
        self._note(time.perf_counter() - started, dst.size, len(shards))

    def _note(self, seconds: float, nbytes: int, reads: int) -> None:
        """Fold the time ``reads`` reads of ``nbytes`` in all took into the moving average of their excess over
        a copy from the page cache (races between I/O threads only blur it)."""
        excess = (seconds - nbytes / PAGE_CACHE_BYTES_PER_S) / max(1, reads)
        self._excess += 0.125 * (max(0.0, excess) - self._excess)

    def _read(self, jobs: list[tuple[_Shard, int, memoryview]], key: str | None) -> None:
        """Fill each job's buffer with its shard's bytes at its offset. While reads are as fast as copies from
        the page cache they run here one after the other; when they take longer (a disk, a network drive), up to
        :data:`IO_DEPTH` run at once on the I/O threads, so the storage always has requests in flight."""
        shards = list({id(shard): shard for shard, _, _ in jobs}.values())
        fds = {id(shard): shard.acquire() for shard in shards}
        try:
            if len(jobs) > 1 and self._excess > SLOW_READ_S:
                futures = [_io_pool().submit(self._timed_read, shard, begin, dst, fds[id(shard)])
                           for shard, begin, dst in jobs]
                for f in futures:
                    f.result()
            else:
                for shard, begin, dst in jobs:
                    self._timed_read(shard, begin, dst, fds[id(shard)])
        except CacheFormatError as exc:
            raise DamagedEntryError(f"{self.path}: entry {key!r}: {exc}") from exc
        finally:
            for shard in shards:
                shard.release()
            self._keep_open(shards)

    def _timed_read(self, shard: _Shard, begin: int, dst: memoryview, fd: int) -> None:
        started = time.perf_counter()
        shard.read_into(begin, dst, fd)
        self._note(time.perf_counter() - started, len(dst), 1)

    def _keep_open(self, used: list[_Shard]) -> None:
        """Remember the shards just read as recently used; close the descriptors of the least recently used
        beyond :data:`MAX_OPEN_SHARDS` (unless a read is using them). While fewer are open nothing is closed, so
        a shard already remembered is not moved (the order matters only once the limit is reached)."""
        if len(used) == 1 and (self._last_used is used[0] or (
                len(self._open_order) < MAX_OPEN_SHARDS and id(used[0]) in self._open_order)):
            return
        self._last_used = used[-1]
        with self._lock:
            for shard in used:
                self._open_order[id(shard)] = shard
                self._open_order.move_to_end(id(shard))
            excess = len(self._open_order) - MAX_OPEN_SHARDS
            if excess > 0:
                for k in list(itertools.islice(self._open_order, excess)):
                    if self._open_order[k].close_idle():
                        del self._open_order[k]

    def _check_sizes(self, shards: list[_Shard], key: str | None) -> None:
        checked: set[int] = set()
        for shard in shards:
            if id(shard) not in checked:
                checked.add(id(shard))
                try:
                    shard.check_size()
                except CacheFormatError as exc:
                    raise DamagedEntryError(f"{self.path}: entry {key!r}: {exc}") from exc

    def _decode(self, meta: EntryRecord, load: Callable[[int, bool], Any]) -> Any:
        where = f"{self.path}: entry {meta.key!r}"
        try:
            return decode_skeleton(meta.skeleton, len(meta.tensors), load, where)
        except (DamagedEntryError, StaleCacheError):
            raise
        except CacheFormatError as exc:
            raise DamagedEntryError(str(exc)) from exc

    def _materialize(self, i: int, mode: str, check: bool = False) -> Any:
        """Entry ``i`` with copied (``"copy"``) or shared (``"view"``) tensors, or only its skeleton checked
        (``"skip"``)."""
        meta = self.entry_record(i)
        loaded: dict[int, torch.Tensor] = {}

        def load(j: int, as_numpy: bool) -> Any:
            if mode == "skip":
                return None
            t = loaded.get(j)
            if t is None:  # a tensor referenced twice in one entry comes back as one object
                t = self._tensor(meta.tensors[j], meta.key, copy=mode != "view")
                if check:
                    got = fmt.tensor_digest(fmt.SAFETENSORS_NAME[t.dtype], tuple(t.shape), fmt.tensor_bytes(t))
                    if got.hex() != self.tensor_record(meta.tensors[j]).digest:
                        raise DamagedEntryError(f"{self.path}: entry {meta.key!r}: tensor {j} fails its checksum; "
                                                "the shard is damaged. Run verify, then rebuild the damaged entries")
                loaded[j] = t
            return t.numpy() if as_numpy else t

        return self._decode(meta, load)

    def materialize(self, i: int, *, check: bool = False) -> Any:
        """Entry ``i`` as it was put, with tensors the caller owns (see the module docstring)."""
        if _HAS_PREADV:
            try:
                return self._copy(i, check)
            except _Slow:
                pass
        return self._materialize(i, "copy", check)

    def _copy(self, i: int, check: bool) -> Any:
        """:meth:`materialize` the short way, for an entry whose records are healthy and whose shards are open:
        the entry's fields read with ``struct`` from the mapped index, its skeleton's builder and each record's
        :class:`_Form` decoded once and reused, and each tensor read by one positioned read into a numpy array
        the tensor is made over. Raises :class:`_Slow` for anything else, before any of its bytes are read."""
        tables = self._tables if self._tables is not None else self._index_tables()
        if not 0 <= i < self._n:
            raise IndexError(f"entry {i} out of range (cache has {self._n})")
        lo, hi = _U64_PAIR.unpack_from(tables.leaf_offsets, 8 * i)
        count = hi - lo
        (sid,) = _U32.unpack_from(tables.skeletons, 4 * i)
        build = self._builders.get((sid, count))
        if build is None:
            build = self._builder(i, sid, count)
        records = _U32.unpack_from(tables.leaves, 4 * lo) if count == 1 else \
            struct.unpack_from(f"<{count}I", tables.leaves, 4 * lo)
        loaded: list[torch.Tensor | None] = [None] * count

        def load(j: int, as_numpy: bool) -> Any:
            t = loaded[j]
            if t is None:  # a tensor referenced twice in one entry comes back as one object
                t = loaded[j] = self._copy_tensor(records[j], i, j, check)
            return t.numpy() if as_numpy else t

        return build(load, {})

    def _builder(self, i: int, sid: int, count: int) -> Builder:
        """The builder of skeleton ``sid`` with ``count`` tensors (entry ``i`` uses it), remembered; :class:`_Slow`
        if the skeleton or its number is bad (the general path then names the problem)."""
        tables = self._tables
        assert tables is not None
        if sid >= tables.skeleton_count:
            raise _Slow
        try:
            build = compile_skeleton(self._skeleton(sid), count, f"{self.path}: entry {self.key_at(i)!r}")
        except CacheFormatError:
            raise _Slow from None
        if len(self._builders) >= _MAX_FORMS:
            self._builders.clear()
        self._builders[(sid, count)] = build
        return build

    def _copy_tensor(self, r: int, i: int, j: int, check: bool) -> torch.Tensor:
        """Tensor ``j`` (record ``r``) of entry ``i``, read by one positioned read into memory the caller owns;
        :class:`_Slow` for a record that is not healthy or whose shard is not open yet and cannot be opened."""
        tables = self._tables
        assert tables is not None
        if r >= tables.records:
            raise _Slow
        shard_id, code, ndim, _, begin, end, hi, lo, start = _ROW.unpack_from(tables.rows, 48 * r)
        form = self._forms.get((code, ndim, start))
        if form is None:
            form = self._form(code, ndim, start)
        array_dtype, view, shape, nbytes, prefix = form
        if shard_id >= tables.shards or end - begin != nbytes:
            raise _Slow
        shard = self._shards.get(shard_id)
        if type(shard) is not _Shard:
            shard = self._open_shard(shard_id)
        if shard.outside(end) or (shard.bad and r in shard.bad):
            raise _Slow
        raw = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            self._read_one(shard, begin, raw, i)
        if check and fmt.prefixed_digest(prefix, raw.data) != hi.to_bytes(8, "big") + lo.to_bytes(8, "big"):
            raise DamagedEntryError(f"{self.path}: entry {self.key_at(i)!r}: tensor {j} fails its checksum; the "
                                    "shard is damaged. Run verify, then rebuild the damaged entries")
        t = torch.from_numpy(raw.view(array_dtype).reshape(shape))
        return t if view is None else t.view(view)

    def _form(self, code: int, ndim: int, start: int) -> _Form:
        """How records of dtype ``code`` and the shape at ``start`` of the shape table are read, remembered;
        :class:`_Slow` for an unknown dtype or a shape outside the table or that no tensor can have."""
        shapes = self._sec("tensors.shapes")
        dtypes = _ARRAY_DTYPES.get(code)
        if dtypes is None or start + ndim > len(shapes):
            raise _Slow
        name = fmt.DTYPE_NAMES[code]
        shape = tuple(shapes[start:start + ndim].tolist())
        nbytes = fmt.shape_bytes(name, shape)
        if nbytes < 0:
            raise _Slow
        form = _Form(dtypes[0], dtypes[1], shape, nbytes, fmt.digest_prefix(name, shape))
        if len(self._forms) >= _MAX_FORMS:
            self._forms.clear()
        self._forms[(code, ndim, start)] = form
        return form

    def _open_shard(self, sid: int) -> _Shard:
        """Shard ``sid`` for the fast path: opened here; :class:`_Slow` if it cannot be (the general path then
        raises what went wrong, naming the entry)."""
        try:
            return self._shard(sid)
        except StaleCacheError:
            raise
        except CacheError:
            raise _Slow from None

    def _read_one(self, shard: _Shard, begin: int, dst: np.ndarray, i: int) -> None:
        """Fill ``dst`` (bytes) from ``shard`` at ``begin`` of its data area by positioned reads, timed as
        :meth:`_read` times them; a short read damages entry ``i``."""
        fd = shard.acquire()
        try:
            started = time.perf_counter()
            shard.read_into(begin, dst.data, fd)
            self._note(time.perf_counter() - started, len(dst), 1)
        except CacheFormatError as exc:
            raise DamagedEntryError(f"{self.path}: entry {self.key_at(i)!r}: {exc}") from exc
        finally:
            shard.release()
        self._keep_open([shard])

    def views(self, i: int) -> Any:
        """Entry ``i`` with read-only-by-contract views of the shared mapping: copy before writing."""
        return self._materialize(i, "view")

    def collate(self, indices: Sequence[int], pin: bool = False,
                allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> Any:
        """Entries ``indices`` as one batch: tensors stacked along a new first dimension, other leaves as lists.

        When the entries share one skeleton and their tensors' shapes (the normal case inside a shape bucket),
        the skeleton is decoded once, the batch's index records are looked up and checked all at once, and each
        entry's bytes are read straight from its shard into the batch tensor: one copy, no per-entry objects.
        Otherwise each entry is viewed and stacked. The batch tensors come from ``allocate(shape, dtype)`` if
        given, else from the process's pool of reused buffers (``buffers.shared_pool``; pinned, page-locked, for
        fast host-to-device copies with ``pin=True``); they are the caller's until dropped.
        """
        if len(indices) == 0:
            raise CacheError("cannot collate an empty batch")
        allocate = allocate if allocate is not None else shared_pool(pin).empty
        plan = self._plan(np.asarray(indices, dtype=np.int64))
        if plan is None:
            metas = [self.entry_record(int(i)) for i in indices]
            self._check_sizes([self._source(r, m.key)[0] for m in metas for r in m.tensors], metas[0].key)
            return collate([self.views(int(i)) for i in indices], pin)
        first, leaves = plan
        n = len(indices)
        batched: dict[int, torch.Tensor] = {}

        def load(j: int, as_numpy: bool) -> torch.Tensor:
            out = batched.get(j)
            if out is None:
                dtype, shape, shards, begins = leaves[j]
                out = batched[j] = allocate((n, *shape), dtype)
                if out.numel():
                    dst = out.reshape(n, -1).view(torch.uint8).numpy()
                    if self._reads(dst.shape[1]):
                        self._read([(shards[k], int(begins[k]), dst[k].data) for k in range(n)], first.key)
                    else:
                        self._copy_mapped(shards, begins, dst, first.key)
            return out

        key = first.key if n == 1 else f"{first.key}..{self.key_at(int(indices[-1]))}"
        return replicate(self._decode(EntryRecord(key, first.skeleton, first.tensors), load), n)

    def _plan(self, idx: np.ndarray) -> tuple[EntryRecord, list[tuple[torch.dtype, tuple[int, ...], list[_Shard],
                                                                  np.ndarray]]] | None:
        """How to read a batch of entries ``idx`` that share one skeleton and their tensors' dtypes and shapes:
        the first entry's record and, per leaf, its dtype, shape, each entry's shard and the offset of its bytes,
        from the reader's :class:`~.records.RecordTable` (a few array lookups for the whole batch). None when the
        entries differ or one of them must be read on its own (the caller then stacks entry by entry)."""
        if idx.min() < 0 or idx.max() >= self._n:
            raise IndexError(f"entry out of range (cache has {self._n})")
        self.index.check_tables()
        table = self._table()
        layout = table.layout[idx]
        if layout[0] < 0 or (layout != layout[0]).any():
            return None
        first = self.entry_record(int(idx[0]))
        lo = self._sec("entries.leaf_offsets")[idx].astype(np.int64)
        records = self._sec("leaves.tensor")[lo[:, None] + np.arange(len(first.tensors))].astype(np.int64)
        leaves = []
        for j, r in enumerate(first.tensors):
            shard0, t = self._source(r, first.key)  # the first entry's record, checked in full
            column = records[:, j]
            shard_ids = table.shard[column]
            shards: list[_Shard] = []
            begins = table.begin[column]
            single = bool((shard_ids == t.shard).all())
            for sid in ([t.shard] if single else np.unique(shard_ids).tolist()):
                shard = shard0 if sid == t.shard else self._shard_for(sid, int(idx[np.argmax(shard_ids == sid)]))
                mine = None if single else shard_ids == sid
                if shard.bad:
                    damaged = np.flatnonzero((shard_ids == sid) & np.isin(column, list(shard.bad)))
                    if len(damaged):
                        k = int(damaged[0])
                        raise DamagedEntryError(f"{self.path}: entry {self.key_at(int(idx[k]))!r}: "
                                                f"{shard.bad[int(column[k])]}")
                past = _first_outside(begins, mine, shard.data_len - (t.end - t.begin))
                if past is not None:
                    raise DamagedEntryError(f"{self.path}: entry {self.key_at(int(idx[past]))!r}: tensor "
                                            f"{_digest_hex(self._sec('tensors.rows')[int(column[past])])} lies "
                                            f"outside shard {shard.name}")
                shards.append(shard)
            if len(shards) == 1:
                per_entry = shards * len(idx)
            else:
                by_id = {shard_id: shards[i] for i, shard_id in enumerate(np.unique(shard_ids).tolist())}
                per_entry = [by_id[sid] for sid in shard_ids.tolist()]
            leaves.append((t.dtype, t.shape, per_entry, begins))
        return first, leaves

    def _table(self) -> RecordTable:
        """The index as numpy tables (:mod:`.records`), built on first use."""
        if self._records is None:
            with self._lock:
                if self._records is None:
                    skel_off = self._sec("skeletons.offsets")
                    table = record_table(self._sec("tensors.rows"), self._sec("tensors.shapes"),
                                         len(self._shard_names), self._sec("entries.skeleton"),
                                         max(0, len(skel_off) - 1), self._sec("entries.leaf_offsets"),
                                         self._sec("leaves.tensor"))
                    layout = _narrowed(table.layout)
                    shapes = layout if table.shapes is table.layout else _narrowed(table.shapes)
                    self._records = RecordTable(table.ok, table.begin, table.shard, layout, shapes)
        return self._records

    def _by_shard(self) -> ShardRecords:
        """Which tensor records each shard holds (:mod:`.records`), found on first use: a shard's first touch then
        looks at its own records only, whatever the size of the index."""
        if self._shard_records is None:
            found = shard_records(self._sec("tensors.rows")["shard"], len(self._shard_names))
            if found.order is not None:
                found = ShardRecords(_narrowed(found.order), found.starts)
            self._shard_records = found
        return self._shard_records

    def _shard_for(self, sid: int, entry: int) -> _Shard:
        """Shard ``sid``, used by entry ``entry``: its problems name the entry."""
        shard = self._shards.get(sid)
        if type(shard) is _Shard:
            return shard
        try:
            return self._shard(sid)
        except StaleCacheError:
            raise
        except CacheError as exc:
            raise DamagedEntryError(f"{self.path}: entry {self.key_at(entry)!r}: {exc}") from exc

    # ------------------------------------------------------------------------------------------ verify
    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Recompute every tensor's checksum and read every skeleton; name each damaged entry.

        Damage in one shard or entry does not stop the check of the others.
        """
        report = VerifyReport(entries=self._n)
        try:
            for name in fmt.SECTION_DTYPES:
                self._sec(name)
            rows = self._sec("tensors.rows")
        except CacheFormatError as exc:
            report.problems.append(str(exc))
            return report
        bad_rows: dict[int, str] = {}
        total = int((rows["end"] - rows["begin"]).sum()) if len(rows) else 0
        done = 0
        for r in range(len(rows)):
            row = rows[r]
            try:
                t = self._tensor(r, None, copy=False)
                digest = fmt.tensor_digest(fmt.SAFETENSORS_NAME[t.dtype], tuple(t.shape), fmt.tensor_bytes(t))
                if digest.hex() != _digest_hex(row):
                    bad_rows[r] = f"tensor {_digest_hex(row)} fails its checksum (damaged bytes)"
                report.bytes += t.numel() * t.element_size()
                report.tensors += 1
            except (CacheError, OSError, KeyError, IndexError, ValueError, RuntimeError) as exc:
                bad_rows[r] = str(exc)
            done += int(row["end"]) - int(row["begin"])
            if progress:
                progress(done, total)
        for i in range(self._n):
            try:
                key = self.key_at(i)
            except CacheFormatError as exc:
                report.problems.append(str(exc))
                continue
            try:
                records = self.entry_record(i).tensors
                bad = next((bad_rows[r] for r in records if r in bad_rows), None)
                if bad is None:
                    self._materialize(i, "skip")
                else:
                    report.damaged[key] = bad
            except CacheError as exc:
                report.damaged[key] = str(exc)
        return report

    def close(self) -> None:
        """Release file descriptors and the lease. Tensors already materialized stay valid (they keep their
        mappings)."""
        with self._lock:
            self._shards.clear()
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CacheReader({self.path!r}, entries={self._n}, generation={self.generation})"


class LazyEntry:
    """A handle on one entry: metadata from the index now, tensor bytes only on :meth:`materialize`."""

    __slots__ = ("reader", "index", "key")

    def __init__(self, reader: CacheReader, index: int, key: str):
        self.reader, self.index, self.key = reader, index, key

    @property
    def tensors(self) -> list[TensorInfo]:
        return self.reader.tensor_info(self.index)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def materialize(self, *, check: bool = False) -> Any:
        """The value as it was put. ``check=True`` also verifies each tensor's checksum."""
        return self.reader.materialize(self.index, check=check)

    def __repr__(self) -> str:
        return f"LazyEntry({self.key!r}, tensors={len(self.tensors)})"


def open_cache(path: str | os.PathLike[str]) -> CacheReader:
    """Open a cache for reading. Reads only the index header; see :class:`CacheReader`."""
    return CacheReader(path)
