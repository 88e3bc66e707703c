"""Writing a cache: buffered puts, shard files, atomic commits, the writer lock and compaction.

Commit protocol (what makes a kill at any instant safe): tensor bytes go to a shard written under a temporary
name, fsynced, then renamed; the index is written under a temporary name, fsynced, renamed over the old one,
and the directory is fsynced. The rename of the index is the single commit point. Files left by a crash (a
temporary file, or a shard no index lists) are removed the next time a writer opens the cache.

The writer keeps what it knows as columns, not an object per tensor or entry: a tensor is a row of
:class:`_Tensors` (its :class:`_Spec`, digest and place), an entry of one plain tensor is its tensor's number, and
shard headers and index tables are built from those columns with a few array operations. A million small
entries then cost a digest and a few dictionary operations each, whether put one by one or many at a time.
"""

from __future__ import annotations

import array
import ctypes
import errno
import itertools
import logging
import mmap
import os
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from . import format as fmt
from . import layout, leases, records
from .errors import CacheError, CacheFormatError, UnsupportedValueError
from .lock import WriterLock
from .skeleton import MAX_DIMS, check_array, check_tensor, collect_leaves, decode_skeleton, encode_skeleton

log = logging.getLogger("streaming_cache")

DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
_HEADER_SLACK = 4096  # a shard header's metadata and padding
_WRITE_BYTES = 8 << 20
_DIRECT_BYTES = 1 << 20  # pieces this large are written as they are, not gathered first
_DIGEST_BLOCK = 1 << 20  # the most bytes of rows put_many copies at once to digest them
_STAGING_BYTES = 32 << 20  # the most bytes put_many keeps in its staging buffer
MAX_KEY_BYTES = 4096
PENDING = -1  # the shard number of a tensor not written yet
UNUSABLE = -2  # the shard number of an index record that fails its checks (no entry uses it)
_RECORD_BLOCK = 1024  # shard header records formatted at once
_RUN_RECORDS = 64  # header records are laid out as arrays where runs of equally long ones are this long on average
_POWERS_OF_TEN = 10 ** np.arange(1, 19, dtype=np.int64)
_HEX_PAIRS = np.array([ord(a) | ord(b) << 8 for a in "0123456789abcdef" for b in "0123456789abcdef"], dtype="<u2")
_SHARD_HEAD = f'{{"__metadata__":{{"format":"streaming_cache","format_version":"{fmt.FORMAT_VERSION}"}}'.encode()
_STRIDED = torch.strided
_string_at = ctypes.string_at
_xxh3_128 = xxhash.xxh3_128_digest


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
    if set(map(type, keys)) <= {str} and all(keys) and max(map(len, keys), default=0) * 4 <= MAX_KEY_BYTES:
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

Entry = int | tuple[bytes, tuple[int, ...]]
"""What the writer holds of an entry: its tensor's number where it is one tensor (skeleton
:data:`_TENSOR_SKELETON`), otherwise its skeleton and its tensors' numbers."""


def _leaf_ids(entry: Entry) -> tuple[int, ...]:
    return (entry,) if isinstance(entry, int) else entry[1]


def _full_entry(entry: Entry) -> tuple[bytes, tuple[int, ...]]:
    return (_TENSOR_SKELETON, (entry,)) if isinstance(entry, int) else entry


# ------------------------------------------------------------------------------------------------ tensor columns
@dataclass(frozen=True, slots=True)
class _Spec:
    """A dtype and shape the writer has met, numbered ``id``: what every tensor of it shares. ``prefix`` is what its
    digest hashes before the bytes, ``record`` the most bytes its record takes in a shard header, ``template`` that
    record as written, with a comma (``%`` slots for the name and the two offsets), ``middle`` its text between
    the name and the offsets."""

    id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    prefix: bytes
    record: int
    middle: bytes
    template: str


class _Specs:
    """The specs met so far, numbered in order, with per-spec columns (dtype code, dimensions, bytes, element size,
    distinct shape) for array lookups by spec number."""

    def __init__(self) -> None:
        self.items: list[_Spec] = []
        self.shapes: list[tuple[int, ...]] = []  # the distinct shapes, dtypes aside (the index stores each once)
        self._ids: dict[tuple[str, tuple[int, ...]], _Spec] = {}
        self._shape_ids: dict[tuple[int, ...], int] = {}
        self._columns = {name: array.array("q") for name in ("code", "ndim", "nbytes", "itemsize", "shape")}

    def get(self, dtype: str, shape: tuple[int, ...]) -> _Spec:
        """The spec of ``dtype`` (a safetensors name) and ``shape``, added if new."""
        spec = self._ids.get((dtype, shape))
        if spec is not None:
            return spec
        nbytes = fmt.ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        middle = f'":{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],"data_offsets":['
        spec = _Spec(len(self.items), dtype, shape, nbytes, fmt.digest_prefix(dtype, shape),
                     fmt.header_record_bytes("0" * 32, len(shape)), middle.encode(), f'"%s{middle}%d,%d]}},')
        self.items.append(spec)
        self._ids[(dtype, shape)] = spec
        shape_id = self._shape_ids.setdefault(shape, len(self._shape_ids))
        if shape_id == len(self.shapes):
            self.shapes.append(shape)
        for name, value in (("code", fmt.DTYPE_CODE[dtype]), ("ndim", len(shape)), ("nbytes", nbytes),
                            ("itemsize", fmt.ITEMSIZE[dtype]), ("shape", shape_id)):
            self._columns[name].append(value)
        return spec

    def column(self, name: str, specs: np.ndarray) -> np.ndarray:
        """Column ``name`` (code, ndim, nbytes, itemsize or shape) of each spec number in ``specs``."""
        return np.frombuffer(self._columns[name], dtype=np.int64)[specs]


