"""Data-parallel scaling benchmark: samples per second on 1..N processes, and how much of a step waits on the
gradient all-reduce.

A LoRA-shaped model (frozen ``width`` x ``width`` linear layers, ``depth`` of them, each with a rank-``rank``
adapter that trains) learns from a cache of latents through the real trainer (:func:`~..train.backend.train_with`:
the streaming loader, per-sample draws, the bucketed gradient sum). For each process count the benchmark launches
torchrun (``torch.distributed.run --standalone``) on this machine, every process on its own GPU (NCCL), or on the
CPU with one thread each (gloo) without CUDA, and times ``--steps`` steps after ``--warmup``. It prints, measured
in this one run:

* samples/s for each process count, and its ratio to that many times the one-process figure (1.0 = linear);
* the all-reduce's share of a step: the time a step waits for the gradient sum (what the backward pass did not
  hide) and the loss and stop sums, over the step time.

Each process trains ``--batch-size`` samples per step, as a real multi-GPU run does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..dataset import DatasetHandle
from ..group import init_from_env, leave
from ..train.backend import train_with
from ..train.draws import Draws
from ..train.loop import TrainHooks
from ..train.spec import TrainSpec
from ..writer import CacheWriter
from . import benchmark_main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", default="", help="process counts to time, e.g. 1,2,4 (default: 1 and every GPU, "
                                                  "or 1 and 2 on the CPU)")
    p.add_argument("--width", type=int, default=1024, help="width of the frozen layers")
    p.add_argument("--depth", type=int, default=8, help="number of layers")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--batch-size", type=int, default=8, help="samples per process per step")
    p.add_argument("--rows", type=int, default=512, help="samples in the synthetic dataset")
    p.add_argument("--steps", type=int, default=30, help="steps timed per process count")
    p.add_argument("--warmup", type=int, default=5, help="steps run before timing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


class LoraMLP:
    """The trainer's backend: ``x -> relu(W_i x + B_i A_i x)`` for each layer, the loss the MSE between the last
    layer's output and per-sample noise (drawn from the sample's generator)."""

    def __init__(self, width: int, depth: int, rank: int, device: torch.device):
        g = torch.Generator().manual_seed(0)
        self.device = device
        self.base = [(torch.randn(width, width, generator=g) / width ** 0.5).to(device) for _ in range(depth)]
        self.params: dict[str, torch.Tensor] = {}
        for i in range(depth):
            self.params[f"layer{i}.lora_down"] = (torch.randn(rank, width, generator=g) * 0.01).to(device) \
                .requires_grad_()
            self.params[f"layer{i}.lora_up"] = torch.zeros(width, rank, device=device, requires_grad=True)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.params

    def loss(self, batch: Any, draws: Draws, *, t: float | None = None) -> torch.Tensor:
        x = batch.to(self.device, torch.float32)
        target, _ = draws.randn((x.shape[1],), x.shape[0])
        for i, w in enumerate(self.base):
            down, up = self.params[f"layer{i}.lora_down"], self.params[f"layer{i}.lora_up"]
            x = torch.relu(x @ w.T + (x @ down.T) @ up.T)
        return torch.nn.functional.mse_loss(x, target.to(self.device))

    def run(self, work: Callable[[torch.device], Any]) -> Any:
        return work(self.device)


def _worker(args: argparse.Namespace) -> None:
    """One process of a timed run (under torchrun); rank 0 prints the figures as JSON."""
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    group = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    backend = LoraMLP(args.width, args.depth, args.rank, device)
    dataset = DatasetHandle.from_cache(args.worker)
    times: list[float] = []
    spec = TrainSpec.build({"steps": args.warmup + args.steps, "learning_rate": 1e-3, "batch_size": args.batch_size,
                            "optimizer": "AdamW", "workers": 2, "max_grad_norm": 0.0})
    result = train_with(backend, dataset, spec, group=group,
                        hooks=TrainHooks(on_step=lambda step, loss: times.append(time.perf_counter()),
                                         report_seconds=0.0))  # each step timed when it ends
    if group is None or group.is_main:
        first = max(args.warmup, 1)  # the step before the first timed one ends where timing starts
        seconds = times[-1] - times[first - 1]
        steps = len(times) - first
        world = group.world_size if group else 1
        waited = sum(result.sync_waits[first:])
        print("RESULT " + json.dumps({"processes": world, "step_s": seconds / steps,
                                      "samples_per_s": steps * args.batch_size * world / seconds,
                                      "allreduce_share": waited / seconds,
                                      "lora_mb": sum(p.numel() * 4 for p in backend.params.values()) / 1e6,
                                      "device": str(device)}), flush=True)
    if group is not None:
        leave(finished=True)


def _counts(args: argparse.Namespace) -> list[int]:
    if args.processes:
        return sorted({int(c) for c in args.processes.split(",")})
    gpus = torch.cuda.device_count()
    return [1, gpus] if gpus > 1 else [1, 2]


def run(args: argparse.Namespace, out: Callable[..., None] = print) -> dict[str, Any]:
    workdir = args.path or tempfile.mkdtemp(prefix="streaming-cache-bench-scaling-")
    cache = os.path.join(workdir, "scaling-cache")
    try:
        shutil.rmtree(cache, ignore_errors=True)
        g = torch.Generator().manual_seed(1)
        with CacheWriter(cache) as w:
            for i in range(args.rows):
                w.put(f"row{i}", torch.randn(args.width, generator=g).to(torch.float16))
        where = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else \
            f"the CPU ({os.cpu_count()} cores, one thread per process, gloo)"
        out(f"LoRA MLP: {args.depth} layers of {args.width}, rank {args.rank}; batch {args.batch_size} per process; "
            f"{args.steps} steps timed after {args.warmup}; on {where}")
        rows: list[dict[str, Any]] = []
        for n in _counts(args):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m",
                   "streaming_cache.devtools.bench_scaling", "--worker", cache, *_forwarded(args)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                  timeout=3600)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"the run on {n} processes failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            rows.append(json.loads(lines[-1][len("RESULT "):]))
        single = next((r["samples_per_s"] for r in rows if r["processes"] == 1), None)
        out(f"{'processes':>9}{'samples/s':>12}{'vs N x 1':>10}{'step ms':>10}{'all-reduce':>12}")
        for r in rows:
            r["vs_linear"] = r["samples_per_s"] / (single * r["processes"]) if single else None
            ratio = f"{r['vs_linear']:.2f}x" if r["vs_linear"] is not None else "-"
            out(f"{r['processes']:>9}{r['samples_per_s']:>12.1f}{ratio:>10}{r['step_s'] * 1000:>10.1f}"
                f"{r['allreduce_share']:>12.1%}")
        out(f"(LoRA gradients: {rows[0]['lora_mb']:.1f} MB per step; all-reduce: share of the step spent waiting "
            "for the gradient sum and the loss and stop sums)")
        return {"runs": rows}
    finally:
        if not args.path:
            shutil.rmtree(workdir, ignore_errors=True)


def _forwarded(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("width", "depth", "rank", "batch_size", "steps",
                                                                     "warmup")]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.startswith("--worker") for a in argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        _worker(p.parse_args(argv))
        return 0
    return benchmark_main("bench-scaling", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
