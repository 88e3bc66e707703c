"""The bytes on disk: dtype codes, tensor digests, safetensors shards and the index file.

With ``skeleton`` (entry structure), this is the only code that interprets bytes read from a cache;
``docs/FORMAT.md`` specifies what it reads and writes. Everything read is treated as untrusted: sizes and offsets
are bounds-checked before use.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from . import layout
from .errors import CacheFormatError

FORMAT_VERSION = 1
INDEX_MAGIC = b"SCCACHE\x00"
MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit: a longer header no safetensors reader opens
# What one shard may hold, shared by the writer (it starts a new shard before passing either) and the reader (a
# shard's first touch reads and digests its whole header, so its cost is bounded by these, not by the tensors'
# size). 16,384 tensors make a header of about 2 MB; the byte limit covers long shapes and names.
SHARD_MAX_TENSORS = 16_384
SHARD_MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_INDEX_HEADER = 64 * 1024 * 1024
ALIGN = 64

# Stable on-disk dtype codes. Appending is allowed; renumbering is a format change.
_DTYPE_TABLE: list[tuple[str, str]] = [
    ("BOOL", "bool"),
    ("U8", "uint8"),
    ("I8", "int8"),
    ("I16", "int16"),
    ("U16", "uint16"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I32", "int32"),
    ("U32", "uint32"),
    ("F32", "float32"),
    ("F64", "float64"),
    ("I64", "int64"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("C64", "complex64"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
]
DTYPE_NAMES: list[str] = [name for name, _ in _DTYPE_TABLE]
DTYPE_CODE: dict[str, int] = {name: code for code, name in enumerate(DTYPE_NAMES)}
TORCH_DTYPE: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _DTYPE_TABLE if hasattr(torch, attr)
}
SAFETENSORS_NAME: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPE.items()}
ITEMSIZE: dict[str, int] = {name: torch.empty((), dtype=dt).element_size() for name, dt in TORCH_DTYPE.items()}


# --------------------------------------------------------------------------------------------- tensors
NUMPY_DTYPES = frozenset(dt for dt in TORCH_DTYPE.values() if dt not in (
    torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.uint16, torch.uint32, torch.uint64))  # those torch hands to numpy (and takes back) as they are
ONE_SHOT_BYTES = 1 << 16  # tensors up to this size are digested from one copy of their bytes
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.dim() and t.dtype in NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over ``data`` (no copy); ``data`` must be writable for the tensor to be."""
    if len(data) == 0:
        return torch.empty(tuple(shape), dtype=TORCH_DTYPE[dtype])
    return torch.frombuffer(data, dtype=torch.uint8).view(TORCH_DTYPE[dtype]).reshape(tuple(shape))


def tensor_digest(dtype: str, shape: Sequence[int], data: memoryview | bytes) -> bytes:
    """xxh3-128 of a tensor's dtype, shape and bytes: its identity for deduplication and its checksum."""
    return prefixed_digest(digest_prefix(dtype, shape), data)


def digest_prefix(dtype: str, shape: Sequence[int]) -> bytes:
    """What :func:`tensor_digest` hashes before a tensor's bytes: its dtype and shape."""
    return f"{dtype}:{','.join(map(str, map(int, shape)))}:".encode()


def prefixed_digest(prefix: bytes, data: memoryview | bytes) -> bytes:
    """:func:`tensor_digest` of the tensor whose :func:`digest_prefix` is ``prefix``."""
    if len(data) <= ONE_SHOT_BYTES:  # the same digest as hashing the pieces one after the other
        return xxhash.xxh3_128_digest(prefix + bytes(data))
    h = xxhash.xxh3_128(prefix)
    h.update(data)
    return h.digest()


