"""The incremental builder: exactly the changed work, caption dedupe, per-item retry, stop/resume, stat ladder."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import xxhash

import streaming_cache as sc
from helpers.sources import Encoders, age_files, items_of, write_dataset, write_one
from streaming_cache import builder


@pytest.fixture
def src(tmp_path):
    folder = tmp_path / "src"
    write_dataset(folder, 10)
    age_files(folder)
    return str(folder)


def manifest_rows(cache, name="default"):
    return {(r["name"], tuple(sorted(r["keys"].items()))) for r in sc.open_cache(cache).manifest(name)["rows"]}


def test_incremental_rebuild_encodes_exactly_the_changes(cache, src):
    enc = Encoders()
    r1 = sc.build(cache, items_of(src), enc.encoders())
    assert (r1.encoded, r1.reused, r1.failed, r1.rows) == (20, 0, 0, 10)
    enc.images.clear(), enc.captions.clear()
    r2 = sc.build(cache, items_of(src), enc.encoders())
    assert (r2.encoded, r2.reused, r2.rows) == (0, 20, 10) and enc.images == [] and enc.captions == []
    with open(os.path.join(src, "img003.bin"), "wb") as f:
        f.write(b"\x07changed bytes")
    write_one(src, "new.bin", b"\x09new image", "caption new")
    os.remove(os.path.join(src, "img005.bin"))
    r3 = sc.build(cache, items_of(src), enc.encoders())
    assert sorted(enc.images) == ["img003.bin", "new.bin"] and enc.captions == [b"caption new"]
    assert (r3.encoded, r3.removed, r3.rows, r3.failed) == (3, 1, 10, 0)
    names = {n for n, _ in manifest_rows(cache)}
    assert "img005.bin" not in names and "new.bin" in names
    handle = sc.open_cache(cache).dataset("default")
    row = next(r for r in handle if r.keys["latent"] == next(
        k for n, ks in manifest_rows(cache) if n == "img003.bin" for c, k in ks if c == "latent"))
    assert row.materialize()["latent"]["samples"].flatten().tolist() == [14.0, 7.0]


def test_identical_captions_encoded_once_across_runs(cache, tmp_path):
    folder = tmp_path / "caps"
    write_dataset(folder, 12, captions=["a cat", "a dog", "a cat on a mat"])
    enc = Encoders()
    report = sc.build(cache, items_of(folder), enc.encoders())
    assert sorted(enc.captions) == [b"a cat", b"a cat on a mat", b"a dog"]
    assert report.deduplicated == 9 and report.encoded == 12 + 3
    write_one(str(folder), "zz.bin", b"\x01fresh", "a dog")
    enc.captions.clear()
    report = sc.build(cache, items_of(folder), enc.encoders())
    assert enc.captions == [] and report.encoded == 1
    r = sc.open_cache(cache)
    conds = {row.keys["cond"] for row in r.dataset("default")}
    assert len(conds) == 3


def test_fingerprint_or_settings_change_reencodes_everything(cache, src):
    sc.build(cache, items_of(src), Encoders("v1").encoders())
    keys_v1 = manifest_rows(cache)
    enc = Encoders("v2")
    report = sc.build(cache, items_of(src), enc.encoders())
    assert report.encoded == 20 and len(enc.images) == 10
    keys_v2 = manifest_rows(cache)
    assert not ({k for _, ks in keys_v1 for k in ks} & {k for _, ks in keys_v2 for k in ks})
    enc = Encoders("v2")
    report = sc.build(cache, items_of(src), enc.encoders(settings={"resolution": 768}))
    assert len(enc.images) == 10 and enc.captions == [] and report.encoded == 10


def test_failing_item_is_isolated_from_its_batch(cache, tmp_path):
    folder = tmp_path / "batch"
    write_dataset(folder, 8)
    with open(os.path.join(folder, "img004.bin"), "wb") as f:
        f.write(b"\x04BAD image")
    enc = Encoders(batch_size=8)
    report = sc.build(cache, items_of(folder), enc.encoders())
    assert report.failed == 1 and report.rows == 7
    (failure,) = report.failures
    assert failure.item == "img004.bin" and failure.column == "latent" and "cannot decode img004.bin" in failure.error
    assert enc.batches[0] == 8 and enc.batches.count(1) == 8, "batch failed, then every item retried alone"
    assert "img004.bin" not in {n for n, _ in manifest_rows(cache)}
    assert sc.open_cache(cache).manifest("default")["failed"][0]["item"] == "img004.bin"
    # fixed input: the next run encodes exactly that one
    with open(os.path.join(folder, "img004.bin"), "wb") as f:
        f.write(b"\x04good now")
    enc2 = Encoders(batch_size=8)
    report = sc.build(cache, items_of(folder), enc2.encoders())
    assert enc2.images == ["img004.bin"] and report.rows == 8 and report.failed == 0


def test_encoder_returning_wrong_count_fails_per_item(cache, src):
    enc = Encoders()
    encs = enc.encoders()
    encs["cond"] = sc.Encoder("clip", lambda parts: [], batch_size=4)
    report = sc.build(cache, items_of(src), encs)
    assert report.failed == 10 and report.rows == 0
    assert "returned 0 values for 1 inputs" in report.failures[0].error


def test_unreadable_sources_fail_per_item(cache, src):
    items = items_of(src)
    os.symlink("loop_b", os.path.join(src, "loop_a.bin"))
    os.symlink("loop_a.bin", os.path.join(src, "loop_b"))
    items.append(sc.Item("loop", {"latent": sc.Part(path=os.path.join(src, "loop_a.bin")), "cond": sc.Part(data=b"x")}))
    items.append(sc.Item("missing", {"latent": sc.Part(path=os.path.join(src, "nope.bin")), "cond": sc.Part(data=b"x")}))
    items.append(sc.Item("dir", {"latent": sc.Part(path=src), "cond": sc.Part(data=b"x")}))
    report = sc.build(cache, items, Encoders().encoders())
    assert report.rows == 10 and report.failed == 3
    errors = {f.item: f.error for f in report.failures}
    assert "nope.bin" in errors["missing"] and "not a regular file" in errors["dir"] and errors["loop"]


def test_should_stop_commits_and_resume_equals_uninterrupted(cache, src, tmp_path):
    reference = str(tmp_path / "reference")
    sc.build(reference, items_of(src), Encoders().encoders())
    calls = {"n": 0}

    def stop_after_first_batch():
        calls["n"] += 1
        return calls["n"] > 1

    enc = Encoders()
    report = sc.build(cache, items_of(src), enc.encoders(), should_stop=stop_after_first_batch)
    assert report.stopped and 0 < report.encoded < 20
    r = sc.open_cache(cache)
    assert len(r) == report.encoded, "finished work is committed"
    assert r.manifest("default")["complete"] is False
    enc2 = Encoders()
    report2 = sc.build(cache, items_of(src), enc2.encoders())
    assert report2.encoded == 20 - report.encoded and not report2.stopped
    assert sc.open_cache(cache).manifest("default")["complete"] is True
    assert manifest_rows(cache) == manifest_rows(reference)
    assert set(sc.open_cache(cache).keys()) == set(sc.open_cache(reference).keys())


def test_keyboard_interrupt_keeps_finished_work(cache, src):
    enc = Encoders(batch_size=2)
    real = enc.vae

    def vae(parts):
        if len(enc.images) >= 4:
            raise KeyboardInterrupt
        return real(parts)

    encs = enc.encoders()
    encs["latent"] = sc.Encoder("vae-v1", vae, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        sc.build(cache, items_of(src), encs)
    done = set(sc.open_cache(cache).keys())
    assert len(done) >= 4
    enc2 = Encoders(batch_size=2)
    report = sc.build(cache, items_of(src), enc2.encoders())
    assert report.reused == len(done) and report.encoded == 20 - len(done)
    assert not (set(enc2.images) & set(enc.images))


def test_groups_never_share_a_batch(cache, src):
    seen = []

    def vae(parts):
        seen.append({p.group for p in parts})
        return [{"samples": torch.zeros(1)} for _ in parts]

    items = [sc.Item(it.name, {"latent": sc.Part(path=it.parts["latent"].path, group=i % 3),
                               "cond": it.parts["cond"]}) for i, it in enumerate(items_of(src))]
    enc = Encoders()
    sc.build(cache, items, {"latent": sc.Encoder("v", vae, batch_size=8), "cond": enc.encoders()["cond"]})
    assert seen and all(len(s) == 1 for s in seen)
    assert sum(1 for s in seen) == 3


def test_params_are_part_of_the_key(cache, src):
    items = items_of(src)
    enc = Encoders()
    sc.build(cache, items, enc.encoders())
    bigger = [sc.Item(it.name, {"latent": sc.Part(path=it.parts["latent"].path, params={"size": 1024}),
                                "cond": it.parts["cond"]}) for it in items]
    enc.images.clear()
    report = sc.build(cache, bigger, enc.encoders())
    assert len(enc.images) == 10 and report.encoded == 10


def test_stat_ladder_hashes_only_changed_files(cache, src):
    assert sc.build(cache, items_of(src), Encoders().encoders()).hashed == 10
    assert sc.build(cache, items_of(src), Encoders().encoders()).hashed == 0, "per-process memo"
    builder.forget_source_digests()  # as a new process would start
    assert sc.build(cache, items_of(src), Encoders().encoders()).hashed == 0, "stat records in the manifest"
    path = os.path.join(src, "img002.bin")
    with open(path, "r+b") as f:
        f.write(b"\x63")  # same size, new content
    old = time.time() - 30
    os.utime(path, (old, old))
    enc = Encoders()
    report = sc.build(cache, items_of(src), enc.encoders())
    assert report.hashed == 1 and enc.images == ["img002.bin"]


def test_fresh_mtime_is_not_trusted(cache, tmp_path):
    folder = tmp_path / "racy"
    write_dataset(folder, 3)  # mtimes are "now": inside the racy window
    sc.build(cache, items_of(folder), Encoders().encoders())
    builder.forget_source_digests()
    assert sc.build(cache, items_of(folder), Encoders().encoders()).hashed == 3


def test_duplicate_item_names_refused(cache, src):
    items = items_of(src)
    with pytest.raises(sc.CacheError, match="unique"):
        sc.build(cache, items + items[:1], Encoders().encoders())
    with pytest.raises(sc.CacheError, match="parts"):
        sc.build(cache, [sc.Item("x", {"latent": sc.Part(data=b"x")})], Encoders().encoders())


def test_progress_and_manifest_contents(cache, src):
    seen = []
    report = sc.build(cache, items_of(src), Encoders().encoders(), manifest="cats", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (20, 20) and all(t == 20 for _, t in seen)
    m = sc.open_cache(cache).manifest("cats")
    assert m["columns"] == ["cond", "latent"] and m["complete"] and len(m["rows"]) == 10
    assert len(m["sources"]) == 10 and all(len(v) == 4 for v in m["sources"].values())
    assert m["encoders"]["latent"]["fingerprint"] == "vae-v1"
    assert "encoded 20, reused 0, failed 0" in report.summary()
    json.dumps(m)


def test_unchanged_rebuild_leaves_the_cache_untouched(cache, src):
    age_files(src)
    enc = Encoders()
    sc.build(cache, items_of(src), enc.encoders())
    generation = sc.open_cache(cache).generation
    report = sc.build(cache, items_of(src), enc.encoders())
    assert report.encoded == 0 and report.reused > 0 and report.rows == len(items_of(src))
    assert sc.open_cache(cache).generation == generation, "nothing changed, so nothing may be committed"


def test_equal_params_of_different_types_get_different_keys(cache):
    values = (1, 1.0, True, "1")
    items = [sc.Item(f"i{n}", {"x": sc.Part(data=b"x", params={"w": v})}) for n, v in enumerate(values)]
    enc = sc.Encoder("f", lambda parts: [torch.zeros(1) for _ in parts])
    sc.build(cache, items, {"x": enc})
    keys = {row["name"]: row["keys"]["x"] for row in sc.open_cache(cache).manifest("default")["rows"]}
    assert len(set(keys.values())) == 4
    assert keys["i0"] == sc.entry_key(enc, sc.Part(params={"w": 1}), xxhash.xxh3_128_hexdigest(b"x"))
