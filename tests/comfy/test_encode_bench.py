"""scripts/bench_encode.py end to end on a few small images, in real ComfyUI: Encode Dataset, its decode and
encoder halves alone and ComfyUI's own dataset nodes all run on the same folder and the ratios come from that run.
What the figures are on real sizes is the benchmark's business, not this test's."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers.installs import SCRIPTS, require_comfyui, subprocess_env

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all


def test_encode_benchmark_runs_ours_and_comfyuis_path_on_one_folder(comfyui, tmp_path):
    comfyui = require_comfyui(comfyui)
    proc = subprocess.run([comfyui.python, os.path.join(SCRIPTS, "bench_encode.py"), "--comfyui", comfyui.path,
                           "--tiny", "--json"], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(TMPDIR=str(tmp_path)), check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert set(results) == {"decode", "encoders", "encode_dataset", "comfyui"}
    for name, r in results.items():
        assert r["ok"], (name, r["error"])
        assert r["seconds"] > 0 and r["images_per_s"] > 0, (name, r)
    assert report["comfyui_latents"] == report["images"] == 4, "ComfyUI's path encoded every image of the folder"
    assert report["wall_vs_max_decode_encoders"] == round(
        results["encode_dataset"]["seconds"] / max(results["decode"]["seconds"], results["encoders"]["seconds"]), 3)
    assert report["images_per_s_vs_comfyui"] == round(
        results["comfyui"]["seconds"] / results["encode_dataset"]["seconds"], 3)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("bench_encode_")], \
        "the benchmark removes its checkpoint, folders and caches"
