"""The scale benchmark runs end to end on a small cache and reports what it measured: each rank plans only its own
half of the rows, and the signatures from the index tables equal the per-entry ones (the benchmark checks that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_scale_reports_every_figure(tmp_path):
    out = subprocess.run([sys.executable, "-m", "streaming_cache", "bench-scale", str(tmp_path), "--sizes", "3k",
                          "--batches", "5", "--random", "50", "--batch-size", "16", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout)["sizes"]["3000"]
    assert row["rows"] == 3000 and row["plan_rows"] == 3000 and row["shards"] == 1
    assert [r["plan_rows"] for r in row["ranks"]] == [1500, 1500]
    assert row["first_batch_s"] > 0 and row["steady_per_s"] > 0 and row["random_warm_us"] > 0
    assert row["plan_per_entry_s"] > 0 and row["plan_tables_s"] > 0  # the per-entry baseline ran and agreed