# --------------------------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class ShardTensor:
    """One tensor of a shard: its name (the hex digest), dtype name, shape and [begin, end) in the data area."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def shard_layout(items: Iterable[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[ShardTensor]]:
    """Plan a shard: returns its header bytes (length prefix included) and where each tensor goes.

    Tensors are ordered by element size, largest first (stable otherwise), so every tensor starts at a multiple
    of its element size and the safetensors rule of a gap-free data area holds without padding tensors.
    """
    ordered = sorted(items, key=lambda it: -ITEMSIZE[it[1]])
    placed: list[ShardTensor] = []
    offset = 0
    parts = [f'{{"__metadata__":{{"format":"streaming_cache","format_version":"{FORMAT_VERSION}"}}']
    seen: set[str] = set()
    middles: dict[tuple[str, tuple[int, ...]], str] = {}  # the record's text between its name and its offsets
    for name, dtype, shape, nbytes in ordered:
        if name in seen or dtype not in ITEMSIZE:
            raise ValueError(f"a shard cannot hold tensor {name!r} of dtype {dtype!r} (named twice, or no dtype)")
        seen.add(name)
        shape = tuple(shape)
        placed.append(ShardTensor(name, dtype, shape, offset, offset + nbytes))
        middle = middles.get((dtype, shape))
        if middle is None:
            middle = middles[(dtype, shape)] = \
                f':{{"dtype":"{dtype}","shape":[{",".join(map(str, map(int, shape)))}],"data_offsets":['
        quoted = f'"{name}"' if name.isascii() and name.isalnum() else json.dumps(name)
        parts.append(f"{quoted}{middle}{offset},{offset + nbytes}]}}")
        offset += nbytes
    raw = (",".join(parts) + "}").encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, placed


_HEADER_DIGEST = re.compile(r"[0-9a-f]{16}")


def shard_header_digest(header: bytes) -> str:
    """The digest the index records of a shard's header (its first ``8 + n`` bytes, as :func:`shard_layout`
    makes them): a reader whose shard starts with exactly these bytes knows the header is the one written with
    the index, so it need not parse and compare it record by record."""
    return xxhash.xxh3_64_hexdigest(header)


def header_record_bytes(name: str, ndim: int) -> int:
    """The most bytes one tensor's record can take in a shard header written by :func:`shard_layout`
    (``"name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},`` with every number at its widest)."""
    return len(name) + 97 + 21 * ndim


def read_header_length(f: Any, file_size: int, where: str) -> int:
    """The length of a shard's JSON header (its first 8 bytes), checked against the file's size."""
    head = f.read(8)
    if len(head) != 8:
        raise CacheFormatError(f"{where}: shard is truncated ({file_size} bytes, no safetensors header)")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > file_size:
        raise CacheFormatError(f"{where}: safetensors header claims {n} bytes but the file has {file_size}; "
                               "the shard is truncated or damaged")
    return int(n)


_HEADER_PIECE = 1 << 18
_header_buffers = threading.local()


def header_digest_matches(f: Any, n: int, digest: str) -> bool:
    """Whether the first ``8 + n`` bytes of ``f`` have the digest :func:`shard_header_digest` gives. They are read
    from offset 0 in 256 KiB pieces into one buffer per thread, reused: a header of any length costs no more memory,
    and opening a shard allocates nothing the size of its header (fresh memory costs a page fault a page)."""
    buffer = getattr(_header_buffers, "buffer", None)
    if buffer is None:
        buffer = _header_buffers.buffer = memoryview(bytearray(_HEADER_PIECE))
    f.seek(0)
    h, left = xxhash.xxh3_64(), 8 + n
    while left:
        got = f.readinto(buffer[:min(left, _HEADER_PIECE)])
        if not got:
            return False
        h.update(buffer[:got])
        left -= got
    return h.hexdigest() == digest


def read_header_bytes(f: Any, file_size: int, where: str) -> bytes:
    """A shard's header as written (the 8-byte length and the JSON), checked only for its length. A header longer
    than safetensors allows is refused with what to do: such shards were written by earlier releases, which did
    not limit the tensors a shard holds, and are read only where the index records their header's digest."""
    f.seek(0)
    n = read_header_length(f, file_size, where)
    if n > MAX_SAFETENSORS_HEADER:
        raise CacheFormatError(f"{where}: the shard's safetensors header is {n:,} bytes, more than the "
                               f"{MAX_SAFETENSORS_HEADER:,} a safetensors header may have: the shard holds too many "
                               "tensors (written by an earlier release, which did not limit them) and its index "
                               "records no digest to read it by. Rewrite the cache's shards with `python -m "
                               "streaming_cache compact CACHE_DIR`")
    head = struct.pack("<Q", n)
    raw = head + f.read(n)
    if len(raw) != 8 + n:
        raise CacheFormatError(f"{where}: shard is truncated (its header claims {n} bytes)")
    return raw


def shard_data_start(f: Any) -> int:
    """Where a shard's data area starts: after the 8-byte header length and the header. Reads from offset 0."""
    f.seek(0)
    head = f.read(8)
    if len(head) != 8:
        raise CacheFormatError(f"{getattr(f, 'name', 'shard')}: shard is truncated (no safetensors header)")
    return 8 + struct.unpack("<Q", head)[0]


def read_shard_header(f: Any, file_size: int, where: str) -> tuple[int, dict[str, ShardTensor]]:
    """Parse and validate a safetensors header; returns (data start offset, tensors by name)."""
    return parse_shard_header(read_header_bytes(f, file_size, where), file_size, where)


def parse_shard_header(raw: bytes, file_size: int, where: str) -> tuple[int, dict[str, ShardTensor]]:
    """Validate a safetensors header (``raw`` from :func:`read_header_bytes`); returns (data start offset, tensors
    by name).

    Checks everything a hostile file could get wrong: header size, JSON shape, dtype names, non-negative
    shapes, offsets inside the file, byte counts matching shapes, and no two tensors overlapping.
    """
    n = len(raw) - 8
    try:
        header = json.loads(raw[8:])
    except (ValueError, RecursionError) as exc:
        raise CacheFormatError(f"{where}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CacheFormatError(f"{where}: safetensors header is not a JSON object")
    data_start = 8 + n
    data_len = file_size - data_start
    tensors: dict[str, ShardTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                dtype in ITEMSIZE
                and isinstance(shape, list)
                and all(type(s) is int and s >= 0 for s in shape)
                and type(begin) is int and type(end) is int
                and 0 <= begin <= end <= data_len
                and end - begin == math.prod(shape) * ITEMSIZE[dtype]
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CacheFormatError(f"{where}: tensor {name!r} has an invalid header record {info!r} "
                                   f"(data area is {data_len} bytes)")
        tensors[name] = ShardTensor(name, dtype, tuple(shape), begin, end)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise CacheFormatError(f"{where}: tensors {name_a!r} and {name_b!r} overlap")
    return data_start, tensors


# --------------------------------------------------------------------------------------------- index
TENSOR_ROW = np.dtype(
    [
        ("shard", "<u4"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("reserved", "<u2"),
        ("begin", "<u8"),
        ("end", "<u8"),
        ("digest_hi", "<u8"),
        ("digest_lo", "<u8"),
        ("shape_start", "<u8"),
    ]
)
SECTION_DTYPES: dict[str, np.dtype] = {
    "keys.offsets": np.dtype("<u8"),
    "keys.blob": np.dtype("u1"),
    "keys.hash_sorted": np.dtype("<u8"),
    "keys.hash_order": np.dtype("<u8"),
    "entries.skeleton": np.dtype("<u4"),
    "entries.leaf_offsets": np.dtype("<u8"),
    "leaves.tensor": np.dtype("<u4"),
    "skeletons.offsets": np.dtype("<u8"),
    "skeletons.blob": np.dtype("u1"),
    "tensors.rows": TENSOR_ROW,
    "tensors.shapes": np.dtype("<i8"),
}


def key_hash(key: str) -> int:
    """The hash the index's key tables sort entries by: xxh3-64 of the key's UTF-8 bytes."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))


def key_hashes(keys: Iterable[bytes], count: int) -> np.ndarray:
    """:func:`key_hash` of ``count`` keys given as UTF-8 bytes, as an array."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype="<u8", count=count)


def write_index(path: str, header: dict[str, Any], sections: Mapping[str, np.ndarray | bytes]) -> None:
    """Write a new index file at ``path`` (created exclusively) and fsync it. The caller renames it into place
    (the commit point)."""
    table: dict[str, dict[str, Any]] = {}
    blobs: list[tuple[int, memoryview]] = []
    offset = 0
    for name, data in sections.items():
        mv = memoryview(data.tobytes() if isinstance(data, np.ndarray) else data).cast("B")
        table[name] = {"offset": offset, "nbytes": mv.nbytes, "xxh3": xxhash.xxh3_64_hexdigest(mv)}
        blobs.append((offset, mv))
        offset += mv.nbytes + (-mv.nbytes % ALIGN)
    header = dict(header, format_version=FORMAT_VERSION, sections=table)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(24 + len(raw)) % ALIGN)
    base = 24 + len(raw)
    with layout.create_file(path) as f:
        f.write(INDEX_MAGIC + struct.pack("<Q", len(raw)) + xxhash.xxh3_64_digest(raw) + raw)
        for off, mv in blobs:
            f.seek(base + off)
            f.write(mv)
        f.truncate(base + offset)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class IndexInfo:
    """The index header (docs/FORMAT.md section 3), every field checked for type and range."""

    cache_id: str
    generation: int
    entries: int
    tensors: int
    shards: tuple[tuple[str, int], ...]  # (file name, size in bytes), in the order tensor records number them
    manifests: dict[str, str]  # dataset name -> section name
    shard_headers: dict[str, str] = field(default_factory=dict)  # file name -> xxh3 of its header, where recorded


_MAX_COUNT = 2**40  # far above any real cache; keeps arithmetic on counts in range


def _int(v: Any, what: str, path: str, top: int = 2**63) -> int:
    if type(v) is not int or not 0 <= v < top:
        raise CacheFormatError(f"{path}: index header field {what} is {v!r:.80}, not an integer in [0, {top}); the "
                               "index is damaged")
    return v


def _str(v: Any, what: str, path: str) -> str:
    if type(v) is not str or len(v) > 4096:
        raise CacheFormatError(f"{path}: index header field {what} is {v!r:.80}, not a string; the index is damaged")
    return v


def parse_index_header(header: Any, path: str) -> IndexInfo:
    """Check the header's fields (types, ranges, shard names, manifest sections) before anything uses them."""
    if not isinstance(header, dict):
        raise CacheFormatError(f"{path}: index header is not a JSON object; the index is damaged")
    counts = header.get("counts")
    shards = header.get("shards")
    manifests = header.get("manifests", {})
    sections = header.get("sections")
    if not isinstance(counts, dict) or not isinstance(shards, list) or not isinstance(manifests, dict) \
            or not isinstance(sections, dict):
        raise CacheFormatError(f"{path}: index header lacks its counts, shards, manifests or section table; the "
                               "index is damaged")
    names = []
    headers: dict[str, str] = {}
    for s in shards:
        if not isinstance(s, dict):
            raise CacheFormatError(f"{path}: index header lists a shard that is not an object; the index is damaged")
        name = _str(s.get("name"), "shards.name", path)
        if not layout.is_shard_name(name):
            raise CacheFormatError(f"{path}: shard name {name!r:.300} is not a plain file name; refusing it")
        names.append((name, _int(s.get("nbytes"), "shards.nbytes", path)))
        digest = s.get("header_xxh3")
        if isinstance(digest, str) and _HEADER_DIGEST.fullmatch(digest):
            headers[name] = digest
    datasets = {_str(k, "manifests", path): _str(v, "manifests", path) for k, v in manifests.items()}
    for name, section in datasets.items():
        if not section.startswith("manifest.") or section not in sections:
            raise CacheFormatError(f"{path}: manifest {name!r:.100} names section {section!r:.100}, which the "
                                   "index does not hold; the index is damaged")
    return IndexInfo(cache_id=_str(header.get("cache_id"), "cache_id", path),
                     generation=_int(header.get("generation"), "generation", path),
                     entries=_int(counts.get("entries"), "counts.entries", path, _MAX_COUNT),
                     tensors=_int(counts.get("tensors", 0), "counts.tensors", path, _MAX_COUNT),
                     shards=tuple(names), manifests=datasets, shard_headers=headers)


class TensorRecordError(CacheFormatError):
    """One tensor record is inconsistent: it damages the entries using it, not the whole cache."""


MAX_TENSOR_ELEMENTS_BYTES = 1 << 62  # the largest stride span (bytes) a record may imply; torch sizes are 64-bit


def decode_tensor_record(row: np.void, shapes: np.ndarray, n_shards: int, where: str
                         ) -> tuple[int, str, tuple[int, ...], int, int, bytes]:
    """(shard number, dtype name, shape, begin, end, digest) of one ``tensors.rows`` record, checked against the
    shape table and the shard list, and its byte span against its dtype and shape."""
    shard, code, ndim, _, begin, end, hi, lo, start = row.item()  # one conversion: the fields in TENSOR_ROW order
    if code >= len(DTYPE_NAMES) or DTYPE_NAMES[code] not in TORCH_DTYPE:
        raise TensorRecordError(f"{where} has unknown dtype code {code}")
    dtype = DTYPE_NAMES[code]
    if start + ndim > len(shapes) or shard >= n_shards or end < begin:
        raise TensorRecordError(f"{where} points outside the shape table or the shards, or has a negative size")
    shape = tuple(shapes[start:start + ndim].tolist())
    if any(d < 0 for d in shape) or math.prod(shape) * ITEMSIZE[dtype] != end - begin:
        raise TensorRecordError(f"{where} has shape {shape} and dtype {dtype} but {end - begin} bytes")
    if shape_bytes(dtype, shape) < 0:
        # an empty tensor whose other dimensions are huge: its strides would overflow torch's 64-bit sizes
        raise TensorRecordError(f"{where} has shape {shape}, whose strides no tensor can have")
    return shard, dtype, shape, begin, end, hi.to_bytes(8, "big") + lo.to_bytes(8, "big")


def shape_bytes(dtype: str, shape: Sequence[int]) -> int:
    """The bytes a tensor of ``dtype`` (a known name) and ``shape`` holds; -1 for a shape no tensor can have (a
    negative dimension, or strides past torch's 64-bit sizes, as an empty tensor whose other dimensions are huge
    would have). What every reader of a record checks its byte span against."""
    size = ITEMSIZE[dtype]
    if any(d < 0 for d in shape) or math.prod(d for d in shape if d) * size >= MAX_TENSOR_ELEMENTS_BYTES:
        return -1
    return math.prod(shape) * size


class IndexFile:
    """A memory-mapped index: the header is parsed and checked at open, sections are checked on first use."""

    def __init__(self, path: str):
        self.path = path
        with layout.open_reader(path, "index") as f:
            self.stat = os.fstat(f.fileno())
            size = self.stat.st_size
            head = f.read(24)
            if len(head) < 24 or head[:8] != INDEX_MAGIC:
                raise CacheFormatError(f"{path}: not a streaming cache index (bad magic or truncated); "
                                       "delete the cache directory and rebuild it")
            (n,) = struct.unpack("<Q", head[8:16])
            if n > MAX_INDEX_HEADER or 24 + n > size:
                raise CacheFormatError(f"{path}: index header claims {n} bytes but the file has {size}; "
                                       "the index is truncated")
            raw = f.read(n)
            if xxhash.xxh3_64_digest(raw) != head[16:24]:
                raise CacheFormatError(f"{path}: index header checksum mismatch; the index is damaged")
            if os.name == "nt":
                # Windows cannot replace a file that is mapped; read it so writers can always commit.
                f.seek(0)
                self._mm: Any = f.read()
            else:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            self.header: dict[str, Any] = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise CacheFormatError(f"{path}: index header is not valid JSON ({type(exc).__name__}); the index is "
                                   "damaged") from exc
        version = self.header.get("format_version") if isinstance(self.header, dict) else None
        if version != FORMAT_VERSION:
            raise CacheFormatError(f"{path}: index format version {version!r:.40} is not supported by this version "
                                   f"(which reads version {FORMAT_VERSION}); upgrade the package or rebuild")
        self.info = parse_index_header(self.header, path)
        self._base = 24 + n
        self._size = size
        self._checked: dict[str, np.ndarray] = {}
        self._sections: dict[str, Any] = self.header["sections"]
        self._tables_ok = False

    def has(self, name: str) -> bool:
        return name in self._sections

    def section(self, name: str) -> np.ndarray:
        """A read-only array view of a section, checksummed the first time it is used."""
        arr = self._checked.get(name)
        if arr is not None:
            return arr
        info = self._sections.get(name)
        dtype = SECTION_DTYPES.get(name, np.dtype("u1"))
        if not isinstance(info, dict):
            raise CacheFormatError(f"{self.path}: index has no section {name!r}; the index is damaged")
        offset, nbytes, digest = info.get("offset"), info.get("nbytes"), info.get("xxh3")
        if type(offset) is not int or type(nbytes) is not int or type(digest) is not str:
            raise CacheFormatError(f"{self.path}: section {name!r} has an invalid record; the index is damaged")
        start = self._base + offset
        if offset < 0 or nbytes < 0 or start + nbytes > self._size or nbytes % dtype.itemsize:
            raise CacheFormatError(f"{self.path}: section {name!r} lies outside the file; the index is truncated")
        view = memoryview(self._mm)[start:start + nbytes] if self._mm is not None else memoryview(b"")
        if xxhash.xxh3_64_hexdigest(view) != digest:
            raise CacheFormatError(f"{self.path}: section {name!r} checksum mismatch; the index is damaged. "
                                   "Rebuild the cache (sources are needed) or restore it from a copy")
        arr = np.frombuffer(view, dtype=dtype)
        self._checked[name] = arr
        return arr

    def check_tables(self) -> None:
        """Check once that the tables agree with each other, so no lookup can index out of range.

        Checksums prove the bytes are what the writer wrote; this proves the tables are consistent even if
        whoever wrote them (a bug, or someone crafting a file with valid checksums) was not. The fuzzer
        (``streaming_cache/devtools/fuzz.py``) checks this by re-serialising mutated indexes with valid checksums.
        References from one entry to a tensor record or skeleton are checked per entry (a bad one damages only
        that entry) by the reader and refused by the writer.
        """
        if self._tables_ok:
            return
        n = self.info.entries

        def bad(what: str) -> CacheFormatError:
            return CacheFormatError(f"{self.path}: index tables are inconsistent ({what}); the index is damaged or "
                                    "was not written by this program. Rebuild the cache")

        def offsets(name: str, count: int, end: int) -> None:
            off = self.section(name)
            if len(off) != count + 1 or (count + 1 and (int(off[0]) != 0 or int(off[-1]) > end)) \
                    or (len(off) > 1 and bool((off[1:] < off[:-1]).any())):
                raise bad(f"{name} does not partition its table")

        offsets("keys.offsets", n, len(self.section("keys.blob")))
        order = self.section("keys.hash_order")
        if len(self.section("keys.hash_sorted")) != n or len(order) != n or (n and int(order.max()) >= n):
            raise bad("key hash tables do not match the entry count")
        hashes = self.section("keys.hash_sorted")
        if n > 1 and bool((hashes[1:] < hashes[:-1]).any()):
            raise bad("the key hash table is not sorted")
        offsets("entries.leaf_offsets", n, len(self.section("leaves.tensor")))
        skel_off = self.section("skeletons.offsets")
        offsets("skeletons.offsets", max(0, len(skel_off) - 1), len(self.section("skeletons.blob")))
        if len(self.section("entries.skeleton")) != n:
            raise bad("the skeleton table does not match the entry count")
        if len(self.section("tensors.rows")) != self.info.tensors and "tensors" in self.header["counts"]:
            raise bad("the tensor table does not match the tensor count")
        self._tables_ok = True
