"""BatchLoader and BucketSampler: determinism, resume, buckets, rank split, threads, errors, memory bound."""

from __future__ import annotations

import gc
import os
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest
import torch

import streaming_cache as sc
from helpers.installs import subprocess_env
from streaming_cache.loader import BatchLoader, LoaderError, collate, effective_workers
from streaming_cache.sampler import BucketSampler
from streaming_cache.transfers import CudaTransfers

pytestmark = pytest.mark.oldest_torch

CUDA = torch.cuda.is_available()


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streaming-cache-loader")]


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    """60 rows in three shape buckets (8x8, 16x8, 8x16), each row knows its own number."""
    path = tmp_path_factory.mktemp("loader") / "cache"
    shapes = [(4, 8, 8), (4, 16, 8), (4, 8, 16)]
    with sc.CacheWriter(path) as w:
        for i in range(60):
            w.put(f"row{i:02d}", {"samples": torch.full(shapes[i % 3], float(i)), "i": i, "tag": f"t{i}"})
    return sc.open_cache(path).dataset()


def _ids(batch) -> list[int]:
    return [int(v) for v in batch["samples"][:, 0, 0, 0]]


def _epoch(loader) -> list[list[int]]:
    return [_ids(b) for b in loader]


def test_batches_are_collated_and_never_mix_shapes(handle):
    with BatchLoader(handle, 4, workers=2) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) == 15
    for b in batches:
        assert b["samples"].ndim == 4 and b["samples"].shape[0] <= 4
        ids = _ids(b)
        assert len({i % 3 for i in ids}) == 1, f"batch mixes buckets: {ids}"
        assert b["i"] == ids and b["tag"] == [f"t{i}" for i in ids]
    assert sorted(i for b in batches for i in _ids(b)) == list(range(60))


def test_same_seed_same_order_and_epochs_differ(handle):
    a = BatchLoader(handle, 4, seed=7, workers=2)
    b = BatchLoader(handle, 4, seed=7, workers=0)
    first_a, first_b = _epoch(a), _epoch(b)
    assert first_a == first_b
    second_a = _epoch(a)
    assert second_a != first_a and sorted(map(sorted, second_a)) != [] and a.epoch == 2
    assert _epoch(BatchLoader(handle, 4, seed=8)) != first_a
    assert _epoch(BatchLoader(handle, 4, shuffle=False)) == _epoch(BatchLoader(handle, 4, shuffle=False))


def test_resume_from_state_gives_the_remaining_batches(handle):
    reference = BatchLoader(handle, 4, seed=3, workers=2)
    full = _epoch(reference) + _epoch(reference)
    run = BatchLoader(handle, 4, seed=3, workers=2)
    it = iter(run)
    seen = [_ids(next(it)) for _ in range(6)]
    state = run.state_dict()
    run.close()
    resumed = BatchLoader(handle, 4, seed=3, workers=1)
    resumed.load_state_dict(state)
    rest = _epoch(resumed) + _epoch(resumed)
    assert seen + rest == full
    with pytest.raises(sc.CacheError, match="global batch"):
        BatchLoader(handle, 5, seed=3).load_state_dict(state)


def test_drop_last_and_repeats(handle):
    loader = BatchLoader(handle, 7, drop_last=True)
    batches = _epoch(loader)
    assert all(len(b) == 7 for b in batches) and len(batches) == len(loader) == 6  # 20 per bucket -> 2 x 7 each
    rep = BatchLoader(handle, 4, repeats=3)
    ids = [i for b in _epoch(rep) for i in b]
    assert len(ids) == 180 and all(ids.count(i) == 3 for i in range(60))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_each_global_batch_as_one_process_with_the_global_batch_size_sees_it(handle, world_size,
                                                                                        drop_last):
    """N processes with batch size B see exactly the batches of one process with batch size N x B: rank r takes
    its contiguous slice of each, the same number of steps each, and a short batch is split as evenly as
    possible (a rank with no share computes on a stand-in row that counts as no sample)."""
    whole = _epoch(BatchLoader(handle, 4 * world_size, seed=11, drop_last=drop_last))
    shares = [list(BatchLoader(handle, 4, seed=11, rank=r, world_size=world_size, drop_last=drop_last,
                               shares=True)) for r in range(world_size)]
    assert {len(s) for s in shares} == {len(whole)}, "every rank takes a slice of every global batch"
    for k, batch in enumerate(whole):
        slices = [shares[r][k] for r in range(world_size)]
        assert [s.total for s in slices] == [len(batch)] * world_size
        counts = [s.samples for s in slices]
        assert sum(counts) == len(batch) and max(counts) - min(counts) <= 1 and counts == sorted(counts)[::-1]
        if len(batch) == 4 * world_size:
            assert counts == [4] * world_size
        joined = [i for s in slices if s.samples for i in _ids(s.batch)]
        assert joined == batch, "the slices, in rank order, are the global batch"
        assert [s.first for s in slices if s.samples] == [sum(counts[:r]) for r in range(world_size) if counts[r]]
        for s in slices:
            if not s.samples:
                assert len(_ids(s.batch)) == 1 and _ids(s.batch)[0] in batch
    if drop_last:
        assert all(len(b) == 4 * world_size for b in whole)


