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
import re
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


def _preview_counts(text: str) -> tuple[int, int, int]:
    """(pages, samples an epoch, their sum over the buckets) from the preview line of a node's text."""
    line = next(x for x in text.splitlines() if x.startswith("preview page "))
    pages, samples = map(int, re.match(r"preview page 1 of (\d+) \((\d+) samples an epoch", line).groups())
    counts = re.search(r"buckets: (.*?)(;|$)", line).group(1)
    return pages, samples, sum(int(part.rsplit(" ", 1)[1]) for part in counts.split(", "))


def test_encode_dataset_and_load_streaming_cache_show_the_dataset_preview(result):
    """The preview page (the samples as cropped, their buckets, the failures) is shown on Encode Dataset and on
    Load Streaming Cache without the sources; its text line counts the buckets over every sample."""
    first = result["first"]
    rows = int(re.search(r"\((\d+) samples", first["encode"]).group(1))
    pages, samples, in_buckets = _preview_counts(first["encode"])
    assert pages == 1 and samples == in_buckets and samples > rows > 1, first["encode"]  # a folder repeats twice
    assert "1 failed in the cache" in first["encode"], "the broken image's failure is recorded in the cache"
    assert len(first["encode_images"]) == 1 and first["encode_images"][0][0] >= 480, first["encode_images"]
    load = result["sourceless"]
    assert _preview_counts(load["load"]) == (1, samples, samples), load["load"]
    assert len(load["load_images"]) == 1 and load["load_images"][0] == first["encode_images"][0]


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
                                                          "StreamingCacheTrain", "StreamingCacheMemoryOptions"}, "the demo trains in fp32"
