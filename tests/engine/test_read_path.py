"""How tensor bytes get from the shards into batches: reused buffers that are never written while a caller holds
them, explicit reads in flight on slow storage, and shard headers checked against the index."""

from __future__ import annotations

import gc
import json
import os
import struct
import threading
import time

import numpy as np
import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import shard_paths
from streaming_cache import reader as reader_module
from streaming_cache.buffers import BufferPool
from streaming_cache.loader import BatchLoader

pytestmark = pytest.mark.oldest_torch


@pytest.fixture
def handle(tmp_path):
    """48 rows of 64 KiB in one shape, each filled with its own number."""
    with sc.CacheWriter(tmp_path / "cache") as w:
        for i in range(48):
            w.put(f"r{i:02d}", {"samples": torch.full((8, 64, 64), float(i))})
    return sc.open_cache(tmp_path / "cache").dataset()


def _ids(batch) -> list[int]:
    return [int(v) for v in batch["samples"][:, 0, 0, 0]]


def test_a_pool_reuses_a_buffer_only_when_nothing_holds_it():
    pool = BufferPool()
    first = pool.empty((4, 3), torch.float32)
    address = first.data_ptr()
    view = first[1:]
    array = first.numpy()
    del first
    gc.collect()
    assert pool.empty((4, 3), torch.float32).data_ptr() != address, "a view still holds it"
    del view
    gc.collect()
    assert pool.empty((4, 3), torch.float32).data_ptr() != address, "a numpy array still holds it"
    del array
    gc.collect()
    again = [pool.empty((4, 3), torch.float32) for _ in range(4)]
    assert address in [t.data_ptr() for t in again], "free again: reused"


class Event:
    """Stands for a CUDA event: ``query()`` is False until ``done``."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_buffer_a_copy_still_reads_is_not_reused_before_the_copy_completes():
    pool = BufferPool()
    t = pool.empty((1024,), torch.uint8)
    address, event = t.data_ptr(), Event()
    pool.fence([t], event)
    del t
    gc.collect()
    while_copying = [pool.empty((1024,), torch.uint8) for _ in range(2)]
    assert address not in [t.data_ptr() for t in while_copying]
    del while_copying
    event.done = True
    gc.collect()
    after = [pool.empty((1024,), torch.uint8) for _ in range(3)]
    assert address in [t.data_ptr() for t in after]


def test_the_loader_reuses_its_buffers_over_epochs_and_never_overwrites_a_batch_held(handle):
    loader = BatchLoader(handle, 4, seed=1, workers=2, prefetch=2)
    held = next(iter(loader))
    kept, expected = held["samples"], _ids(held)
    for _ in range(3):
        for batch in loader:
            assert len(set(_ids(batch))) == len(_ids(batch))
    assert _ids({"samples": kept}) == expected and torch.equal(kept[:, 1:, 1:], kept[:, :-1, :-1]), \
        "a batch the consumer still holds is never written"
    for _ in range(3):
        for _batch in loader:
            pass
    # Buffers alive at once: 2 in flight (prefetch), 1 with the consumer, 1 held; and a buffer given back just
    # after a worker took one is counted by the next take: 1 per worker.
    assert loader.pool.allocated <= 2 + 1 + 1 + 2, "buffers are reused: memory stays flat over 7 epochs"
    loader.close()


def test_reads_go_in_flight_together_when_storage_is_slow(handle, monkeypatch):
    """A read that takes milliseconds (a network drive) makes the reader read explicitly, several at once on its
    I/O threads; the batches are the same."""
    expected = [_ids(b) for b in BatchLoader(handle, 8, seed=2, workers=0)]
    threads: set[str] = set()
    original = reader_module._pread

    def slow(fd, dst, offset):
        threads.add(threading.current_thread().name)
        time.sleep(0.003)
        return original(fd, dst, offset)

    monkeypatch.setattr(reader_module, "_pread", slow)
    monkeypatch.setattr(reader_module, "PREAD_MIN_BYTES", 0)
    reader = sc.open_cache(handle.caches[0])
    started = time.perf_counter()
    got = [_ids(reader.collate(list(b))) for b in BatchLoader(handle, 8, seed=2, workers=0).sampler.epoch_batches(0)]
    assert got == expected
    assert reader._excess > reader_module.SLOW_READ_S, "the reader noticed the storage is slow"
    assert any(n.startswith("streaming-cache-io") for n in threads), "reads ran on the I/O threads"
    assert time.perf_counter() - started >= 0.003, "the slow reads were made"


def _rewrite_shard_header(path: str, change) -> None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_a_shard_header_that_disagrees_with_the_index_damages_only_its_entries(tmp_path, damage):
    with sc.CacheWriter(tmp_path / "cache") as w:
        for i in range(6):
            w.put(f"r{i}", {"samples": torch.full((2, 4), float(i))})
    reader = sc.open_cache(tmp_path / "cache")
    victim = reader["r3"].tensors[0].digest

    def change(header):
        if damage == "missing":
            info = header.pop(victim)
            header["f" * 32] = info  # its bytes under another name
        else:
            header[victim]["shape"] = [4, 2]

    _rewrite_shard_header(shard_paths(tmp_path / "cache")[0], change)
    reader = sc.open_cache(tmp_path / "cache")
    with pytest.raises(sc.DamagedEntryError, match="missing from shard" if damage == "missing" else "disagrees"):
        reader["r3"].materialize()
    with pytest.raises(sc.DamagedEntryError, match="'r3'"):
        reader.collate(list(range(6)))
    others = [i for i in range(6) if reader.key_at(i) != "r3"]
    assert sorted(float(v) for v in reader.collate(others)["samples"][:, 0, 0]) == [0, 1, 2, 4, 5]
    assert set(reader.verify().damaged) == {"r3"}
    assert np.array_equal(sc.open_cache(tmp_path / "cache")["r0"].materialize()["samples"], torch.zeros(2, 4))


def test_a_shard_cut_short_damages_only_the_entries_whose_bytes_it_lost(tmp_path):
    """The shard's header is the one the index recorded (its digest matches, so it is not parsed again), but the
    file lost its tail: the records past the end are refused by the bounds check, the others read."""
    with sc.CacheWriter(tmp_path / "cache") as w:
        for i in range(6):
            w.put(f"r{i}", {"samples": torch.full((2, 4), float(i))})
    reader = sc.open_cache(tmp_path / "cache")
    path = shard_paths(tmp_path / "cache")[0]
    with open(path, "rb") as f:
        _, placed = sc.format.read_shard_header(f, os.path.getsize(path), path)
    at_end = max(placed.values(), key=lambda t: t.end).name
    last = next(i for i in range(6) if reader[f"r{i}"].tensors[0].digest == at_end)
    os.truncate(path, os.path.getsize(path) - 4)
    reader = sc.open_cache(tmp_path / "cache")
    with pytest.raises(sc.DamagedEntryError, match="lies outside shard"):
        reader[f"r{last}"].materialize()
    others = [i for i in range(6) if reader.key_at(i) != f"r{last}"]
    assert sorted(float(v) for v in reader.collate(others)["samples"][:, 0, 0]) == sorted(
        float(i) for i in range(6) if i != last)
    assert set(reader.verify().damaged) == {f"r{last}"}
