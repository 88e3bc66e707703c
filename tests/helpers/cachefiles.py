"""A cache's files as an attacker sees them: where a tensor's bytes are, flipping bytes, rewriting the index
with valid checksums."""

from __future__ import annotations

import json
import os
import struct

import streaming_cache as sc
from streaming_cache import format as fmt
from streaming_cache import layout


def shard_paths(cache) -> list[str]:
    d = layout.shard_dir(str(cache))
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(layout.SHARD_SUFFIX))


def shard_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def tensor_file_offset(cache, digest_hex: str) -> tuple[str, int, int]:
    """(shard path, absolute begin, end) of the tensor named ``digest_hex``."""
    for path in shard_paths(cache):
        start, header = shard_header(path)
        if digest_hex in header:
            b, e = header[digest_hex]["data_offsets"]
            return path, start + b, start + e
    raise KeyError(digest_hex)


def entry_digests(cache, key: str) -> list[str]:
    return [t.digest for t in sc.open_cache(cache)[key].tensors]


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def rewrite_index(cache, mutate) -> None:
    """Rewrite ``index.scc`` after ``mutate(header, sections)``, with valid checksums: what an attacker who
    knows the format would do."""
    path = layout.index_path(str(cache))
    index = fmt.IndexFile(path)
    sections = {name: bytes(index.section(name).tobytes()) for name in index.header["sections"]}
    header = {k: v for k, v in index.header.items() if k not in ("sections", "format_version")}
    mutate(header, sections)
    tmp = path + ".attacker"
    fmt.write_index(tmp, header, sections)
    os.replace(tmp, path)


INDEX_DAMAGE = ("negative_count", "huge_count", "offsets", "unsorted_hashes", "hash_order", "manifests_not_dict",
                "row_shape", "bad_key_utf8", "skeleton_id", "row_bytes", "overflow_shape")
"""Ways to make an index inconsistent while keeping its checksums valid (see :func:`damage_index`)."""


def damage_index(cache, damage: str) -> None:
    """Rewrite the index of ``cache`` with one :data:`INDEX_DAMAGE` inconsistency, checksums kept valid, so
    only the reader's consistency checks can catch it."""
    import numpy as np

    def mutate(header, sections):
        if damage == "negative_count":
            header["counts"]["entries"] = -1
        elif damage == "huge_count":
            header["counts"]["entries"] = 2**62
        elif damage == "offsets":
            off = np.frombuffer(sections["keys.offsets"], "<u8").copy()
            off[2] = 10**9
            sections["keys.offsets"] = off.tobytes()
        elif damage == "unsorted_hashes":
            sections["keys.hash_sorted"] = np.frombuffer(sections["keys.hash_sorted"], "<u8")[::-1].copy().tobytes()
        elif damage == "hash_order":
            o = np.frombuffer(sections["keys.hash_order"], "<u8").copy()
            o[0] = 99
            sections["keys.hash_order"] = o.tobytes()
        elif damage == "manifests_not_dict":
            header["manifests"] = "oops"
        elif damage in ("row_shape", "row_bytes", "overflow_shape"):
            rows = np.frombuffer(sections["tensors.rows"], fmt.TENSOR_ROW).copy()
            if damage == "row_shape":
                rows[0]["shape_start"] = 10**6
            elif damage == "row_bytes":
                rows[0]["end"] = rows[0]["begin"] + 2**40
            else:  # no bytes, as the shape says, but strides beyond any tensor's
                shapes = np.frombuffer(sections["tensors.shapes"], "<u8")
                rows[0]["shape_start"], rows[0]["ndim"], rows[0]["end"] = len(shapes), 3, rows[0]["begin"]
                sections["tensors.shapes"] = np.concatenate([shapes, [0, 2**40, 2**40]]).astype("<u8").tobytes()
            sections["tensors.rows"] = rows.tobytes()
        elif damage == "bad_key_utf8":
            sections["keys.blob"] = b"\xff" + sections["keys.blob"][1:]
        elif damage == "skeleton_id":
            sk = np.frombuffer(sections["entries.skeleton"], "<u4").copy()
            sk[1] = 77
            sections["entries.skeleton"] = sk.tobytes()
        else:
            raise ValueError(f"unknown damage {damage!r}")

    rewrite_index(cache, mutate)
