"""Peak GPU memory, step time and the chip's share of Train LoRA (streaming cache) against ComfyUI's own
TrainLoraNode, on real-size random-weight models, each configuration in a process of its own.

    python scripts/bench_memory.py [--comfyui PATH] [--model sdxl|flux] [--steps 8] [--resolution 1024] [--json]
    python scripts/bench_memory.py --tiny          # small models at 64 px: checks the script itself, anywhere
    python scripts/bench_memory.py --profile DIR   # also a torch.profiler table of two steps per configuration
    python scripts/bench_memory.py --narrow --count-ops --only comfyui,streaming_eager   # ATen ops per step

Run it with ComfyUI's Python (the newest ComfyUI: the one with offloading and bypass mode), from any folder. The
model is built with ComfyUI's own classes at its published size (SDXL's UNet, 2.6 B parameters; Flux dev, 11.9 B),
filled with random weights, saved once and loaded by Load Diffusion Model in every configuration, so detection,
dtypes and loading are what a user gets. Both trainers run through ComfyUI's executor on the same data (batch 1,
rank 16, AdamW, bf16, gradient checkpointing, the same number of steps) in these configurations:

* ``comfyui``: TrainLoraNode; ``streaming``: Train LoRA with the same settings (its steps replayed from CUDA graphs
  on a CUDA GPU, its default);
* ``streaming_eager``: Train LoRA without CUDA graphs (``STREAMING_CACHE_CUDA_GRAPHS=0``); the report gives the
  cosine between ``streaming``'s LoRA and this one's (the same training, so near 1);
* ``streaming_no_checkpointing`` / ``streaming_eager_no_checkpointing``: the same two without gradient checkpointing
  (no recomputation, more memory);
* ``streaming_half_recomputed``: Train LoRA with half of the blocks recomputed (``checkpoint_share`` 0.5);
* ``streaming_wrapped``: Train LoRA with its layers run through ComfyUI's weight wrappers (``STREAMING_CACHE_FUSED_LORA
  =0``), to show what the fused layers change;
* ``streaming_compiled``: Train LoRA with its blocks compiled (``STREAMING_CACHE_COMPILE=blocks``); its first steps
  include the compilation, which the median step leaves out;
* ``comfyui_offloading`` / ``streaming_offloading``: the frozen model partly kept on the CPU;
* ``comfyui_fp8_bypass`` / ``streaming_fp8_bypass``: the model loaded with fp8 (e4m3fn) weights, bypass mode;
* ``streaming_auto``: Train LoRA with Memory & Precision's ``plan`` ``auto`` (the other configurations are
  ``manual``: their settings as named); its report has the summary's ``memory plan`` line, with the estimate to
  set beside the measured peak. ``streaming_auto_24gib``: the same within 24 GiB
  (``torch.cuda.set_per_process_memory_fraction``, and the plan told so), as on a 24 GiB GPU; ``--memory-cap GIB``
  runs every configuration so.
* ``streaming_graphs_emulated``: Train LoRA with CUDA graphs, the device's paths emulated on the CPU
  (``STREAMING_CACHE_EMULATE_DEVICE=1``): with ``--count-ops``, the launches of a replayed step on the CPU (each
  replay of a recorded pass counts as one launch, the operations it replays do not).

Each configuration runs in a fresh process (ComfyUI booted anew, the model loaded anew), so its peak memory and
speed do not depend on what ran before it, and a first-training-after-start failure shows as one (TrainLoraNode has
one on Hopper GPUs, which the benchmark sidesteps with one attention call before it: see ``worker``). Peak memory is
``torch.cuda.max_memory_allocated`` over the whole node run (model load included; the JSON adds the peak up to the
first optimizer step, the peak of the steps after it alone, which is what ``scripts/estimate_memory.py`` estimates,
and the peak reserved by the allocator, which includes what CUDA graphs keep for their replays); step time is the
median interval between optimizer steps after two warm-up steps, timed where each trainer takes them (torch's global
optimizer-step hook sees both). Ratios are against ``comfyui`` from the same run. The chip's share is the work of a
step over its time and the chip's dense bf16 rate: the work is three times the model's forward FLOPs at this size
(counted with torch's FlopCounterMode on the meta device: the forward pass, its recomputation under gradient
checkpointing, and the input gradients of the backward pass; the base weights are frozen, and the adapters' own
products are under 1 %), twice without checkpointing. Without CUDA only times are reported.

``--count-ops`` counts the ATen operations each optimizer step dispatches (a ``TorchDispatchMode`` on the thread
that trains, between torch's global optimizer-step hooks: the forward pass, the backward pass and the optimizer,
each counted apart), which on a GPU are its kernel launches: a count does not depend on the width of the layers, so
``--narrow`` (the published depth at a narrow width: Flux dev's 19 + 38 blocks at 128; SDXL stays at its published
size, the only one ComfyUI's detection knows it at) gives a GPU's launch count anywhere, on the CPU. Views,
allocations and reads to the host launch no kernel and are not counted (host reads are counted apart). On the CPU,
torch's AdamW loops over the parameters (``foreach`` is for CUDA tensors), so the optimizer's count there stands for
a loop a GPU runs in a few launches: the forward and backward passes are what compares. Counted on the CPU, the
model's weights are stored in bf16 (``--bf16-unet``), as on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # headless.py beside it; the pack's engine (build_cache)
import headless  # noqa: E402

TINY = {"sdxl": dict(num_res_blocks=[1, 1, 1], transformer_depth=[0, 2, 5],  # KOALA-700M, detected as SDXL
                     transformer_depth_output=[0, 0, 2, 2, 5, 5], transformer_depth_middle=-2),
        "flux": dict(hidden_size=128, num_heads=1, depth=1, depth_single_blocks=1)}
"""What ``--tiny`` changes in the published configurations (``memory_estimate.FAMILIES``)."""
NARROW = {"sdxl": {},  # detection knows SDXL at its published 320 channels only: the published model
          "flux": dict(hidden_size=128, num_heads=1)}  # detection reads the width and makes a head of 128
"""What ``--narrow`` changes: the width only, every block kept (launch counts at the published depth)."""
SIZES = {"tiny": TINY, "narrow": NARROW}
OBJECTS: dict[str, Any] = {}
MODEL_FILE = "bench_random.safetensors"


class BenchSource:
    """Hands the latents and conditioning to ComfyUI's trainer inside the executor."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"key": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("LATENT", "CONDITIONING")
    FUNCTION = "get"
    CATEGORY = "benchmark"

    def get(self, key: str):
        return OBJECTS[key]


