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

import json
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from . import format as fmt
from . import layout
from .collate import collate, replicate
from .errors import CacheError, CacheFormatError, DamagedEntryError, StaleCacheError
from .skeleton import decode_skeleton

log = logging.getLogger("streaming_cache")
_MEMO_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor as the index describes it: safetensors dtype name, shape and size; also its checksum
    (hex xxh3-128, FORMAT.md section 4) and the shard file holding it, which equality and repr leave out."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str = field(default="", compare=False, repr=False)
    shard: str = field(default="", compare=False, repr=False)


class TensorRecord(NamedTuple):
    """A decoded ``tensors.rows`` record (FORMAT.md section 3), bounds-checked against the index."""

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


class _Shard:
    """An open shard: its header checked against the index, its bytes mapped privately (copy-on-write: nothing
    done through the mapping can ever reach the file). A shard truncated in place while mapped (``cp`` or
    ``rsync --inplace`` over it) is noticed before bytes are copied out of the mapping, which would otherwise
    kill the process with SIGBUS."""

    def __init__(self, path: str, rows: np.ndarray, shapes: np.ndarray, shard_id: int):
        self.path = path
        with layout.open_reader(path, "shard") as f:
            st = os.fstat(f.fileno())
            self.size = size = st.st_size
            self.inode = (st.st_dev, st.st_ino)
            self.data_start, tensors = fmt.read_shard_header(f, size, path)
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.array = np.frombuffer(self.map, dtype=np.uint8) if self.map is not None else np.zeros(0, np.uint8)
        self.bad: dict[int, str] = {}
        for i in np.flatnonzero(rows["shard"] == shard_id).tolist():
            r = rows[i]
            t = tensors.get(_digest_hex(r))
            dtype = fmt.DTYPE_NAMES[r["dtype"]] if r["dtype"] < len(fmt.DTYPE_NAMES) else "?"
            shape = tuple(shapes[r["shape_start"]:r["shape_start"] + r["ndim"]].tolist())
            if t is None:
                self.bad[i] = f"tensor {_digest_hex(r)} is missing from shard {os.path.basename(path)}"
            elif (t.dtype, t.shape, t.begin, t.end) != (dtype, shape, int(r["begin"]), int(r["end"])):
                self.bad[i] = f"tensor {t.name} in shard {os.path.basename(path)} disagrees with the index"


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
        self.index = fmt.IndexFile(index_path)
        info = self.index.info
        self.cache_id, self.generation, self._n = info.cache_id, info.generation, info.entries
        self._shard_names = [name for name, _ in info.shards]
        self._manifest_sections = info.manifests
        layout.check_dir(layout.shard_dir(self.path), "shards folder")
        self._shards: dict[int, _Shard | BaseException] = {}
        self._lock = threading.Lock()
        # Decoded index records, so the hot path does no numpy record access. Bounded: cleared when full.
        self._record_memo: dict[int, TensorRecord] = {}
        self._entry_memo: dict[int, EntryRecord] = {}
        self._skeleton_memo: dict[int, bytes] = {}  # by skeleton number: entries sharing one share its bytes
        self._skeleton_bytes = 0

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
        meta = self._entry_memo.get(i)
        if meta is not None:
            return meta
        if not 0 <= i < self._n:
            raise IndexError(f"entry {i} out of range (cache has {self._n})")
        key = self.key_at(i)
        off = self._sec("entries.leaf_offsets")
        records = tuple(self._sec("leaves.tensor")[int(off[i]):int(off[i + 1])].tolist())
        if records and max(records) >= len(self._sec("tensors.rows")):
            raise DamagedEntryError(f"{self.path}: entry {key!r} refers to a tensor the index lacks")
        skel_off = self._sec("skeletons.offsets")
        sid = int(self._sec("entries.skeleton")[i])
        if sid + 1 >= len(skel_off):
            raise DamagedEntryError(f"{self.path}: entry {key!r} refers to a skeleton the index lacks")
        skeleton = self._skeleton_memo.get(sid)
        if skeleton is None:
            skeleton = self._sec("skeletons.blob")[int(skel_off[sid]):int(skel_off[sid + 1])].tobytes()
            if self._skeleton_bytes + len(skeleton) > _MEMO_BYTES:  # bounded in bytes, not only in count
                self._skeleton_memo.clear()
                self._entry_memo.clear()
                self._skeleton_bytes = 0
            self._skeleton_memo[sid] = skeleton
            self._skeleton_bytes += len(skeleton)
        if len(self._entry_memo) >= 100_000:
            self._entry_memo.clear()
        meta = self._entry_memo[i] = EntryRecord(key, skeleton, records)
        return meta

    def tensor_record(self, r: int) -> TensorRecord:
        """Tensor record ``r`` of the index (FORMAT.md section 3), checked against the shape table and shards."""
        meta = self._record_memo.get(r)
        if meta is not None:
            return meta
        shard, dtype, shape, begin, end, digest = fmt.decode_tensor_record(
            self._sec("tensors.rows")[r], self._sec("tensors.shapes"), len(self._shard_names),
            f"{self.index.path}: tensor record {r}")
        if len(self._record_memo) >= 200_000:
            self._record_memo.clear()
        meta = self._record_memo[r] = TensorRecord(shard, fmt.TORCH_DTYPE[dtype], shape, begin, end, digest.hex())
        return meta

    def entry_digest(self, i: int) -> bytes:
        """xxh3-128 of entry ``i``'s skeleton and tensor checksums, from the index: changes whenever its value
        does, also when a key is given a new value."""
        meta = self.entry_record(i)
        h = xxhash.xxh3_128(meta.skeleton)
        for r in meta.tensors:
            h.update(self.tensor_record(r).digest.encode())
        return h.digest()

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
        """Manifest ``name`` as parsed JSON (a dataset manifest is a dict, FORMAT.md section 6)."""
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
                            shard = _Shard(path, self._sec("tensors.rows"), self._sec("tensors.shapes"), sid)
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
        record = self._record_memo.get(r)
        if record is not None:  # the hot path: a known record in an open, healthy shard
            shard = self._shards.get(record.shard)
            if type(shard) is _Shard and not (shard.bad and r in shard.bad):
                return shard, record
        try:
            record = self.tensor_record(r)
            shard = self._shards.get(record.shard)
            if not isinstance(shard, _Shard):
                shard = self._shard(record.shard)
            if shard.bad and r in shard.bad:
                raise CacheFormatError(shard.bad[r])
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
        raw = torch.frombuffer(shard.map, dtype=torch.uint8, offset=shard.data_start + t.begin, count=nbytes)
        if copy:
            self._check_sizes([shard], key)
            raw = raw.clone()  # one copy from the page cache into memory the caller owns
        return raw.view(t.dtype).reshape(t.shape)

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
        return self._materialize(i, "copy", check)

    def views(self, i: int) -> Any:
        """Entry ``i`` with read-only-by-contract views of the shared mapping: copy before writing."""
        return self._materialize(i, "view")

    def collate(self, indices: Sequence[int], pin: bool = False) -> Any:
        """Entries ``indices`` as one batch: tensors stacked along a new first dimension, other leaves as lists.

        When the entries share one skeleton and their tensors' shapes (the normal case inside a shape bucket),
        the skeleton is decoded once and each entry's bytes are copied straight from the mapping into the
        batch tensor: one copy, no per-entry objects. Otherwise each entry is viewed and stacked.
        ``pin=True`` allocates the batch in pinned (page-locked) memory for fast host-to-device copies.
        """
        metas = [self.entry_record(int(i)) for i in indices]
        if not metas:
            raise CacheError("cannot collate an empty batch")
        first = metas[0]
        layouts = [self.tensor_record(r)[1:3] for r in first.tensors]  # (dtype, shape) per leaf
        uniform = all(m.skeleton == first.skeleton and len(m.tensors) == len(first.tensors) for m in metas) and all(
            self.tensor_record(r)[1:3] == layouts[j] for m in metas[1:] for j, r in enumerate(m.tensors))
        if not uniform:
            self._check_sizes([self._source(r, m.key)[0] for m in metas for r in m.tensors], first.key)
            return collate([self.views(int(i)) for i in indices], pin)
        n = len(metas)
        batched: dict[int, torch.Tensor] = {}

        def load(j: int, as_numpy: bool) -> torch.Tensor:
            out = batched.get(j)
            if out is None:
                dtype, shape = layouts[j]
                sources = [self._source(meta.tensors[j], meta.key) for meta in metas]  # checked before allocating
                out = batched[j] = torch.empty((n, *shape), dtype=dtype, pin_memory=pin)
                if out.numel():
                    self._check_sizes([shard for shard, _ in sources], first.key)
                    dst = out.reshape(n, -1).view(torch.uint8).numpy()
                    for k, (shard, t) in enumerate(sources):
                        dst[k] = shard.array[shard.data_start + t.begin:shard.data_start + t.end]
            return out

        batch_meta = EntryRecord(f"{first.key}..{metas[-1].key}", first.skeleton, first.tensors)
        return replicate(self._decode(batch_meta, load), n)

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
        """Release file descriptors. Tensors already materialized stay valid (they keep their mappings)."""
        with self._lock:
            self._shards.clear()

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
