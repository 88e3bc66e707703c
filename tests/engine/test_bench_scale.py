"""The scale benchmark runs end to end on a small cache and reports what it measured: the writes, the loader as
Train LoRA makes it, memory after each step, the raw-read baselines beside the timings, each rank planning only its
share, and the signatures from the index tables equal to the per-entry ones (the benchmark checks that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_scale_reports_every_figure(tmp_path):
    out = subprocess.run([sys.executable, "-m", "streaming_cache", "bench-scale", str(tmp_path), "--sizes", "3k",
                          "--batches", "5", "--random", "50", "--batch-size", "16", "--plan-ranks", "4", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout)["sizes"]["3000"]
    assert row["rows"] == 3000 and row["plan_rows"] == 3000 and row["shards"] == 1
    assert row["put_per_s"] > 0 and row["put_many_per_s"] > 0 and row["raw_write_per_s"] > 0
    assert [r["plan_rows"] for r in row["ranks"]] == [1500, 1500]
    assert row["first_batch_s"] > 0 and row["steady_per_s"] > 0 and row["steady_raw_per_s"] > 0
    assert row["random_warm_us"] > 0 and row["random_raw_warm_us"] > 0 and row["random_after_batches_us"] > 0
    assert list(row["memory"]) == ["opened", "first_batch", "batches", "random"]
    assert 0 < row["loader_bytes"] <= 5 * 3000  # a row number in 4 bytes, 8 bytes a batch of 16
    plans = row["plans"]
    assert plans["one"]["plan_rows"] == 3000 and [r["plan_rows"] for r in plans["ranks"]] == [750] * 4
    assert all(r["kept_bytes"] <= plans["one"]["kept_bytes"] / 4 + 16 * 1024 for r in plans["ranks"])
    assert row["plan_per_entry_s"] > 0 and row["plan_tables_s"] > 0  # the per-entry baseline ran and agreed