class StepClock:
    """The time of every optimizer step taken while it is open (torch's global optimizer-step hook: every
    trainer's optimizer, whatever it reports to ComfyUI's progress bar).

    The host queues a step and goes on: Train LoRA reads its losses only every few steps, so the host's times
    run ahead of the device's. On CUDA the clock waits for the device at step ``warmup`` and at step ``last``
    (two waits in the run, none between them), and :meth:`step_seconds` is the mean time of the steps
    between."""

    def __init__(self, warmup: int = 2, last: int | None = None) -> None:
        self.warmup, self.last = warmup, last
        self.times: list[float] = []
        self.first_peak: int | None = None  # CUDA: the peak up to the first optimizer step (model load included)

    def __enter__(self) -> StepClock:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: self._stepped())
        return self

    def _stepped(self) -> None:
        import torch

        if torch.cuda.is_available() and len(self.times) + 1 in (self.warmup, self.last):
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and torch.cuda.is_available():
            self.first_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()  # from here on: the steps' own peak

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()

    def step_seconds(self) -> float | None:
        """The mean time of the steps after step ``warmup`` to step ``last`` where the run took them all, else
        the median interval between the steps after ``warmup`` (None with fewer than two)."""
        if self.last is not None and len(self.times) >= self.last > self.warmup >= 1:
            return (self.times[self.last - 1] - self.times[self.warmup - 1]) / (self.last - self.warmup)
        timed = self.times[self.warmup:]
        gaps = [b - a for a, b in zip(timed, timed[1:])]
        return statistics.median(gaps) if gaps else None


def _family(kind: str, size: str) -> tuple[Any, dict]:
    """ComfyUI's model config class of ``kind`` and the config that builds it at its published size (the memory
    estimate's, ``nodes/backend/memory_estimate.py``), or with the changes of ``size`` (:data:`SIZES`)."""
    family = headless.pack_module("backend.memory_estimate").FAMILIES["sdxl" if kind == "sdxl" else "flux-dev"]
    config = family.config()
    config.update(SIZES.get(size, {}).get(kind, {}))
    return family.config_class(), config


