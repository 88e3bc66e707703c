"""CacheWriter: adding to a cache, atomic commit and abort, the lock, leftovers, compaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import shard_paths
from helpers.installs import subprocess_env
from helpers.values import latent
from streaming_cache import layout


def test_reopen_adds_and_replaces(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
        w.put("b", latent(2))
    with sc.CacheWriter(cache) as w:
        assert len(w) == 2 and "a" in w
        w.put("c", latent(3))
        w.put("a", latent(10))
    r = sc.open_cache(cache)
    assert sorted(r.keys()) == ["a", "b", "c"]
    assert torch.equal(r["a"].materialize()["samples"], latent(10)["samples"])
    assert torch.equal(r["b"].materialize()["samples"], latent(2)["samples"])
    assert r.generation == 2


def test_exception_commits_nothing_of_the_block(cache):
    with pytest.raises(RuntimeError):
        with sc.CacheWriter(cache) as w:
            w.put("kept", latent(1))
            w.commit()
            w.put("lost", latent(2))
            w.put("kept", latent(3))
            raise RuntimeError("boom")
    r = sc.open_cache(cache)
    assert list(r.keys()) == ["kept"]
    assert torch.equal(r["kept"].materialize()["samples"], latent(1)["samples"])
    assert r.verify().ok
    # the aborted block's shard (if one was written) is gone or unreferenced and removed on the next open
    with sc.CacheWriter(cache):
        pass
    listed = {s["name"] for s in sc.open_cache(cache).index.header["shards"]}
    assert {os.path.basename(p) for p in shard_paths(cache)} == listed


def test_abort_after_shard_flush_removes_the_shard(cache):
    w = sc.CacheWriter(cache, shard_bytes=1024)
    w.put("a", latent(1))
    w.commit()
    before = set(shard_paths(cache))
    w.put("b", latent(2))  # 1 KiB: flushed to its own shard before any commit
    w.put("c", latent(3))
    assert len(set(shard_paths(cache)) - before) >= 1
    w.abort()
    assert set(shard_paths(cache)) == before
    w.close()
    assert list(sc.open_cache(cache).keys()) == ["a"]


def test_remove_and_manifests(cache):
    with sc.CacheWriter(cache) as w:
        for i in range(3):
            w.put(f"k{i}", latent(i))
        w.set_manifest("ds", json.dumps({"rows": []}).encode())
        with pytest.raises(sc.CacheError):
            w.set_manifest("../evil", b"{}")
    with sc.CacheWriter(cache) as w:
        assert w.remove(["k1", "missing"]) == 1
        assert w.get_manifest("ds") == b'{"rows": []}'
    r = sc.open_cache(cache)
    assert sorted(r.keys()) == ["k0", "k2"] and r.manifests == ["ds"] and r.manifest("ds") == {"rows": []}
    with pytest.raises(KeyError, match="no manifest named"):
        r.manifest("nope")
    with sc.CacheWriter(cache) as w:
        assert w.delete_manifest("ds")
    assert sc.open_cache(cache).manifests == []


@pytest.mark.multiprocess
def test_second_writer_is_refused_readers_are_not(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
        w.commit()
        with pytest.raises(sc.CacheLockedError, match="this process already has a writer open") as info:
            sc.CacheWriter(cache)
        assert f"pid={os.getpid()}" not in str(info.value), "never blame the caller's own pid on another process"
        code = (f"import streaming_cache as sc\ntry:\n    sc.CacheWriter({cache!r})\nexcept sc.CacheLockedError as e:\n"
                f"    print('LOCKED', e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=subprocess_env())
        assert "LOCKED" in out.stdout and f"pid={os.getpid()}" in out.stdout, out
        w.put("b", latent(2))
        r = sc.open_cache(cache)  # a reader opens while the writer holds the lock
        assert list(r.keys()) == ["a"], "uncommitted puts are invisible"
        w.commit()
        assert list(r.keys()) == ["a"], "an open reader keeps its generation"
        assert sorted(sc.open_cache(cache).keys()) == ["a", "b"]
    with sc.CacheWriter(cache):  # released on close
        pass


@pytest.mark.multiprocess
def test_lock_released_when_the_writer_process_dies(cache):
    code = (f"import os, streaming_cache as sc\nw = sc.CacheWriter({cache!r})\nw.put('a', 1)\nw.commit()\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=subprocess_env())
    with sc.CacheWriter(cache) as w:
        assert "a" in w


def test_refuses_non_cache_directory(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.png").write_bytes(b"x")
    with pytest.raises(sc.CacheError, match="not empty and holds no streaming cache"):
        sc.CacheWriter(tmp_path / "photos")
    (tmp_path / "file").write_text("x")
    with pytest.raises(sc.CacheError, match="not a directory"):
        sc.CacheWriter(tmp_path / "file")
    with pytest.raises(sc.CacheError, match="no such cache"):
        sc.open_cache(tmp_path / "nothing")
    with pytest.raises(sc.CacheError, match="not a streaming cache"):
        sc.open_cache(tmp_path / "photos")


def test_leftovers_removed_by_the_next_writer_never_by_a_reader(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
    stray_shard = os.path.join(cache, layout.SHARD_DIR, "0" * 32 + ".safetensors")
    tmp_shard = os.path.join(cache, layout.SHARD_DIR, "1" * 32 + ".safetensors.tmp")
    tmp_index = os.path.join(cache, layout.INDEX_NAME + ".tmp-123")
    for p in (stray_shard, tmp_shard, tmp_index):
        open(p, "wb").write(b"junk")
    sc.open_cache(cache).verify()
    assert all(os.path.exists(p) for p in (stray_shard, tmp_shard, tmp_index)), "a reader deletes nothing"
    sc.CacheWriter(cache).close()
    assert not any(os.path.exists(p) for p in (stray_shard, tmp_shard, tmp_index))
    assert sc.open_cache(cache).verify().ok


def test_reader_leaves_leftovers_while_a_writer_holds_the_lock(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
        w.commit()
        stray = os.path.join(cache, layout.SHARD_DIR, "f" * 32 + ".safetensors")
        open(stray, "wb").write(b"in progress")
        sc.open_cache(cache)
        assert os.path.exists(stray), "a reader must never delete what a live writer may be writing"


def test_compact_reclaims_space_and_keeps_entries(cache):
    values = {f"k{i}": latent(i, shape=(1, 4, 32, 32)) for i in range(12)}
    with sc.CacheWriter(cache, shard_bytes=40_000) as w:
        for k, v in values.items():
            w.put(k, v)
    old_shards = set(shard_paths(cache))
    assert len(old_shards) > 1
    before = sc.open_cache(cache).stored_bytes()
    with sc.CacheWriter(cache, shard_bytes=40_000) as w:
        w.remove([f"k{i}" for i in range(0, 12, 2)])
        stats = w.compact()
    r = sc.open_cache(cache)
    assert r.stored_bytes() < before * 0.6 and stats["bytes_after"] < stats["bytes_before"]
    assert not (old_shards & set(shard_paths(cache))) or stats["shards_rewritten"] < len(old_shards)
    for i in range(1, 12, 2):
        assert torch.equal(r[f"k{i}"].materialize(check=True)["samples"], values[f"k{i}"]["samples"])
    assert r.verify().ok and len(r) == 6
    # dedup after compaction must not point at deleted shards
    with sc.CacheWriter(cache) as w:
        w.put("again", latent(0, shape=(1, 4, 32, 32)))
    assert sc.open_cache(cache)["again"].materialize(check=True) is not None


def test_small_shards_and_many_entries(cache):
    with sc.CacheWriter(cache, shard_bytes=64 * 1024) as w:
        for i in range(40):
            w.put(f"k{i}", latent(i, shape=(1, 4, 32, 32)))  # 16 KiB each
    assert len(shard_paths(cache)) >= 8
    r = sc.open_cache(cache)
    assert all(torch.equal(r[f"k{i}"].materialize()["samples"], latent(i, shape=(1, 4, 32, 32))["samples"])
               for i in range(40))


def _small_shards_then_compacted(cache) -> None:
    with sc.CacheWriter(cache, shard_bytes=1024) as w:
        w.put("a", latent(1))
        w.put("b", latent(2))
        w.put("c", latent(3))


def test_a_reader_keeps_reading_its_generation_while_a_writer_compacts(cache):
    """Its lease keeps the shards it may read; the next writer after it closed removes them."""
    _small_shards_then_compacted(cache)
    r = sc.open_cache(cache)
    assert r.leased
    shards = set(os.listdir(os.path.join(cache, "shards")))
    with sc.CacheWriter(cache) as w:  # small shards get merged: a's shard is rewritten
        w.remove(["b"])
        assert w.compact()["shards_rewritten"] > 0
    assert shards <= set(os.listdir(os.path.join(cache, "shards"))), "the old shards are kept for the reader"
    assert torch.equal(r["a"].materialize()["samples"], latent(1)["samples"])
    assert torch.equal(r["b"].materialize()["samples"], latent(2)["samples"]), "removed after it opened: still its"
    r.close()
    with sc.CacheWriter(cache):
        pass
    left = set(os.listdir(os.path.join(cache, "shards")))
    with sc.open_cache(cache) as now:
        assert left == set(now._shard_names) and len(left) < len(shards), "unleased, unlisted shards are gone"
        assert now["a"].materialize() is not None and now.index_of("b") is None


def test_a_reader_without_a_lease_is_told_to_open_the_cache_again(cache, monkeypatch):
    """Where no lease can be taken (a read-only cache), a shard deleted under the reader is a StaleCacheError
    that names the remedy, never an OS error."""
    from streaming_cache import leases

    _small_shards_then_compacted(cache)
    monkeypatch.setattr(leases, "take", lambda cache, generation, shards: None)
    r = sc.open_cache(cache)
    assert not r.leased
    r["c"].materialize()  # its shard opened now, closed again when idle
    monkeypatch.undo()
    with sc.CacheWriter(cache) as w:
        w.remove(["b"])
        w.compact()
    with pytest.raises(sc.StaleCacheError, match="open the cache again"):
        r["a"].materialize()
    assert sc.open_cache(cache)["a"].materialize() is not None


def test_invalid_keys_refused(cache):
    with sc.CacheWriter(cache) as w:
        for bad in ("", None, 3):
            with pytest.raises(sc.CacheError):
                w.put(bad, 1)  # type: ignore[arg-type]
