"""A build killed with SIGKILL at several points leaves a valid cache, and resuming gives exactly the result
of an uninterrupted build."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import streaming_cache as sc
from helpers import build_worker
from helpers.installs import HELPERS, subprocess_env
from streaming_cache.devtools.toy import write_folder

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")]


def make_source(folder, n=40):
    write_folder(folder, [f"caption {i % 7}" for i in range(n)], size=16)


def snapshot(cache) -> dict:
    """Everything that must match: keys, their tensor digests, and the manifest rows."""
    r = sc.open_cache(cache)
    digests = {k: tuple(t.digest for t in r[k].tensors) for k in r.keys()}
    rows = {(x["name"], tuple(sorted(x["keys"].items()))) for x in r.manifest("default")["rows"]}
    return {"digests": digests, "rows": rows}


def kill_after_batches(src, cache, batches: int, extra_delay: float) -> bool:
    """Run the worker, SIGKILL it after it reported ``batches`` finished batches (+ a delay). True if killed."""
    proc = subprocess.Popen([sys.executable, os.path.join(HELPERS, "build_worker.py"), src, cache, "0.01"],
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout is not None
    try:
        seen = 0
        for line in proc.stdout:
            seen += line.startswith("progress")
            if seen >= batches:
                time.sleep(extra_delay)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
        proc.wait()
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_during_build_then_resume(tmp_path):
    src = str(tmp_path / "src")
    make_source(src)
    reference = str(tmp_path / "reference")
    build_worker.build(src, reference)
    expected = snapshot(reference)
    assert len(expected["rows"]) == 40 and len(expected["digests"]) == 47

    cache = str(tmp_path / "cache")
    rng = random.Random(1234)
    committed: dict = {}
    kills = 0
    for batches in (1, 1, 2, 1, 3, 1, 2, 1, 1, 2):
        killed = kill_after_batches(src, cache, batches, rng.uniform(0, 0.04))
        kills += killed
        if not killed:
            break
        if not os.path.exists(os.path.join(cache, "index.scc")):
            continue  # killed before the first commit: nothing was promised yet
        r = sc.open_cache(cache)
        assert r.verify().ok
        now = snapshot(cache)["digests"]
        for key, digests in committed.items():
            assert now.get(key) == digests, f"committed entry {key} was lost or changed by a kill"
        committed = now
        assert set(now) <= set(expected["digests"])
        assert all(expected["digests"][k] == d for k, d in now.items())
    assert kills >= 6, f"only {kills} kills landed before the build finished"
    report = build_worker.build(src, cache)
    assert not report.stopped and report.failed == 0
    assert snapshot(cache) == expected
    assert sc.open_cache(cache).verify().ok
    assert len(os.listdir(os.path.join(cache, "shards"))) == len(sc.open_cache(cache).index.header["shards"])