def test_a_position_means_the_same_global_batches_for_any_number_of_processes(handle):
    two = BatchLoader(handle, 2, seed=3, rank=1, world_size=2)
    it = iter(two)
    for _ in range(5):
        next(it)
    state = two.state_dict()
    one = BatchLoader(handle, 4, seed=3)
    one.load_state_dict(state)
    expected = _epoch(BatchLoader(handle, 4, seed=3))[5:]
    assert _epoch(one) == expected, "resumed on one process with the same global batch: the rest of the epoch"
    with pytest.raises(sc.CacheError, match="global batch"):
        BatchLoader(handle, 2, seed=3).load_state_dict(state)


class _Rows:
    """A dataset of ``n`` rows of one shape whose batch is its row numbers: only the loader's own memory counts."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def signatures(self) -> np.ndarray:
        return np.zeros(self.n, dtype=np.uint64)

    def collate(self, indices, pin=False, allocate=None):
        return torch.tensor(indices)

    def fingerprint(self) -> str:
        return f"{self.n} rows"


def test_a_loader_keeps_about_four_bytes_a_row():
    """What a loader keeps per row is its epoch's plan: a row number in 4 bytes, 8 bytes a batch, no signatures
    and no object per batch (numpy reports its buffers to tracemalloc)."""
    n = 400_000
    next(iter(BatchLoader(_Rows(100), 16, workers=0)))  # imports done before
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        loader = BatchLoader(_Rows(n), 16, workers=0, prefetch=2)
        it = iter(loader)
        got = [next(it).tolist() for _ in range(4)]  # past the first batches: the whole plan is made
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    plan = loader.sampler.epoch_plan(0)
    assert got == [plan[k].rows.tolist() for k in range(4)]
    assert loader.rows_held() == n and loader.nbytes() == 4 * n + 8 * (n // 16)
    assert held <= 4 * n + 8 * (n // 16) + 64 * 1024


@pytest.mark.parametrize("workers", [0, 2])
def test_the_first_batches_come_before_the_whole_plan_is_made(workers):
    """Rows of one bucket past a shuffle block: the loader hands out its first batches before the epoch's whole plan
    is made (a worker makes it when it needs a later batch), from the start and from a resumed position, and every
    batch is the plan's."""
    n = 100_000
    loader = BatchLoader(_Rows(n), 16, workers=workers, prefetch=2, world_size=2, rank=1, seed=9)
    plan = loader.sampler.epoch_plan(0)
    it = iter(loader)
    first = next(it)
    if workers == 0:  # with workers, one may already be making it
        assert not loader._active.batches.made() and loader.rows_held() == 3 * 16
    rest = [b.tolist() for b in it]
    assert [first.tolist()] + rest == [s.rows.tolist() for s in plan]
    state = {**loader.state_dict(), "epoch": 1, "position": 100}
    loader.load_state_dict(state)
    resumed = [b.tolist() for b in loader]
    plan = loader.sampler.epoch_plan(1)
    assert resumed == [plan[k].rows.tolist() for k in range(100, len(plan))]


def test_sampler_validates_arguments():
    with pytest.raises(ValueError):
        BucketSampler(np.zeros(3, np.uint64), 0)
    with pytest.raises(ValueError):
        BucketSampler(np.zeros(3, np.uint64), 2, rank=2, world_size=2)
    assert len(BucketSampler(np.zeros(0, np.uint64), 2)) == 0


