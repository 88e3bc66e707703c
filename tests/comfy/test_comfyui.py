"""The pack inside real ComfyUI: example workflows run through ComfyUI's executor with tiny random-weight models.

Runs once per ComfyUI named by ``COMFYUI_PATH`` (several joined with ``:``; ``COMFYUI_PYTHON`` gives each one's
Python); skipped visibly without one, and a failure in CI (``CI=true``), where ``.ci/run`` installs the oldest
supported and the newest ComfyUI. The scenario runs in a child process so ComfyUI's global state never leaks
into the other tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from helpers.demo_output import CHATTER, assert_demo_runs
from helpers.installs import NODE_TYPES, SCRIPTS, comfyui_installs, require_comfyui, run_scenario, subprocess_env


@pytest.fixture(scope="module")
def result(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    work = str(tmp_path_factory.mktemp("comfyui"))
    return run_scenario(comfyui, "comfy_scenario.py", work, "full")


def test_pack_registers_its_nodes(result):
    assert result["node_types"] == NODE_TYPES


def test_encode_and_train_example_workflow(result):
    first = result["first"]
    assert first["ok"], first["error"]
    assert first["encode"].startswith("encoded 11, reused 0, failed 1"), first["encode"]
    assert "broken.png" in first["encode"], "the zero-byte image fails alone and is named"
    assert "2 duplicate captions shared" in first["encode"]
    assert result["lora_exists"]
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])


def test_second_run_encodes_nothing(result):
    second = result["second"]
    assert second["ok"], second["error"]
    assert second["encode"].startswith("encoded 0, reused 11"), second["encode"]
    assert second["train"].startswith("resuming tiny_lora: same dataset and settings"), second["train"]
    assert "tiny_lora: already trained for 3 steps" in second["train"]


def test_saved_lora_loads_in_lora_loader_and_changes_the_output(result):
    assert result["patched_weights"] == result["lora_targets"] > 0, "every LoRA key was recognised by LoraLoader"
    assert result["outputs_finite"]
    assert result["output_change"] > 1e-4


def test_cancel_saves_progress_says_so_and_the_next_run_resumes(result):
    """Cancel stops the prompt (the preview after Train LoRA never runs), and the node's summary, kept in the
    prompt's history, says what was saved and how to go on."""
    cancel = result["cancel"]
    assert not cancel["ok"] and cancel["error"].startswith("execution_interrupted: node 4 (PreviewImage)"), cancel
    assert cancel["saved_steps"] == 2
    assert "cancelled at step 2 of 4: cancel_lora saved with the steps done" in cancel["train"], cancel["train"]
    assert "queue again to continue" in cancel["train"]
    resumed = result["cancel_resume"]
    assert resumed["ok"], resumed["error"]
    assert resumed["step"] == 4 and resumed["losses"] == 4, "resumed at step 2 and finished the 4 steps"
    assert "trained cancel_lora: steps 3-4 of 4" in resumed["train"], resumed["train"]


def test_comfyui_is_told_it_is_training_and_told_again_when_done(result):
    """Newer ComfyUI picks differentiable kernels only while ``in_training`` is set (its fused RoPE has no
    backward); older versions have no such switch and must not get one left behind."""
    flag = result["in_training"]
    assert flag["during"] and all(v is True for v in flag["during"]), flag
    assert flag["after"] in (False, None), "restored after training, also when it was cancelled"


def test_train_from_cache_without_sources(result):
    run = result["sourceless"]
    assert run["ok"], run["error"]
    assert run["load"].startswith("my_dataset: 7 samples")
    assert "trained sourceless: steps 1-2 of 2" in run["train"]


def test_dit_family_trains_and_its_lora_loads(result):
    """An SD3-family MMDiT (flow matching, 16-channel latents) through the same node: ComfyUI's machinery
    prepares its conditioning, the LoRA covers its layers and changes its output."""
    dit = result["dit"]
    assert dit["ok"], dit["error"]
    assert dit["model_type"] == "SD3"
    assert "trained dit_lora: steps 1-3 of 3" in dit["train"]
    assert len(dit["losses"]) == 3 and all(math.isfinite(x) for x in dit["losses"])
    assert dit["patched_weights"] == dit["lora_targets"] > 0
    assert dit["output_change"] > 1e-4


def test_a_lora_not_trained_here_is_never_overwritten(result):
    """A LoRA of that name not made by this trainer is kept: the run goes to a numbered file instead."""
    foreign = result["foreign"]
    assert foreign["ok"], foreign["error"]


def test_path_traversal_is_refused(result):
    t = result["traversal"]
    assert not t["ok"] and "outside the allowed folders" in t["error"]


def test_headless_command_demo_runs_twice_and_exports_api(tmp_path):
    """The demo from the command line, progress on the terminal, on the oldest ComfyUI (the newest runs the same
    command inside the README's install command, ``test_install_command.py``, with the same checks).

    Its output reads like a tool's (``helpers.demo_output``), no warning twice, ComfyUI's start-up log only with
    --verbose."""
    installs = comfyui_installs()
    comfyui = require_comfyui(installs[0] if installs else None)
    cmd = [comfyui.python, os.path.join(SCRIPTS, "headless.py"), "--comfyui", comfyui.path,
           "--demo", str(tmp_path / "demo")]
    runs = [subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=subprocess_env()) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        said = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(said) == len(set(said)), proc.stderr[-3000:]  # no warning twice
        assert not any(chatter in proc.stderr for chatter in CHATTER), proc.stderr[-3000:]
    assert_demo_runs(runs[0].stdout, runs[1].stdout)
    assert os.path.isfile(tmp_path / "demo" / "models" / "loras" / "demo_lora.safetensors")
    out = tmp_path / "prompt.json"
    proc = subprocess.run([*cmd, "--export-api", str(out), "--verbose"], capture_output=True, text=True, timeout=300,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Total VRAM" in proc.stdout + proc.stderr, "--verbose shows ComfyUI's start-up log"
    prompt = json.loads(out.read_text())["prompt"]
    assert {v["class_type"] for v in prompt.values()} == {"CheckpointLoaderSimple", "StreamingCacheEncode",
                                                          "StreamingCacheTrain", "PreviewImage",
                                                          "StreamingCacheMemoryOptions"}, "the demo trains in fp32"
