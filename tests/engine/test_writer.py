"""CacheWriter: adding to a cache, atomic commit and abort, the lock, leftovers, compaction, batched writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import shard_header, shard_paths
from helpers.installs import subprocess_env
from helpers.values import latent
from streaming_cache import format as fmt
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


# ------------------------------------------------------------------------------------------------ batched writes
def _index_and_shards(path: str) -> tuple[dict, list[bytes]]:
    """Everything a cache holds but its random names: the index sections and counts, and each shard's bytes in
    the order the index lists the shards."""
    index = fmt.IndexFile(layout.index_path(path))
    sections = {name: index.section(name).tobytes() for name in index.header["sections"]}
    shards = [open(layout.shard_path(path, s["name"]), "rb").read() for s in index.header["shards"]]
    return {"sections": sections, "counts": index.header["counts"]}, shards


def _rows(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = torch.zeros(n, 1, 2, 2, dtype=torch.float32)
    values.view(n, -1)[:, 0] = torch.arange(n, dtype=torch.float32)
    return values.to(dtype)


@pytest.mark.parametrize("max_tensors,shard_bytes", [(7, 10**9), (10**6, 16 * 5 + 1), (4, 16 * 5 + 1), (4, 16 * 3)])
def test_put_many_writes_what_puts_one_by_one_write(tmp_path, monkeypatch, max_tensors, shard_bytes):
    """The batched path cuts shards where puts one by one do (by tensor count and by bytes), numbers tensors,
    dedups and orders replaced keys as they do: the same index and the same shard bytes."""
    monkeypatch.setattr(fmt, "SHARD_MAX_TENSORS", max_tensors)
    rows = _rows(40)
    rows[17] = rows[3]  # equal to an earlier row of the batch
    keys = [f"k{i}" for i in range(40)]
    keys[25] = "k2"  # a key given twice in one batch
    later = _rows(12) + 5  # partly equal to tensors already stored
    later_keys = [f"k{i}" for i in range(30, 42)]  # partly keys already there
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    with sc.CacheWriter(one, shard_bytes=shard_bytes) as w:
        for key, row in zip(keys, rows):
            w.put(key, row)
        for key, row in zip(later_keys, later):
            w.put(key, row)
    with sc.CacheWriter(many, shard_bytes=shard_bytes) as w:
        w.put_many(keys, rows)
        w.put_many(later_keys, later)
    assert _index_and_shards(one) == _index_and_shards(many)
    assert len(shard_paths(many)) > 2
    with sc.open_cache(many) as r:
        assert r.verify().ok and len(r) == 41
        assert torch.equal(r["k2"].materialize(), rows[25]) and torch.equal(r["k35"].materialize(), later[5])


def _headers_are_laid_out_by_the_format(cache: str) -> int:
    """Check every shard's header against ``shard_layout`` of the tensors it lists, and that it names each tensor by
    the digest the index records for it, at the index's offsets; returns how many tensors the headers list."""
    index = fmt.IndexFile(layout.index_path(cache))
    names = [s["name"] for s in index.header["shards"]]
    recorded = {(names[int(row["shard"])], f"{int(row['digest_hi']):016x}{int(row['digest_lo']):016x}"):
                [int(row["begin"]), int(row["end"])] for row in index.section("tensors.rows")}
    listed = 0
    for path in shard_paths(cache):
        data = open(path, "rb").read()
        start, header = shard_header(path)
        items = [(name, t["dtype"], tuple(t["shape"]), t["data_offsets"][1] - t["data_offsets"][0])
                 for name, t in header.items() if name != "__metadata__"]
        planned, placed = fmt.shard_layout(items)
        assert data[:start] == planned
        assert [(p.begin, p.end) for p in placed] == [tuple(header[p.name]["data_offsets"]) for p in placed]
        for name, *_ in items:
            assert recorded[(os.path.basename(path), name)] == header[name]["data_offsets"]
        listed += len(items)
    assert listed == len(recorded)
    return listed


def test_shard_headers_are_what_the_format_lays_out(tmp_path):
    """Headers are built from columns, as arrays for runs of one dtype and shape and formatted where those
    alternate: byte for byte what ``shard_layout`` makes of the same tensors, larger elements first, whatever
    order the values came in."""
    mixed, uniform = str(tmp_path / "mixed"), str(tmp_path / "uniform")
    with sc.CacheWriter(mixed, shard_bytes=2000) as w:
        w.put("half", torch.arange(6, dtype=torch.float16))
        w.put_many([f"f{i}" for i in range(9)], _rows(9))
        w.put("long", torch.arange(5))
        w.put("flag", torch.tensor([True, False, True]))
        w.put("scalar", torch.tensor(2.5, dtype=torch.float64))
        w.put("bf", torch.arange(3, dtype=torch.bfloat16))
        w.put("dict", {"a": torch.ones(2, 3, dtype=torch.int8), "b": np.arange(4, dtype=np.int32)})
    with sc.CacheWriter(uniform, shard_bytes=16 * 1000) as w:  # offsets of 1 to 5 digits
        w.put_many([f"u{i}" for i in range(1500)], _rows(1500))
    assert _headers_are_laid_out_by_the_format(mixed) == 9 + 7
    assert _headers_are_laid_out_by_the_format(uniform) == 1500
    with sc.open_cache(mixed) as r:
        assert r.verify().ok
        assert r["long"].materialize().tolist() == [0, 1, 2, 3, 4]
        assert r["dict"].materialize()["b"].tolist() == [0, 1, 2, 3]
    with sc.open_cache(uniform) as r:
        assert r.verify().ok and float(r["u1234"].materialize().flatten()[0]) == 1234