def write_model(kind: str, size: str, path: str) -> int:
    """A ``kind`` diffusion model at its real size (or tiny) with random bf16 weights, saved where Load
    Diffusion Model finds it (so both trainers load it as users do); returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    family, config = _family(kind, size)
    shapes = family(config).get_model({}, device="meta").state_dict()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for k, v in shapes.items():
        if k.startswith("diffusion_model."):
            t = torch.empty(v.shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=g)
            sd[k[len("diffusion_model."):]] = t.cpu()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path)
    return sum(t.numel() for t in sd.values())


def forward_flops(kind: str, size: str, resolution: int) -> float:
    """FLOPs of one forward pass of the model at ``resolution``, batch 1, with the benchmark's conditioning,
    counted by torch's FlopCounterMode on the meta device (no memory, no device time). ComfyUI's attention reads
    free memory to pick its chunks, which the meta device has none of: it is told there is plenty (one chunk)."""
    import comfy.model_management
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    family, config = _family(kind, size)
    model = family(config).get_model({}, device="meta").diffusion_model
    side = resolution // 8
    with torch.device("meta"):
        if kind == "sdxl":
            inputs = dict(x=torch.empty(1, 4, side, side), timesteps=torch.empty(1),
                          context=torch.empty(1, 77, 2048), y=torch.empty(1, config["adm_in_channels"]))
        else:
            inputs = dict(x=torch.empty(1, 16, side, side), timestep=torch.empty(1),
                          context=torch.empty(1, 256, config["context_in_dim"]), y=torch.empty(1, config["vec_in_dim"]),
                          guidance=torch.empty(1))
    original = comfy.model_management.get_free_memory
    comfy.model_management.get_free_memory = lambda dev=None, torch_free_too=False: \
        (1 << 50, 1 << 50) if torch_free_too else 1 << 50
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(**inputs)
    finally:
        comfy.model_management.get_free_memory = original
    return float(counter.get_total_flops())


def data(kind: str, resolution: int, samples: int) -> tuple[dict, list]:
    """Latents and one conditioning of the shapes the family's VAE and text encoders give."""
    import torch

    g = torch.Generator().manual_seed(1)
    side = resolution // 8
    if kind == "sdxl":
        latent = torch.randn(samples, 4, side, side, generator=g)
        cond = [[torch.randn(1, 77, 2048, generator=g),
                 {"pooled_output": torch.randn(1, 1280, generator=g), "width": resolution, "height": resolution,
                  "crop_w": 0, "crop_h": 0, "target_width": resolution, "target_height": resolution}]]
    else:
        latent = torch.randn(samples, 16, side, side, generator=g)
        cond = [[torch.randn(1, 256, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g),
                                                           "guidance": 1.0}]]
    return {"samples": latent}, cond


def build_cache(name: str, latent: dict, cond: list) -> None:
    import folder_paths

    import streaming_cache as sc

    samples = latent["samples"]
    items = [sc.Item(f"s{i}", {"latent": sc.Part(data=f"l{i}".encode()), "cond": sc.Part(data=b"c")})
             for i in range(samples.shape[0])]
    encoders = {"latent": sc.Encoder("bench-vae", lambda parts: [{"samples": samples[int(p.data[1:]):][:1]}
                                                                  for p in parts]),
                "cond": sc.Encoder("bench-te", lambda parts: [cond for _ in parts])}
    sc.build(os.path.join(folder_paths.get_output_directory(), "streaming_caches", name), items, encoders)


CONFIGS: dict[str, tuple[str, bool, bool, dict[str, str]]] = {
    # name: (trainer, fp8 + bypass, offloading, environment)
    "comfyui": ("comfyui", False, False, {}),
    "streaming": ("streaming", False, False, {}),
    "streaming_eager": ("streaming", False, False, {"STREAMING_CACHE_CUDA_GRAPHS": "0"}),
    "streaming_no_checkpointing": ("streaming", False, False, {}),
    "streaming_eager_no_checkpointing": ("streaming", False, False, {"STREAMING_CACHE_CUDA_GRAPHS": "0"}),
    "streaming_half_recomputed": ("streaming", False, False, {}),
    "streaming_wrapped": ("streaming", False, False, {"STREAMING_CACHE_FUSED_LORA": "0"}),
    "streaming_compiled": ("streaming", False, False, {"STREAMING_CACHE_COMPILE": "blocks"}),
    "comfyui_offloading": ("comfyui", False, True, {}),
    "streaming_offloading": ("streaming", False, True, {}),
    "comfyui_fp8_bypass": ("comfyui", True, False, {}),
    "streaming_fp8_bypass": ("streaming", True, False, {}),
    "streaming_auto": ("streaming", False, False, {}),
    "streaming_auto_24gib": ("streaming", False, False, {"BENCH_MEMORY_CAP_GIB": "24"}),
    "streaming_graphs_emulated": ("streaming", False, False, {"STREAMING_CACHE_EMULATE_DEVICE": "1"}),
}
AGREEMENT = {"streaming": "streaming_eager", "streaming_no_checkpointing": "streaming_eager_no_checkpointing"}
"""Configurations whose LoRA must be the one another configuration trains (the same steps, replayed from CUDA
graphs and run eagerly): the report gives the cosine between their trained tensors."""