def test_worker_count_clamped(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert effective_workers(8) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert effective_workers(8) == 1 and effective_workers(0) == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert effective_workers(8) == 8
    with pytest.raises(ValueError):
        effective_workers(-1)


@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_sees_each_collated_batch_on_the_host_and_its_result_is_the_batch(handle, workers):
    """``prepare`` runs on the thread that collates (a worker's, or the caller's with no workers), before a
    ``Shard`` wraps the batch, and what it returns is what the loader yields."""
    seen: list[tuple[str, list[int]]] = []

    def prepare(batch):
        assert isinstance(batch, dict) and batch["samples"].device.type == "cpu"
        seen.append((threading.current_thread().name, _ids(batch)))
        return dict(batch, prepared=len(seen))

    with BatchLoader(handle, 4, workers=workers, shares=True, prepare=prepare) as loader:
        shards = list(loader)
    assert len(shards) == 15 and all(s.batch["prepared"] >= 1 for s in shards)
    assert sorted(ids for _, ids in seen) == sorted(_ids(s.batch) for s in shards)
    expected = {"MainThread"} if workers == 0 else {f"streaming-cache-loader-{i}" for i in range(workers)}
    assert {name for name, _ in seen} <= expected


def test_zero_workers_is_synchronous(handle):
    before = len(_loader_threads())
    loader = BatchLoader(handle, 4, workers=0)
    it = iter(loader)
    next(it)
    assert len(_loader_threads()) == before
    assert len(list(it)) == len(loader) - 1


def test_worker_exception_names_key_and_traceback(tmp_path):
    cache = tmp_path / "damaged"
    with sc.CacheWriter(cache, shard_bytes=1024) as w:  # one shard per entry
        for i in range(12):
            w.put(f"row{i:02d}", {"samples": torch.full((4, 8, 8), float(i))})
    reader = sc.open_cache(cache)
    victim = reader["row07"].tensors[0].shard
    with open(os.path.join(cache, "shards", victim), "r+b") as f:
        f.truncate(100)
    loader = BatchLoader(reader.dataset(), 4, workers=2, shuffle=False)
    with pytest.raises(LoaderError) as info:
        list(loader)
    msg = str(info.value)
    assert "row07" in msg and "truncated" in msg and "Traceback" in msg
    time.sleep(0.05)
    assert _loader_threads() == []


def test_close_and_break_join_threads(handle):
    loader = BatchLoader(handle, 2, workers=3, prefetch=3)
    it = iter(loader)
    next(it)
    assert len(_loader_threads()) == min(3, os.cpu_count() or 1)
    loader.close()
    assert _loader_threads() == []
    with BatchLoader(handle, 2, workers=2) as loader:
        for _ in loader:
            break
    assert _loader_threads() == []


def test_exception_in_consumer_joins_threads(handle):
    with pytest.raises(KeyboardInterrupt):
        with BatchLoader(handle, 2, workers=2) as loader:
            for i, _ in enumerate(loader):
                if i == 2:
                    raise KeyboardInterrupt
    assert _loader_threads() == []


def test_abandoned_loader_is_collected_and_threads_end(handle):
    loader = BatchLoader(handle, 2, workers=2)
    it = iter(loader)
    next(it)
    ref = weakref.ref(loader)
    del loader, it
    gc.collect()
    deadline = time.monotonic() + 2
    while _loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref() is None and _loader_threads() == []


class CountingHandle:
    """A dataset handle that records which batches it built are still alive (weak references)."""

    def __init__(self, handle):
        self.handle = handle
        self.alive: set[int] = set()
        self.peak = 0
        self.lock = threading.Lock()

    def collate(self, indices, pin=False, allocate=None):
        class Batch(dict):
            pass

        out = Batch(self.handle.collate(indices, pin, allocate))
        with self.lock:
            self.alive.add(id(out))
            self.peak = max(self.peak, len(self.alive))
        weakref.finalize(out, lambda k=id(out): self.alive.discard(k))  # noqa: B008 (bound now, on purpose)
        return out

    def __getitem__(self, item):
        return self.handle[item]

    def __getattr__(self, name):
        return getattr(self.handle, name)


def test_memory_is_bounded_by_prefetch_depth(handle):
    """Count batches alive at once: at most `prefetch` in flight plus the one the consumer holds."""
    for depth in (1, 3):
        counting = CountingHandle(handle)
        with BatchLoader(counting, 2, workers=2, prefetch=depth) as loader:
            for batch in loader:
                time.sleep(0.002)  # a slow consumer lets the workers run ahead as far as they may
                del batch
        assert 1 <= counting.peak <= depth + 1, (depth, counting.peak)


def test_collate_structures():
    a = {"x": torch.ones(2), "l": [torch.zeros(1), "s"], "t": (1, 2.0), "n": np.arange(3)}
    b = {"x": torch.zeros(2), "l": [torch.ones(1), "u"], "t": (3, 4.0), "n": np.arange(3)}
    out = collate([a, b])
    assert out["x"].shape == (2, 2) and out["l"][0].shape == (2, 1) and out["l"][1] == ["s", "u"]
    assert out["t"] == ([1, 3], [2.0, 4.0]) and out["n"].shape == (2, 3)
    with pytest.raises(sc.CacheError, match="different shapes"):
        collate([torch.ones(2), torch.ones(3)])


@pytest.mark.multiprocess
def test_two_process_gloo_ranks_partition(tmp_path, handle):
    """Two real torch.distributed (gloo) processes, each with its own rank, see disjoint slices that together
    are one process's batches with twice the batch size."""
    import subprocess
    import sys

    cache = handle.caches[0]
    script = tmp_path / "rank.py"
    script.write_text(f"""
import os, sys, json, torch, torch.distributed as dist
import streaming_cache as sc
from streaming_cache.group import Group, leave
from streaming_cache.loader import BatchLoader
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
loader = BatchLoader(sc.open_cache({cache!r}).dataset(), 4, seed=5, rank=rank, world_size=world, drop_last=True)
ids = [[int(v) for v in b["samples"][:, 0, 0, 0]] for b in loader]
out = Group.current().gather(ids)  # the pack's own tensors, which leave() waits for
if rank == 0:
    print(json.dumps(out))
leave(finished=True)
""")
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    import json

    shares = json.loads(outs[0][0].strip().splitlines()[-1])
    assert len(shares[0]) == len(shares[1]) > 0
    assert not {i for b in shares[0] for i in b} & {i for b in shares[1] for i in b}
    whole = _epoch(BatchLoader(handle, 8, seed=5, drop_last=True))
    assert [a + b for a, b in zip(shares[0], shares[1])] == whole


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_batches_arrive_on_device_via_copy_stream(handle):
    device = torch.device("cuda", torch.cuda.current_device())
    ref = _epoch(BatchLoader(handle, 4, seed=2))
    with BatchLoader(handle, 4, seed=2, device="cuda", workers=2) as loader:
        got = []
        for b in loader:
            assert b["samples"].device == device
            got.append([int(v) for v in b["samples"][:, 0, 0, 0].cpu()])
    assert got == ref
    assert not loader.fallbacks, loader.fallbacks.lines()
    # these rows carry their own values ("i", "tag"), so batches are stacked entry by entry into memory torch pins,
    # not into the pool's buffers (test_gpu_copy_stream.py checks those with rows that share one skeleton)
    assert isinstance(loader.transfers, CudaTransfers) and loader.pool.pinning and loader.pool.pinned_bytes == 0
    assert CudaTransfers().copy_stream(device) is CudaTransfers().copy_stream(device)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_pinned_staging_by_default(handle):
    loader = BatchLoader(handle, 4, device="cuda")
    assert loader.pin_memory is True
    assert BatchLoader(handle, 4, device="cuda", pin_memory=False).pin_memory is False


def test_reader_collate_fast_path_equals_per_sample_collate(tmp_path):
    cache = tmp_path / "c"
    with sc.CacheWriter(cache) as w:
        for i in range(6):
            pooled = torch.full((1, 3), float(i))
            w.put(f"u{i}", [[torch.full((2, 5), float(i)), {"pooled_output": pooled, "same": pooled,
                                                             "np": np.full(3, i, np.int16), "s": "x", "t": (1, 2)}]])
        w.put("odd", [[torch.zeros(2, 5), {"pooled_output": torch.zeros(1, 3), "extra": 1}]])  # other skeleton
    r = sc.open_cache(cache)
    uniform = [r.index_of(f"u{i}") for i in (4, 1, 3)]
    fast = r.collate(uniform)
    slow = collate([r.views(i) for i in uniform])
    assert fast[0][0].tolist() == slow[0][0].tolist() and fast[0][0][:, 0, 0].tolist() == [4.0, 1.0, 3.0]
    assert torch.equal(fast[0][1]["pooled_output"], slow[0][1]["pooled_output"])
    assert fast[0][1]["pooled_output"] is fast[0][1]["same"]
    assert torch.equal(fast[0][1]["np"], slow[0][1]["np"]) and fast[0][1]["s"] == slow[0][1]["s"] == ["x"] * 3
    assert fast[0][1]["t"] == slow[0][1]["t"] == ([1, 1, 1], [2, 2, 2])
    fast[0][0].fill_(7)  # the batch is the caller's own memory
    assert r.collate(uniform)[0][0][0, 0, 0].item() == 4.0
    with pytest.raises(sc.CacheError):  # mixed skeletons fall back to per-sample collate, which refuses
        r.collate([r.index_of("u0"), r.index_of("odd")])
