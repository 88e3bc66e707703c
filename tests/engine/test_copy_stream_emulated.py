"""The loader's GPU-only paths on the CPU, through the emulated device of ``streaming_cache.transfers``: the copy
stream, its events, the consumer's wait, ``record_stream``, next-batch staging, the pinned buffer pool and its
fences and budget, the fallbacks when any of it raises, and ``conditioning.upload``. The same code runs on a GPU
with ``torch.cuda`` behind the seam (``tests/gpu/test_gpu_copy_stream.py``)."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

import streaming_cache as sc
from streaming_cache.environment import EMULATE_ENV
from streaming_cache.fallbacks import COPY_STREAM, PINNED_MEMORY, Fallbacks
from streaming_cache.loader import BatchLoader, LoaderError
from streaming_cache.train.conditioning import upload
from streaming_cache.transfers import CudaTransfers, EmulatedTransfers, for_device

pytestmark = pytest.mark.oldest_torch

CPU = torch.device("cpu")


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streaming-cache-loader")]


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    """24 rows of two tensors each, both filled with the row's number (one layout: batches are read into the
    loader's buffer pool)."""
    path = tmp_path_factory.mktemp("emulated") / "cache"
    with sc.CacheWriter(path) as w:
        for i in range(24):
            w.put(f"row{i:02d}", {"samples": torch.full((4, 8, 8), float(i)), "pooled": torch.full((1, 3), float(i))})
    return sc.open_cache(path).dataset()


def _ids(batch) -> list[int]:
    ids = [int(v) for v in batch["samples"][:, 0, 0, 0]]
    assert [int(v) for v in batch["pooled"][:, 0, 0]] == ids, "the batch's tensors agree"
    return ids


def _reference(handle, epochs: int = 2) -> list[list[int]]:
    """The batches of the plain path (no device), ``epochs`` epochs."""
    loader = BatchLoader(handle, 4, seed=5, workers=0)
    return [_ids(b) for _ in range(epochs) for b in loader]


def _emulated(handle, transfers, **kwargs) -> BatchLoader:
    return BatchLoader(handle, 4, seed=5, device="cpu", transfers=transfers, **kwargs)


def _tensors(batch) -> list[torch.Tensor]:
    return [batch["samples"], batch["pooled"]]


def _is_copy(transfers: EmulatedTransfers, t: torch.Tensor) -> bool:
    return any(c.made() is t for c in transfers.copies)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "streaming_cache.fallbacks"]


def test_batches_come_through_the_copy_stream_events_and_pinned_buffers(handle):
    full = _reference(handle)
    transfers = EmulatedTransfers()
    got = []
    with _emulated(handle, transfers, workers=2) as loader:
        assert loader.pin_memory and loader.pool.pinning
        consumer = transfers.current_stream(CPU)
        for _ in range(2):
            for batch in loader:
                event = consumer.waited[-1]
                assert {id(c.made()) for c in event.copies} == {id(t) for t in _tensors(batch)}, \
                    "the consumer waited on the event of the copy of the batch it got"
                assert event.stream is transfers.copy_streams[CPU] is not consumer, "copied on the copy stream"
                assert all(consumer.uses(t) for t in _tensors(batch)), "record_stream on the consumer's stream"
                assert all(c.source in transfers.pinned_addresses for c in event.copies), "copied from pinned memory"
                got.append(_ids(batch))
                batch["samples"].mul_(0.0)  # the consumer writes into its batch: must not reach a later one
    assert got == full
    assert len(transfers.copy_streams) == 1, "one long-lived copy stream, not one per epoch"
    assert len(consumer.waited) == len({id(e) for e in consumer.waited}) == len(full), "one copy per batch"
    assert len(transfers.copies) == 2 * len(full)
    assert loader.pool.pinned_bytes == transfers.pinned_bytes > 0
    assert not loader.fallbacks, loader.fallbacks.lines()
    assert _loader_threads() == []


def test_the_next_batch_is_copied_while_the_consumer_holds_one(handle):
    transfers = EmulatedTransfers()
    with _emulated(handle, transfers, workers=0) as loader:
        consumer = transfers.current_stream(CPU)
        n = len(loader)
        for k, batch in enumerate(loader):
            assert consumer.waited[-1] is transfers.events[k] and _is_copy(transfers, batch["samples"])
            if k + 1 < n:
                assert len(transfers.events) == k + 2, "the next batch's copy started before this one was used"
                staged = transfers.events[k + 1]
                assert staged.copies and staged not in consumer.waited
            else:
                assert len(transfers.events) == n
    assert [len(e.copies) for e in transfers.events] == [2] * n