def checkpointing(name: str) -> bool:
    return not name.endswith("_no_checkpointing")


def recomputed_share(name: str) -> float:
    """The share of the blocks recomputed in the backward pass (Train LoRA's ``checkpoint_share``)."""
    return 0.0 if not checkpointing(name) else 0.5 if name.endswith("_half_recomputed") else 1.0


PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,
                    "A100": 312.0, "L40S": 362.0, "RTX 4090": 165.0, "RTX 3090": 71.0}
"""Dense bf16 rates (TFLOP/s) from the vendors' datasheets, matched against the device name (first match wins,
so more specific names come first)."""


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def prompt_for(trainer: str, name: str, steps: int, fp8_bypass: bool, offloading: bool) -> dict:
    common = dict(steps=steps, batch_size=1, learning_rate=1e-4, rank=16, optimizer="AdamW", loss_function="MSE",
                  seed=0, training_dtype="bf16", lora_dtype="bf16", algorithm="LoRA",
                  gradient_checkpointing=checkpointing(name),
                  existing_lora="[None]", bypass_mode=fp8_bypass, offloading=offloading, checkpoint_depth=1)
    prompt: dict = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILE,
                                                                 "weight_dtype": "fp8_e4m3fn" if fp8_bypass
                                                                 else "default"}}}
    if trainer == "comfyui":
        prompt["5"] = {"class_type": "BenchSource", "inputs": {"key": "data"}}
        inputs = dict(headless.node_defaults("TrainLoraNode"), **common, grad_accumulation_steps=1,
                      quantized_backward=False, bucket_mode=False)
        inputs.update(model=["1", 0], latents=["5", 0], positive=["5", 1])
        prompt["2"] = {"class_type": "TrainLoraNode", "inputs": inputs}
        prompt["3"] = {"class_type": "SaveLoRA", "inputs": {"lora": ["2", 0], "prefix": f"loras/bench_{name}"}}
    else:
        import nodes

        prompt["4"] = {"class_type": "StreamingCacheLoad", "inputs": {"cache_name": "bench", "dataset_name": "default",
                                                                      "repeats": True}}
        prompt.update(headless.train_nodes(nodes.NODE_CLASS_MAPPINGS, ["1", 0], ["4", 0],
                                           dict(common, lora_name=f"bench_{name}", resume=False,
                                                checkpoint_share=recomputed_share(name) or 1.0,
                                                plan="auto" if name.startswith("streaming_auto") else "manual"),
                                           prefix="2")[0])
    return prompt


