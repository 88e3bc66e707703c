"""Writing a cache: buffered puts, shard files, atomic commits, the writer lock and compaction.

Commit protocol (what makes a kill at any instant safe): tensor bytes go to a shard written under a temporary
name, fsynced, then renamed; the index is written under a temporary name, fsynced, renamed over the old one,
and the directory is fsynced. The rename of the index is the single commit point. Files left by a crash (a
temporary file, or a shard no index lists) are removed the next time a writer opens the cache.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import math
import mmap
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from . import format as fmt
from . import layout, leases
from .errors import CacheError, CacheFormatError, UnsupportedValueError
from .lock import WriterLock
from .skeleton import check_array, check_tensor, collect_leaves, decode_skeleton, encode_skeleton

log = logging.getLogger("streaming_cache")

DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
_HEADER_SLACK = 4096  # a shard header's metadata and padding
_WRITE_BYTES = 8 << 20
MAX_KEY_BYTES = 4096


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise CacheError(f"cache keys must be non-empty strings, got {key!r:.100}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise UnsupportedValueError(f"cache key {key!r:.100} cannot be stored: it is not valid Unicode text "
                                    f"({exc.reason} at {exc.start}); use keys of plain text") from None
    if size > MAX_KEY_BYTES:
        raise UnsupportedValueError(f"cache key of {size} bytes is longer than {MAX_KEY_BYTES}; use a hash")


def _check_keys(keys: Sequence[str]) -> None:
    """:func:`_check_key` of every key, with a few calls for the whole list where they are all plain."""
    if all(type(k) is str and k for k in keys) and max(map(len, keys), default=0) * 4 <= MAX_KEY_BYTES:
        try:
            "".join(keys).encode("utf-8")
            return
        except UnicodeEncodeError:
            pass
    for key in keys:
        _check_key(key)


def _leaf_skeleton(leaf: torch.Tensor | np.ndarray) -> bytes:
    """The skeleton of a value that is one tensor, or one numpy array (a reference to leaf 0), whatever it holds."""
    return encode_skeleton(leaf, [leaf])


_TENSOR_SKELETON = _leaf_skeleton(torch.zeros(()))
_ARRAY_SKELETON = _leaf_skeleton(np.zeros(()))


@dataclass(slots=True)
class StoredTensor:
    """A tensor the writer knows: where it is stored, or its bytes while still buffered (``shard`` is None)."""

    shard: str | None
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    digest: bytes
    data: torch.Tensor | memoryview | None = None  # the bytes while buffered: a tensor, or a row of a batch

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * fmt.ITEMSIZE[self.dtype]


@dataclass
class _IndexContents:
    """An index as the writer holds it: tensors by record number, entries by key, manifests by name."""

    cache_id: str
    generation: int
    shards: list[tuple[str, int]]
    tensors: list[StoredTensor]
    entries: dict[str, tuple[bytes, tuple[int, ...]]]
    damaged: list[str]
    manifests: dict[str, bytes]


def _read_index(index: fmt.IndexFile) -> _IndexContents:
    """What the reader checks, the writer checks too: the header's fields, the tables' consistency, each tensor
    record and each entry's references. Table-wide damage raises; an entry whose record or references are bad
    is listed in ``damaged`` instead of ``entries``."""
    info = index.info
    index.check_tables()
    names = [name for name, _ in info.shards]
    rows, shapes = index.section("tensors.rows"), index.section("tensors.shapes")
    bad: set[int] = set()
    tensors: list[StoredTensor] = []
    for r in range(len(rows)):
        try:
            shard, dtype, shape, begin, end, digest = fmt.decode_tensor_record(
                rows[r], shapes, len(names), f"{index.path}: tensor record {r}")
        except fmt.TensorRecordError as exc:
            log.warning("%s", exc)
            bad.add(r)
            tensors.append(StoredTensor("", "U8", (0,), 0, 0, b""))  # keeps the numbering; never used
            continue
        tensors.append(StoredTensor(names[shard], dtype, shape, begin, end, digest))
    key_off = index.section("keys.offsets").tolist()
    key_blob = index.section("keys.blob").tobytes()
    skel_ids = index.section("entries.skeleton").tolist()
    leaf_off = index.section("entries.leaf_offsets").tolist()
    leaves = index.section("leaves.tensor")
    skel_off = index.section("skeletons.offsets").tolist()
    skel_blob = index.section("skeletons.blob").tobytes()
    skeletons = [skel_blob[a:b] for a, b in zip(skel_off[:-1], skel_off[1:])]  # shared by their entries
    entries: dict[str, tuple[bytes, tuple[int, ...]]] = {}
    damaged: list[str] = []
    for i, s in enumerate(skel_ids):
        try:
            key = key_blob[key_off[i]:key_off[i + 1]].decode("utf-8")
        except UnicodeDecodeError:
            key = f"#{i} (key not UTF-8)"
        ids = tuple(leaves[leaf_off[i]:leaf_off[i + 1]].tolist())
        if s >= len(skeletons) or any(j >= len(rows) or j in bad for j in ids) or key.startswith("#"):
            damaged.append(key)
            continue
        entries[key] = (skeletons[s], ids)
    manifests = {name: index.section(sec).tobytes() for name, sec in info.manifests.items()}
    return _IndexContents(info.cache_id, info.generation, list(info.shards), tensors, entries, damaged, manifests)


class CacheWriter:
    """Adds entries to a cache directory (created if missing) and commits them atomically.

    Use as a context manager: leaving the block normally commits; an exception inside the block commits
    nothing put since the last :meth:`commit` (earlier explicit commits stay). Existing entries are kept;
    putting an existing key replaces its value in the next commit. Identical tensors (same dtype, shape and
    bytes) are stored once, across entries and across runs.

    Only one writer may hold a cache at a time (:class:`CacheLockedError` otherwise); readers are never
    blocked and keep seeing the last committed state.
    """

    def __init__(self, path: str | os.PathLike[str], *, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.path = os.path.abspath(os.fspath(path))
        if shard_bytes <= 0:
            raise ValueError("shard_bytes must be positive")
        self.shard_bytes = int(shard_bytes)
        self.damaged: list[str] = []
        """Entries the index could not describe consistently (found on open): dropped at the next commit, so
        the next build encodes them again."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CacheError(f"{self.path}: exists and is not a directory; choose a directory for the cache")
        if os.path.isdir(self.path) and not layout.is_cache_dir(self.path):
            stray = [n for n in os.listdir(self.path) if n not in (layout.LOCK_NAME, layout.SHARD_DIR,
                                                                    layout.PARTS_DIR)
                     and not n.startswith(layout.INDEX_NAME)]
            if stray:
                raise CacheError(f"{self.path}: directory is not empty and holds no streaming cache "
                                 f"(found {stray[0]!r}); choose a new or empty directory for the cache")
        layout.check_dir(layout.shard_dir(self.path), "shards folder")
        try:
            os.makedirs(layout.shard_dir(self.path), exist_ok=True)
            self._lock = WriterLock(layout.lock_path(self.path))
            self._lock.acquire(self.path)
        except FileExistsError as exc:  # a file where the shards folder should be
            raise CacheFormatError(f"{layout.shard_dir(self.path)}: the shards folder is a file; the cache is "
                                   "damaged. Move it aside and rebuild it") from exc
        except OSError as exc:
            raise layout.writable_error(self.path, exc) from exc
        try:
            self._load()
            self._remove_leftovers()
        except BaseException:
            self._lock.release()
            raise
        self._closed = False

    # ------------------------------------------------------------------------------------------ state
    def _load(self) -> None:
        self._tensors: list[StoredTensor] = []
        self._by_digest: dict[bytes, int] = {}
        self._entries: dict[str, tuple[bytes, tuple[int, ...]]] = {}
        self._skeletons: dict[bytes, bytes] = {}
        self._manifests: dict[str, bytes] = {}
        self._shards: dict[str, int] = {}
        self._shard_headers: dict[str, str] = {}  # name -> digest of its header, for shards whose header is known
        self._cache_id = uuid.uuid4().hex
        self._generation = 0
        index_path = layout.index_path(self.path)
        if os.path.lexists(index_path):
            self._load_index(fmt.IndexFile(index_path))
        self._snapshot()
        self._dirty = bool(self.damaged)

    def _load_index(self, index: fmt.IndexFile) -> None:
        """What the reader checks, the writer checks too: the header's fields, the tables' consistency, each
        tensor record and each entry's references. Table-wide damage refuses the cache; an entry whose record
        or references are bad is dropped (see :attr:`damaged`)."""
        found = _read_index(index)
        self._cache_id, self._generation = found.cache_id, found.generation
        self._shards = dict(found.shards)
        self._shard_headers = dict(index.info.shard_headers)
        self._tensors = found.tensors
        for i, t in enumerate(found.tensors):
            if t.shard:
                self._by_digest.setdefault(t.digest, i)
        self._entries = found.entries
        self.damaged = found.damaged
        if self.damaged:
            log.warning("%s: %d entries the index cannot describe consistently will be dropped at the next commit "
                        "(the next build encodes them again): %s", self.path, len(self.damaged),
                        ", ".join(self.damaged[:5]))
        self._manifests = found.manifests

    def _snapshot(self) -> None:
        self._committed = (dict(self._entries), dict(self._manifests), len(self._tensors))
        self._pending: list[int] = []
        self._pending_bytes = 0
        self._pending_header = 0  # the most bytes the pending tensors' records can take in a shard header
        self._new_shards: list[str] = []
        self._dirty = False

    def _remove_leftovers(self) -> None:
        layout.remove_leftovers(self.path, set(self._shards), keep=leases.needed_shards(self.path, remove_dead=True))

    def merge(self, part: str) -> int:
        """Add the entries of the cache at ``part`` that this cache lacks (another process's share of a build,
        see ``builder``), taking over the shard files they use: hard-linked into this cache's shards folder where
        the filesystem allows, copied otherwise, so ``part`` can be removed afterwards. Returns how many entries
        were added; they become visible with the next :meth:`commit`, and a crash before it leaves both caches
        as they were. ``part`` is read as strictly as any cache: its index is validated, damaged entries are
        skipped, and its files are used only if they are regular files inside it."""
        self._check_open()
        index_path = layout.index_path(part)
        if not os.path.lexists(index_path):
            return 0
        part_index = fmt.IndexFile(index_path)
        found = _read_index(part_index)
        index_info_headers = part_index.info.shard_headers
        wanted = [(k, v) for k, v in found.entries.items() if k not in self._entries]
        needed = {found.tensors[i].shard for _, (_, ids) in wanted for i in ids
                  if self._by_digest.get(found.tensors[i].digest) is None}
        for name in sorted(n for n in needed if n):
            if name in self._shards:
                continue
            size = layout.adopt_file(layout.shard_path(part, name), layout.shard_path(self.path, name), "shard")
            if size != dict(found.shards).get(name):
                raise CacheFormatError(f"{part}: shard {name} is {size} bytes but its index says "
                                       f"{dict(found.shards).get(name)}; the part is damaged and was not merged")
            self._shards[name] = size
            self._new_shards.append(name)
            digest = index_info_headers.get(name)
            if digest is not None:
                self._shard_headers[name] = digest
        for key, (skeleton, ids) in wanted:
            mine = []
            for i in ids:
                t = found.tensors[i]
                j = self._by_digest.get(t.digest)
                if j is None:
                    j = len(self._tensors)
                    self._tensors.append(StoredTensor(t.shard, t.dtype, t.shape, t.begin, t.end, t.digest))
                    self._by_digest[t.digest] = j
                mine.append(j)
            self._entries[key] = (self._skeletons.setdefault(skeleton, skeleton), tuple(mine))
        self._dirty = self._dirty or bool(wanted)
        return len(wanted)

    # ------------------------------------------------------------------------------------------ reading back
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> Iterator[str]:
        return iter(list(self._entries))

    @property
    def manifests(self) -> list[str]:
        return sorted(self._manifests)

    def get_manifest(self, name: str) -> bytes | None:
        return self._manifests.get(name)

    # ------------------------------------------------------------------------------------------ writing
    def put(self, key: str, value: Any) -> None:
        """Stage ``value`` under ``key``. Tensors are copied to CPU now, so the caller may reuse its buffers."""
        self._check_open()
        _check_key(key)
        if type(value) is torch.Tensor:  # the common value: its skeleton is always the same
            check_tensor(value, f"entry {key!r}")
            leaves: list[torch.Tensor | np.ndarray] = [value]
            skeleton = _TENSOR_SKELETON
        else:
            where = f"entry {key!r}"
            leaves = collect_leaves(value, where)
            skeleton = encode_skeleton(value, leaves)
            if skeleton not in self._skeletons:  # checked once per distinct skeleton
                try:
                    decode_skeleton(skeleton, len(leaves), lambda i, is_np: None, where)
                except CacheFormatError as exc:
                    raise UnsupportedValueError(f"{where}: value cannot be read back from the cache: {exc}") from exc
        ids = tuple([self._add_tensor(leaf) for leaf in leaves])
        self._entries.pop(key, None)
        self._entries[key] = (self._skeletons.setdefault(skeleton, skeleton), ids)  # equal skeletons: one object
        self._dirty = True
        if self._pending_bytes >= self.shard_bytes:
            self._flush_shard()

    def put_many(self, keys: Sequence[str], values: torch.Tensor | np.ndarray) -> None:
        """Stage ``values[k]`` under ``keys[k]`` for every ``k``: what ``put(keys[k], values[k])`` one after the
        other does (a later key replaces an earlier equal one), for many small tensors at once. The batch is
        checked and copied once, so each entry costs a digest and a few dictionary operations: several times
        faster than :meth:`put` for tensors of a few KB."""
        self._check_open()
        where = f"put_many of {len(keys)} keys"
        skeleton = _TENSOR_SKELETON
        if isinstance(values, np.ndarray):
            check_array(values, where)
            values, skeleton = torch.from_numpy(np.ascontiguousarray(values)), _ARRAY_SKELETON
        else:
            check_tensor(values, where)
        if values.dim() < 1 or values.shape[0] != len(keys):
            rows = values.shape[0] if values.dim() else 0
            raise CacheError(f"{where}: values of shape {tuple(values.shape)} hold {rows} rows; give one key per row "
                             "(the first dimension)")
        batch = values.detach().to("cpu").contiguous()
        if batch.data_ptr() == values.data_ptr() and batch.numel():
            batch = batch.clone()  # own the bytes: the caller may overwrite its tensor before the shard is written
        _check_keys(keys)
        dtype, shape = fmt.SAFETENSORS_NAME[batch.dtype], tuple(batch.shape[1:])
        size = math.prod(shape) * fmt.ITEMSIZE[dtype]
        data = fmt.tensor_bytes(batch)
        prefix = fmt.digest_prefix(dtype, shape)
        one_shot = size <= fmt.ONE_SHOT_BYTES
        by_digest, tensors, entries = self._by_digest, self._tensors, self._entries
        for k, key in enumerate(keys):
            row = data[k * size:(k + 1) * size]  # the batch's bytes stay alive as long as a row of them is held
            digest = xxhash.xxh3_128_digest(prefix + bytes(row)) if one_shot else fmt.prefixed_digest(prefix, row)
            i = by_digest.get(digest)
            if i is None:
                i = len(tensors)
                tensors.append(StoredTensor(None, dtype, shape, 0, 0, digest, row))
                by_digest[digest] = i
                self._stage(i, size, len(shape))
                if self._pending_bytes >= self.shard_bytes:
                    self._flush_shard()
            entries.pop(key, None)
            entries[key] = (skeleton, (i,))
        self._dirty = self._dirty or bool(len(keys))

    def remove(self, keys: Iterable[str]) -> int:
        """Drop entries (their bytes are reclaimed by :meth:`compact`). Returns how many existed."""
        self._check_open()
        n = 0
        for key in keys:
            if self._entries.pop(key, None) is not None:
                n += 1
        self._dirty = self._dirty or n > 0
        return n

    def set_manifest(self, name: str, data: bytes) -> None:
        """Store a named manifest (JSON bytes): the list of entries a dataset consists of (see ``builder``)."""
        self._check_open()
        if not name or "/" in name or "\\" in name:
            raise CacheError(f"invalid manifest name {name!r}")
        data = bytes(data)
        if self._manifests.get(name) != data:
            self._manifests[name] = data
            self._dirty = True

    def delete_manifest(self, name: str) -> bool:
        self._check_open()
        found = self._manifests.pop(name, None) is not None
        self._dirty = self._dirty or found
        return found

    def _add_tensor(self, leaf: torch.Tensor | np.ndarray) -> int:
        if isinstance(leaf, np.ndarray):
            t = torch.from_numpy(leaf.copy(order="C"))  # a copy keeps a 0-d array 0-d
        elif leaf.device.type == "cpu":
            t = leaf.detach().clone(memory_format=torch.contiguous_format)  # own the bytes: the caller may
            # overwrite its tensor before the shard is written
        else:
            t = leaf.detach().to("cpu").contiguous()
        dtype = fmt.SAFETENSORS_NAME[t.dtype]
        shape = tuple(t.shape)
        digest = fmt.tensor_digest(dtype, shape, fmt.tensor_bytes(t))
        found = self._by_digest.get(digest)
        if found is not None:
            return found
        i = len(self._tensors)
        self._tensors.append(StoredTensor(None, dtype, shape, 0, 0, digest, t))
        self._by_digest[digest] = i
        self._stage(i, t.numel() * t.element_size(), len(shape))
        return i

    def _stage(self, i: int, nbytes: int, ndim: int) -> None:
        """Queue tensor ``i`` for the next shard, first writing the pending ones out if it would take that shard
        past :data:`~.format.SHARD_MAX_TENSORS` tensors or a header of :data:`~.format.SHARD_MAX_HEADER_BYTES`:
        every shard stays one any reader opens, and opens quickly, whatever its tensors' sizes."""
        record = fmt.header_record_bytes("0" * 32, ndim)
        if self._pending and (len(self._pending) >= fmt.SHARD_MAX_TENSORS
                              or self._pending_header + record > fmt.SHARD_MAX_HEADER_BYTES - _HEADER_SLACK):
            self._flush_shard()
        self._pending.append(i)
        self._pending_bytes += nbytes
        self._pending_header += record

    def _flush_shard(self) -> None:
        if not self._pending:
            return
        name = f"{uuid.uuid4().hex}{layout.SHARD_SUFFIX}"
        final = layout.shard_path(self.path, name)
        tmp = final + layout.TMP_SUFFIX
        pending = {self._tensors[i].digest.hex(): self._tensors[i] for i in self._pending}
        header, placed = fmt.shard_layout((n, t.dtype, t.shape, t.nbytes) for n, t in pending.items())
        try:
            with layout.create_file(tmp) as f:
                f.write(header)
                buffer = bytearray()  # small tensors are written a few MB at a time, not one call each
                for p in placed:
                    data = pending[p.name].data
                    assert data is not None
                    buffer += data if isinstance(data, memoryview) else fmt.tensor_bytes(data)
                    if len(buffer) >= _WRITE_BYTES:
                        f.write(buffer)
                        buffer.clear()
                f.write(buffer)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, final)
        except OSError as exc:
            # Nothing in memory changed yet: the puts stay pending and the last commit stays valid on disk.
            try:
                layout.remove_file(tmp)
            except OSError:
                pass
            reason = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
            raise CacheError(f"{self.path}: could not write a shard ({reason}); the cache keeps its last commit. "
                             "Free space or fix the folder, then run again: finished work resumes") from exc
        for p in placed:
            t = pending[p.name]
            t.shard, t.begin, t.end, t.data = name, p.begin, p.end, None
        self._shards[name] = size
        self._shard_headers[name] = fmt.shard_header_digest(header)
        self._new_shards.append(name)
        self._pending = []
        self._pending_bytes = 0
        self._pending_header = 0

    # ------------------------------------------------------------------------------------------ commit
    def commit(self) -> bool:
        """Make everything put so far durable and visible to new readers. Returns False if nothing changed."""
        self._check_open()
        if not self._dirty:
            return False
        self._flush_shard()
        self._generation += 1
        header, sections = self._build_index()
        final = layout.index_path(self.path)
        tmp = f"{final}{layout.TMP_SUFFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fmt.write_index(tmp, header, sections)
            os.replace(tmp, final)
        except BaseException as exc:
            self._generation -= 1
            try:
                layout.remove_file(tmp)
            except OSError:
                pass
            if isinstance(exc, OSError):
                reason = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
                raise CacheError(f"{self.path}: could not write the index ({reason}); the cache keeps its last "
                                 "commit. Free space or fix the folder, then run again") from exc
            raise
        layout.fsync_dir(self.path)
        layout.note_commit(self.path)
        self._snapshot()
        return True

    def abort(self) -> None:
        """Forget everything put since the last commit."""
        entries, manifests, n_tensors = self._committed
        for t in self._tensors[n_tensors:]:
            if self._by_digest.get(t.digest, -1) >= n_tensors:
                del self._by_digest[t.digest]
        del self._tensors[n_tensors:]
        for name in self._new_shards:
            self._shards.pop(name, None)
            try:
                layout.remove_file(layout.shard_path(self.path, name))
            except OSError:
                pass
        self._entries, self._manifests = dict(entries), dict(manifests)
        self._snapshot()

    def _build_index(self) -> tuple[dict[str, Any], dict[str, np.ndarray | bytes]]:
        """The index sections of the entries put so far. Tensor records are those the entries use, in shard order
        (a reader finds a shard's records as one range), each column gathered with one pass over the entries or
        records, so committing costs little Python work per entry."""
        keys = list(self._entries)
        values = list(self._entries.values())
        encoded = [k.encode("utf-8") for k in keys]
        key_offsets = np.zeros(len(keys) + 1, dtype="<u8")
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(keys)), out=key_offsets[1:])
        skel_ids: dict[bytes, int] = {}
        entry_skel = np.fromiter((skel_ids.setdefault(sk, len(skel_ids)) for sk, _ in values), dtype="<u4",
                                 count=len(values))
        counts = np.fromiter((len(ids) for _, ids in values), dtype=np.int64, count=len(values))
        leaf_offsets = np.zeros(len(values) + 1, dtype="<u8")
        np.cumsum(counts, out=leaf_offsets[1:])
        used = np.fromiter(itertools.chain.from_iterable(ids for _, ids in values), dtype=np.int64,
                           count=int(leaf_offsets[-1]))
        tensors = np.unique(used)  # every tensor an entry uses, once
        shard_ids: dict[str, int] = {}
        stored = [self._tensors[i] for i in tensors.tolist()]
        for t in stored:
            assert t.shard is not None
        shard_of = np.fromiter((shard_ids.setdefault(t.shard, len(shard_ids)) for t in stored),
                               dtype=np.int64, count=len(stored))
        begin = np.fromiter((t.begin for t in stored), dtype=np.uint64, count=len(stored))
        order = np.lexsort((begin, shard_of))
        stored = [stored[i] for i in order.tolist()]
        record_of = np.zeros(len(self._tensors), dtype=np.int64)
        record_of[tensors[order]] = np.arange(len(order))
        ndim = np.fromiter((len(t.shape) for t in stored), dtype=np.int64, count=len(stored))
        shape_at: dict[tuple[int, ...], int] = {}  # each distinct shape is stored once, records share it
        dims_stored = 0
        for t in stored:
            if t.shape not in shape_at:
                shape_at[t.shape] = dims_stored
                dims_stored += len(t.shape)
        shape_start = np.fromiter((shape_at[t.shape] for t in stored), dtype=np.uint64, count=len(stored))
        digests = np.frombuffer(b"".join(t.digest for t in stored), dtype=">u8").reshape(-1, 2)
        rows = np.zeros(len(stored), dtype=fmt.TENSOR_ROW)
        rows["shard"], rows["ndim"], rows["begin"] = shard_of[order], ndim, begin[order]
        rows["dtype"] = np.fromiter((fmt.DTYPE_CODE[t.dtype] for t in stored), dtype=np.uint8, count=len(stored))
        rows["end"] = np.fromiter((t.end for t in stored), dtype=np.uint64, count=len(stored))
        rows["digest_hi"], rows["digest_lo"], rows["shape_start"] = digests[:, 0], digests[:, 1], shape_start
        shape_dims = np.fromiter(itertools.chain.from_iterable(shape_at), dtype="<i8", count=dims_stored)
        # Shards with no live tensor stay listed until compaction, so a reader of an older generation can
        # still read them and only `compact` ever deletes a shard.
        for name in self._shards:
            shard_ids.setdefault(name, len(shard_ids))
        hashes = fmt.key_hashes(encoded, len(encoded))
        hash_order = np.argsort(hashes, kind="stable").astype("<u8")
        skel_offsets = [0]
        skel_blob = bytearray()
        for skeleton_bytes in skel_ids:
            skel_blob += skeleton_bytes
            skel_offsets.append(len(skel_blob))
        sections: dict[str, np.ndarray | bytes] = {
            "keys.offsets": key_offsets,
            "keys.blob": b"".join(encoded),
            "keys.hash_sorted": hashes[hash_order],
            "keys.hash_order": hash_order,
            "entries.skeleton": entry_skel,
            "entries.leaf_offsets": leaf_offsets,
            "leaves.tensor": record_of[used].astype("<u4"),
            "skeletons.offsets": np.array(skel_offsets, dtype="<u8"),
            "skeletons.blob": bytes(skel_blob),
            "tensors.rows": rows,
            "tensors.shapes": shape_dims,
        }
        manifests = {}
        for i, (name, data) in enumerate(sorted(self._manifests.items())):
            sections[f"manifest.{i}"] = data
            manifests[name] = f"manifest.{i}"
        header = {
            "format": "streaming-cache-index",
            "cache_id": self._cache_id,
            "generation": self._generation,
            "counts": {"entries": len(keys), "tensors": len(rows), "skeletons": len(skel_ids)},
            "shards": [dict({"name": n, "nbytes": self._shards[n]},
                            **({"header_xxh3": self._shard_headers[n]} if n in self._shard_headers else {}))
                       for n in sorted(shard_ids, key=shard_ids.__getitem__)],
            "manifests": manifests,
        }
        return header, sections

    # ------------------------------------------------------------------------------------------ compaction
    def compact(self, progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
        """Rewrite shards so they hold only live tensors, then delete the old shard files.

        A shard is rewritten when it holds bytes no entry references, when it holds more tensors or a longer
        header than a shard may (:data:`~.format.SHARD_MAX_TENSORS`; earlier releases wrote such shards), or when
        it is one of several shards smaller than half of ``shard_bytes`` (small shards come from frequent
        commits). The new shards and the
        new index are committed before any old file is deleted, so a kill at any point loses nothing.
        """
        self._check_open()
        self.commit()
        live: set[int] = {i for _, ids in self._entries.values() for i in ids}
        live_bytes: dict[str, int] = {}
        for i in live:
            t = self._tensors[i]
            assert t.shard is not None  # committed entries' tensors are stored
            live_bytes[t.shard] = live_bytes.get(t.shard, 0) + t.nbytes
        data_bytes: dict[str, int] = {}
        missing: set[str] = set()
        for name in self._shards:
            try:
                data_bytes[name] = self._shard_data_bytes(name)
            except FileNotFoundError:
                missing.add(name)
                data_bytes[name] = 0
        lost = sorted(n for n in missing if live_bytes.get(n, 0))
        if lost:
            raise CacheFormatError(f"{self.path}: shard {lost[0]} is missing but entries still use it; run "
                                   "`python -m streaming_cache verify --drop-damaged` first, then clean again")
        dirty = {n for n in self._shards if n in missing or live_bytes.get(n, 0) < data_bytes[n]}
        small = {n for n in self._shards if n not in dirty and data_bytes[n] < self.shard_bytes // 2}
        held = collections.Counter(self._tensors[i].shard for i in live)
        oversized = {n for n in self._shards if n not in missing and (
            held[n] > fmt.SHARD_MAX_TENSORS or self._shards[n] - data_bytes[n] > 8 + fmt.SHARD_MAX_HEADER_BYTES)}
        rewrite = dirty | oversized | (small if len(small) > 1 else set())
        before = sum(self._shards.values())
        moved = [i for i in sorted(live) if self._tensors[i].shard in rewrite]
        total = sum(self._tensors[i].nbytes for i in moved)
        done = 0
        maps: dict[str, tuple[mmap.mmap, int]] = {}
        try:
            for i in moved:
                t = self._tensors[i]
                assert t.shard is not None
                if t.shard not in maps:
                    with layout.open_reader(layout.shard_path(self.path, t.shard), "shard") as f:
                        data_start = fmt.shard_data_start(f)
                        maps[t.shard] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), data_start)
                mm, start = maps[t.shard]
                raw = bytearray(mm[start + t.begin:start + t.end])
                if fmt.tensor_digest(t.dtype, t.shape, memoryview(raw)) != t.digest:
                    raise CacheFormatError(f"{self.path}: shard {t.shard} holds a damaged tensor; run verify "
                                           "and drop the damaged entries before compacting")
                t.data = fmt.tensor_from_bytes(raw, t.dtype, t.shape)
                t.shard = None
                self._stage(i, len(raw), len(t.shape))
                done += len(raw)
                if self._pending_bytes >= self.shard_bytes:
                    self._flush_shard()
                if progress:
                    progress(done, total)
            for name in rewrite:
                del self._shards[name]
            self._dirty = True
            self.commit()
        except BaseException:
            # The committed index on disk is intact: start again from it and drop what this call wrote.
            self._load()
            self._remove_leftovers()
            raise
        finally:
            for mm, _ in maps.values():
                mm.close()
        # Garbage rows pointing into removed shards must not be reused by deduplication.
        for i, t in enumerate(self._tensors):
            if t.shard in rewrite and self._by_digest.get(t.digest) == i:
                del self._by_digest[t.digest]
        needed = leases.needed_shards(self.path, remove_dead=True)  # by open readers of older generations
        deleting = {n for n in rewrite if needed is not None and n not in needed}
        if len(deleting) < len(rewrite):
            log.debug("%s: %d rewritten shard(s) kept for open readers; a later writer removes them", self.path,
                      len(rewrite) - len(deleting))
        for name in deleting:
            try:
                layout.remove_file(layout.shard_path(self.path, name))
            except OSError as exc:
                log.debug("could not remove %s now (removed at next open): %s", name, exc)
        return {"shards_rewritten": len(rewrite), "bytes_before": before, "bytes_after": sum(self._shards.values())}

    def _shard_data_bytes(self, name: str) -> int:
        with layout.open_reader(layout.shard_path(self.path, name), "shard") as f:
            return self._shards[name] - fmt.shard_data_start(f)

    # ------------------------------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise CacheError(f"{self.path}: writer is closed")

    def close(self, commit: bool = True) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            if commit:
                self.commit()
            else:
                self.abort()
        finally:
            self._closed = True
            self._lock.release()

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(commit=exc_type is None)
