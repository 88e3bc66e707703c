"""The bytes on disk: dtype codes, tensor digests, safetensors shards and the index file.

With ``skeleton`` (entry structure), this is the only code that interprets bytes read from a cache;
``FORMAT.md`` specifies what it reads and writes. Everything read is treated as untrusted: sizes and offsets
are bounds-checked before use.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
import xxhash

from .errors import CacheFormatError

FORMAT_VERSION = 1
INDEX_MAGIC = b"SCCACHE\x00"
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
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
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over ``data`` (no copy); ``data`` must be writable for the tensor to be."""
    if len(data) == 0:
        return torch.empty(tuple(shape), dtype=TORCH_DTYPE[dtype])
    return torch.frombuffer(data, dtype=torch.uint8).view(TORCH_DTYPE[dtype]).reshape(tuple(shape))


def tensor_digest(dtype: str, shape: Sequence[int], data: memoryview | bytes) -> bytes:
    """xxh3-128 of a tensor's dtype, shape and bytes: its identity for deduplication and its checksum."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype}:{','.join(str(int(s)) for s in shape)}:".encode())
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
    header: dict[str, Any] = {"__metadata__": {"format": "streaming_cache", "format_version": str(FORMAT_VERSION)}}
    for name, dtype, shape, nbytes in ordered:
        placed.append(ShardTensor(name, dtype, tuple(shape), offset, offset + nbytes))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, placed


def shard_data_start(f: Any) -> int:
    """Where a shard's data area starts: after the 8-byte header length and the header. Reads from offset 0."""
    f.seek(0)
    head = f.read(8)
    if len(head) != 8:
        raise CacheFormatError(f"{getattr(f, 'name', 'shard')}: shard is truncated (no safetensors header)")
    return 8 + struct.unpack("<Q", head)[0]


def read_shard_header(f: Any, file_size: int, where: str) -> tuple[int, dict[str, ShardTensor]]:
    """Parse and validate a safetensors header; returns (data start offset, tensors by name).

    Checks everything a hostile file could get wrong: header size, JSON shape, dtype names, non-negative
    shapes, offsets inside the file, byte counts matching shapes, and no two tensors overlapping.
    """
    head = f.read(8)
    if len(head) != 8:
        raise CacheFormatError(f"{where}: shard is truncated ({file_size} bytes, no safetensors header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_SAFETENSORS_HEADER or 8 + n > file_size:
        raise CacheFormatError(f"{where}: safetensors header claims {n} bytes but the file has {file_size}; "
                               "the shard is truncated or damaged")
    raw = f.read(n)
    try:
        header = json.loads(raw)
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
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))


def write_index(path: str, header: dict[str, Any], sections: Mapping[str, np.ndarray | bytes]) -> None:
    """Write an index file to ``path`` and fsync it. The caller renames it into place (the commit point)."""
    layout: dict[str, dict[str, Any]] = {}
    blobs: list[tuple[int, memoryview]] = []
    offset = 0
    for name, data in sections.items():
        mv = memoryview(data.tobytes() if isinstance(data, np.ndarray) else data).cast("B")
        layout[name] = {"offset": offset, "nbytes": mv.nbytes, "xxh3": xxhash.xxh3_64_hexdigest(mv)}
        blobs.append((offset, mv))
        offset += mv.nbytes + (-mv.nbytes % ALIGN)
    header = dict(header, format_version=FORMAT_VERSION, sections=layout)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(24 + len(raw)) % ALIGN)
    base = 24 + len(raw)
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC + struct.pack("<Q", len(raw)) + xxhash.xxh3_64_digest(raw) + raw)
        for off, mv in blobs:
            f.seek(base + off)
            f.write(mv)
        f.truncate(base + offset)
        f.flush()
        os.fsync(f.fileno())


class IndexFile:
    """A memory-mapped index: the header is parsed and checked at open, sections are checked on first use."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
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
        except ValueError as exc:
            raise CacheFormatError(f"{path}: index header is not valid JSON ({exc})") from exc
        version = self.header.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheFormatError(f"{path}: index format version {version!r} is not supported by this version "
                                   f"(which reads version {FORMAT_VERSION}); upgrade the package or rebuild")
        self._base = 24 + n
        self._size = size
        self._checked: dict[str, np.ndarray] = {}
        sections = self.header.get("sections")
        if not isinstance(sections, dict):
            raise CacheFormatError(f"{path}: index header has no section table")
        self._sections: dict[str, dict[str, Any]] = sections

    def has(self, name: str) -> bool:
        return name in self._sections

    def section(self, name: str) -> np.ndarray:
        """A read-only array view of a section, checksummed the first time it is used."""
        arr = self._checked.get(name)
        if arr is not None:
            return arr
        info = self._sections.get(name)
        dtype = SECTION_DTYPES.get(name, np.dtype("u1"))
        if info is None:
            raise CacheFormatError(f"{self.path}: index has no section {name!r}; the index is damaged")
        try:
            start, nbytes, digest = self._base + int(info["offset"]), int(info["nbytes"]), str(info["xxh3"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheFormatError(f"{self.path}: section {name!r} has an invalid record") from exc
        if start < self._base or nbytes < 0 or start + nbytes > self._size or nbytes % dtype.itemsize:
            raise CacheFormatError(f"{self.path}: section {name!r} lies outside the file; the index is truncated")
        view = memoryview(self._mm)[start:start + nbytes] if self._mm is not None else memoryview(b"")
        if xxhash.xxh3_64_hexdigest(view) != digest:
            raise CacheFormatError(f"{self.path}: section {name!r} checksum mismatch; the index is damaged. "
                                   "Rebuild the cache (sources are needed) or restore it from a copy")
        arr = np.frombuffer(view, dtype=dtype)
        self._checked[name] = arr
        return arr
