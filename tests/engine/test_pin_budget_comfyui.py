"""ComfyUI's pinned-memory settings reach the pack, in real ComfyUI: started with ``--disable-pinned-memory`` (newer
versions have the flag), the budget ``nodes/backend/compat.pin_budget`` gives the training refuses every pin, so
neither the loader's buffer pool nor ``conditioning.upload`` pins anything (through the emulated device, which
counts its pins). Each run boots ComfyUI with this pack alone in a child process of that ComfyUI's Python."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers.installs import ComfyInstall, require_comfyui, subprocess_env

CHILD = '''
import json, os, sys
import torch
import headless  # scripts/, on PYTHONPATH

comfyui, flag = sys.argv[1], sys.argv[2] == "1"
with open(os.path.join(comfyui, "comfy", "cli_args.py"), encoding="utf-8") as f:
    knows_flag = "--disable-pinned-memory" in f.read()
if flag and not knows_flag:
    print("RESULT " + json.dumps({"knows_flag": False}))
    sys.exit(0)
headless.boot(comfyui, ["--cpu"] + (["--disable-pinned-memory"] if flag else []), quiet=True, others=False)
compat = headless.pack_module("backend.compat")
transfers = headless.pack_module("transfers", "streaming_cache")
buffers = headless.pack_module("buffers", "streaming_cache")
conditioning = headless.pack_module("train.conditioning", "streaming_cache")
budget = compat.pin_budget()
pool_device, upload_device = transfers.EmulatedTransfers(), transfers.EmulatedTransfers()
pool = buffers.BufferPool(pin=True, transfers=pool_device, pin_budget=budget)
held = [pool.empty((4096,), torch.uint8) for _ in range(3)]
out = conditioning.upload(torch.ones(16), torch.device("cpu"), pin_budget=budget, transfers=upload_device)
print("RESULT " + json.dumps({
    "knows_flag": knows_flag, "budget": None if budget is None else "callable",
    "refuses_one_byte": None if budget is None else not budget(1),
    "pool_pins": pool_device.pins, "pool_pinned_bytes": pool.pinned_bytes, "upload_pins": upload_device.pins,
    "upload_ok": bool(torch.equal(out, torch.ones(16))),
}))
'''


def _run(install: ComfyInstall, tmp_path, flag: bool) -> dict:
    script = tmp_path / "pins.py"
    script.write_text(CHILD)
    proc = subprocess.run([install.python, str(script), install.path, "1" if flag else "0"], capture_output=True,
                          text=True, timeout=600, env=subprocess_env(), check=False, cwd=str(tmp_path))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_comfyui_started_with_pinned_memory_disabled_means_the_pack_pins_nothing(comfyui, tmp_path):
    install = require_comfyui(comfyui)
    run = _run(install, tmp_path, flag=True)
    if not run["knows_flag"]:
        pytest.skip(f"{install} has no --disable-pinned-memory")
    assert run["budget"] == "callable" and run["refuses_one_byte"], run
    assert run["pool_pins"] == 0 and run["pool_pinned_bytes"] == 0, "the buffer pool pinned nothing"
    assert run["upload_pins"] == 0 and run["upload_ok"], "upload copied without pinning"


def test_without_the_flag_the_pack_pins_as_comfyui_allows(comfyui, tmp_path):
    run = _run(require_comfyui(comfyui), tmp_path, flag=False)
    assert run["upload_ok"], run
    if run["budget"] is None:  # a ComfyUI without a pinned-memory budget: nothing limits the pack's pins
        assert run["pool_pins"] == 3 and run["upload_pins"] == 1, run
    else:  # ComfyUI's budget decides (it refuses when the host is short of memory)
        assert run["pool_pinned_bytes"] == 4096 * run["pool_pins"], run