def test_a_buffer_a_copy_reads_is_reused_only_once_its_event_completed(handle):
    """Events held incomplete (the device has not run the copies): no buffer a held copy reads is handed out again;
    once they complete, buffers are reused."""
    transfers = EmulatedTransfers()
    loader = _emulated(handle, transfers, workers=0)
    pool, original = loader.pool, loader.pool.empty
    given: list[int] = []
    rewritten: list[int] = []

    def empty(shape, dtype):
        out = original(shape, dtype)
        with transfers.lock:
            busy = {c.source for e in transfers.events if e.held for c in e.copies}
        address = out.untyped_storage().data_ptr()
        given.append(address)
        if address in busy:
            rewritten.append(address)
        return out

    pool.empty = empty
    transfers.hold()
    first = [_ids(b) for b in loader]
    assert len(set(given)) == len(given), "nothing reused while every copy is in flight"
    transfers.release()
    transfers.hold()
    second = [_ids(b) for b in loader]
    assert rewritten == [], "a buffer was handed out again while a copy still read it"
    assert len(set(given)) < len(given), "buffers of completed copies are reused"
    assert first + second == _reference(handle)
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("op,at", [("copy_stream", 3), ("copy", 5), ("event", 3), ("record", 3),
                                   ("wait_event", 3), ("record_stream", 5), ("query", 3)])
def test_a_copy_stream_that_raises_falls_back_to_plain_copies_for_the_rest_of_the_run(handle, caplog, workers, op,
                                                                                      at):
    """The third batch's copy (or the query of the second's event, by the pool) raises: every batch arrives once,
    in order; the failure is noted once with its reason, and that batch and every later one take the plain path."""
    full = _reference(handle)
    transfers = EmulatedTransfers(fail={op: at})
    got, copied = [], []
    caplog.set_level(logging.WARNING, logger="streaming_cache.fallbacks")
    with _emulated(handle, transfers, workers=workers) as loader:
        for _ in range(2):
            for batch in loader:
                got.append(_ids(batch))
                copied.append(_is_copy(transfers, batch["samples"]))
    assert got == full
    assert 0 < copied.count(True) < len(copied) and copied == sorted(copied, reverse=True), copied
    if workers == 0:
        assert copied.count(True) == 2, copied
    assert loader.fallbacks.lines() == [f"copy stream fell back to the plain path: {loader.fallbacks.reason(COPY_STREAM)}"]
    assert f"emulated failure of {op} (call {at})" in loader.fallbacks.reason(COPY_STREAM)
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    if op != "query":  # the pool asks about the events of copies made before, and drops their buffers
        assert transfers.calls[op] == at, "nothing is tried on the copy stream after it failed"
    assert _loader_threads() == []


def test_a_failure_while_the_next_batch_is_staged_loses_and_repeats_no_batch_on_resume(handle):
    full = _reference(handle)
    transfers = EmulatedTransfers(fail={"copy": 5})
    run = _emulated(handle, transfers, workers=0)
    it = iter(run)
    seen = [_ids(next(it)) for _ in range(2)]
    assert run.fallbacks.reason(COPY_STREAM) is not None, "the third batch was being staged when its copy failed"
    state = run.state_dict()
    run.close()
    resumed = _emulated(handle, EmulatedTransfers(), workers=1)
    resumed.load_state_dict(state)
    rest = [_ids(b) for _ in range(2) for b in resumed]
    assert seen + rest == full


def test_an_earlier_failure_of_the_run_keeps_the_copy_stream_and_pins_off(handle):
    fallbacks = Fallbacks()
    fallbacks.note(COPY_STREAM, "an earlier pass failed")
    fallbacks.note(PINNED_MEMORY, "an earlier pass failed")
    transfers = EmulatedTransfers()
    with _emulated(handle, transfers, workers=2, fallbacks=fallbacks) as loader:
        got = [_ids(b) for _ in range(2) for b in loader]
        assert loader.fallbacks is fallbacks and loader.pool.fallbacks is fallbacks
    assert got == _reference(handle)
    assert transfers.calls == {}, "neither the copy stream nor a pin was tried"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pin_that_raises_leaves_buffers_unpinned_for_the_rest_of_the_run(handle, caplog, workers):
    caplog.set_level(logging.WARNING, logger="streaming_cache.fallbacks")
    transfers = EmulatedTransfers(fail={"pinned": 2})  # the first batch's second buffer
    with _emulated(handle, transfers, workers=workers) as loader:
        got = [_ids(b) for _ in range(2) for b in loader]
    assert got == _reference(handle)
    assert "emulated failure of pinned" in loader.fallbacks.reason(PINNED_MEMORY)
    assert len(_warnings(caplog)) == 1 and not loader.pool.pinning
    assert transfers.pins == 1 and loader.pool.pinned_bytes == transfers.pinned_bytes
    if workers == 0:
        assert transfers.calls["pinned"] == 2, "no pin is tried after one failed"
    assert loader.fallbacks.reason(COPY_STREAM) is None and len(transfers.copies) == 2 * len(got), \
        "the copy stream goes on"


