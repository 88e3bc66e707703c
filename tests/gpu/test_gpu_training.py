"""Training on a CUDA GPU through real ComfyUI (skipped without CUDA; run on a GPU machine with ``COMFYUI_PATH``).

Each configuration runs in a fresh process (``scripts/bench_memory.py``'s workers): the first training after
ComfyUI starts is where PyTorch fixed its attention kernel order lazily and the first checkpointed block's
recomputation ran another kernel than its forward pass. The small SDXL-shaped UNet (KOALA-700M's layout, random
weights) trains at 512 px, where its attention goes through ComfyUI's kernel-priority path; Flux with one block of
each kind. Offloading and fp8 weights with bypass mode train on CUDA too.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from helpers.installs import SCRIPTS, require_comfyui, subprocess_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OURS = ["streaming", "streaming_offloading", "streaming_fp8_bypass"]


def _bench(comfyui, tmp_path, model: str, resolution: int) -> dict:
    proc = subprocess.run([comfyui.python, os.path.join(SCRIPTS, "bench_memory.py"), "--comfyui", comfyui.path,
                           "--tiny", "--model", model, "--resolution", str(resolution), "--steps", "4", "--json",
                           "--only", ",".join(OURS)], capture_output=True, text=True, timeout=900,
                          env=subprocess_env(TMPDIR=str(tmp_path)), check=False)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("model,resolution", [("sdxl", 512), ("flux", 512)])
def test_first_training_in_a_fresh_process_trains_with_every_memory_option(comfyui, tmp_path, model, resolution):
    comfyui = require_comfyui(comfyui)
    report = _bench(comfyui, tmp_path, model, resolution)
    for name in OURS:
        run = report["results"][name]
        assert run["ok"], (name, run["error"])
        assert run["step_seconds"] > 0 and run["peak_gib"] > 0, (name, run)
