"""The README's first command, from nothing to a trained LoRA: ComfyUI, a Python environment with PyTorch, this
pack in custom_nodes, the demo LoRA; run twice, the second run reuses everything.

ComfyUI comes from the newest installation the tests run against (``COMFYUI_PATH``: a folder holding the
snapshot, the way a machine without access to GitHub passes ``--comfyui-source``), PyTorch from the wheel files in
``STREAMING_CACHE_TORCH_WHEELS`` (``.ci/run`` makes them: this machine reaches only PyPI, whose Linux torchvision
is a CUDA build). The run's environment holds nothing of the test run's (no COMFYUI_PATH, no PYTHONPATH) and its home is new.
Then the README's headless command, run from the clone by a Python without torch, finds the installation the
installer recorded and runs as its Python."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from helpers import hang_limit
from helpers.demo_output import assert_demo_runs
from helpers.installs import ROOT, comfyui_installs, in_ci


def _readme_command() -> tuple[list[str], str]:
    """The README's first command, run from the checkout as written (its folder under ``~``), and that folder."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = f.read().split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(next(line for line in block.splitlines() if line and not line.startswith("#")))
    assert words[:2] == ["python3", "scripts/install.py"] and words[2].startswith("~/"), words
    return [sys.executable, os.path.join(ROOT, words[1]), *words[2:]], words[2][2:]


def _fresh_env(home) -> dict[str, str]:
    """A new user's environment: an empty home (no user site-packages, nothing installed before), none of the test
    run's settings. pip keeps its download cache (it saves downloads and cannot stand in for a package)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMFYUI_", "STREAMING_CACHE_", "PYTHON", "VIRTUAL_ENV", "XDG_"))}
    env.setdefault("PIP_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pip"))
    return {**env, "HOME": str(home)}


def test_one_command_installs_comfyui_and_trains_the_demo_lora_then_reuses_everything(tmp_path):
    installs, wheels = comfyui_installs(), os.environ.get("STREAMING_CACHE_TORCH_WHEELS", "")
    if not installs or not wheels:
        message = "needs COMFYUI_PATH (the ComfyUI source) and STREAMING_CACHE_TORCH_WHEELS (see .ci/run)"
        pytest.fail(message) if in_ci() else pytest.skip(message)
    home = tmp_path / "home"
    home.mkdir()
    readme, folder = _readme_command()
    target = home / folder
    command = [*readme, "--comfyui-source", installs[-1].path, "--torch-wheels", wheels]
    lora = target / "demo" / "models" / "loras" / "demo_lora.safetensors"
    runs, loras = [], []
    for _ in range(2):
        hang_limit.allow(1800)
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=_fresh_env(home),
                              check=False)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
        runs.append(proc.stdout)
        loras.append(lora.read_bytes())
    first, second = runs
    steps = re.findall(r"^\[install\] step (\d)/6: (\S+)", first, re.M)
    assert [s[0] for s in steps] == ["1", "2", "3", "4", "5", "6"], first
    assert_demo_runs(first, second)
    assert len(loras[0]) > 0
    place = target / "ComfyUI" / "custom_nodes" / "comfyui-streaming-cache"
    assert os.path.realpath(place) == os.path.realpath(ROOT), "the pack is linked, so updating it here updates it"
    venv_python = target / "venv" / "bin" / "python"
    assert f"{venv_python} {target / 'ComfyUI' / 'main.py'} --cpu" in first, "it says how to start ComfyUI"
    headless = os.path.join(ROOT, "scripts", "headless.py")
    assert shlex.join([str(venv_python), headless, "--demo", str(target / "demo"), "--comfyui",
                       str(target / "ComfyUI")]) in first, "it ends with the exact headless command"
    record = json.loads((home / ".config" / "comfyui-streaming-cache" / "installs.json").read_text())
    assert record["installs"][os.path.realpath(ROOT)] == {"comfyui": str(target / "ComfyUI"),
                                                          "python": str(venv_python), "isolated": False}
    assert "runs on the CPU only" in first

    assert re.search(r"^\[install\]   kept: ComfyUI ", second, re.M), second
    assert "kept: unchanged since the last run" in second
    assert "Successfully installed" not in second, "nothing is installed again"
    assert f"note: --torch-wheels {wheels} is not used" in second, "an option given and not used is said"
    before, after = (safetensors.torch.load(data) for data in loras)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), \
        "the second run keeps the trained LoRA"

    # python3 scripts/headless.py --demo DIR from the clone, by a Python that cannot import torch (-S: no
    # site-packages), as a system python3 is
    hang_limit.allow(1800)
    proc = subprocess.run([sys.executable, "-S", "scripts/headless.py", "--demo", str(target / "demo")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, env=_fresh_env(home), check=False)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert f"cannot import torch: running with {venv_python}, which runs the ComfyUI in {target / 'ComfyUI'}" \
        in proc.stdout, proc.stdout
    assert "encoded 0, reused 10, failed 0" in proc.stdout