def test_puts_are_flushed_to_shards_by_size_before_the_commit(cache):
    """What waits for the next shard stays under ``shard_bytes``: shards are written while the puts come, one
    after another or many at once, and the commit writes the rest."""
    with sc.CacheWriter(cache, shard_bytes=16 * 10) as w:
        w.put_many([f"m{i}" for i in range(95)], _rows(95))
        assert len(shard_paths(cache)) == 9
        for i in range(95, 119):
            w.put(f"m{i}", _rows(i + 1)[i])
        assert len(shard_paths(cache)) == 11
        assert not os.path.exists(layout.index_path(cache))
    assert len(shard_paths(cache)) == 12
    with sc.open_cache(cache) as r:
        assert len(r) == 119 and r.verify().ok


def test_a_put_copies_the_tensor_it_is_given(cache):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with sc.CacheWriter(cache) as w:
        w.put("row", base[1])
        w.put("transposed", base.t())  # not contiguous: copied the general way
        base.mul_(-1)
        w.put("negated", base[1])
    with sc.open_cache(cache) as r:
        assert r["row"].materialize().tolist() == [4.0, 5.0, 6.0, 7.0]
        assert r["transposed"].materialize().tolist()[0] == [0.0, 4.0, 8.0]
        assert r["negated"].materialize().tolist() == [-4.0, -5.0, -6.0, -7.0]


def test_a_put_stores_the_values_of_views_and_refuses_what_it_cannot_hold(cache):
    """Only dense CPU tensors are copied straight from memory; a conjugated or negated view, a scalar and an empty
    tensor keep their values, and what the cache cannot hold is refused at the put, naming the entry."""
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    values = {"conj": z.conj(), "negated": z.conj().imag, "scalar": torch.tensor(7, dtype=torch.int16),
              "empty": torch.zeros(0, 3), "flags": torch.tensor([True, False]),
              "fp8": torch.ones(3).to(torch.float8_e4m3fn)}
    with sc.CacheWriter(cache) as w:
        for key, value in values.items():
            w.put(key, value)
        for key, value, message in [("c128", torch.zeros(2, dtype=torch.complex128), "not storable"),
                                     ("meta", torch.zeros(2, device="meta"), "meta"),
                                     ("sparse", torch.eye(2).to_sparse(), "sparse")]:
            with pytest.raises(sc.UnsupportedValueError, match=message) as info:
                w.put(key, value)
            assert f"entry '{key}'" in str(info.value)
    with sc.open_cache(cache) as r:
        assert sorted(r.keys()) == sorted(values)
        for key, value in values.items():
            got, expected = r[key].materialize(), value.resolve_conj().resolve_neg()
            assert got.dtype == expected.dtype and got.shape == expected.shape, key
            if key == "fp8":  # compared as bytes: float8 has no equality
                got, expected = got.view(torch.uint8), expected.view(torch.uint8)
            assert torch.equal(got, expected), key


def test_reopening_keeps_entries_and_dedups_against_them(cache):
    values = _rows(30)
    with sc.CacheWriter(cache) as w:
        w.put_many([f"k{i}" for i in range(30)], values)
        w.put("#tag", values[0])  # a key like no other: '#' is a plain first character
        w.put("ñ", {"x": values[1]})
    with sc.CacheWriter(cache) as w:
        assert not w.damaged and len(w) == 32 and "#tag" in w and "ñ" in w
        w.put_many([f"again{i}" for i in range(30)], values)
        w.put("again", values[4])
    with sc.open_cache(cache) as r:
        assert r.index.info.tensors == 30 and len(r) == 63
        assert torch.equal(r["#tag"].materialize(), values[0])
        assert torch.equal(r["ñ"].materialize()["x"], values[1])


_KILLED_WRITER = """
import os, signal, sys
import torch
import streaming_cache as sc
path, kill_at = sys.argv[1], int(sys.argv[2])
values = torch.zeros(200, 1, 2, 2)
values.view(200, -1)[:, 0] = torch.arange(200, dtype=torch.float32)
w = sc.CacheWriter(path, shard_bytes=16 * 20)
w.put_many([f"k{i}" for i in range(50)], values[:50])
w.commit()
calls = [0]
real_replace = os.replace
def replace(src, dst):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)
os.replace = replace
w.put_many([f"k{i}" for i in range(50, 200)], values[50:])
w.commit()
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")
@pytest.mark.parametrize("kill_at", [1, 4, 8, 9, 10])
def test_a_writer_killed_in_a_batch_leaves_its_last_commit_and_resumes(cache, kill_at):
    """SIGKILL before the n-th rename: of a shard put_many writes (1 to 7: 150 tensors, 20 a shard), of the last
    shard, written by the commit (8), of the index (9); 10 is never reached and the run ends."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, cache, str(kill_at)], capture_output=True,
                          text=True, timeout=120, env=subprocess_env())
    committed = 50 if kill_at <= 9 else 200
    assert proc.returncode == (-signal.SIGKILL if kill_at <= 9 else 0), proc.stderr[-2000:]
    with sc.open_cache(cache) as r:
        assert len(r) == committed and r.verify().ok
    with sc.CacheWriter(cache) as w:
        listed = {s["name"] for s in sc.open_cache(cache).index.header["shards"]}
        assert {os.path.basename(p) for p in shard_paths(cache)} == listed, "leftovers are removed"
        w.put_many([f"k{i}" for i in range(200)], _rows(200))
    with sc.open_cache(cache) as r:
        assert len(r) == 200 and r.verify().ok
        assert all(float(r[f"k{i}"].materialize().flatten()[0]) == i for i in range(200))
