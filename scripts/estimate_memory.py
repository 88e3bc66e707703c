"""Peak GPU memory of one LoRA training step per family, resolution and memory setting, estimated on the CPU
(``nodes/backend/memory_estimate.py``: ComfyUI's model classes at full size on the ``meta`` device, this pack's
adapters and checkpointing, every tensor counted), and which GPU sizes each fits.

    python scripts/estimate_memory.py [--comfyui PATH] [--families sdxl,wan21-14b] [--resolutions 512,1024]
    python scripts/estimate_memory.py --json            # one JSON document of every estimate
    python scripts/estimate_memory.py --markdown        # writes docs/vram.md (or --markdown PATH)
    python scripts/estimate_memory.py --trainers comfyui --families sdxl --markdown --merge
                                                        # only those rows, into the table docs/vram.md holds

Run it with ComfyUI's Python (the newest ComfyUI). No GPU and no model files are needed; each estimate takes
seconds to a minute on a CPU. Image families are estimated square at each of ``--resolutions``, video families
at their clips (``memory_estimate.Family.clips``: width, height and frames). A step fits a GPU when Memory &
Precision's plan says so (``streaming_cache.train.memory_plan.fits``: a margin for the allocator's rounding and
fragmentation and kernels' workspaces, and a reserve for the CUDA context and library handles).

``--trainers``: ``pack`` (Train LoRA at each memory setting, ``memory_estimate.iter_settings``), ``comfyui``
(ComfyUI's own TrainLoraNode, ``memory_estimate.estimate_comfyui_step``, on ``memory_estimate.COMFYUI_FAMILIES``)
or both (the default). ``--merge`` writes the rows estimated into the table the Markdown file holds, in place of
those of the same family, size and setting, others kept as they are (a row new to the table after the last of its
family and size), and the text around the table anew.
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
    ("SDXL", 1024, "TrainLoraNode, checkpointing"): ["22.51 (23.55 reserved), runs B and E"],
    ("Flux dev", 1024, "TrainLoraNode, checkpointing"): ["100.48, run C"],
}
"""Peaks measured by ``scripts/bench_memory.py`` on an H200 with ComfyUI 0.33.0 (``torch.cuda.max_memory_allocated``
over the node's run, GiB; reserved in brackets), beside the estimate of the same configuration in
``docs/vram.md``; runs A to E are those of ``docs/benchmarks.md``, where ComfyUI's own TrainLoraNode ran at its
defaults (gradient checkpointing at depth 1)."""
TRAINERS = ("pack", "comfyui")


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


def estimate_all(module: Any, plan: Any, families: list[str], resolutions: list[int],
                 trainers: tuple[str, ...] = TRAINERS) -> list[dict[str, Any]]:
    rows = []
    comfyui = "comfyui" in trainers and module.comfyui_trainer() is not None
    for family in families:
        for width, height, frames in sizes(module.FAMILIES[family], resolutions):
            runs = [(s, o, module.estimate_step) for s, o in module.iter_settings()] if "pack" in trainers else []
            if comfyui and family in module.COMFYUI_FAMILIES:
                runs += [(s, o, module.estimate_comfyui_step) for s, o in module.iter_comfyui_settings()]
            for setting, options, estimate in runs:
                try:
                    est = estimate(family, height, frames=frames, width=width, **options)
                except RuntimeError as e:  # TrainLoraNode's backward pass on a model that updates in place
                    if estimate is not module.estimate_comfyui_step or not module.is_inplace_update(e):
                        raise
                    size = size_label({"resolution": height, "frames": frames, "width": width})
                    print(f"{module.FAMILIES[family].name:12} {size:20} {setting}: the backward pass stops: "
                          f"{str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                    continue
                row = dict(est.to_json(), setting=setting, fits=fits(plan, est.peak_gib))
                launched = est.launches or {}
                fitting = ", ".join(map(str, row["fits"])) + " GiB" if row["fits"] else "none"
                print(f"{est.family:12} {size_label(row):20} {setting:18} peak {est.peak_gib:6.2f} GiB "
                      f"(weights {est.weights_gib:.2f}, activations {est.activations_gib:.2f}, LoRA + AdamW "
                      f"{est.adapters_gib + est.optimizer_gib:.2f}) fits {fitting}, launches "
                      f"{launched.get('forward')} + {launched.get('backward')} [{est.seconds:.0f} s]",
                      file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def table_line(r: dict[str, Any]) -> str:
    """A row of the table: an estimate, its fits and the peaks measured at its setting."""
    measured = "; ".join(MEASURED.get((r["family"], r["resolution"], r["setting"]), [])) or "-"
    return (f"| {r['family']} | {size_label(r)} | {r['setting']} | **{r['peak_gib']:.2f}** | {r['weights_gib']:.2f} | "
            f"{r['activations_gib']:.2f} | {r['adapters_gib'] + r['optimizer_gib']:.2f} | "
            f"{', '.join(map(str, r['fits'])) or 'none'} | {measured} |")


def _key(line: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in line.strip("|").split("|")[:3])


def merged(path: str, rows: list[dict[str, Any]]) -> list[str]:
    """The table lines of the Markdown file at ``path`` with ``rows`` written in: in place of the line of the same
    family, size and setting, or after the last line of the row's family and size, as :func:`estimate_all` orders
    them (else after its family's last line, at the end for a new family)."""
    with open(path, encoding="utf-8") as f:
        old = [line for line in f.read().splitlines()
               if line.startswith("| ") and not line.startswith(("| family |", "| --- |"))]
    lines = list(old)
    for r in rows:
        line = table_line(r)
        keys = [_key(x) for x in lines]
        if _key(line) in keys:
            lines[keys.index(_key(line))] = line
        else:
            size = [i for i, k in enumerate(keys) if k[:2] == _key(line)[:2]]
            same = size or [i for i, k in enumerate(keys) if k[0] == r["family"]]
            lines.insert(same[-1] + 1 if same else len(lines), line)
    return lines


def markdown(rows: list[dict[str, Any]], plan: Any, table: list[str] | None = None) -> str:
    """``docs/vram.md``: the table of estimates, the fits and the measured peaks beside them (``table``: its lines
    as :func:`merged` gives them, instead of those of ``rows``)."""
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
        "The *TrainLoraNode* rows estimate ComfyUI's own TrainLoraNode (`comfy_extras/nodes_train.py`, ComfyUI",
        "0.33.0) the same way, on the same model, inputs and AdamW arithmetic, its step made by its own functions",
        "(`memory_estimate.count_comfyui_step`): `_setup_lora_adapters` at the node's defaults (a rank-16 LoRA in",
        "bf16 on every matrix weight, with its alpha, which the node trains as a parameter, and a full-size",
        "difference on every 1-D weight and bias, all as weight wrappers: each layer's weight and its LoRA are",
        "merged at every call, and the merged weight is kept for the backward pass), its gradient checkpointing",
        "(`find_modules_at_depth` at its default depth 1, each module found `patch`-ed; at depth 1 the module found",
        "is the diffusion model itself, so the backward pass recomputes the whole forward pass at once and the",
        "peak is that of a step without checkpointing) and its `fwd_bwd` (the noisy latent and the sigma made to",
        "require gradients, the loss against the clean latent). Substituted, because it does not run on `meta` or",
        "changes no tensor's size: the model is called through `apply_model`, as the node's guider calls it for",
        "its one condition, instead of through the guider (whose batching of conditions adds latent-sized",
        "tensors); the node's `torch.autocast` is not entered (the model already computes in bf16, as the node's",
        "`set_model_compute_dtype` sets it); the adapters are attached to the layers and moved to the device as",
        "`ModelPatcher.load` does. They cover every family of the table the node can train on the table's inputs:",
        "a video family's clip goes to it as one latent, as an image does, and its guider adds HunyuanVideo 1.5's",
        "image-to-video channels as counted above. LTX-2 has none: its rows count the sound track, and the node",
        "takes its latents as one tensor, which LTX-2's audio-video latent (LTXVConcatAVLatent's two streams) is",
        "not; the node counts no samples in it and stops before its first step (the number of conditionings does",
        "not match the number of latents). On video alone it trains ([the families table](families.md) gives it",
        "the video latent only), a step the LTX-2 rows do not count. Without checkpointing, the node's step on",
        "Flux dev, Flux.2 dev and HunyuanVideo 1.5 stops in the backward pass (PyTorch: a tensor the gradient",
        "needs was modified by an in-place operation, Flux's double blocks, which the other two share, adding to",
        "their input), so the table has no such rows.",
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
    lines += table if table is not None else [table_line(r) for r in rows]
    lines += [
        "",
        "*activations*: the step's peak above what was live at its start (saved activations, temporaries and the",
        "LoRA's gradients). *half recomputed*: `checkpoint_share` 0.5. *fp8 + bypass*: the base weights in fp8",
        "(e4m3fn) and the adapters as bypass hooks, with checkpointing. *TrainLoraNode, ...*: ComfyUI's own",
        "trainer at its defaults, with its checkpointing (depth 1) or without.",
        "",
        "**TrainLoraNode against the GPU.** Its H200 peaks at 1024 px (runs B, C and E of the benchmarks, the node",
        "at its defaults) beside the estimates: SDXL 22.51 GiB measured, 20.41 estimated (0.91 of the measured",
        "peak: 9 % under, as Train LoRA's SDXL step without checkpointing is 12 % under its own), Flux dev 100.48",
        "measured, 104.63 estimated (1.04: 4 % over). At the same settings, the estimates put Train LoRA's step",
        "(checkpointing) at 0.32 of TrainLoraNode's for SDXL and 0.24 for Flux dev; measured, 0.31 (run E) and",
        "0.25 (Train LoRA in run E, TrainLoraNode in run C).",
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
    p.add_argument("--trainers", default=",".join(TRAINERS),
                   help="comma-separated: pack (Train LoRA), comfyui (ComfyUI's TrainLoraNode) (default: both)")
    p.add_argument("--merge", action="store_true",
                   help="with --markdown: write the rows estimated into the file's table, keeping its other rows")
    args = p.parse_args(argv)
    trainers = tuple(t for t in args.trainers.split(",") if t)
    if not trainers or any(t not in TRAINERS for t in trainers):
        p.error(f"--trainers: choose from {', '.join(TRAINERS)}")
    comfyui = headless.find_comfyui(args.comfyui)
    headless.boot(comfyui, ["--cpu", "--use-pytorch-cross-attention"], quiet=True, others=False)
    module = headless.pack_module("backend.memory_estimate")
    families = [f for f in args.families.split(",") if f] or list(module.FAMILIES)
    unknown = [f for f in families if f not in module.FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(module.FAMILIES)}")
    plan = headless.pack_module("train.memory_plan", part="streaming_cache")
    rows = estimate_all(module, plan, families, [int(r) for r in args.resolutions.split(",") if r], trainers)
    if args.markdown:
        table = merged(args.markdown, rows) if args.merge else None
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(rows, plan, table))
    if args.json:
        print(json.dumps({"margin": plan.MARGIN, "reserve_gib": plan.RESERVE / plan.GIB, "gpus": GPUS,
                          "estimates": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
