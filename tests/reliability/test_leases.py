"""A cache keeps serving while it changes (streaming_cache/leases.py): readers on threads of the writer's process
and in other processes read the generation they opened to the end while a writer adds, removes and compacts over
and over; a training run beside a process that cleans the cache trains the weights it trains alone; a reader that
was killed never blocks deletion; a hostile leases folder is read as strictly as the rest of a cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import streaming_cache as sc
from helpers.installs import HELPERS, subprocess_env
from helpers.toy_backend import Toy
from streaming_cache import leases
from streaming_cache.train.backend import train_with
from streaming_cache.train.loop import TrainHooks
from streaming_cache.train.spec import TrainSpec

pytestmark = pytest.mark.multiprocess

CHURN = os.path.join(HELPERS, "churn.py")
ROWS = 16


def _values(i: int) -> dict:
    return {"x": torch.full((32,), float(i)), "y": torch.full((8,), float(-i))}


@pytest.fixture
def cache(tmp_path):
    """16 entries in small shards (a few entries each), so every compaction rewrites them."""
    path = str(tmp_path / "cache")
    with sc.CacheWriter(path, shard_bytes=512) as w:
        for i in range(ROWS):
            w.put(f"e{i}", _values(i))
            if i % 3 == 2:
                w.commit()
    return path


def _shards(path: str) -> set[str]:
    return set(os.listdir(os.path.join(path, "shards")))


def _read_all(reader: sc.CacheReader) -> None:
    for i in range(ROWS):
        got = reader[f"e{i}"].materialize()
        assert torch.equal(got["x"], _values(i)["x"]) and torch.equal(got["y"], _values(i)["y"]), f"e{i}"


def test_readers_on_threads_read_their_generation_while_a_writer_thread_compacts(cache):
    """The same process on both sides: ComfyUI's server encodes (and compacts) and trains, the loader reads on
    threads."""
    from helpers import churn

    early = sc.open_cache(cache)
    early["e0"].materialize()  # its first shard open: the others open lazily, after the compactions
    errors: list[BaseException] = []
    reads = [0]
    done = threading.Event()

    def reader() -> None:
        try:
            while not done.is_set() or reads[0] < 20:
                with sc.open_cache(cache) as r:
                    _read_all(r)
                    reads[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    generation = early.generation
    try:
        for k in range(8):
            churn.churn_round(cache, f"t{k}")
    finally:
        done.set()
        for t in threads:
            t.join(300)
    assert errors == [], errors[:3]
    assert sc.open_cache(cache).generation >= generation + 8 * 3, "the writer committed and compacted"
    _read_all(early)  # opened before all of it: still its generation
    early.close()


def test_readers_in_another_process_and_a_writer_in_this_one(cache, tmp_path):
    stop = str(tmp_path / "stop")
    # each reader opens the cache, reads one entry, says it is ready, waits until the writer has committed a whole
    # round (its compaction included), then reads them all; the writer starts once both readers are ready
    code = ("import os, sys, time, streaming_cache as sc\n"
            "sys.path.insert(0, sys.argv[3])\n"
            "from test_leases import _read_all\n"
            "reads = 0\n"
            "while not os.path.exists(sys.argv[2]) or reads < 3:\n"
            "    with sc.open_cache(sys.argv[1]) as r:\n"
            "        r['e0'].materialize()\n"
            "        open(sys.argv[2] + f'.ready{os.getpid()}', 'w').close()\n"
            "        while not os.path.exists(sys.argv[2]) and sc.open_cache(sys.argv[1]).generation < r.generation + 8:\n"
            "            time.sleep(0.01)\n"
            "        _read_all(r)\n"
            "    reads += 1\n"
            "print('READS', reads, flush=True)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, cache, stop, os.path.dirname(__file__)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for _ in range(2)]
    from helpers import churn

    try:
        deadline = time.monotonic() + 300
        while sum(name.startswith("stop.ready") for name in os.listdir(tmp_path)) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the readers did not start"
            time.sleep(0.05)
        churn.churn(cache, 8)
    finally:
        open(stop, "w").close()
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "READS" in out, err[-3000:]


def test_a_training_beside_a_process_that_cleans_the_cache_trains_what_it_trains_alone(tmp_path):
    """Between steps another process adds and removes entries and runs clean (compaction): the training's reader
    keeps its generation, so every batch is the one it would have been."""
    path = str(tmp_path / "pairs")
    with sc.CacheWriter(path, shard_bytes=256) as w:  # one shard each: most are first opened after a compaction
        for i in range(96):
            x = torch.tensor([i / 96])
            w.put(f"k{i}", {"x": x, "y": 3 * x + 1})
            w.commit()
    spec = TrainSpec.build({"steps": 12, "learning_rate": 0.1, "batch_size": 4, "optimizer": "Adam", "seed": 5,
                            "workers": 2})
    alone = Toy()
    train_with(alone, sc.open_cache(path).dataset(), spec)
    generations = []

    def clean_between_steps(step: int, loss: float) -> None:
        if step % 3 == 0:
            proc = subprocess.run([sys.executable, CHURN, path, "1"], capture_output=True, text=True, timeout=300,
                                  env=subprocess_env())
            assert proc.returncode == 0 and "ROUNDS 1" in proc.stdout, proc.stderr[-3000:]
            generations.append(sc.open_cache(path).generation)

    beside = Toy()
    reader = sc.open_cache(path)
    opened = _shards(path)
    train_with(beside, reader.dataset(), spec, hooks=TrainHooks(on_step=clean_between_steps))
    assert len(generations) == 4 and generations[-1] > reader.generation
    assert not opened <= set(sc.open_cache(path)._shard_names), "the cleaner rewrote the training's shards"
    for k in alone.params:
        assert torch.equal(alone.params[k], beside.params[k]), k


def _reader_process(cache: str) -> subprocess.Popen:
    code = ("import sys, time, streaming_cache as sc\n"
            "r = sc.open_cache(sys.argv[1]); r['e0'].materialize()\n"
            "print('LEASED' if r.leased else 'NO LEASE', flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, cache], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    assert proc.stdout is not None
    said = proc.stdout.readline().strip()
    if said != "LEASED":
        proc.kill()
        proc.wait(30)
    assert said == "LEASED", said
    return proc


def _compact(cache: str) -> dict:
    with sc.CacheWriter(cache) as w:
        w.remove(["e1"])
        return w.compact()


def test_a_reader_in_another_process_keeps_its_shards_until_it_is_killed(cache):
    """A lease is seen from another process; once its holder is killed (no chance to clean up) the next writer
    finds it dead, removes it and deletes what only it needed."""
    proc = _reader_process(cache)
    try:
        before = _shards(cache)
        assert _compact(cache)["shards_rewritten"] > 0
        assert before <= _shards(cache), "kept while the reader lives"
    finally:
        proc.send_signal(signal.SIGKILL) if hasattr(signal, "SIGKILL") else proc.kill()
        proc.wait(30)
    assert len(os.listdir(leases.lease_dir(cache))) == 1, "the killed reader's lease file is still there"
    with sc.CacheWriter(cache):
        pass  # a writer opens: the dead lease goes, and the shards only it needed
    with sc.open_cache(cache) as r:
        assert _shards(cache) == set(r._shard_names)
    assert os.listdir(leases.lease_dir(cache)) == [] or all(
        n.startswith(f"g{r.generation}-{os.getpid()}-") for n in os.listdir(leases.lease_dir(cache)))


def test_a_hostile_leases_folder_is_never_followed_and_never_blocks(cache, tmp_path, monkeypatch):
    from helpers import churn

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "g0-1-0123456789abcdef.lease").write_text("not yours")
    folder = leases.lease_dir(cache)
    os.symlink(outside, folder)
    r = sc.open_cache(cache)
    assert not r.leased, "no lease through a link"
    _read_all(r)
    churn.churn_round(cache, "h1")
    assert sorted(os.listdir(outside)) == ["g0-1-0123456789abcdef.lease"], "nothing outside the cache touched"
    os.remove(folder)
    os.mkdir(folder)
    for name in ("junk.txt", "g1-2-zzzz.lease", "g" + "9" * 30 + "-1-0123456789abcdef.lease"):
        (tmp_path / "cache" / "leases" / name).write_text("x")
    if hasattr(os, "mkfifo"):
        os.mkfifo(os.path.join(folder, "g0-3-0123456789abcdef.lease"))
    with sc.open_cache(cache) as r:
        assert r.leased
        churn.churn_round(cache, "h2")
        _read_all(r)
    left = sorted(os.listdir(folder))
    assert [n for n in left if not n.endswith("abcdef.lease")] == [], left  # malformed names removed
    monkeypatch.setattr(leases, "MAX_LEASES", 3)
    for i in range(5):
        (tmp_path / "cache" / "leases" / f"g0-{i}-0123456789abcde{i}.lease").write_text("")
    assert leases.needed_shards(cache) is None, "more entries than it looks at: every file counts as needed"


def test_a_reader_open_for_long_keeps_only_its_own_generations_files(cache):
    """However often the cache is compacted meanwhile: the files of the generations between are removed."""
    from helpers import churn

    r = sc.open_cache(cache)
    mine = set(r._shard_names)
    for k in range(4):
        churn.churn_round(cache, f"long{k}")
        with sc.open_cache(cache) as now:
            assert _shards(cache) == mine | set(now._shard_names), f"round {k}"
    _read_all(r)
    r.close()


def test_a_lease_is_released_with_its_reader(cache):
    r = sc.open_cache(cache)
    assert r.leased and len(os.listdir(leases.lease_dir(cache))) == 1
    r.close()
    assert not r.leased and os.listdir(leases.lease_dir(cache)) == []
    r2 = sc.open_cache(cache)
    del r2
    import gc

    gc.collect()
    time.sleep(0)
    assert os.listdir(leases.lease_dir(cache)) == [], "a reader dropped without close releases its lease"