class _Tensors:
    """The tensors the writer knows, as columns indexed by tensor number (an open index's record numbers first,
    then in the order tensors are added): each one's spec number, digest (16 bytes), and place: a shard number
    (into the writer's list of shard names; :data:`PENDING` until written, :data:`UNUSABLE` for a record the index
    could not describe) and [begin, end) in that shard's data area."""

    def __init__(self) -> None:
        self.spec = array.array("q")
        self.digests = bytearray()
        self._shard = np.zeros(0, dtype=np.int64)
        self._begin = np.zeros(0, dtype=np.uint64)
        self._end = np.zeros(0, dtype=np.uint64)

    @classmethod
    def from_columns(cls, spec: np.ndarray, digests: bytes, shard: np.ndarray, begin: np.ndarray,
                     end: np.ndarray) -> _Tensors:
        table = cls()
        table.spec.frombytes(spec.astype(np.int64).tobytes())
        table.digests += digests
        table._shard, table._begin, table._end = shard.astype(np.int64), begin.astype(np.uint64), end.astype(np.uint64)
        return table

    def __len__(self) -> int:
        return len(self.spec)

    def add(self, spec: int, digest: bytes) -> int:
        i = len(self.spec)
        self.spec.append(spec)
        self.digests += digest
        return i

    def add_run(self, spec: int, digests: bytes) -> int:
        """Add ``len(digests) // 16`` tensors of one spec; returns the first one's number."""
        i = len(self.spec)
        self.spec.frombytes(np.full(len(digests) // 16, spec, dtype=np.int64).tobytes())
        self.digests += digests
        return i

    def digest(self, i: int) -> bytes:
        return bytes(self.digests[16 * i:16 * i + 16])

    def digest_list(self, ids: np.ndarray) -> list[bytes]:
        return np.frombuffer(self.digests, dtype="V16")[ids].tolist()

    def digest_rows(self, ids: np.ndarray) -> np.ndarray:
        """The digests of tensors ``ids`` as rows of 16 bytes."""
        return np.frombuffer(self.digests, dtype=np.uint8).reshape(-1, 16)[ids]

    def specs_of(self, ids: np.ndarray) -> np.ndarray:
        return np.frombuffer(self.spec, dtype=np.int64)[ids]

    def places(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shard, begin and end columns, one row per tensor (read-only use)."""
        self._grow()
        return self._shard, self._begin, self._end

    def place(self, ids: np.ndarray | Sequence[int], shard: np.ndarray | int, begin: np.ndarray | Sequence[int],
              end: np.ndarray | Sequence[int]) -> None:
        self._grow()
        self._shard[ids], self._begin[ids], self._end[ids] = shard, begin, end

    def truncate(self, n: int) -> None:
        del self.spec[n:]
        del self.digests[16 * n:]
        self._shard, self._begin, self._end = self._shard[:n], self._begin[:n], self._end[:n]

    def _grow(self) -> None:
        n, have = len(self.spec), len(self._shard)
        if have >= n:
            return
        size = max(n, 2 * have, 1024)
        self._shard = np.concatenate([self._shard, np.full(size - have, PENDING, dtype=np.int64)])
        self._begin = np.concatenate([self._begin, np.zeros(size - have, dtype=np.uint64)])
        self._end = np.concatenate([self._end, np.zeros(size - have, dtype=np.uint64)])


class _Staging:
    """A buffer the bytes of put_many's pending tensors are copied into, a run at a time, used again from shard to
    shard until the next commit: a fresh copy of every batch would cost a page fault per 4 KB. Runs past
    :data:`_STAGING_BYTES` get a copy of their own, so the buffer stays bounded."""

    def __init__(self) -> None:
        self._buffer = np.zeros(0, dtype=np.uint8)
        self._used = 0

    def copy(self, data: memoryview) -> memoryview:
        """A copy of ``data`` (bytes) that stays valid until :meth:`clear`."""
        n = len(data)
        if self._used + n > len(self._buffer):
            if self._used + n > _STAGING_BYTES:
                return memoryview(bytes(data))
            self._buffer = np.empty(min(max(2 * len(self._buffer), self._used + n), _STAGING_BYTES), dtype=np.uint8)
            self._used = 0  # the copies made so far keep the old buffer alive
        view = self._buffer[self._used:self._used + n]
        view[:] = np.frombuffer(data, dtype=np.uint8)
        self._used += n
        return view.data

    def clear(self) -> None:
        """Forget every copy made: their bytes are written, or no longer wanted."""
        self._used = 0


class _RowDigests:
    """Digests of the rows of a batch: each row is copied after its digest prefix into a scratch buffer, a block
    at a time, so one C loop digests the block. The buffer is kept from batch to batch: fresh memory for every
    block would cost a page fault per 4 KB."""

    def __init__(self) -> None:
        self._scratch = np.zeros(0, dtype=np.uint8)

    def __call__(self, spec: _Spec, data: memoryview, count: int) -> list[bytes]:
        """The digest of each of ``count`` tensors of ``spec`` whose bytes lie one after the other in ``data``."""
        n = spec.nbytes
        if n > fmt.ONE_SHOT_BYTES:
            return [fmt.prefixed_digest(spec.prefix, data[k * n:(k + 1) * n]) for k in range(count)]
        width = len(spec.prefix) + n
        rows = np.frombuffer(data, dtype=np.uint8).reshape(count, n) if count and n else np.zeros((count, n), np.uint8)
        step = max(1, _DIGEST_BLOCK // width)
        if len(self._scratch) < min(step, count) * width:
            self._scratch = np.zeros(min(step, count) * width, dtype=np.uint8)
        out: list[bytes] = []
        for a in range(0, count, step):
            block = rows[a:a + step]
            scratch = self._scratch[:len(block) * width].reshape(len(block), width)
            scratch[:, :len(spec.prefix)] = np.frombuffer(spec.prefix, dtype=np.uint8)
            scratch[:, len(spec.prefix):] = block
            out += map(_xxh3_128, scratch.view(f"V{width}").reshape(-1).tolist())
        return out


# ------------------------------------------------------------------------------------------------ shards
def _shard_header(records: list[bytes]) -> bytes:
    """A shard's header (length prefix included) holding ``records`` (``"name":{...},`` of each tensor, a block of
    them an item): the bytes :func:`~.format.shard_layout` makes for the same tensors in the same order, put
    together with one copy."""
    size = len(_SHARD_HEAD) + 1 + sum(map(len, records))  # the last record's comma becomes the closing brace
    pad = -(8 + size) % fmt.ALIGN
    return b"".join([struct.pack("<Q", size + pad), _SHARD_HEAD, b",", *records[:-1], records[-1][:-1], b"}",
                     b" " * pad])


def _header_records(specs: _Specs, record_specs: np.ndarray, digests: np.ndarray, begins: np.ndarray,
                    ends: np.ndarray) -> list[bytes]:
    """The shard header records (each ``"name":{...},``) of tensors of ``record_specs`` and ``digests`` (rows of 16
    bytes) at [``begins``, ``ends``), in order. The records of one spec whose offsets have as many digits are
    equally long: each run of them is laid out as the rows of one byte array, with no Python object per tensor.
    Where runs are short (specs alternating), records are formatted instead."""
    begin_digits = np.searchsorted(_POWERS_OF_TEN, begins, side="right") + 1
    end_digits = np.searchsorted(_POWERS_OF_TEN, ends, side="right") + 1
    kind = (record_specs * 32 + begin_digits) * 32 + end_digits
    starts = np.flatnonzero(np.concatenate(([True], kind[1:] != kind[:-1])))
    if len(starts) * _RUN_RECORDS > len(kind):
        return _formatted_records(specs, record_specs, digests.tobytes().hex(), begins, ends)
    names = _HEX_PAIRS[digests].view(np.uint8).reshape(-1, 32)
    stops = np.append(starts[1:], len(kind))
    return [_record_rows(specs.items[int(record_specs[a])], names[a:b], begins[a:b], ends[a:b],
                         int(begin_digits[a]), int(end_digits[a])) for a, b in zip(starts.tolist(), stops.tolist())]


def _record_rows(spec: _Spec, names: np.ndarray, begins: np.ndarray, ends: np.ndarray, begin_digits: int,
                 end_digits: int) -> bytes:
    """The records of a run of tensors of ``spec`` (``names``: rows of 32 hex digits) whose offsets have
    ``begin_digits`` and ``end_digits`` digits: a row each, the columns filled by array operations."""
    n = len(names)

    def constant(text: bytes) -> np.ndarray:
        return np.broadcast_to(np.frombuffer(text, dtype=np.uint8), (n, len(text)))

    columns = [constant(b'"'), names, constant(spec.middle), _decimal(begins, begin_digits), constant(b","),
               _decimal(ends, end_digits), constant(b"]},")]
    return np.concatenate(columns, axis=1).tobytes()


def _decimal(values: np.ndarray, width: int) -> np.ndarray:
    """The ASCII decimal digits of each value (every one has ``width`` digits), one row a value."""
    out = np.empty((len(values), width), dtype=np.uint8)
    rest = values.astype(np.int64)
    for column in range(width - 1, -1, -1):
        rest, out[:, column] = np.divmod(rest, 10)
    out += ord("0")
    return out


def _formatted_records(specs: _Specs, record_specs: np.ndarray, names: str, begins: np.ndarray,
                       ends: np.ndarray) -> list[bytes]:
    """:func:`_header_records` by formatting (``names``: the hex digests one after the other): one ``%`` a block
    of tensors, with a template made of their specs' templates. A block's Python objects are freed before the
    next: their memory serves again."""
    out = []
    items = specs.items
    for a in range(0, len(record_specs), _RECORD_BLOCK):
        kinds = record_specs[a:a + _RECORD_BLOCK].tolist()
        if kinds.count(kinds[0]) == len(kinds):
            template = items[kinds[0]].template * len(kinds)
        else:
            template = "".join([items[k].template for k in kinds])
        block = [names[k:k + 32] for k in range(32 * a, 32 * (a + len(kinds)), 32)]
        values = itertools.chain.from_iterable(zip(block, begins[a:a + _RECORD_BLOCK].tolist(),
                                                   ends[a:a + _RECORD_BLOCK].tolist()))
        out.append((template % tuple(values)).encode())
    return out


@dataclass
class _ShardPlan:
    """Where the pending tensors go in one shard: ``header``, and per pending tensor (in pending order) its
    ``begin`` and ``end`` in the data area. ``written`` lists the pending positions whose bytes are written, in
    data order (None: all of them, in pending order); a tensor staged twice is written once, both point there."""

    header: bytes
    begin: np.ndarray
    end: np.ndarray
    written: np.ndarray | None


def _plan_shard(specs: _Specs, tensors: _Tensors, ids: np.ndarray, may_repeat: bool) -> _ShardPlan:
    """The plan :func:`~.format.shard_layout` makes (largest element size first, otherwise in pending order, no
    gaps), built from the tensor columns. ``may_repeat``: two of the tensors may have one digest (tensors of an
    index staged again by compaction; new tensors never do)."""
    spec_of = tensors.specs_of(ids)
    nbytes, itemsize = specs.column("nbytes", spec_of), specs.column("itemsize", spec_of)
    digests = tensors.digest_rows(ids)
    written: np.ndarray | None = None
    first: np.ndarray | None = None  # per position, the first position holding its digest, where digests repeat
    if may_repeat:
        listed = digests.view("V16").reshape(-1).tolist()
        first_of = dict(zip(reversed(listed), range(len(listed) - 1, -1, -1)))
        if len(first_of) < len(listed):
            first = np.fromiter(map(first_of.__getitem__, listed), dtype=np.int64, count=len(listed))
            written = np.flatnonzero(first == np.arange(len(listed)))
    if len(ids) > 1 and bool((itemsize[1:] > itemsize[:-1]).any()):
        keep = np.arange(len(ids)) if written is None else written
        written = keep[np.argsort(-itemsize[keep], kind="stable")]
    sizes = nbytes if written is None else nbytes[written]
    ends = np.cumsum(sizes, dtype=np.int64)
    begins = ends - sizes
    if written is None:
        begin, end = begins, ends
        names, record_specs = digests, spec_of
    else:
        slot = np.zeros(len(ids), dtype=np.int64)
        slot[written] = np.arange(len(written))
        at = slot if first is None else slot[first]
        begin, end = begins[at], ends[at]
        names, record_specs = digests[written], spec_of[written]
    records = _header_records(specs, record_specs, names, begins, ends)
    return _ShardPlan(_shard_header(records), begin, end, written)


def _pieces(chunks: list[Any], runs: list[int], sizes: np.ndarray, written: np.ndarray | None) -> Iterable[Any]:
    """The pending bytes in the order a plan writes them. ``chunks[c]`` holds ``runs[c]`` tensors one after the
    other; ``sizes`` is each pending tensor's byte count."""
    if written is None:
        return chunks
    views: list[memoryview] = []
    k = 0
    for chunk, count in zip(chunks, runs):
        mv = memoryview(chunk).cast("B")
        offset = 0
        for n in sizes[k:k + count].tolist():
            views.append(mv[offset:offset + n])
            offset += n
        k += count
    return [views[k] for k in written.tolist()]


def _write_pieces(f: BinaryIO, pieces: Iterable[Any]) -> None:
    """Write ``pieces`` one after the other, small ones gathered a few MB at a time, not one call each."""
    buffer = bytearray()
    for piece in pieces:
        if len(piece) >= _DIRECT_BYTES:
            f.write(buffer)
            buffer.clear()
            f.write(piece)
            continue
        buffer += piece
        if len(buffer) >= _WRITE_BYTES:
            f.write(buffer)
            buffer.clear()
    f.write(buffer)


# ------------------------------------------------------------------------------------------------ reading an index
@dataclass
class _Records:
    """An index's tensor records as columns: ``ok`` (it passes every check; the entries using one that does not
    are damaged), ``layout`` (numbers into ``layouts``, each a (dtype, shape); -1 where not ok), the shard number,
    [begin, end), and the digests, 16 bytes a record."""

    ok: np.ndarray
    layout: np.ndarray
    layouts: list[tuple[str, tuple[int, ...]]]
    shard: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    digests: bytes

    def digest(self, r: int) -> bytes:
        return self.digests[16 * r:16 * r + 16]


@dataclass
class _IndexContents:
    """An index as the writer holds it: tensor records as columns, entries by key, manifests by name."""

    cache_id: str
    generation: int
    shards: list[tuple[str, int]]
    records: _Records
    entries: dict[str, Entry]
    damaged: list[str]
    manifests: dict[str, bytes]


def _read_records(index: fmt.IndexFile, n_shards: int) -> _Records:
    """Every tensor record checked at once (:func:`~.records.record_layouts`, the checks
    :func:`~.format.decode_tensor_record` makes); a record that fails is decoded alone to log what is wrong."""
    rows, shapes = index.section("tensors.rows"), index.section("tensors.shapes")
    ok, layout = records.record_layouts(rows, shapes, n_shards)
    ok, layout = ok.copy(), layout.copy()
    layouts: list[tuple[str, tuple[int, ...]]] = []
    if len(layout) and ok.any():
        firsts = records.first_of(layout[ok])
        good = np.flatnonzero(ok)
        for r in good[firsts].tolist():
            code, ndim, start = int(rows["dtype"][r]), int(rows["ndim"][r]), int(rows["shape_start"][r])
            layouts.append((fmt.DTYPE_NAMES[code], tuple(shapes[start:start + ndim].tolist())))
    for r in np.flatnonzero(~ok).tolist():
        try:
            _, dtype, shape, _, _, _ = fmt.decode_tensor_record(rows[r], shapes, n_shards,
                                                                f"{index.path}: tensor record {r}")
        except fmt.TensorRecordError as exc:
            log.warning("%s", exc)
            continue
        ok[r], layout[r] = True, len(layouts)  # the record's own check is the one that decides, as it always was
        layouts.append((dtype, shape))
    digests = np.stack([rows["digest_hi"], rows["digest_lo"]], axis=1).astype(">u8").tobytes()
    return _Records(ok, layout, layouts, rows["shard"].astype(np.int64), rows["begin"].copy(), rows["end"].copy(),
                    digests)


def _read_keys(index: fmt.IndexFile) -> list[str | None]:
    """Every entry's key (None where it is not UTF-8)."""
    offsets = index.section("keys.offsets").tolist()
    blob = index.section("keys.blob").tobytes()
    if blob.isascii():
        text = blob.decode("ascii")
        return [text[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    keys: list[str | None] = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        try:
            keys.append(blob[a:b].decode("utf-8"))
        except UnicodeDecodeError:
            keys.append(None)
    return keys


def _read_index(index: fmt.IndexFile) -> _IndexContents:
    """What the reader checks, the writer checks too: the header's fields, the tables' consistency, each tensor
    record and each entry's references. Table-wide damage raises; an entry whose record or references are bad
    is listed in ``damaged`` instead of ``entries``."""
    info = index.info
    index.check_tables()
    found = _read_records(index, len(info.shards))
    n_rows = len(found.ok)
    keys = _read_keys(index)
    skel_ids = index.section("entries.skeleton")
    leaf_off = index.section("entries.leaf_offsets")
    leaves = index.section("leaves.tensor")
    skel_off = index.section("skeletons.offsets").tolist()
    skel_blob = index.section("skeletons.blob").tobytes()
    skeletons = [skel_blob[a:b] for a, b in zip(skel_off[:-1], skel_off[1:])]  # shared by their entries
    usable = np.append(found.ok, False)  # a reference past the records lands on the last, unusable one
    entries: dict[str, Entry] = {}
    damaged: list[str] = []
    counts = np.diff(leaf_off.astype(np.int64))
    if len(keys) and int(counts.min()) == int(counts.max()) == 1:
        leaf = leaves[leaf_off[:-1].astype(np.int64)].astype(np.int64)
        bad = ~usable[np.minimum(leaf, n_rows)] | (skel_ids.astype(np.int64) >= len(skeletons))
        plain = skeletons.index(_TENSOR_SKELETON) if _TENSOR_SKELETON in skeletons else -1
        if not bad.any() and None not in keys and bool((skel_ids == plain).all()):  # the usual index: one pass
            entries = dict(zip(keys, leaf.tolist()))  # type: ignore[arg-type]
        else:
            for i, (key, s, t, wrong) in enumerate(zip(keys, skel_ids.tolist(), leaf.tolist(), bad.tolist())):
                if wrong or key is None:
                    damaged.append(key if key is not None else f"#{i} (key not UTF-8)")
                else:
                    entries[key] = t if s == plain else (skeletons[s], (t,))
    else:
        offsets = leaf_off.tolist()
        for i, (key, s) in enumerate(zip(keys, skel_ids.tolist())):
            ids = tuple(leaves[offsets[i]:offsets[i + 1]].tolist())
            if key is None or s >= len(skeletons) or not all(usable[min(j, n_rows)] for j in ids):
                damaged.append(key if key is not None else f"#{i} (key not UTF-8)")
            elif len(ids) == 1 and skeletons[s] == _TENSOR_SKELETON:
                entries[key] = ids[0]
            else:
                entries[key] = (skeletons[s], ids)
    manifests = {name: index.section(sec).tobytes() for name, sec in info.manifests.items()}
    return _IndexContents(info.cache_id, info.generation, list(info.shards), found, entries, damaged, manifests)


def _key_blob(keys: list[str]) -> tuple[bytes, np.ndarray]:
    """The keys' UTF-8 bytes one after the other, and where each starts (one more offset: the end)."""
    offsets = np.zeros(len(keys) + 1, dtype="<u8")
    text = "".join(keys)
    if text.isascii():
        np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)), out=offsets[1:])
        return text.encode("ascii"), offsets
    encoded = list(map(str.encode, keys))
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(keys)), out=offsets[1:])
    return b"".join(encoded), offsets


