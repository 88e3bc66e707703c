"""Data-parallel training and parallel encoding through real ComfyUI, headless under torchrun (see
tests/comfy/test_distributed_workflow.py); prints one JSON line of results.

    python ddp_scenario.py COMFYUI_PATH WORKDIR

Runs the demo workflow (encode a folder, train a LoRA) twice with the same seed: on one process with batch size
2, and on two processes (gloo) with batch size 1 each. Compares the LoRAs and the caches the two runs made, and
reports what each rank's nodes said.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file
from values import lora_difference

HEADLESS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                        "headless.py")
TRAIN_NODE = "3"  # Train LoRA in example_workflows/Train a LoRA from an image folder.json
STEPS = 6


def run(comfyui: str, base: str, processes: int, batch: int) -> tuple[subprocess.CompletedProcess, float]:
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    cmd = [*launcher, HEADLESS, "--comfyui", comfyui, "--demo", base, "--set", f"{TRAIN_NODE}.steps={STEPS}",
           "--set", f"{TRAIN_NODE}.batch_size={batch}"]
    env = dict(os.environ, STREAMING_CACHE_COLLECTIVE_TIMEOUT="300", OMP_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    return proc, time.perf_counter() - started


def cache_values(base: str) -> dict:
    """The demo cache's entries (key -> flat list of its tensors) and its dataset rows."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HEADLESS)))
    import streaming_cache as sc
    from streaming_cache.loader import _tensors

    index = glob.glob(os.path.join(base, "**", "index.scc"), recursive=True)
    assert len(index) == 1, index
    with sc.open_cache(os.path.dirname(index[0])) as reader:
        rows = {r.name: r.keys for r in sc.Manifest.from_json(reader.manifest_bytes("default"), "").rows}
        values = {k: list(_tensors(reader[k].materialize())) for k in reader.keys()}
    return {"rows": rows, "values": values, "path": os.path.dirname(index[0])}


def compare_caches(one: str, other: str) -> dict:
    """The demo caches under two base directories: same rows, same keys, the largest difference of their values
    (-1 when no key is shared), and the ranks' parts left in the second (merged parts are removed)."""
    caches = [cache_values(one), cache_values(other)]
    return {"cache_rows_equal": caches[0]["rows"] == caches[1]["rows"],
            "cache_keys_equal": sorted(caches[0]["values"]) == sorted(caches[1]["values"]),
            "cache_largest_difference": max(
                (float((a.float() - b.float()).abs().max()) for k in caches[0]["values"] if k in caches[1]["values"]
                 for a, b in zip(caches[0]["values"][k], caches[1]["values"][k])), default=-1.0),
            "parts_left": glob.glob(os.path.join(caches[1]["path"], "parts", "*"))}


def main() -> None:
    comfyui, work = sys.argv[1], sys.argv[2]
    out: dict = {}
    one, out["one_seconds"] = run(comfyui, os.path.join(work, "one"), 1, 2)
    two, out["two_seconds"] = run(comfyui, os.path.join(work, "two"), 2, 1)
    out["one_ok"], out["two_ok"] = one.returncode == 0, two.returncode == 0
    if not (out["one_ok"] and out["two_ok"]):
        out["errors"] = [one.stdout[-3000:] + one.stderr[-3000:], two.stdout[-3000:] + two.stderr[-5000:]]
        print("RESULT " + json.dumps(out), flush=True)
        return
    loras = [load_file(os.path.join(work, run_dir, "models", "loras", "demo_lora.safetensors"))
             for run_dir in ("one", "two")]
    out["lora"] = lora_difference(loras[0], loras[1])
    out["summaries_two"] = [line for line in two.stdout.splitlines() if "trained" in line or "rank 1 of 2" in line
                            or "encoded" in line]
    out["rank1_said"] = "rank 1 of 2" in two.stdout + two.stderr
    out.update(compare_caches(os.path.join(work, "one"), os.path.join(work, "two")))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
