"""Every shard the writer writes, the reader reads: shards roll by tensor count and header size as well as bytes,
and a cache written before that (a shard whose header is longer than safetensors allows) is read, or named with
the command that rewrites it, never called truncated."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from streaming_cache import format as fmt
from streaming_cache import layout
from streaming_cache.errors import CacheFormatError, DamagedEntryError
from streaming_cache.reader import open_cache
from streaming_cache.writer import CacheWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path: str, n: int, dims: int = 3) -> None:
    with CacheWriter(path) as w:
        for i in range(n):
            w.put(f"k{i}", torch.full((1,) * dims, float(i)))


def _headers(path: str) -> list[tuple[int, int]]:
    """(header bytes, tensors) of every shard file of a cache."""
    out = []
    folder = os.path.join(path, "shards")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out.append((n, len(header) - 1))
    return out


def _read_all(path: str, n: int) -> None:
    with open_cache(path) as r:
        for i in range(n):
            assert float(r[f"k{i}"].materialize().flatten()[0]) == float(i)


def test_shards_roll_by_tensor_count(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "SHARD_MAX_TENSORS", 100)
    _write(str(tmp_path / "c"), 350)
    counts = [t for _, t in _headers(str(tmp_path / "c"))]
    assert sorted(counts) == [50, 100, 100, 100]
    _read_all(str(tmp_path / "c"), 350)


def test_shards_roll_by_header_size(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "SHARD_MAX_HEADER_BYTES", 20_000)
    _write(str(tmp_path / "c"), 300, dims=8)
    found = _headers(str(tmp_path / "c"))
    assert len(found) > 1 and sum(t for _, t in found) == 300
    assert all(n <= 20_000 for n, _ in found), found
    _read_all(str(tmp_path / "c"), 300)


def test_header_record_bound_holds_for_the_widest_record():
    name = "f" * 32
    shape = (2**63 - 1,) * 5
    header, _ = fmt.shard_layout([(name, "F8_E4M3FNUZ", shape, 2**63 - 1)])
    record = json.dumps({name: {"dtype": "F8_E4M3FNUZ", "shape": list(shape),
                                "data_offsets": [2**63 - 1, 2**63 - 1]}}, separators=(",", ":"))
    assert len(record) - 2 + 1 <= fmt.header_record_bytes(name, len(shape))  # minus the braces, plus a comma
    assert len(header) > 0


def _old_release_cache(path: str, monkeypatch, n: int) -> None:
    """A cache as an earlier release wrote it: one shard with every tensor, its header past the (here scaled down)
    limit of a safetensors header."""
    with monkeypatch.context() as m:
        m.setattr(fmt, "SHARD_MAX_TENSORS", 10**9)
        m.setattr(fmt, "SHARD_MAX_HEADER_BYTES", 10**12)
        _write(path, n)
    assert len(_headers(path)) == 1


def test_an_old_oversized_shard_is_read_by_its_digest(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    _old_release_cache(path, monkeypatch, 3000)
    (n, _), = _headers(path)
    monkeypatch.setattr(fmt, "MAX_SAFETENSORS_HEADER", n // 3)  # the header is past the limit
    _read_all(path, 3000)


def test_an_old_oversized_shard_without_a_digest_is_named_and_compact_rewrites_it(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    _old_release_cache(path, monkeypatch, 3000)
    (n, _), = _headers(path)
    index_path = layout.index_path(path)
    index = fmt.IndexFile(index_path)
    sections = {name: index.section(name) for name in fmt.SECTION_DTYPES}
    header = {k: v for k, v in index.header.items() if k not in ("sections", "format_version")}
    for s in header["shards"]:
        s.pop("header_xxh3")  # as releases wrote before the digest was recorded
    del index
    os.replace(index_path, str(tmp_path / "old-index"))
    fmt.write_index(index_path, header, sections)
    monkeypatch.setattr(fmt, "MAX_SAFETENSORS_HEADER", n // 3)
    monkeypatch.setattr(fmt, "SHARD_MAX_TENSORS", 1000)
    with open_cache(path) as r, pytest.raises(DamagedEntryError) as err:
        r["k0"].materialize()
    message = str(err.value)
    assert "truncated" not in message
    assert f"header is {n:,} bytes" in message and "python -m streaming_cache compact" in message
    with CacheWriter(path) as w:
        assert w.compact()["shards_rewritten"] == 1
    assert sorted(t for _, t in _headers(path)) == [1000, 1000, 1000]
    _read_all(path, 3000)


def test_compact_command_rewrites_oversized_shards(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    _old_release_cache(path, monkeypatch, 300)
    code = ("import sys; from streaming_cache import format as f; f.SHARD_MAX_TENSORS = 100; "
            "from streaming_cache.cli import main; sys.exit(main(['compact', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "rewrote 1 shards" in out.stdout
    assert sorted(t for _, t in _headers(path)) == [100, 100, 100]
    _read_all(path, 300)


def test_a_header_past_the_file_is_called_truncated(tmp_path):
    path = str(tmp_path / "c")
    _write(path, 3)
    folder = os.path.join(path, "shards")
    shard = os.path.join(folder, os.listdir(folder)[0])
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(shard)))
    with open_cache(path) as r, pytest.raises(CacheFormatError, match="truncated or damaged"):
        r["k0"].materialize()


def test_a_shard_header_is_the_json_safetensors_readers_parse():
    items = [("a" * 32, "F32", (1, 4, 4, 4), 256), ("b" * 32, "BF16", (3,), 6), ("c" * 32, "F64", (), 8),
             ("d" * 32, "I64", (0, 5), 0), ("e" * 32, "F32", [1, 4, 4, 4], 256), ("näme \"q\"", "U8", (2,), 2)]
    header, placed = fmt.shard_layout(items)
    (n,) = struct.unpack("<Q", header[:8])
    parsed = json.loads(header[8:8 + n])
    assert n == len(header) - 8 and len(header) % fmt.ALIGN == 0
    assert parsed.pop("__metadata__") == {"format": "streaming_cache", "format_version": str(fmt.FORMAT_VERSION)}
    assert parsed == {p.name: {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [p.begin, p.end]}
                      for p in placed}
    assert [p.name[0] for p in placed] == ["c", "d", "a", "e", "b", "n"]  # by element size, largest first
    with pytest.raises(ValueError, match="named twice"):
        fmt.shard_layout(items[:1] * 2)
