"""What reading a large cache keeps per entry, and the per-entry path's shape.

The reader and a handle on a whole cache keep numpy columns of a byte or two per entry (no Python object, dict
item or eight-byte array per entry), and reading entries one by one keeps nothing per entry read. Memory is
counted with ``tracemalloc``, which sees Python objects and numpy's arrays (the mapped index and shards are
files, not counted), so the figures are the same on every machine.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import flip_byte, tensor_file_offset
from streaming_cache import format as fmt
from streaming_cache import reader as reader_module
from streaming_cache.dataset import DatasetHandle

pytestmark = pytest.mark.oldest_torch

ENTRIES = 200_000
KEPT_PER_ENTRY = 4.0
"""Bytes a reader and a handle on all of its entries may keep per entry once an epoch is planned, batches are
collated and random entries are read (the whole process may use 100; the epoch's plan and the loader need most).
They keep 2.2; one more column of four bytes per entry would not pass."""


def _write(path: str, entries: int) -> str:
    """A cache of ``entries`` entries of one 1x4x4x4 float32 tensor each, entry ``i`` holding ``i``."""
    chunk = 1 << 16
    with sc.CacheWriter(path) as w:
        for lo in range(0, entries, chunk):
            count = min(chunk, entries - lo)
            values = torch.zeros(count, 1, 4, 4, 4)
            values.view(count, -1)[:, 0] = torch.arange(lo, lo + count, dtype=torch.float32)
            w.put_many([f"k{i:07d}" for i in range(lo, lo + count)], values)
    return path


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> str:
    """A cache of :data:`ENTRIES` entries (see :func:`_write`)."""
    return _write(str(tmp_path_factory.mktemp("entries") / "cache"), ENTRIES)


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.fixture
def traced():
    tracemalloc.start()
    try:
        yield _traced
    finally:
        tracemalloc.stop()


def _open_and_read(path: str, entries: int) -> DatasetHandle:
    """Open a cache of ``entries`` entries and do what a training does with it: plan an epoch, collate batches,
    read random entries."""
    reader = sc.open_cache(path)
    handle = DatasetHandle.from_reader(reader)
    signatures = handle.signatures()  # what planning an epoch asks for: the caller's, not counted
    assert len(set(signatures.tolist())) == 1
    del signatures
    rng = random.Random(0)
    for _ in range(8):
        batch = handle.collate(rng.sample(range(entries), 64))
        assert batch.shape == (64, 1, 4, 4, 4)
    for i in rng.sample(range(entries), 2000):
        assert float(handle[i].materialize()[0, 0, 0, 0]) == i
    return handle


def test_a_reader_and_a_handle_on_every_entry_keep_a_few_bytes_per_entry(large, traced, tmp_path):
    """Only what grows with the entries is counted: the same work on a small cache first makes what a process
    makes once (modules imported on first use, a thread's header buffer: 0.8 MB, 4 bytes per entry here), which
    counted would make the figure depend on which tests ran before."""
    _open_and_read(_write(str(tmp_path / "small"), 4096), 4096)
    before = traced()
    handle = _open_and_read(large, ENTRIES)
    kept = traced() - before
    assert kept / ENTRIES <= KEPT_PER_ENTRY, f"{kept / ENTRIES:.1f} bytes kept per entry"
    assert handle.fingerprint() == handle.fingerprint()


def test_reading_entries_one_by_one_keeps_nothing_per_entry_read(large, traced):
    reader = sc.open_cache(large)
    handle = DatasetHandle.from_reader(reader)
    for i in range(100):  # the shards and what is decoded once
        handle[i].materialize()
        reader.views(i)
    before = traced()
    for i in range(100, 5100):
        handle[i].materialize()
        reader.views(i)
        reader.entry_record(i)
    grown = traced() - before
    assert grown < 64 * 1024, f"{grown} bytes kept after reading 5,000 entries"


def test_a_healthy_entry_is_read_without_decoding_an_index_record(large, monkeypatch):
    """The per-entry path reads the index fields it needs in place and reuses what it decoded for the entry's
    skeleton and its records' dtype and shape: no record object per tensor, and no work done twice."""
    reader = sc.open_cache(large)
    reader.materialize(0)

    def refused(*args, **kwargs):
        raise AssertionError("a record was decoded one by one")

    monkeypatch.setattr(fmt, "decode_tensor_record", refused)
    monkeypatch.setattr(reader_module.CacheReader, "entry_record", refused)
    monkeypatch.setattr(reader_module.CacheReader, "tensor_record", refused)
    for i in (1, 77_777, ENTRIES - 1):
        value = reader.materialize(i, check=True)
        assert float(value[0, 0, 0, 0]) == i and value.shape == (1, 4, 4, 4) and value.dtype == torch.float32
        value.zero_()  # the caller's own memory
        assert float(reader.materialize(i)[0, 0, 0, 0]) == i


def test_a_record_damaged_after_its_entry_was_read_is_still_refused(tmp_path):
    """What the per-entry path remembers is per dtype and shape, never per record: a record of the same shape
    whose checksum fails is caught on every read."""
    with sc.CacheWriter(tmp_path / "cache") as w:
        w.put_many(["a", "b"], torch.arange(32, dtype=torch.float32).reshape(2, 16))
    reader = sc.open_cache(tmp_path / "cache")
    assert torch.equal(reader["a"].materialize(check=True), torch.arange(16, dtype=torch.float32))
    path, begin, _ = tensor_file_offset(tmp_path / "cache", reader["b"].tensors[0].digest)
    flip_byte(path, begin)
    with pytest.raises(sc.DamagedEntryError, match="'b': tensor 0 fails its checksum"):
        reader["b"].materialize(check=True)
    assert torch.equal(reader["a"].materialize(check=True), torch.arange(16, dtype=torch.float32))
