"""Two nodes the way people launch them, on this machine (see tests/comfy/test_distributed_workflow.py); prints one
JSON line of results.

    python multinode_scenario.py COMFYUI_PATH WORKDIR

Each "node" is its own ``torchrun --nnodes 2 --nproc-per-node 1`` launcher with a c10d rendezvous, started in its
own working folder; the ComfyUI base directory (models, the dataset and the cache) is one folder both see, as
shared storage is on two machines. Runs the demo workflow with the same seed:

- ``one``: one process, batch size 2 (the reference);
- ``nodes``: two nodes, batch size 1 each;
- ``killed``: two nodes again in a fresh base directory, saving every 2 steps; once the first save is on disk the
  second node's launcher and its worker are killed (SIGKILL), then both launchers are started again and resume.

Reports the LoRA differences (``values.lora_difference``), the caches, and what each launch said.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
from ddp_scenario import HEADLESS, TRAIN_NODE, compare_caches
from safetensors.torch import load_file
from values import lora_difference

STEPS = 24
SAVE_EVERY = 2
ENV = dict(os.environ, STREAMING_CACHE_COLLECTIVE_TIMEOUT="120", OMP_NUM_THREADS="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(comfyui: str, base: str, batch: int, launcher: list[str]) -> list[str]:
    return [*launcher, HEADLESS, "--comfyui", comfyui, "--demo", base, "--set", f"{TRAIN_NODE}.steps={STEPS}",
            "--set", f"{TRAIN_NODE}.batch_size={batch}", "--set", f"{TRAIN_NODE}.save_every={SAVE_EVERY}"]


def start_nodes(comfyui: str, base: str, work: str, tag: str) -> list[subprocess.Popen]:
    """Two launchers, each in its own working folder, meeting at one rendezvous endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in range(2):
        cwd = os.path.join(work, f"{tag}-node{node}")
        os.makedirs(cwd, exist_ok=True)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"streaming-cache-{tag}",
                    "--max-restarts", "0"]
        with open(os.path.join(cwd, "stdout.txt"), "w") as out, open(os.path.join(cwd, "stderr.txt"), "w") as err:
            procs.append(subprocess.Popen(command(comfyui, base, 1, launcher), cwd=cwd, env=ENV, stdout=out,
                                          stderr=err))
    return procs


def said(work: str, tag: str) -> list[str]:
    return [open(os.path.join(work, f"{tag}-node{n}", name), encoding="utf-8", errors="replace").read()
            for n in range(2) for name in ("stdout.txt", "stderr.txt")]


def kill_node(pid: int) -> None:
    """SIGKILL a launcher and every process under it, as a machine that dies (torch's launcher starts each worker
    in a session of its own, so killing the launcher's process group would leave the worker training)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in reversed(tree):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(procs: list[subprocess.Popen], timeout: float = 900) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_node(p.pid)
            codes.append(p.wait())
    return codes


def lora(base: str) -> dict:
    return load_file(os.path.join(base, "models", "loras", "demo_lora.safetensors"))


def main() -> None:
    comfyui, work = sys.argv[1], sys.argv[2]
    out: dict = {}
    one = subprocess.run(command(comfyui, os.path.join(work, "one"), 2, [sys.executable]), capture_output=True,
                         text=True, timeout=900, env=ENV)
    out["one_ok"] = one.returncode == 0

    base = os.path.join(work, "nodes")
    out["nodes_codes"] = finish(start_nodes(comfyui, base, work, "nodes"))
    nodes_said = said(work, "nodes")
    out["nodes_said"] = [line for text in nodes_said for line in text.splitlines()
                         if "trained demo_lora" in line or "encoded" in line or "rank 1 of 2" in line]
    out["errors"] = [] if out["one_ok"] and out["nodes_codes"] == [0, 0] else \
        [one.stdout[-2000:] + one.stderr[-3000:], *(t[-3000:] for t in nodes_said)]
    if out["errors"]:
        print("RESULT " + json.dumps(out), flush=True)
        return
    out["lora"] = lora_difference(lora(os.path.join(work, "one")), lora(base))
    out.update(compare_caches(os.path.join(work, "one"), base))

    killed = os.path.join(work, "killed")
    state = os.path.join(killed, "output", "lora_training", "demo_lora.state.pt")
    procs = start_nodes(comfyui, killed, work, "killed")
    deadline = time.monotonic() + 900
    while not os.path.exists(state) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    out["killed_after_a_save"] = os.path.exists(state)
    kill_node(procs[1].pid)
    out["killed_codes"] = finish(procs, 300)
    out["killed_said"] = [line for text in said(work, "killed") for line in text.splitlines() if "demo_lora" in line]
    procs = start_nodes(comfyui, killed, work, "resumed")
    out["resumed_codes"] = finish(procs)
    resumed_said = said(work, "resumed")
    out["resumed_said"] = [line for text in resumed_said for line in text.splitlines() if "demo_lora" in line]
    if out["resumed_codes"] != [0, 0]:
        out["errors"] = [t[-3000:] for t in resumed_said]
    else:
        out["resumed_lora"] = lora_difference(lora(base), lora(killed))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