def _in_order_of_first_use(values: np.ndarray) -> np.ndarray:
    """The distinct values of ``values``, in the order they first occur. Only the first value of each run of equal
    values is sorted: columns the writer fills in order (a shard's tensors, a batch's shape) have few runs."""
    if not len(values):
        return values[:0]
    heads = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    distinct, first = np.unique(values[heads], return_index=True)
    return distinct[np.argsort(first, kind="stable")]


def _shard_order(shard: np.ndarray, begin: np.ndarray) -> np.ndarray:
    """The order of records by shard, then by place in it (stable): no sort where they are in that order already,
    as the tensors of a write are."""
    if len(shard) < 2:
        return np.arange(len(shard))
    step = shard[1:].astype(np.int64) - shard[:-1]
    if bool(((step > 0) | ((step == 0) & (begin[1:] >= begin[:-1]))).all()):
        return np.arange(len(shard))
    return np.lexsort((begin, shard))


def _stable_argsort(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")``, by the faster unstable sort where no two values are equal (then both
    orders are the same)."""
    order = np.argsort(values)
    ordered = values[order]
    if len(ordered) > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        return np.argsort(values, kind="stable")
    return order


def _distinct(ids: np.ndarray, count: int) -> np.ndarray:
    """The distinct numbers of ``ids`` (each below ``count``), ascending: one pass over a mask, not a sort."""
    seen = np.zeros(count, dtype=bool)
    seen[ids] = True
    return np.flatnonzero(seen)


@dataclass
class _EntryTables:
    """The entries' index tables: keys in order, their skeletons (``skeletons`` numbered by first use), and the
    tensors each uses (``leaf_offsets`` into ``used``)."""

    keys: list[str]
    skeletons: list[bytes]
    entry_skeleton: np.ndarray
    leaf_offsets: np.ndarray
    used: np.ndarray


def _entry_tables(entries: dict[str, Entry]) -> _EntryTables:
    """:class:`_EntryTables` of ``entries``: one array conversion where every entry is one plain tensor, a pass
    over the entries otherwise."""
    keys = list(entries)
    values = list(entries.values())
    n = len(values)
    try:
        used = np.fromiter(values, dtype=np.int64, count=n)  # every entry one plain tensor
    except TypeError:
        pass
    else:
        return _EntryTables(keys, [_TENSOR_SKELETON] if n else [], np.zeros(n, dtype="<u4"),
                            np.arange(n + 1, dtype="<u8"), used)
    full = list(map(_full_entry, values))
    skel_ids: dict[bytes, int] = {}
    entry_skel = np.fromiter((skel_ids.setdefault(sk, len(skel_ids)) for sk, _ in full), dtype="<u4", count=n)
    counts = np.fromiter((len(ids) for _, ids in full), dtype=np.int64, count=n)
    leaf_offsets = np.zeros(n + 1, dtype="<u8")
    np.cumsum(counts, out=leaf_offsets[1:])
    used = np.fromiter(itertools.chain.from_iterable(ids for _, ids in full), dtype=np.int64,
                       count=int(leaf_offsets[-1]))
    return _EntryTables(keys, list(skel_ids), entry_skel, leaf_offsets, used)


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
        self._specs = _Specs()
        self._plain: dict[tuple[torch.dtype, torch.Size], _Spec | bool] = {}
        self._row_digests = _RowDigests()
        self._tensors = _Tensors()
        self._by_digest: dict[bytes, int] = {}
        self._entries: dict[str, Entry] = {}
        self._skeletons: dict[bytes, bytes] = {}
        self._manifests: dict[str, bytes] = {}
        self._shards: dict[str, int] = {}
        self._shard_names: list[str] = []  # every shard name a tensor's shard number may refer to
        self._shard_no: dict[str, int] = {}
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
        for name, _ in found.shards:
            self._shard_number(name)
        self._shard_headers = dict(index.info.shard_headers)
        recs = found.records
        spec_of_layout = np.array([self._specs.get(dtype, shape).id for dtype, shape in recs.layouts] + [-1],
                                  dtype=np.int64)
        spec = spec_of_layout[recs.layout]  # -1 (a record not ok) takes the last: -1
        if not recs.ok.all():
            spec[~recs.ok] = self._specs.get("U8", (0,)).id  # keeps the numbering; never used
        shard = np.where(recs.ok, recs.shard, UNUSABLE)
        self._tensors = _Tensors.from_columns(spec, recs.digests, shard, recs.begin, recs.end)
        good = np.flatnonzero(recs.ok)[::-1]  # reversed: the first record of a digest is the one kept
        self._by_digest = dict(zip(self._tensors.digest_list(good), good.tolist()))
        self._entries = found.entries
        self.damaged = found.damaged
        if self.damaged:
            log.warning("%s: %d entries the index cannot describe consistently will be dropped at the next commit "
                        "(the next build encodes them again): %s", self.path, len(self.damaged),
                        ", ".join(self.damaged[:5]))
        self._manifests = found.manifests

    def _shard_number(self, name: str) -> int:
        number = self._shard_no.get(name)
        if number is None:
            number = self._shard_no[name] = len(self._shard_names)
            self._shard_names.append(name)
        return number

    def _snapshot(self) -> None:
        self._committed = (dict(self._entries), dict(self._manifests), len(self._tensors))
        self._staging = _Staging()  # a new one: an idle writer holds no staging memory
        self._clear_pending()
        self._new_shards: list[str] = []
        self._dirty = False

    def _clear_pending(self) -> None:
        self._pending_ids = array.array("q")  # tensors waiting for the next shard, in the order they came
        self._pending_data: list[Any] = []  # their bytes: chunk c holds _pending_runs[c] tensors, one after the other
        self._pending_runs: list[int] = []
        self._pending_bytes = 0
        self._pending_header = 0  # the most bytes the pending tensors' records can take in a shard header
        self._pending_restaged = False  # whether compaction staged tensors of the index (their digests may repeat)
        self._staging.clear()

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
        recs = found.records
        names = [name for name, _ in found.shards]
        sizes = dict(found.shards)
        wanted = [(k, v) for k, v in found.entries.items() if k not in self._entries]
        needed = {names[int(recs.shard[i])] for _, v in wanted for i in _leaf_ids(v)
                  if self._by_digest.get(recs.digest(i)) is None}
        for name in sorted(needed):
            if name in self._shards:
                continue
            size = layout.adopt_file(layout.shard_path(part, name), layout.shard_path(self.path, name), "shard")
            if size != sizes.get(name):
                raise CacheFormatError(f"{part}: shard {name} is {size} bytes but its index says "
                                       f"{sizes.get(name)}; the part is damaged and was not merged")
            self._shards[name] = size
            self._shard_number(name)
            self._new_shards.append(name)
            header_digest = part_index.info.shard_headers.get(name)
            if header_digest is not None:
                self._shard_headers[name] = header_digest
        mine: dict[int, int] = {}
        added: list[int] = []
        for key, value in wanted:
            for i in _leaf_ids(value):
                if i in mine:
                    continue
                digest = recs.digest(i)
                j = self._by_digest.get(digest)
                if j is None:
                    dtype, shape = recs.layouts[int(recs.layout[i])]
                    j = self._tensors.add(self._specs.get(dtype, shape).id, digest)
                    self._by_digest[digest] = j
                    added.append(i)
                mine[i] = j
            if type(value) is int:
                self._entries[key] = mine[value]
            else:
                skeleton, ids = value  # type: ignore[misc]
                self._entries[key] = (self._skeletons.setdefault(skeleton, skeleton), tuple(mine[i] for i in ids))
        if added:
            rows = np.array(added, dtype=np.int64)
            shard_of = np.array([self._shard_no.get(name, UNUSABLE) for name in names] or [0], dtype=np.int64)
            self._tensors.place(np.array([mine[i] for i in added], dtype=np.int64), shard_of[recs.shard[rows]],
                                recs.begin[rows], recs.end[rows])
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
        """Stage ``value`` under ``key``. Tensors are copied to CPU now, so the caller may reuse its buffers.

        A value that is one dense CPU tensor is copied straight from its memory and costs a digest and a few
        dictionary operations; any other value is walked, checked and its skeleton encoded."""
        self._check_open()
        if type(key) is not str or not 0 < len(key) <= MAX_KEY_BYTES or not key.isascii():
            _check_key(key)
        if type(value) is torch.Tensor:
            spec = self._plain_spec(value)
            if spec is not None:
                self._put_plain(key, spec, _string_at(value.data_ptr(), spec.nbytes))
                return
        where = f"entry {key!r}"
        if type(value) is torch.Tensor:
            check_tensor(value, where)
            leaves: list[torch.Tensor | np.ndarray] = [value]
            skeleton = _TENSOR_SKELETON
        else:
            leaves = collect_leaves(value, where)
            skeleton = encode_skeleton(value, leaves)
            if skeleton not in self._skeletons:  # checked once per distinct skeleton
                try:
                    decode_skeleton(skeleton, len(leaves), lambda i, is_np: None, where)
                except CacheFormatError as exc:
                    raise UnsupportedValueError(f"{where}: value cannot be read back from the cache: {exc}") from exc
        ids = tuple([self._add_leaf(leaf) for leaf in leaves])
        if len(ids) == 1 and skeleton == _TENSOR_SKELETON:
            self._set_entry(key, ids[0])
        else:
            self._set_entry(key, (self._skeletons.setdefault(skeleton, skeleton), ids))  # equal skeletons: one object
        if self._pending_bytes >= self.shard_bytes:
            self._flush_shard()

    def _plain_spec(self, t: torch.Tensor) -> _Spec | None:
        """The spec of a tensor whose bytes can be copied straight from its memory: on the CPU, dense and
        contiguous, with no pending negation, of a dtype and shape the cache holds, not complex and not empty.
        None for any other tensor: it is checked and copied the general way."""
        if not t.is_cpu or t.is_nested or t.layout is not _STRIDED or not t.is_contiguous() or t.is_neg():
            return None
        found = self._plain.get((t.dtype, t.shape))
        if found is None:
            dtype = fmt.SAFETENSORS_NAME.get(t.dtype)
            if dtype is None or t.dim() > MAX_DIMS:
                return None
            spec = self._specs.get(dtype, tuple(t.shape))
            found = spec if spec.nbytes and not t.is_complex() else False
            self._plain[(t.dtype, t.shape)] = found
        return found or None  # type: ignore[return-value]

    def _put_plain(self, key: str, spec: _Spec, raw: bytes) -> None:
        """Stage the bytes ``raw`` of one tensor of ``spec`` (the caller's copy) as the entry ``key``."""
        digest = _xxh3_128(spec.prefix + raw) if spec.nbytes <= fmt.ONE_SHOT_BYTES else \
            fmt.prefixed_digest(spec.prefix, raw)
        i = self._by_digest.get(digest)
        if i is None:
            i = self._add_tensor(spec, digest, raw)
        entries = self._entries
        entries.pop(key, None)
        entries[key] = i
        self._dirty = True
        if self._pending_bytes >= self.shard_bytes:
            self._flush_shard()

    def _set_entry(self, key: str, entry: Entry) -> None:
        self._entries.pop(key, None)
        self._entries[key] = entry
        self._dirty = True

    def put_many(self, keys: Sequence[str], values: torch.Tensor | np.ndarray) -> None:
        """Stage ``values[k]`` under ``keys[k]`` for every ``k``: what ``put(keys[k], values[k])`` one after the
        other does (a later key replaces an earlier equal one), for many small tensors at once. The batch is
        checked once, its rows digested in blocks and the new ones copied before this returns (the caller may
        reuse its tensor), so each entry costs a digest and a few dictionary operations done by C loops."""
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
        batch = values.detach().to("cpu").contiguous()  # its new rows are copied before this returns
        keys = list(keys)
        _check_keys(keys)
        spec = self._specs.get(fmt.SAFETENSORS_NAME[batch.dtype], tuple(batch.shape[1:]))
        data = fmt.tensor_bytes(batch)
        ids = self._add_rows(spec, self._row_digests(spec, data, len(keys)), data)
        if skeleton is _TENSOR_SKELETON:
            self._set_entries(keys, ids)
        else:
            self._set_entries(keys, [(skeleton, (i,)) for i in ids])

    def _add_rows(self, spec: _Spec, digests: list[bytes], data: memoryview) -> list[int]:
        """The tensor number of each row of a batch of ``spec`` (``data``, with ``digests``): the number of the
        equal tensor already known, or of a new one, staged in the order the rows come."""
        by_digest = self._by_digest
        base, known = len(self._tensors), len(by_digest)
        number: Callable[[bytes, int], int] = by_digest.setdefault
        ids = list(map(number, digests, itertools.count(base)))  # a new digest takes base + its row
        rows: Sequence[int] = range(len(digests))
        new = digests
        if len(by_digest) - known < len(digests):  # some rows known or equal to an earlier one: undo, then number
            for digest, i in zip(digests, ids):  # the first row of each new digest
                if i >= base:
                    by_digest.pop(digest, None)
            first = dict(zip(reversed(digests), range(len(digests) - 1, -1, -1)))
            rows = [r for r, d in enumerate(digests) if d not in by_digest and first[d] == r]
            new = [digests[r] for r in rows]
            by_digest.update(zip(new, range(base, base + len(new))))
            ids = list(map(by_digest.__getitem__, digests))
            if not rows:
                return ids
        self._tensors.add_run(spec.id, b"".join(new))
        n = spec.nbytes
        if len(rows) == len(digests) or not n:
            chunk = data
        else:
            table = np.frombuffer(data, dtype=np.uint8).reshape(len(digests), n)
            chunk = table[np.array(rows, dtype=np.int64)].reshape(-1).data
        self._queue_run(spec, base, len(rows), chunk)
        return ids  # the int objects by_digest holds: one for both

    def _set_entries(self, keys: list[str], entries: Sequence[Entry]) -> None:
        """``_set_entry(keys[k], entries[k])`` for every ``k`` in order, as a few dictionary operations where the
        keys are distinct."""
        mine = self._entries
        before = len(mine)
        mine.update(zip(keys, entries))
        if len(mine) - before < len(keys):  # a key replaced, or given twice: it moves to its last place
            for key, entry in zip(keys, entries):
                del mine[key]
                mine[key] = entry
        self._dirty = self._dirty or bool(keys)

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

    def _add_leaf(self, leaf: torch.Tensor | np.ndarray) -> int:
        """The tensor number of one leaf of a value (checked by the caller), copied now."""
        if isinstance(leaf, np.ndarray):
            t = torch.from_numpy(leaf.copy(order="C"))  # a copy keeps a 0-d array 0-d
        else:
            spec = self._plain_spec(leaf)
            if spec is not None:
                return self._tensor_number(spec, _string_at(leaf.data_ptr(), spec.nbytes))
            if leaf.device.type == "cpu":
                t = leaf.detach().clone(memory_format=torch.contiguous_format)
            else:
                t = leaf.detach().to("cpu").contiguous()
        return self._tensor_number(self._specs.get(fmt.SAFETENSORS_NAME[t.dtype], tuple(t.shape)),
                                   fmt.tensor_bytes(t))

    def _tensor_number(self, spec: _Spec, data: bytes | memoryview) -> int:
        """The number of the tensor of ``spec`` holding ``data`` (owned by the writer): an equal one already
        known, or a new one staged for the next shard."""
        digest = fmt.prefixed_digest(spec.prefix, data)
        i = self._by_digest.get(digest)
        return self._add_tensor(spec, digest, data) if i is None else i

    def _add_tensor(self, spec: _Spec, digest: bytes, data: bytes | memoryview) -> int:
        self._make_room(spec)
        i = self._tensors.add(spec.id, digest)
        self._by_digest[digest] = i
        self._pending_ids.append(i)
        self._pending_data.append(data)
        self._pending_runs.append(1)
        self._pending_bytes += spec.nbytes
        self._pending_header += spec.record
        return i

    def _make_room(self, spec: _Spec) -> None:
        """Write the pending tensors out if one more of ``spec`` would take their shard past
        :data:`~.format.SHARD_MAX_TENSORS` tensors or a header of :data:`~.format.SHARD_MAX_HEADER_BYTES`: every
        shard stays one any reader opens, and opens quickly, whatever its tensors' sizes."""
        if self._pending_ids and (len(self._pending_ids) >= fmt.SHARD_MAX_TENSORS or self._pending_header
                                  + spec.record > fmt.SHARD_MAX_HEADER_BYTES - _HEADER_SLACK):
            self._flush_shard()

    def _room(self, spec: _Spec) -> int:
        """How many tensors of ``spec`` can join the pending ones before a shard is written: what
        :meth:`_make_room` and the byte limit checked after each tensor allow (at least one into an empty shard)."""
        count = len(self._pending_ids)
        room = min(fmt.SHARD_MAX_TENSORS - count,
                   (fmt.SHARD_MAX_HEADER_BYTES - _HEADER_SLACK - self._pending_header) // spec.record)
        if not count:
            room = max(room, 1)
        if spec.nbytes:
            room = min(room, -(-(self.shard_bytes - self._pending_bytes) // spec.nbytes))
        return room

    def _queue_run(self, spec: _Spec, first: int, count: int, data: memoryview) -> None:
        """Stage tensors ``first`` to ``first + count - 1`` (all of ``spec``, their bytes one after the other in
        ``data``, copied now), writing shards where staging them one by one would: the same shards, cut at the same
        tensors."""
        n = spec.nbytes
        done = 0
        while done < count:
            room = self._room(spec)
            if room <= 0:
                self._flush_shard()
                continue
            take = min(room, count - done)
            self._pending_ids.extend(range(first + done, first + done + take))
            self._pending_data.append(self._staging.copy(data[done * n:(done + take) * n]))
            self._pending_runs.append(take)
            self._pending_bytes += take * n
            self._pending_header += take * spec.record
            done += take
            if self._pending_bytes >= self.shard_bytes:
                self._flush_shard()

    def _flush_shard(self) -> None:
        if not self._pending_ids:
            return
        name = f"{uuid.uuid4().hex}{layout.SHARD_SUFFIX}"
        final = layout.shard_path(self.path, name)
        tmp = final + layout.TMP_SUFFIX
        ids = np.frombuffer(self._pending_ids, dtype=np.int64).copy()
        plan = _plan_shard(self._specs, self._tensors, ids, self._pending_restaged)
        try:
            with layout.create_file(tmp) as f:
                f.write(plan.header)
                sizes = plan.end - plan.begin
                _write_pieces(f, _pieces(self._pending_data, self._pending_runs, sizes, plan.written))
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
        self._tensors.place(ids, self._shard_number(name), plan.begin, plan.end)
        self._shards[name] = size
        self._shard_headers[name] = fmt.shard_header_digest(plan.header)
        self._new_shards.append(name)
        self._clear_pending()

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
        for i in range(n_tensors, len(self._tensors)):
            digest = self._tensors.digest(i)
            if self._by_digest.get(digest, -1) >= n_tensors:
                del self._by_digest[digest]
        self._tensors.truncate(n_tensors)
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
        (a reader finds a shard's records as one range), each column gathered from the tensor columns with a few
        array operations, so committing costs little Python work per entry."""
        tables = _entry_tables(self._entries)
        keys, used = tables.keys, tables.used
        key_blob, key_offsets = _key_blob(keys)
        tensors = _distinct(used, len(self._tensors))
        shard_col, begin_col, end_col = self._tensors.places()
        shard, begin = shard_col[tensors], begin_col[tensors]
        assert not len(shard) or int(shard.min()) >= 0, "every tensor an entry uses is in a shard"
        # Shards are numbered in the order the records (by tensor number) first name them.
        by_first = _in_order_of_first_use(shard)
        number_of = np.zeros(max(len(self._shard_names), 1), dtype=np.int64)
        number_of[by_first] = np.arange(len(by_first))
        shard_of = number_of[shard]
        order = _shard_order(shard_of, begin)
        stored = tensors[order]
        record_of = np.zeros(len(self._tensors), dtype=np.int64)
        record_of[stored] = np.arange(len(stored))
        spec_of = self._tensors.specs_of(stored)
        ndim = self._specs.column("ndim", spec_of)
        shape_of = self._specs.column("shape", spec_of)
        # Each distinct shape is stored once, in the order the records first use it; records share it.
        shape_order = _in_order_of_first_use(shape_of)
        lengths = np.fromiter((len(self._specs.shapes[s]) for s in shape_order.tolist()), dtype=np.int64,
                              count=len(shape_order))
        shape_start = np.zeros(len(self._specs.shapes), dtype=np.int64)
        shape_start[shape_order] = np.cumsum(lengths) - lengths
        shape_dims = np.fromiter(itertools.chain.from_iterable(self._specs.shapes[s] for s in shape_order.tolist()),
                                 dtype="<i8", count=int(lengths.sum()))
        digests = self._tensors.digest_rows(stored).view(">u8")
        rows = np.zeros(len(stored), dtype=fmt.TENSOR_ROW)
        rows["shard"], rows["ndim"], rows["begin"] = shard_of[order], ndim, begin[order]
        rows["dtype"] = self._specs.column("code", spec_of)
        rows["end"] = end_col[stored]
        rows["digest_hi"], rows["digest_lo"], rows["shape_start"] = digests[:, 0], digests[:, 1], shape_start[shape_of]
        # Shards with no live tensor stay listed until compaction, so a reader of an older generation can
        # still read them and only `compact` ever deletes a shard.
        shard_names = [self._shard_names[s] for s in by_first.tolist()]
        listed = set(shard_names)
        shard_names += [name for name in self._shards if name not in listed]
        hashes = fmt.key_hashes(map(str.encode, keys), len(keys))
        hash_order = _stable_argsort(hashes).astype("<u8")
        skel_offsets = np.zeros(len(tables.skeletons) + 1, dtype="<u8")
        np.cumsum(np.array([len(s) for s in tables.skeletons], dtype=np.int64), out=skel_offsets[1:])
        sections: dict[str, np.ndarray | bytes] = {
            "keys.offsets": key_offsets,
            "keys.blob": key_blob,
            "keys.hash_sorted": hashes[hash_order],
            "keys.hash_order": hash_order,
            "entries.skeleton": tables.entry_skeleton,
            "entries.leaf_offsets": tables.leaf_offsets,
            "leaves.tensor": record_of[used].astype("<u4"),
            "skeletons.offsets": skel_offsets,
            "skeletons.blob": b"".join(tables.skeletons),
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
            "counts": {"entries": len(keys), "tensors": len(rows), "skeletons": len(tables.skeletons)},
            "shards": [dict({"name": n, "nbytes": self._shards[n]},
                            **({"header_xxh3": self._shard_headers[n]} if n in self._shard_headers else {}))
                       for n in shard_names],
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
        live = _distinct(_entry_tables(self._entries).used, len(self._tensors))
        shard_col, begin_col, end_col = self._tensors.places()
        live_shard = shard_col[live]
        live_nbytes = self._specs.column("nbytes", self._tensors.specs_of(live))
        slots = max(len(self._shard_names), 1)
        live_bytes = np.bincount(live_shard, weights=live_nbytes, minlength=slots) if len(live) else np.zeros(slots)
        held = np.bincount(live_shard, minlength=slots) if len(live) else np.zeros(slots, dtype=np.int64)
        data_bytes: dict[str, int] = {}
        missing: set[str] = set()
        for name in self._shards:
            try:
                data_bytes[name] = self._shard_data_bytes(name)
            except FileNotFoundError:
                missing.add(name)
                data_bytes[name] = 0
        live_of = {name: int(live_bytes[self._shard_no[name]]) for name in self._shards}
        lost = sorted(n for n in missing if live_of[n])
        if lost:
            raise CacheFormatError(f"{self.path}: shard {lost[0]} is missing but entries still use it; run "
                                   "`python -m streaming_cache verify --drop-damaged` first, then clean again")
        dirty = {n for n in self._shards if n in missing or live_of[n] < data_bytes[n]}
        small = {n for n in self._shards if n not in dirty and data_bytes[n] < self.shard_bytes // 2}
        oversized = {n for n in self._shards if n not in missing and (
            held[self._shard_no[n]] > fmt.SHARD_MAX_TENSORS
            or self._shards[n] - data_bytes[n] > 8 + fmt.SHARD_MAX_HEADER_BYTES)}
        rewrite = dirty | oversized | (small if len(small) > 1 else set())
        rewrite_no = np.array(sorted(self._shard_no[n] for n in rewrite), dtype=np.int64)
        before = sum(self._shards.values())
        moved = live[np.isin(live_shard, rewrite_no)]
        total = int(self._specs.column("nbytes", self._tensors.specs_of(moved)).sum()) if len(moved) else 0
        done = 0
        maps: dict[int, tuple[mmap.mmap, int]] = {}
        try:
            for i in moved.tolist():
                number = int(shard_col[i])
                if number not in maps:
                    path = layout.shard_path(self.path, self._shard_names[number])
                    with layout.open_reader(path, "shard") as f:
                        data_start = fmt.shard_data_start(f)
                        maps[number] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), data_start)
                mm, start = maps[number]
                raw = mm[start + int(begin_col[i]):start + int(end_col[i])]
                spec = self._specs.items[self._tensors.spec[i]]
                if fmt.tensor_digest(spec.dtype, spec.shape, raw) != self._tensors.digest(i):
                    raise CacheFormatError(f"{self.path}: shard {self._shard_names[number]} holds a damaged tensor; "
                                           "run verify and drop the damaged entries before compacting")
                self._tensors.place([i], PENDING, [0], [0])
                self._make_room(spec)
                self._pending_restaged = True
                self._pending_ids.append(i)
                self._pending_data.append(raw)
                self._pending_runs.append(1)
                self._pending_bytes += len(raw)
                self._pending_header += spec.record
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
        shard_col, _, _ = self._tensors.places()
        for i in np.flatnonzero(np.isin(shard_col[:len(self._tensors)], rewrite_no)).tolist():
            digest = self._tensors.digest(i)
            if self._by_digest.get(digest) == i:
                del self._by_digest[digest]
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
