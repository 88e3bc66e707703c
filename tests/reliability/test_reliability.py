"""The adversarial reliability suite: crash at any instant, fuzzed and hostile inputs, a builder under faults.

See docs/RELIABILITY.md for the guarantee each test proves. The crash harness and the fuzzer print their tallies
(``pytest -s`` shows them); ``python -m streaming_cache crashtest`` / ``fuzz --seconds N`` run them longer.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import signal
import time

import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import damage_index
from helpers.values import latent
from streaming_cache import builder, layout
from streaming_cache.devtools import crashtest, fuzz
from streaming_cache.skeleton import decode_skeleton

FUZZ_SECONDS = float(os.environ.get("STREAMING_CACHE_FUZZ_SECONDS", "15"))


@pytest.mark.skipif(not hasattr(signal, "SIGKILL") or not hasattr(os, "fork"), reason="needs POSIX fork + SIGKILL")
def test_sigkill_at_60_instants_then_resume_equals_uninterrupted(tmp_path):
    tally = crashtest.run(kills=60, seed=11, workdir=str(tmp_path), out=lambda *a, **k: None)
    print("\ncrash tally:", json.dumps(tally))
    assert tally["kills"] >= 50
    assert tally["resumed_equal"] == 60, "every resumed run equals the uninterrupted one"
    assert tally["verified"] + tally["no_index_yet"] == 60, "after every kill the cache opened and verified, or no " \
        "commit had happened yet"
    assert tally["verified"] >= 40
    assert set(tally["by_phase"]) >= {"build v1", "rebuild v2", "clean + compact"}, tally["by_phase"]
    assert all(tally["by_plan"].get(k, 0) > 0 for k in ("replace", "fsync", "remove", "open_w", "time"))


def test_fuzz_index_skeleton_and_shard_readers():
    report = fuzz.run(seconds=FUZZ_SECONDS, seed=int(time.time()) % 1000, out=lambda *a, **k: None)
    print("\nfuzz:", json.dumps({k: v for k, v in report.items() if k != "findings"}))
    assert report["executions"] > 200
    assert report["findings"] == [], json.dumps(report["findings"], indent=1)


# ------------------------------------------------------------------------- regressions the fuzzer found
def test_memo_index_pickle_bomb_is_refused_before_unpickling():
    bomb = b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00\x8c\x01a\x94r\x61\x61\x61\x47N."  # LONG_BINPUT ~1.2e9
    started = time.perf_counter()
    with pytest.raises(sc.CacheFormatError, match="memo slot"):
        decode_skeleton(bomb, 0, lambda i, n: None, "entry 'x'")
    assert time.perf_counter() - started < 1.0


def test_opcodes_outside_skeletons_are_refused():
    for data in (b"\x80\x04}}b.",  # BUILD (calls __setstate__ or updates __dict__ of the object below it)
                 b"\x80\x04\x8c\x08builtins\x8c\x03set\x93)\x81.",  # NEWOBJ of an allowed class
                 b"(S'x'\nt."):  # protocol-0 text opcodes
        with pytest.raises(sc.CacheFormatError, match="opcode"):
            decode_skeleton(data, 0, lambda i, n: None, "entry 'y'")
    obj = {"x": 1}
    assert decode_skeleton(pickle.dumps(obj, protocol=4), 0, lambda i, n: None, "e") == obj


def test_allowed_bytearray_with_a_hostile_size_is_refused():
    class Huge:
        def __reduce__(self):
            return bytearray, (2**40,)

    with pytest.raises(sc.CacheFormatError, match="bytearray"):
        decode_skeleton(pickle.dumps(Huge(), protocol=4), 0, lambda i, n: None, "entry 'z'")
    assert decode_skeleton(pickle.dumps(bytearray(b"ok"), protocol=4), 0, lambda i, n: None, "e") == b"ok"


@pytest.mark.parametrize("damage", ["negative_count", "huge_count", "offsets", "unsorted_hashes", "hash_order",
                                    "manifests_not_dict", "row_shape"])
def test_inconsistent_index_with_valid_checksums_is_refused_cleanly(cache, damage):
    with sc.CacheWriter(cache) as w:
        for i in range(4):
            w.put(f"k{i}", latent(i))

    damage_index(cache, damage)
    try:
        r = sc.open_cache(cache)
        for k in list(r.keys()):
            r[k].materialize()
        if damage == "row_shape":
            pytest.fail("a row pointing outside the shape table must not materialize")
    except sc.CacheError as exc:
        assert "index.scc" in str(exc) or "k" in str(exc)
    if damage == "row_shape":  # damage in one row stays with its entry
        r = sc.open_cache(cache)
        report = r.verify()
        assert len(report.damaged) == 1 and not report.ok


# ------------------------------------------------------------------------- the builder under faults
class _FailingFile(io.FileIO):
    """A file that fails writes once ``budget`` bytes were written (a disk filling up)."""

    budget = 0
    code = errno.ENOSPC

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if _FailingFile.budget < n:
            raise OSError(_FailingFile.code, os.strerror(_FailingFile.code))
        _FailingFile.budget -= n
        return super().write(data)


def _toy_items(n, tag=b""):
    return [sc.Item(f"i{i}", {"x": sc.Part(data=tag + bytes([i]) * 64)}) for i in range(n)]


def _toy_encoder():
    return {"x": sc.Encoder("toy", lambda parts: [torch.full((256,), float(p.data[-1])) for p in parts], batch_size=2)}


@pytest.mark.parametrize("code,reason", [(errno.ENOSPC, "the disk is full"), (errno.EACCES, "Permission denied")])
def test_disk_full_or_permission_error_keeps_the_last_commit(cache, monkeypatch, code, reason):
    sc.build(cache, _toy_items(6), _toy_encoder())
    before = {k: sc.open_cache(cache)[k].materialize() for k in sc.open_cache(cache).keys()}
    _FailingFile.budget, _FailingFile.code = 1500, code
    monkeypatch.setattr(layout, "create_file", lambda path: _FailingFile(path, "x"))
    with pytest.raises(sc.CacheError, match=reason) as info:
        sc.build(cache, _toy_items(40, b"new"), _toy_encoder(), commit_seconds=0)
    assert "keeps its last commit" in str(info.value)
    monkeypatch.undo()
    r = sc.open_cache(cache)
    assert r.verify().ok
    for k, v in before.items():
        assert torch.equal(r[k].materialize(), v), "an entry committed before the fault was lost"
    assert not [n for n in os.listdir(layout.shard_dir(cache)) if layout.TMP_SUFFIX in n]
    report = sc.build(cache, _toy_items(40, b"new"), _toy_encoder())  # space is back: the build resumes
    assert report.failed == 0 and report.rows == 40


def test_unreadable_source_fails_its_item_only(cache, tmp_path, monkeypatch):
    paths = []
    for i in range(4):
        p = tmp_path / f"s{i}.bin"
        p.write_bytes(bytes([i]) * 32)
        paths.append(str(p))
    real_open = open

    def guarded_open(path, *a, **k):
        if str(path) == paths[2]:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(builder, "open", guarded_open, raising=False)
    items = [sc.Item(f"s{i}", {"x": sc.Part(path=p)}) for i, p in enumerate(paths)]
    enc = {"x": sc.Encoder("toy", lambda parts: [torch.zeros(2) for _ in parts])}
    report = sc.build(cache, items, enc)
    assert report.rows == 3 and report.failed == 1
    assert report.failures[0].item == "s2" and "Permission denied" in report.failures[0].error


def test_file_changing_while_hashed_fails_its_item(cache, tmp_path, monkeypatch):
    target = tmp_path / "moving.bin"
    target.write_bytes(b"x" * 100)
    stable = tmp_path / "stable.bin"
    stable.write_bytes(b"y" * 100)
    real_stat = os.stat
    ticks = [0]

    def moving_stat(path, *a, **k):
        st = real_stat(path, *a, **k)
        if str(path) == str(target):
            ticks[0] += 1
            values = list(st)
            return os.stat_result(values[:8] + [st.st_mtime + ticks[0], st.st_ctime],
                                  {"st_mtime_ns": st.st_mtime_ns + ticks[0]})
        return st

    monkeypatch.setattr(os, "stat", moving_stat)
    items = [sc.Item("moving", {"x": sc.Part(path=str(target))}), sc.Item("stable", {"x": sc.Part(path=str(stable))})]
    report = sc.build(cache, items, {"x": sc.Encoder("toy", lambda parts: [torch.zeros(2) for _ in parts])})
    monkeypatch.undo()
    assert report.rows == 1 and report.failures[0].item == "moving"
    assert "kept changing while it was being read" in report.failures[0].error


def test_empty_and_binary_captions_are_data_like_any_other(cache):
    items = [sc.Item("empty", {"c": sc.Part(data=b"")}), sc.Item("latin1", {"c": sc.Part(data="café".encode("latin-1"))})]
    enc = {"c": sc.Encoder("t", lambda parts: [torch.tensor([float(len(p.data))]) for p in parts])}
    report = sc.build(cache, items, enc)
    assert report.rows == 2 and report.failed == 0


def test_an_input_slow_under_the_tracer_is_timed_again_without_it():
    """A slow input is a finding only when it is slow again on its own: the tracer's cost, or a moment the machine
    was busy (an input once took 5.5 s on a loaded CI machine), are not the input's."""
    seen = []

    def call():
        seen.append(1)
        time.sleep(0.05)
        raise ValueError("judged on the traced run")

    assert fuzz._untraced_seconds(call) >= 0.05 and seen == [1]
