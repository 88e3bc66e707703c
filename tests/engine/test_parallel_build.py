"""Encoding by several processes (torchrun, gloo on CPU): ranks hash and encode disjoint shares, each distinct
caption once over all of them, into a cache equal in content to a one-process build; a killed rank leaves the
cache valid and the next launch encodes only what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import streaming_cache as sc
from helpers.installs import HELPERS, subprocess_env
from helpers.sources import age_files, write_dataset, write_one
from streaming_cache import layout

pytestmark = [pytest.mark.multiprocess, pytest.mark.oldest_torch]

SCRIPT = os.path.join(HELPERS, "ddp_build.py")
CAPTIONS = ["a cat", "a dog", "a cat", "a bird", "a dog"]  # repeated captions: encoded once each


def launch(source: str, cache: str, processes: int, *args: str) -> tuple[subprocess.CompletedProcess, list, dict]:
    cmd = [sys.executable, SCRIPT] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), SCRIPT]
    env = subprocess_env(STREAMING_CACHE_COLLECTIVE_TIMEOUT="60", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + [source, cache, *args], env=env, capture_output=True, text=True, timeout=240)
    encoded = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("ENCODED ")]
    reports = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    return proc, encoded, reports[0] if reports else {}


def contents(cache: str) -> dict:
    """The dataset's rows (name -> keys) and every entry's tensors, by key."""
    with sc.open_cache(cache) as reader:
        rows = {r.name: r.keys for r in sc.Manifest.from_json(reader.manifest_bytes("default"), "").rows}
        values = {k: reader[k].materialize() for k in reader.keys()}
    return {"rows": rows, "values": values}


def same(a: dict, b: dict) -> bool:
    if a["rows"] != b["rows"] or sorted(a["values"]) != sorted(b["values"]):
        return False
    flat = [(sc.loader._tensors(a["values"][k]), sc.loader._tensors(b["values"][k])) for k in a["values"]]
    return all(torch.equal(x, y) for xs, ys in flat for x, y in zip(list(xs), list(ys)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("src"))
    write_dataset(folder, 13, CAPTIONS)
    write_one(folder, "img999.bin", b"\x04BAD image", "a broken one")
    age_files(folder)
    return folder


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("one") / "cache")
    proc, _, report = launch(source, cache, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cache, report


def test_two_ranks_encode_disjoint_shares_into_the_cache_one_rank_makes(source, reference, tmp_path):
    cache = str(tmp_path / "cache")
    proc, encoded, report = launch(source, cache, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(encoded) == 2 and all(e["images"] for e in encoded), "both ranks encoded images"
    shares = [set(e["images"]) for e in encoded]
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 13, "disjoint shares of the 13 good images"
    captions = [c for e in encoded for c in e["captions"]]
    assert sorted(captions) == sorted(set(CAPTIONS) | {"a broken one"}), "each distinct caption once over both"
    assert report == reference[1], "the same report as one process"
    assert report["failures"] == ["img999.bin"] and report["rows"] == 13
    assert same(contents(cache), contents(reference[0]))
    assert not os.path.exists(layout.parts_dir(cache)) or not os.listdir(layout.parts_dir(cache)), \
        "the ranks' parts are merged and removed"
    proc, encoded, again = launch(source, cache, 2)
    assert proc.returncode == 0 and again["encoded"] == 0 and again["rows"] == 13, "a re-run encodes nothing"


def test_a_killed_rank_leaves_the_cache_valid_and_the_next_launch_encodes_only_what_is_missing(
        source, reference, tmp_path):
    cache = str(tmp_path / "cache")
    proc, _, _ = launch(source, cache, 2, "--kill-rank", "1", "--kill-after", "2")
    assert proc.returncode != 0, "the job ends when a rank is killed"
    with sc.open_cache(cache) as reader:
        assert reader.verify().ok, "the cache is valid after the kill"
        kept = set(reader.keys())
    for part in layout.list_parts(cache):
        with sc.open_cache(part) as reader:
            kept |= set(reader.keys())
    assert kept, "work finished before the kill is kept (in the cache and in the killed rank's part)"
    proc, encoded, report = launch(source, cache, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    total = len(contents(reference[0])["values"])
    assert report["encoded"] == total - len(kept), "only what is missing is encoded again"
    assert same(contents(cache), contents(reference[0]))
