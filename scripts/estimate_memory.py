"""Peak GPU memory of one LoRA training step per family, resolution and memory setting, estimated on the CPU
(``nodes/backend/memory_estimate.py``: ComfyUI's model classes at full size on the ``meta`` device, this pack's
adapters and checkpointing, every tensor counted), and which GPU sizes each fits.

    python scripts/estimate_memory.py [--comfyui PATH] [--families sdxl,wan21-14b] [--resolutions 512,1024]
    python scripts/estimate_memory.py --json            # one JSON document of every estimate
    python scripts/estimate_memory.py --markdown        # writes docs/vram.md (or --markdown PATH)

Run it with ComfyUI's Python (the newest ComfyUI). No GPU and no model files are needed; each estimate takes
seconds to a minute on a CPU. Image families are estimated square at each of ``--resolutions``, video families
at their clips (``memory_estimate.Family.clips``: width, height and frames). A step fits a GPU when Memory &
Precision's plan says so (``streaming_cache.train.memory_plan.fits``: a margin for the allocator's rounding and
fragmentation and kernels' workspaces, and a reserve for the CUDA context and library handles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import headless  # noqa: E402

GPUS = (8, 12, 16, 24, 48)
"""GPU sizes (GiB) the table says a step fits."""
DOC = os.path.join(os.path.dirname(HERE), "docs", "vram.md")

MEASURED: dict[tuple[str, int, str], list[str]] = {
    ("SDXL", 1024, "checkpointing"): [
        "6.88 (8.00 reserved), CUDA graphs, commit 7697f65; 5.47 in the steps after the first",
        "6.91 (7.58 reserved) without graphs, commit e95eda6"],
    ("SDXL", 1024, "no checkpointing"): ["17.63 (18.85), CUDA graphs, run A"],
    ("SDXL", 1024, "fp8 + bypass"): ["4.44, run C"],
    ("Flux dev", 1024, "checkpointing"): ["25.11 (29.32 reserved), CUDA graphs, commit 7697f65"],
    ("Flux dev", 1024, "fp8 + bypass"): ["34.52, run C (an earlier commit whose Flux dev runs peaked at 41.46 GiB "
                                         "with checkpointing)"],
}
"""Peaks measured by ``scripts/bench_memory.py`` on an H200 with ComfyUI 0.33.0 (``torch.cuda.max_memory_allocated``
over the node's run, GiB; reserved in brackets), beside the estimate of the same configuration in
``docs/vram.md``; runs A to C are those of ``docs/benchmarks.md``. For comparison, ComfyUI's own TrainLoraNode
peaked at 22.51 GiB for SDXL and 100.48 GiB for Flux dev (1024 px, rank 16)."""


def fits(plan: Any, peak_gib: float) -> list[int]:
    """The sizes of :data:`GPUS` a step of ``peak_gib`` fits as Memory & Precision's plan counts it
    (``plan``: ``streaming_cache.train.memory_plan``: its margin and reserve beside the estimate)."""
    return [g for g in GPUS if plan.fits(int(peak_gib * plan.GIB), g * plan.GIB)]


def sizes(spec: Any, resolutions: list[int]) -> list[tuple[int, int, int | None]]:
    """The (width, height, frames) a family is estimated at: an image family square at each of ``resolutions``,
    a video family at its clips (``Family.clips``)."""
    if spec.video:
        return list(spec.clips)
    return [(r, r, None) for r in resolutions]


def size_label(row: dict[str, Any]) -> str:
    """The table's size: pixels for a square image, ``width x height, frames`` for a video."""
    if row["frames"] is None and row.get("width") in (None, row["resolution"]):
        return str(row["resolution"])
    size = f"{row.get('width') or row['resolution']}x{row['resolution']}"
    return f"{size}, {row['frames']} frames" if row["frames"] is not None else size


def estimate_all(module: Any, plan: Any, families: list[str], resolutions: list[int]) -> list[dict[str, Any]]:
    rows = []
    for family in families:
        for width, height, frames in sizes(module.FAMILIES[family], resolutions):
            for setting, options in module.iter_settings():
                est = module.estimate_step(family, height, frames, width=width, **options)
                row = dict(est.to_json(), setting=setting, fits=fits(plan, est.peak_gib))
                print(f"{est.family:12} {size_label(row):20} {setting:18} peak {est.peak_gib:6.2f} GiB "
                      f"(weights {est.weights_gib:.2f}, activations {est.activations_gib:.2f}, optimizer "
                      f"{est.optimizer_gib:.2f}) fits {', '.join(map(str, row['fits'])) or 'none'} GiB "
                      f"[{est.seconds:.0f} s]", file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], plan: Any) -> str:
    """``docs/vram.md``: the table of estimates, the fits and the measured peaks beside them."""
    lines = [
        "# GPU memory of a training step",
        "",
        "Peak GPU memory of one Train LoRA step, estimated on a CPU by `scripts/estimate_memory.py` (ComfyUI's",
        "model classes at their published size on PyTorch's `meta` device, this pack's LoRA adapters, fused layers",
        "and gradient checkpointing, every tensor the step makes counted while it lives; attention counted as the",
        "GPU's flash / memory-efficient kernels keep it). Batch 1, LoRA rank 16 on every layer ComfyUI patches,",
        "bf16 model and LoRA, AdamW (its two moments per trained parameter added by arithmetic: they do not run on",
        "`meta`). The latent is the family's at the resolution, the conditioning that of its text encoders at their",
        "padded length (SDXL: 77 tokens of CLIP-L + CLIP-G, 2048 wide; Flux dev: 256 tokens of T5-XXL, 4096 wide;",
        "SD3.5 Large: 77 of CLIP-L + CLIP-G and 77 of T5-XXL, 4096 wide; Flux.2 dev: 512 of Mistral Small 3, 15360",
        "wide; Wan: 512 of UMT5-XXL, 4096 wide; LTX-2: 1024 of Gemma 3 12B through its connectors, 2 x 3840 wide).",
        "Qwen-Image and HunyuanVideo 1.5 (Qwen2.5-VL, 3584 wide) and Z-Image (Qwen3 4B, 2560 wide) do not pad:",
        "256 tokens stand for a long caption. Video rows are one clip of the stated size and frame count (Wan's",
        "latent 8 times smaller per side, Wan 2.2 5B's and HunyuanVideo 1.5's 16, 4 frames to a latent frame;",
        "LTX-2's 32 times, 8 frames, with its sound track at 25 fps: ComfyUI's LTXAV model takes audio and video).",
        "LTX-2's text connectors run before the model call and are not counted. HunyuanVideo 1.5 (480p T2V) takes",
        "the image-to-video condition's 33 channels beside its latent at every step (zeros for text-to-video);",
        "its ByT5 glyph features (only for quoted text in a caption) and an image-to-video start image's SigLIP",
        "features (729 tokens) are not counted.",
        "",
        f"**Fits** lists the GPU sizes (GiB) where `peak x {1 + plan.MARGIN:.2f} + {plan.RESERVE / plan.GIB:.1f} GiB` "
        f"fits: {plan.MARGIN:.0%} for the allocator's rounding",
        "and fragmentation and the kernels' workspaces, and the CUDA context with its library handles: the test",
        "Memory & Precision's `plan` auto makes before the first step (see [the nodes](nodes.md)). The estimate",
        "leaves out what is not a tensor of the step: the context, the allocator's reserve, the loader's prefetched",
        "batches, CUDA graphs' replay pool (graphs allocate what the eager step allocates; they hold more *reserved*",
        "memory, see the measured figures), and the fp32 outputs CUDA's autocast gives norms (ComfyUI's layers",
        "already compute in bf16). *Measured*: `torch.cuda.max_memory_allocated` over the training node's run on an",
        "H200 (reserved in brackets), from [the benchmarks](benchmarks.md#training-on-a-gpu) and later runs at the",
        "same settings.",
        "",
        "| family | px | setting | peak GiB | weights | activations | LoRA + AdamW | fits (GiB) | measured, H200 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        measured = "; ".join(MEASURED.get((r["family"], r["resolution"], r["setting"]), [])) or "-"
        lines.append(f"| {r['family']} | {size_label(r)} | {r['setting']} | **{r['peak_gib']:.2f}** | "
                     f"{r['weights_gib']:.2f} | {r['activations_gib']:.2f} | "
                     f"{r['adapters_gib'] + r['optimizer_gib']:.2f} | {', '.join(map(str, r['fits'])) or 'none'} | "
                     f"{measured} |")
    lines += [
        "",
        "*activations*: the step's peak above what was live at its start (saved activations, temporaries and the",
        "LoRA's gradients). *half recomputed*: `checkpoint_share` 0.5. *fp8 + bypass*: the base weights in fp8",
        "(e4m3fn) and the adapters as bypass hooks, with checkpointing. ComfyUI's own TrainLoraNode measured 22.51",
        "GiB for SDXL and 100.48 GiB for Flux dev at 1024 px on the same GPU.",
        "",
        "**Against the GPU.** At commit 7697f65 on an H200, the whole node run (model load, the first step with its",
        "CUDA-graph recording, the later steps) peaked at 6.88 GiB for SDXL (estimate 6.58: 4 % under) and 25.11",
        "GiB for Flux dev (estimate 25.03: 0.3 % under), with checkpointing at 1024 px; the plan's margin covers",
        "both. SDXL without checkpointing is 12 % under its measured peak (an earlier run; likely autocast's fp32",
        "norm outputs, which are not counted). The fp8 rows' measurements come from an earlier commit whose Flux",
        "dev runs peaked 16 GiB higher, and have not been repeated.",
        "",
        "**Offloading** is not in the table: what stays on the GPU is decided by ComfyUI's partial loading from the",
        "memory free when the model loads (measured at 1024 px on an H200: SDXL 2.16 GiB, Flux dev 23.67 GiB). The",
        "plan counts a step with offloading as its estimate without the frozen weights: ComfyUI keeps on the GPU",
        "what fits beside the rest. **Families** not in the table are not estimated yet; with them, the plan",
        "trains with the settings as set and says so.",
        "",
        "Run it again with `python scripts/estimate_memory.py --markdown` (ComfyUI's Python).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", help="the ComfyUI folder (default: as scripts/headless.py finds it)")
    p.add_argument("--families", default="", help="comma-separated keys of FAMILIES (default: all)")
    p.add_argument("--resolutions", default="512,1024", help="comma-separated pixels (default: 512,1024)")
    p.add_argument("--json", action="store_true", help="print one JSON document of every estimate")
    p.add_argument("--markdown", nargs="?", const=DOC, help=f"write the table as Markdown (default: {DOC})")
    args = p.parse_args(argv)
    comfyui = headless.find_comfyui(args.comfyui)
    headless.boot(comfyui, ["--cpu", "--use-pytorch-cross-attention"], quiet=True, others=False)
    module = headless.pack_module("backend.memory_estimate")
    families = [f for f in args.families.split(",") if f] or list(module.FAMILIES)
    unknown = [f for f in families if f not in module.FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(module.FAMILIES)}")
    plan = headless.pack_module("train.memory_plan", part="streaming_cache")
    rows = estimate_all(module, plan, families, [int(r) for r in args.resolutions.split(",") if r])
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(rows, plan))
    if args.json:
        print(json.dumps({"margin": plan.MARGIN, "reserve_gib": plan.RESERVE / plan.GIB, "gpus": GPUS,
                          "estimates": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