class RefusesPins:
    """A dataset handle whose collate raises ``error`` when asked to pin (by default as torch's pinning does when
    the host is out of pinned memory)."""

    def __init__(self, handle, error: Exception | None = None):
        self.handle = handle
        self.error = error or RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported "
                                           "asynchronously")
        self.pins: list[bool] = []

    def collate(self, indices, pin=False, allocate=None):
        self.pins.append(pin)
        if pin:
            raise self.error
        return self.handle.collate(indices, pin, allocate)

    def __getitem__(self, item):
        return self.handle[item]

    def __getattr__(self, name):
        return getattr(self.handle, name)


def test_a_batch_collated_outside_the_pool_is_retried_unpinned_when_pinning_raises(handle):
    refusing = RefusesPins(handle)
    transfers = EmulatedTransfers(torch_pins=True)
    with BatchLoader(refusing, 4, seed=5, device="cpu", transfers=transfers, workers=0) as loader:
        got = [_ids(b) for _ in range(2) for b in loader]
    assert got == _reference(handle)
    assert refusing.pins[:2] == [True, False] and not any(refusing.pins[2:]), "pinned once, then never again"
    assert loader.fallbacks.reason(PINNED_MEMORY) == "pinning host memory for a batch failed (RuntimeError: CUDA " \
                                                     "error: out of memory)"
    with BatchLoader(refusing, 4, seed=5, device="cpu", transfers=EmulatedTransfers(torch_pins=True),
                     pin_budget=lambda n: True, workers=0) as budgeted:
        refusing.pins.clear()
        list(budgeted)
    assert not any(refusing.pins), "with a budget to respect, batches outside the pool are not pinned"
    damaged = RefusesPins(handle, sc.CacheError("entry row03: the shard is damaged"))
    loader = BatchLoader(damaged, 4, seed=5, device="cpu", transfers=EmulatedTransfers(torch_pins=True), workers=0)
    with pytest.raises(LoaderError, match="the shard is damaged"):
        list(loader)
    assert damaged.pins == [True] and not loader.fallbacks, "an entry's error is no pin failure: it is raised"


def test_a_damaged_entry_still_fails_the_run(tmp_path):
    cache = tmp_path / "damaged"
    with sc.CacheWriter(cache, shard_bytes=1024) as w:
        for i in range(12):
            w.put(f"row{i:02d}", {"samples": torch.full((4, 8, 8), float(i))})
    reader = sc.open_cache(cache)
    with open(os.path.join(cache, "shards", reader["row07"].tensors[0].shard), "r+b") as f:
        f.truncate(100)
    for torch_pins in (False, True):
        loader = BatchLoader(reader.dataset(), 4, workers=2, shuffle=False, device="cpu",
                             transfers=EmulatedTransfers(torch_pins=torch_pins))
        with pytest.raises(LoaderError, match="row07"):
            list(loader)
        assert not loader.fallbacks, loader.fallbacks.lines()
    assert _loader_threads() == []


def test_the_pin_budget_decides_what_is_pinned(handle):
    refused = EmulatedTransfers()
    with _emulated(handle, refused, workers=2, pin_budget=lambda nbytes: False) as loader:
        got = [_ids(b) for b in loader]
    assert got == _reference(handle, 1)
    assert refused.pins == 0 and loader.pool.pinned_bytes == 0 and not loader.fallbacks
    assert len(refused.copies) == 2 * len(got), "the copy stream does not need pinned buffers"

    limit = 3 * 4 * 4 * 8 * 8  # three batches' "samples" buffers
    asked: list[int] = []

    def budget(nbytes: int) -> bool:
        if sum(asked) + nbytes > limit:
            return False
        asked.append(nbytes)
        return True

    limited = EmulatedTransfers()
    with _emulated(handle, limited, workers=0, pin_budget=budget) as loader:
        assert [_ids(b) for b in loader] == got
    assert 0 < loader.pool.pinned_bytes == limited.pinned_bytes == sum(asked) <= limit
    assert limited.pins == len(asked) < loader.pool.allocated, "beyond the budget, buffers are ordinary memory"


