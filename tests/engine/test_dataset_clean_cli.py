"""The lazy dataset handle, orphan preview and clean, and the command line."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import entry_digests, flip_byte, tensor_file_offset
from helpers.installs import subprocess_env
from helpers.sources import Encoders, age_files, items_of, write_dataset
from helpers.values import latent
from streaming_cache import cli


@pytest.fixture
def built(tmp_path):
    src = tmp_path / "src"
    write_dataset(src, 12, captions=["a", "b", "c"])
    age_files(src)
    cache = str(tmp_path / "cache")
    sc.build(cache, items_of(src), Encoders().encoders())
    return cache, str(src)


def test_handle_basics(built):
    cache, _ = built
    h = sc.open_cache(cache).dataset("default")
    assert len(h) == 12 and h.columns == ("cond", "latent")
    row = h[-1]
    assert set(row.keys) == {"cond", "latent"} and row.keys == h[11].keys
    value = row.materialize()
    assert value["latent"]["samples"].shape == (1, 2, 1, 1) and value["cond"][0][0].shape == (1, 3)
    assert [r.keys for r in h[2:5]] == [h[i].keys for i in (2, 3, 4)]
    assert [r.keys for r in h[[5, 1, 5]]] == [h[5].keys, h[1].keys, h[5].keys]
    both = h[:3] + h[9:]
    assert len(both) == 6 and both[3].keys == h[9].keys
    assert len(h.repeat(3)) == 36
    small = h.filter(lambda r: r.keys["cond"] == h[0].keys["cond"])
    assert len(small) == 4
    with pytest.raises(IndexError):
        h[12]
    everything = sc.open_cache(cache).dataset()
    assert len(everything) == 15 and everything.columns is None  # 12 latents + 3 captions


def test_handle_pickles_small_and_without_tensors(built):
    cache, _ = built
    h = sc.open_cache(cache).dataset("default")
    clone = pickle.loads(pickle.dumps(h))
    assert [r.keys for r in clone] == [r.keys for r in h]
    assert torch.equal(clone[3].materialize()["latent"]["samples"], h[3].materialize()["latent"]["samples"])
    big = h.repeat(1000)  # 12k rows
    assert len(pickle.dumps(big)) < 100 * len(big)
    assert b"samples" not in pickle.dumps(big)


def test_handle_survives_growth_and_detects_removal(built, tmp_path):
    cache, src = built
    h = sc.open_cache(cache).dataset("default")
    with sc.CacheWriter(cache) as w:
        w.put("unrelated", latent(1))
    assert h[0].materialize() is not None
    os.remove(os.path.join(src, "img000.bin"))
    sc.build(cache, items_of(src), Encoders().encoders())
    sc.clean(cache, dry_run=False)
    with pytest.raises(sc.StaleCacheError, match="no longer has"):
        h[0].materialize()


def test_fingerprint_and_signatures(built):
    cache, _ = built
    h = sc.open_cache(cache).dataset("default")
    assert h[:4].fingerprint() == h[[0, 1, 2, 3]].fingerprint()
    assert h[:4].fingerprint() != h[1:5].fingerprint()
    sigs = h.signatures()
    assert len(set(sigs.tolist())) == 1  # all rows have equal shapes
    with sc.CacheWriter(cache) as w:
        w.put("x", {"samples": torch.zeros(2, 2)})
        w.put("y", {"samples": torch.zeros(2, 2)})
        w.put("z", {"samples": torch.zeros(3, 2)})
    raw = sc.open_cache(cache).dataset().filter(lambda r: r.keys in ("x", "y", "z"))
    s = raw.signatures().tolist()
    assert s[0] == s[1] != s[2]


def test_manifest_repeats_expand_rows(cache, tmp_path):
    src = tmp_path / "rep"
    write_dataset(src, 2)
    items = items_of(src)
    items = [sc.Item(items[0].name, items[0].parts, repeats=3), items[1]]
    sc.build(cache, items, Encoders().encoders())
    r = sc.open_cache(cache)
    assert len(r.dataset("default")) == 4
    assert len(sc.DatasetHandle.from_cache(cache, "default", repeats=False)) == 2


def test_orphan_preview_and_clean(built):
    cache, src = built
    before = sc.open_cache(cache)
    stored = before.stored_bytes()
    files = sorted(os.listdir(os.path.join(cache, "shards")))
    assert sc.preview(cache).orphan_entries == 0
    for i in (0, 1):
        os.remove(os.path.join(src, f"img{i:03d}.bin"))  # captions "a" and "b" remain used by other rows
    sc.build(cache, items_of(src), Encoders().encoders())
    report = sc.preview(cache)
    assert report.orphan_entries == 2 and report.orphan_bytes == 2 * 2 * 4
    assert sc.clean(cache).deleted is False
    assert sorted(os.listdir(os.path.join(cache, "shards"))) == files and len(sc.open_cache(cache)) == 15
    handle = sc.open_cache(cache).dataset("default")
    values = [r.materialize() for r in handle]
    done = sc.clean(cache, dry_run=False)
    assert done.deleted and done.stored_bytes_after is not None and done.stored_bytes_after <= stored
    r = sc.open_cache(cache)
    assert len(r) == 13 and r.verify().ok
    again = [row.materialize() for row in r.dataset("default")]
    assert all(torch.equal(a["latent"]["samples"], b["latent"]["samples"]) for a, b in zip(values, again))
    assert sc.preview(cache).orphan_entries == 0


def test_no_manifest_means_no_orphans(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
        w.put("a", latent(2))  # the first value's bytes become unreferenced
    report = sc.preview(cache)
    assert report.orphan_entries == 0
    sc.clean(cache, dry_run=False)
    assert list(sc.open_cache(cache).keys()) == ["a"]


def test_pending_keys_of_unfinished_build_survive_clean(cache, tmp_path):
    src = tmp_path / "p"
    write_dataset(src, 8)
    calls = {"n": 0}
    report = sc.build(cache, items_of(src), Encoders(batch_size=2).encoders(),
                      should_stop=lambda: (calls.__setitem__("n", calls["n"] + 1), calls["n"] > 3)[1])
    assert report.stopped
    kept = set(sc.open_cache(cache).keys())
    sc.clean(cache, dry_run=False)
    assert set(sc.open_cache(cache).keys()) == kept


def run_cli(args, capsys):
    code = cli.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_info_verify_clean(built, capsys):
    cache, src = built
    code, out, _ = run_cli(["info", cache], capsys)
    assert code == 0 and "entries    15" in out and "'default': 12 rows" in out
    code, out, _ = run_cli(["info", cache, "--json"], capsys)
    data = json.loads(out)
    assert data["entries"] == 15 and data["manifests"]["default"]["complete"] is True
    code, out, _ = run_cli(["verify", cache, "--json"], capsys)
    assert code == 0 and json.loads(out)["ok"] is True
    os.remove(os.path.join(src, "img003.bin"))
    sc.build(cache, items_of(src), Encoders().encoders())
    code, out, _ = run_cli(["clean", cache], capsys)
    assert code == 0 and "would remove 1 orphan" in out and "--yes" in out
    assert len(sc.open_cache(cache)) == 15
    code, out, _ = run_cli(["clean", cache, "--yes", "--json"], capsys)
    assert json.loads(out)["deleted"] is True and len(sc.open_cache(cache)) == 14


def test_cli_verify_names_damage_and_drops_it(built, capsys):
    cache, src = built
    key = sc.open_cache(cache).dataset("default")[4].keys["latent"]
    path, begin, _ = tensor_file_offset(cache, entry_digests(cache, key)[0])
    flip_byte(path, begin)
    code, out, _ = run_cli(["verify", cache], capsys)
    assert code == 1 and f"DAMAGED {key}" in out
    code, out, _ = run_cli(["verify", cache, "--drop-damaged"], capsys)
    assert code == 1 and "dropped 1" in out
    enc = Encoders()
    report = sc.build(cache, items_of(src), enc.encoders())
    assert report.encoded == 1 and enc.images == ["img004.bin"]
    code, out, _ = run_cli(["verify", cache], capsys)
    assert code == 0 and out.strip().endswith("OK")


def test_cli_bad_input_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "streaming_cache", "info", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no such cache directory" in proc.stderr


def test_cli_demo(tmp_path, capsys):
    code, out, _ = run_cli(["demo", str(tmp_path / "demo"), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["verify_ok"]
    steps = list(data["builds"].values())
    assert steps[0]["encoded"] > 0 and steps[1]["encoded"] == 0 and steps[2]["encoded"] == 1
