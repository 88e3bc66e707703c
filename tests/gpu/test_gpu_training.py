"""Training on a CUDA GPU through real ComfyUI (skipped without CUDA; run on a GPU machine with ``COMFYUI_PATH``).

Each configuration runs in a fresh process (``scripts/bench_memory.py``'s workers): the first training after
ComfyUI starts is where PyTorch fixed its attention kernel order lazily and the first checkpointed block's
recomputation ran another kernel than its forward pass. The small SDXL-shaped UNet (KOALA-700M's layout, random
weights) trains at 512 px, where its attention goes through ComfyUI's kernel-priority path; Flux with one block of
each kind. Offloading and fp8 weights with bypass mode train on CUDA too, and steps replayed from CUDA graphs train
what eager steps train.
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


def _bench(comfyui, tmp_path, model: str, resolution: int, configurations: list[str] = OURS) -> dict:
    proc = subprocess.run([comfyui.python, os.path.join(SCRIPTS, "bench_memory.py"), "--comfyui", comfyui.path,
                           "--tiny", "--model", model, "--resolution", str(resolution), "--steps", "4", "--json",
                           "--only", ",".join(configurations)], capture_output=True, text=True, timeout=900,
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


def test_steps_replayed_from_cuda_graphs_train_the_lora_eager_steps_train(comfyui, tmp_path):
    """Train LoRA's default on CUDA records its step once and replays it; the LoRA it trains is the one the same
    training without graphs gives (the attention's backward pass is not bit-exact from run to run, so the two are
    compared by the cosine of their up tensors, which start at zero: a wrong gradient or a stale input would
    leave them far apart)."""
    report = _bench(require_comfyui(comfyui), tmp_path, "sdxl", 512, ["streaming", "streaming_eager"])
    run = report["results"]["streaming"]
    assert run["ok"], run["error"]
    graphs = run["cuda_graphs"]
    # the call that records is checked against its warm-up pass and replayed, as are the three later steps
    assert graphs["failed"] is None and graphs["recorded"] == 1 and graphs["replays"] == 4, graphs
    assert run["lora_agreement"]["cosine"] > 0.99, run["lora_agreement"]