def test_a_training_run_on_the_cpu_takes_the_emulated_path_when_asked(handle, monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")
    loader = BatchLoader(handle, 4, seed=5, device="cpu", workers=0)
    assert isinstance(loader.transfers, EmulatedTransfers) and loader.pin_memory and loader.pool.pinning
    assert [_ids(b) for b in loader] == _reference(handle, 1)
    assert len(loader.transfers.copies) == 2 * len(loader) and loader.transfers.pins > 0
    assert BatchLoader(handle, 4).transfers is None, "without a device, batches stay where they are collated"
    monkeypatch.setenv(EMULATE_ENV, "0")
    plain = BatchLoader(handle, 4, device="cpu")
    assert plain.transfers is None and not plain.pool.pinning
    assert isinstance(for_device(torch.device("cuda", 0)), CudaTransfers) and for_device(None) is None


@pytest.mark.parametrize("fail", [{}, {"copy": 7}, {"wait_event": 4}, {"pinned": 2}])
def test_a_training_run_through_the_emulated_device_trains_what_the_plain_run_trains(tmp_path, monkeypatch, fail):
    """``train_with`` (the toy regression, two workers) with its batches through the emulated copy stream and
    pinned pool, with and without a failure mid-run: the trained tensors and losses are the plain run's, bit for
    bit."""
    from helpers.toy_backend import Toy, pairs_cache
    from streaming_cache.train import backend as train_backend
    from streaming_cache.train.backend import train_with
    from streaming_cache.train.spec import TrainSpec

    pairs = sc.open_cache(pairs_cache(str(tmp_path / "cache"))).dataset()
    spec = TrainSpec.build({"steps": 12, "learning_rate": 0.1, "batch_size": 4, "grad_accumulation_steps": 2,
                            "optimizer": "Adam", "seed": 5, "workers": 2})
    plain = Toy()
    expected = train_with(plain, pairs, spec)
    made: list[BatchLoader] = []

    def emulated(*args, **kwargs):
        kwargs.update(device="cpu", transfers=EmulatedTransfers(fail=fail))
        made.append(BatchLoader(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(train_backend, "BatchLoader", emulated)
    toy = Toy()
    result = train_with(toy, pairs, spec)
    assert result.losses == expected.losses
    assert all(torch.equal(toy.params[k], plain.params[k]) for k in plain.params)
    (loader,) = made
    assert len(loader.transfers.copies) > 0 and len(loader.fallbacks.lines()) == (1 if fail else 0)


# ---------------------------------------------------------------------------------- conditioning.upload

def test_upload_goes_through_pinned_memory_and_a_copy():
    t = torch.arange(6.0)
    transfers = EmulatedTransfers()
    out = upload(t, CPU, transfers=transfers)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert transfers.pins == 1 and transfers.pinned_bytes == 24
    (copy,) = transfers.copies
    assert copy.made() is out and copy.source in transfers.pinned_addresses and copy.source != t.data_ptr()


def test_upload_pins_only_within_the_budget():
    t = torch.arange(6.0)
    asked: list[int] = []
    transfers = EmulatedTransfers()
    out = upload(t, CPU, pin_budget=lambda nbytes: asked.append(nbytes) or False, transfers=transfers)
    assert torch.equal(out, t) and asked == [24]
    assert transfers.pins == 0 and transfers.copies == [], "refused: the plain copy"


def test_a_pin_that_raises_in_upload_makes_the_copies_plain_for_the_rest_of_the_run(caplog):
    caplog.set_level(logging.WARNING, logger="streaming_cache.fallbacks")
    t = torch.arange(6.0)
    transfers = EmulatedTransfers(fail={"pin": 1})
    fallbacks = Fallbacks()
    assert all(torch.equal(upload(t, CPU, fallbacks, transfers=transfers), t) for _ in range(3))
    assert transfers.calls["pin"] == 1 and transfers.copies == []
    assert "emulated failure of pin" in fallbacks.reason(PINNED_MEMORY) and len(_warnings(caplog)) == 1
    assert torch.equal(upload(t, CPU, transfers=EmulatedTransfers(fail={"pin": 1})), t), "no record: still no crash"


def test_upload_on_the_cpu_is_emulated_only_when_asked(monkeypatch):
    t = torch.arange(6.0)
    monkeypatch.setenv(EMULATE_ENV, "0")
    assert upload(t, CPU) is t
    monkeypatch.setenv(EMULATE_ENV, "1")
    out = upload(t, CPU)
    assert out is not t and torch.equal(out, t)
