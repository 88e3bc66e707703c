"""Peak GPU memory and step time of Train LoRA (streaming cache) against ComfyUI's own TrainLoraNode, on
real-size random-weight models, in one process and one run.

    python scripts/bench_memory.py [--comfyui PATH] [--model sdxl|flux] [--steps 12] [--resolution 1024] [--json]
    python scripts/bench_memory.py --tiny          # small models at 64 px: checks the script itself, anywhere

Run it with ComfyUI's Python (the newest ComfyUI: the one with offloading and bypass mode). The model is built
with ComfyUI's own classes at its published size (SDXL's UNet, 2.6 B parameters; Flux dev, 11.9 B), filled with
random weights, saved and loaded by Load Diffusion Model, so detection, dtypes and loading are what a user gets. Both
trainers then run through ComfyUI's executor on the same data (batch 1, rank 16, AdamW, bf16, gradient
checkpointing, the same number of steps) in these configurations:

* ``comfyui``: TrainLoraNode; ``streaming``: Train LoRA with the same settings;
* ``comfyui_fp8_bypass`` / ``streaming_fp8_bypass``: the model loaded with fp8 (e4m3fn) weights, bypass mode;
* ``streaming_offloading``: Train LoRA with offloading.

Peak memory is ``torch.cuda.max_memory_allocated`` over the whole node run (model load included); step time is
the median interval between optimizer steps after two warm-up steps, timed where each trainer takes them (torch's
global optimizer-step hook sees both), so it does not depend on how often ComfyUI reports progress. Ratios are
against ``comfyui``, measured in the same run. Without CUDA only times are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import headless  # noqa: E402

SDXL = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
        "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
        "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
        "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
        "use_temporal_attention": False, "use_temporal_resblock": False}
FLUX = {"image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 768,
        "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
        "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
        "guidance_embed": True}
TINY = {"sdxl": dict(SDXL, num_res_blocks=[1, 1, 1], transformer_depth=[0, 2, 5],  # KOALA-700M, detected as SDXL
                     transformer_depth_output=[0, 0, 2, 2, 5, 5], transformer_depth_middle=-2),
        "flux": dict(FLUX, hidden_size=128, num_heads=1, depth=1, depth_single_blocks=1)}
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
    trainer's optimizer, whatever it reports to ComfyUI's progress bar)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __enter__(self) -> StepClock:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.handle = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: self.times.append(time.perf_counter()))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()

    def step_seconds(self, warmup: int = 2) -> float | None:
        """The median interval between optimizer steps after ``warmup`` steps (None with fewer than two)."""
        import statistics

        gaps = [b - a for a, b in zip(self.times[warmup:], self.times[warmup + 1:])]
        return statistics.median(gaps) if gaps else None


def write_model(kind: str, tiny: bool, path: str) -> int:
    """A ``kind`` diffusion model at its real size (or tiny) with random bf16 weights, saved where Load
    Diffusion Model finds it (so both trainers load it as users do); returns its parameter count."""
    import comfy.supported_models
    import torch
    from safetensors.torch import save_file

    config = dict(TINY[kind] if tiny else (SDXL if kind == "sdxl" else FLUX))
    if kind == "flux":
        import dataclasses

        import comfy.ldm.flux.model

        if "txt_ids_dims" in {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:
            config["txt_ids_dims"] = []  # what detection gives Flux.1 on versions that have the field
    family = comfy.supported_models.SDXL if kind == "sdxl" else comfy.supported_models.Flux
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


def prompt_for(trainer: str, name: str, steps: int, fp8_bypass: bool, offloading: bool) -> dict:
    common = dict(steps=steps, batch_size=1, learning_rate=1e-4, rank=16, optimizer="AdamW", loss_function="MSE",
                  seed=0, training_dtype="bf16", lora_dtype="bf16", algorithm="LoRA", gradient_checkpointing=True,
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
                                           dict(common, lora_name=f"bench_{name}", resume=False), prefix="2")[0])
    return prompt


def measure(server: Any, prompt: dict) -> dict:
    import comfy.model_management
    import torch

    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with StepClock() as clock:
        ok, _, error = headless.run(prompt, server)
    seconds = time.perf_counter() - start
    return {"ok": ok, "error": error, "seconds": round(seconds, 2),
            "step_seconds": clock.step_seconds(),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", help="ComfyUI folder (default: COMFYUI_PATH or the custom_nodes parent)")
    p.add_argument("--model", choices=["sdxl", "flux"], default="sdxl")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--tiny", action="store_true",
                   help="small models at 64 px (Flux: one block of each kind; SDXL: KOALA-700M): checks the script")
    p.add_argument("--only", help="comma-separated configurations to run (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="bench_memory_")  # the model file, cache and LoRAs; removed at the end
    try:
        return _bench(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _bench(args: argparse.Namespace, workdir: str) -> int:
    resolution = 64 if args.tiny else args.resolution
    server = headless.boot(headless.find_comfyui(args.comfyui), ["--base-directory", workdir], quiet=True)
    import folder_paths

    import nodes

    native = {name for name, _ in headless._widget_inputs(nodes.NODE_CLASS_MAPPINGS["TrainLoraNode"])}
    if not {"offloading", "bypass_mode", "checkpoint_depth"} <= native:
        print("this ComfyUI's TrainLoraNode has no offloading, bypass mode or checkpoint depth to compare with; "
              "run the benchmark with a newer ComfyUI (0.33 or later)", file=sys.stderr)
        return 2
    nodes.NODE_CLASS_MAPPINGS["BenchSource"] = BenchSource
    params = write_model(args.model, args.tiny,
                         os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], MODEL_FILE))
    latent, cond = data(args.model, resolution, samples=8)
    OBJECTS["data"] = (latent, cond)
    build_cache("bench", latent, cond)
    configs = {"comfyui": ("comfyui", False, False), "streaming": ("streaming", False, False),
               "comfyui_offloading": ("comfyui", False, True), "streaming_offloading": ("streaming", False, True),
               "comfyui_fp8_bypass": ("comfyui", True, False), "streaming_fp8_bypass": ("streaming", True, False)}
    chosen = args.only.split(",") if args.only else list(configs)
    results: dict[str, dict] = {}
    for name in chosen:
        trainer, fp8, offloading = configs[name]
        results[name] = measure(server, prompt_for(trainer, name, args.steps, fp8, offloading))
        print(f"[bench] {name}: {results[name]}", file=sys.stderr, flush=True)
    base = results.get("comfyui") or {}
    for r in results.values():
        for k in ("peak_gib", "step_seconds"):
            if r.get(k) is not None and base.get(k):
                r[f"{k}_vs_comfyui"] = round(r[k] / base[k], 3)
    report = {"model": args.model, "parameters": params, "tiny": args.tiny, "resolution": resolution,
              "steps": args.steps, "results": results}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.model} ({params / 1e9:.2f} B parameters{', tiny' if args.tiny else ''}) {resolution}px, batch 1, "
              f"rank 16, {args.steps} steps")
        print(f"{'configuration':24} {'peak GiB':>9} {'x comfyui':>9} {'s/step':>8} {'x comfyui':>9}")
        for name, r in results.items():
            if not r["ok"]:
                print(f"{name:24} failed: {r['error']}")
                continue
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            step = "-" if r["step_seconds"] is None else f"{r['step_seconds']:.3f}"
            print(f"{name:24} {peak:>9} {r.get('peak_gib_vs_comfyui', '-'):>9} {step:>8} "
                  f"{r.get('step_seconds_vs_comfyui', '-'):>9}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