class StepProfile:
    """torch.profiler over two optimizer steps (the third and fourth), summarised: kernel time on the device
    against the steps' wall time, kernel launches and host waits for the device per step, and the ops that take
    the most device and host time."""

    def __init__(self, first: int = 3, steps: int = 2):
        self.first, self.steps, self.count = first, steps, 0
        self.profiler: Any = None
        self.wall: list[float] = []

    def __enter__(self) -> StepProfile:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.count += 1
            if self.count == self.first:
                self.profiler.start()
                self.wall.append(time.perf_counter())
            elif self.count == self.first + self.steps:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.wall.append(time.perf_counter())
                self.profiler.stop()

        self.handle = register_optimizer_step_post_hook(hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()

    def summary(self, path: str | None) -> dict | None:
        if len(self.wall) < 2:
            return None
        events = self.profiler.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events
                       if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
        waits = [e for e in events if e.key in ("cudaStreamSynchronize", "cudaEventSynchronize")]
        wall = (self.wall[1] - self.wall[0]) / self.steps
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(events.table(sort_by="self_device_time_total", row_limit=40) + "\n")
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        return {"step_wall_s": round(wall, 4), "kernel_s": round(kernel_us / 1e6 / self.steps, 4),
                "kernel_share": round(kernel_us / 1e6 / self.steps / wall, 3) if wall > 0 else None,
                "launches": launches // self.steps,
                # the host waiting for the device: each wait keeps the host from preparing the next step meanwhile
                "host_waits": sum(e.count for e in waits) // self.steps,
                "host_wait_s": round(sum(e.cpu_time_total for e in waits) / 1e6 / self.steps, 4)}


class OpCount:
    """The ATen operations each optimizer step dispatches on this thread, by pass: ``backward`` (inside autograd's
    backward pass), ``optimizer`` (between torch's global optimizer-step hooks) and ``forward`` (the rest: the
    forward pass, noise, loss, casts); views, allocations and host reads are left out (they launch no kernel:
    ``streaming_cache.train.launches.is_launch``) and host reads (``.item()``, ``bool()`` of a tensor) counted
    apart, by pass. The most frequent ops are those of the model's passes (the optimizer's on the CPU are not a
    GPU's). The mode is entered before the run and counts until it leaves; a step is what happens between two
    post-step hooks."""

    def __init__(self, warmup: int = 2, top: int = 12):
        self.warmup, self.top = warmup, top
        self.steps: list[dict[str, Any]] = []
        self.current: dict[str, Any] = self._fresh()
        self.in_optimizer = False
        self.replaying = 0

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"forward": 0, "backward": 0, "optimizer": 0, "ops": {}, "graph_replays": 0,
                "host_reads": {"forward": 0, "backward": 0, "optimizer": 0}}

    def __enter__(self) -> OpCount:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils._python_dispatch import TorchDispatchMode

        from streaming_cache.train import launches

        self.launches = launches

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter._count(func, torch._C._current_graph_task_id() != -1)
                return func(*args, **(kwargs or {}))

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.in_optimizer = True

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.in_optimizer = False
            self.steps.append(self.current)
            self.current = self._fresh()

        self.handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def replays(self, replay: Callable[..., Any]) -> Callable[..., Any]:
        """``replay`` (a recorded graph's, emulated on the CPU) counted as what a GPU launches for it: one launch,
        in the pass it runs in, and none of the operations the emulation runs to stand for the graph's kernels."""
        import torch

        def counted(*args: Any, **kwargs: Any) -> Any:
            where = "optimizer" if self.in_optimizer else \
                "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.current[where] += 1
            self.current["graph_replays"] += 1
            self.replaying += 1
            try:
                return replay(*args, **kwargs)
            finally:
                self.replaying -= 1

        return counted

    def _count(self, func: Any, in_backward: bool) -> None:
        if self.replaying:
            return
        name = func.overloadpacket.__name__
        where = "optimizer" if self.in_optimizer else "backward" if in_backward else "forward"
        if name == self.launches.HOST_READ:
            self.current["host_reads"][where] += 1
        if not self.launches.is_launch(func):
            return
        self.current[where] += 1
        if where != "optimizer":
            ops = self.current["ops"]
            ops[name] = ops.get(name, 0) + 1

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    def summary(self) -> dict[str, Any] | None:
        """The median step after ``warmup`` steps: its ops by pass, its host reads and its most frequent ops (None
        with no step counted after the warm-up)."""
        steps = self.steps[self.warmup:]
        if not steps:
            return None
        total = [s["forward"] + s["backward"] + s["optimizer"] for s in steps]
        step = steps[sorted(range(len(steps)), key=total.__getitem__)[len(steps) // 2]]
        top = sorted(step["ops"].items(), key=lambda kv: -kv[1])[:self.top]
        return {"per_step": step["forward"] + step["backward"] + step["optimizer"],
                "model_passes": step["forward"] + step["backward"], "forward": step["forward"],
                "backward": step["backward"], "optimizer": step["optimizer"], "host_reads": step["host_reads"],
                "graph_replays": step["graph_replays"],
                "steps_counted": len(steps), "top": top}


def worker(args: argparse.Namespace) -> int:
    """One configuration in this process: boot ComfyUI on the prepared folder, train, print one RESULT line."""
    import torch

    # on the CPU ComfyUI keeps a model's weights in fp32, and each layer would cast them to bf16 at every call,
    # which a GPU (weights stored in bf16) does not: counted, the weights are stored as on a GPU
    stored = ["--bf16-unet"] if args.count_ops and not torch.cuda.is_available() else []
    server = headless.boot(headless.find_comfyui(args.comfyui), ["--base-directory", args.workdir, *stored],
                           quiet=True)
    import comfy.model_management

    import nodes

    nodes.NODE_CLASS_MAPPINGS["BenchSource"] = BenchSource
    OBJECTS["data"] = data(args.model, args.resolution, samples=8)
    trainer, fp8, offloading, _ = CONFIGS[args.worker]
    prompt = prompt_for(trainer, args.worker, args.steps, fp8, offloading)
    cuda = torch.cuda.is_available()
    if cuda and trainer == "comfyui":
        # TrainLoraNode fails on the first training of a process on Hopper (PyTorch fixes its attention kernel
        # order at the first attention call, so the first checkpointed block recomputes with another kernel); one
        # attention call first, as Train LoRA makes itself, lets it be measured in a fresh process
        q = torch.zeros(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    cap = args.memory_cap or float(os.environ.get("BENCH_MEMORY_CAP_GIB") or 0)
    if cuda and cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
        # the plan reads the device's free memory, which the fraction does not change
        os.environ.setdefault("STREAMING_CACHE_DEVICE_MEMORY", f"{cap}GiB")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    profile = StepProfile() if args.profile else None
    ops = OpCount() if args.count_ops else None
    if ops is not None and args.worker == "streaming_graphs_emulated":
        # the pack's engine as ComfyUI loaded it (a custom node's package), not a copy imported from here
        for name, module in list(sys.modules.items()):
            if name.endswith("streaming_cache.train.graph_devices"):
                module._EmulatedGraph.replay = ops.replays(module._EmulatedGraph.replay)
    start = time.perf_counter()
    with StepClock(last=args.steps) as clock, profile or contextlib.nullcontext(), ops or contextlib.nullcontext():
        ok, history, error = headless.run(prompt, server, traceback=True)
    seconds = time.perf_counter() - start
    step = clock.step_seconds()
    result = {"ok": ok, "error": error, "seconds": round(seconds, 2), "step_seconds": step,
              "step_times": [round(b - a, 3) for a, b in zip(clock.times, clock.times[1:])],
              "samples_per_second": round(1.0 / step, 3) if step else None,
              "peak_gib": max(clock.first_peak or 0, torch.cuda.max_memory_allocated()) / 2**30 if cuda else None,
              # the steps after the first alone: what the memory estimate counts (docs/vram.md)
              "steps_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda and clock.first_peak else None,
              "first_step_peak_gib": clock.first_peak / 2**30 if clock.first_peak else None,
              # CUDA graphs keep their memory pool reserved while tensors in it count as freed
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
              "device": torch.cuda.get_device_name() if cuda else str(comfy.model_management.get_torch_device()),
              "lora": saved_lora(args.workdir, args.worker),
              "memory_plan": [line for line in _texts(history) if line.startswith("memory plan")]}
    graphed = [m for n, m in sys.modules.items() if n.endswith("streaming_cache.train.graphs")]
    if trainer == "streaming" and graphed and graphed[0].last_run:
        result["cuda_graphs"] = dict(graphed[0].last_run)
    if ops is not None:
        result["ops"] = ops.summary()
    if profile is not None:
        path = os.path.join(args.profile, f"profile_{args.model}_{args.worker}.txt")
        result["profile"] = profile.summary(path)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _texts(value: Any) -> list[str]:
    """Every line of text in a prompt's history result (the nodes' summaries)."""
    if isinstance(value, str):
        return value.splitlines()
    if isinstance(value, dict):
        return [line for v in value.values() for line in _texts(v)]
    if isinstance(value, (list, tuple)):
        return [line for v in value for line in _texts(v)]
    return []


def saved_lora(workdir: str, name: str) -> str | None:
    """The LoRA file configuration ``name`` saved (Train LoRA: ``bench_NAME``; SaveLoRA: ``bench_NAME_00001_``)."""
    found = [p for pattern in (f"bench_{name}.safetensors", f"bench_{name}_[0-9]*.safetensors")
             for p in glob.glob(os.path.join(workdir, "**", pattern), recursive=True)]
    return sorted(found)[-1] if found else None


def lora_agreement(path: str, reference: str) -> dict:
    """How close two LoRAs trained the same way are: the cosine between their up (B) tensors, which start at zero
    and hold what training did, and the norm of the difference relative to the reference's. A wrong gradient gives
    a cosine near 0; the kernels' own run-to-run differences (atomics in attention's backward pass) stay near 1."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(path), load_file(reference)
    keys = sorted(k for k in b if ("lora_up" in k or "lora_B" in k) and k in a)
    if not keys:
        return {"error": "no up tensors in common"}
    x = torch.cat([a[k].float().flatten() for k in keys])
    y = torch.cat([b[k].float().flatten() for k in keys])
    return {"tensors": len(keys), "cosine": round(float(torch.nn.functional.cosine_similarity(x, y, dim=0)), 5),
            "relative_difference": round(float((x - y).norm() / y.norm().clamp_min(1e-30)), 5)}


def prepare(args: argparse.Namespace) -> int:
    """Boot ComfyUI on the work folder, write the model and the cache, count the model's forward FLOPs."""
    headless.boot(headless.find_comfyui(args.comfyui), ["--base-directory", args.workdir], quiet=True)
    import folder_paths

    import nodes

    native = {name for name, _ in headless._widget_inputs(nodes.NODE_CLASS_MAPPINGS["TrainLoraNode"])}
    if not {"offloading", "bypass_mode", "checkpoint_depth"} <= native:
        print("RESULT " + json.dumps({"unsupported": True}), flush=True)
        return 0
    params = write_model(args.model, args.size,
                         os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], MODEL_FILE))
    build_cache("bench", *data(args.model, args.resolution, samples=8))
    flops = forward_flops(args.model, args.size, args.resolution)
    print("RESULT " + json.dumps({"parameters": params, "forward_flops": flops}), flush=True)
    return 0


def _child(args: argparse.Namespace, role: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run this script as a child process in ``role`` (``--prepare`` or ``--worker NAME``); its RESULT, or the
    error it ended with."""
    command = [sys.executable, os.path.abspath(__file__), *role, "--workdir", args.workdir, "--model", args.model,
               "--steps", str(args.steps), "--resolution", str(args.resolution)]
    if args.comfyui:
        command += ["--comfyui", args.comfyui]
    if args.size != "published":
        command.append(f"--{args.size}")
    if args.count_ops and role[0] == "--worker":
        command.append("--count-ops")
    if args.profile and role[0] == "--worker":
        command += ["--profile", args.profile]
    if args.memory_cap:
        command += ["--memory-cap", str(args.memory_cap)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **env}, check=False)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"ok": False, "error": f"no result within {timeout:.0f} s; its last output: {tail[-1500:]}"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", help="ComfyUI folder (default: COMFYUI_PATH or the custom_nodes parent)")
    p.add_argument("--model", choices=["sdxl", "flux"], default="sdxl")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--resolution", type=int, help="image side in pixels (default 1024; 64 with --tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="small models (Flux: one block of each kind; SDXL: KOALA-700M's layout), at 64 px unless "
                   "--resolution says otherwise: checks the script, and the GPU tests' first trainings")
    p.add_argument("--only", help=f"comma-separated configurations to run (default: all of {', '.join(CONFIGS)})")
    p.add_argument("--narrow", action="store_true",
                   help="the published depth at a narrow width (with --count-ops: a GPU's launches, counted anywhere)")
    p.add_argument("--count-ops", action="store_true",
                   help="count the ATen operations (a GPU's kernel launches) of each step, by pass, and the most "
                        "frequent ones")
    p.add_argument("--profile", metavar="DIR",
                   help="write a torch.profiler table of two steps per configuration to DIR")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one configuration may take (default 600)")
    p.add_argument("--memory-cap", type=float, metavar="GIB",
                   help="run every configuration with at most this much GPU memory "
                        "(torch.cuda.set_per_process_memory_fraction), as on a smaller GPU")
    p.add_argument("--json", action="store_true")
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny and args.narrow:
        p.error("--tiny and --narrow are two sizes: give one")
    args.size = "tiny" if args.tiny else "narrow" if args.narrow else "published"
    if args.resolution is None:
        args.resolution = 1024 if args.size == "published" else 64
    if args.prepare:
        return prepare(args)
    if args.worker:
        return worker(args)
    chosen = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        args.profile = os.path.abspath(args.profile)
    args.workdir = tempfile.mkdtemp(prefix="bench_memory_")  # the model file, cache and LoRAs; removed at the end
    try:
        return _bench(args, chosen)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)


def _bench(args: argparse.Namespace, chosen: list[str]) -> int:
    started = time.perf_counter()
    prepared = _child(args, ["--prepare"], {}, args.timeout)
    if prepared.get("unsupported"):
        print("this ComfyUI's TrainLoraNode has no offloading, bypass mode or checkpoint depth to compare with; "
              "run the benchmark with a newer ComfyUI (0.33 or later)", file=sys.stderr)
        return 2
    if "parameters" not in prepared:
        print(f"could not prepare the model: {prepared.get('error')}", file=sys.stderr)
        return 1
    print(f"[bench] prepared {args.model}: {prepared['parameters'] / 1e9:.2f} B parameters, "
          f"{prepared['forward_flops'] / 1e12:.2f} TFLOP a forward pass, {time.perf_counter() - started:.0f} s",
          file=sys.stderr, flush=True)
    results: dict[str, dict] = {}
    for name in chosen:
        results[name] = _child(args, ["--worker", name], CONFIGS[name][3], args.timeout)
        print(f"[bench] {name}: {json.dumps(results[name])[:600]}", file=sys.stderr, flush=True)
    for name, reference in AGREEMENT.items():
        got, ref = results.get(name, {}), results.get(reference, {})
        if got.get("lora") and ref.get("lora"):
            got["lora_agreement"] = dict(lora_agreement(got["lora"], ref["lora"]), reference=reference)
    work = 3.0 * prepared["forward_flops"]
    base = results.get("comfyui") or {}
    for name, r in results.items():
        peak = peak_tflops(r.get("device") or "")
        passes = 2.0 + recomputed_share(name)  # the forward pass, its recomputation (if any), input gradients
        if r.get("step_seconds") and peak:
            r["chip_share"] = round(passes * prepared["forward_flops"] / r["step_seconds"] / (peak * 1e12), 4)
        if (r.get("ops") or {}).get("model_passes") and (base.get("ops") or {}).get("model_passes"):
            r["model_ops_vs_comfyui"] = round(r["ops"]["model_passes"] / base["ops"]["model_passes"], 3)
        for k in ("peak_gib", "step_seconds"):
            if r.get(k) is not None and base.get(k):
                r[f"{k}_vs_comfyui"] = round(r[k] / base[k], 3)
        if r.get("step_seconds") and base.get("step_seconds"):
            r["speedup_vs_comfyui"] = round(base["step_seconds"] / r["step_seconds"], 2)
    devices = sorted({r["device"] for r in results.values() if r.get("device")})
    report = {"model": args.model, "parameters": prepared["parameters"], "forward_flops": prepared["forward_flops"],
              "work_flops_per_step": work, "tiny": args.tiny, "size": args.size, "resolution": args.resolution,
              "steps": args.steps,
              "devices": devices, "seconds": round(time.perf_counter() - started, 1), "results": results}
    if args.json:
        print(json.dumps(report))
    else:
        size = "" if args.size == "published" else f", {args.size}"
        print(f"{args.model} ({prepared['parameters'] / 1e9:.2f} B parameters{size}) "
              f"{args.resolution}px, batch 1, rank 16, {args.steps} steps, on {', '.join(devices) or '?'}; "
              f"work {work / 1e12:.1f} TFLOP a step")
        print(f"{'configuration':22} {'peak GiB':>8} {'x comfyui':>9} {'s/step':>7} {'samples/s':>9} "
              f"{'speed-up':>8} {'chip':>6}")
        for name, r in results.items():
            if not r.get("ok"):
                print(f"{name:22} failed: {r.get('error')}")
                continue
            peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
            step = "-" if r.get("step_seconds") is None else f"{r['step_seconds']:.3f}"
            rate = "-" if r.get("samples_per_second") is None else f"{r['samples_per_second']:.2f}"
            share = "-" if r.get("chip_share") is None else f"{100 * r['chip_share']:.1f}%"
            print(f"{name:22} {peak:>8} {r.get('peak_gib_vs_comfyui', '-'):>9} {step:>7} {rate:>9} "
                  f"{r.get('speedup_vs_comfyui', '-'):>8} {share:>6}")
        counted = {name: r["ops"] for name, r in results.items() if r.get("ops")}
        if counted:
            print(f"\nATen ops per step (a GPU's kernel launches){'':10} {'forward':>8} {'backward':>8} "
                  f"{'optimizer':>9} {'host reads':>10}  most frequent in the model's passes")
            for name, o in counted.items():
                top = ", ".join(f"{op} {n}" for op, n in o["top"][:6])
                reads = o["host_reads"]["forward"] + o["host_reads"]["backward"]
                print(f"{name:52} {o['forward']:>8} {o['backward']:>8} {o['optimizer']:>9} {reads:>10}  {top}")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
