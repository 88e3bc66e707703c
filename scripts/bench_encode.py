"""Encode Dataset's wall time against its own parts measured alone, and its images/s against ComfyUI's own
dataset nodes, on the same folder, in one process and one run.

    python scripts/bench_encode.py [--comfyui PATH] [--checkpoint FILE] [--images 24] [--source-size 1024]
                                   [--resolution 512] [--batch-size 4] [--json]
    python scripts/bench_encode.py --tiny       # 4 small images: checks the script itself, anywhere

Run it with ComfyUI's Python. The checkpoint is a file of yours (``--checkpoint``) or, by default, an SD1.x-shaped
one built with ComfyUI's own classes: the real-size VAE and CLIP-L with random weights and a tiny UNet (encoding
does not use the UNet). The folder holds ``--images`` photo-like JPEGs of ``--source-size`` pixels square with
kohya captions. Each configuration runs through ComfyUI's executor, the checkpoint loaded once beforehand:

* ``decode``: Encode Dataset's reading, decoding and fitting to the bucket of every image, alone, on its
  threads; ``encoders``: its VAE and text-encoder calls on the decoded pixels and captions, alone;
* ``encode_dataset``: Encode Dataset into a new cache (everything a user waits for: hashing the files and the
  weights, decoding, encoding, writing the cache). Goal: wall time <= 1.15x max(decode, encoders), i.e.
  decoding hides behind the encoders (or the other way round);
* the dataset preview Encode Dataset draws when it is done (its first page and the bucket histogram), timed alone
  on the cache just built: its share of ``encode_dataset``'s wall time;
* ``comfyui``: ComfyUI's own path to latents and conditionings at the same size (v0.3.x: Load Image and Text
  Dataset from Folder, crop, then VAE Encode; newer: Load Image-Text (from Folder), Resize by Shorter Edge,
  Center Crop, Make Training Dataset), held in memory as ComfyUI's trainer takes them.
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
import demo_assets  # noqa: E402

import headless  # noqa: E402

RESULTS: dict[str, Any] = {}


class BenchEncoders:
    """Times Encode Dataset's two halves alone, inside the executor (so it gets the loaded VAE and CLIP): the
    decode step of every image on the encoder's own threads, then the encoders on the decoded pixels."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("VAE",), "clip": ("CLIP",), "folder": ("STRING", {"default": ""}),
                             "resolution": ("INT", {"default": 512}), "batch_size": ("INT", {"default": 4})}}

    RETURN_TYPES = ()
    FUNCTION = "measure"
    OUTPUT_NODE = True
    CATEGORY = "benchmark"

    def measure(self, vae: Any, clip: Any, folder: str, resolution: int, batch_size: int):
        import importlib

        import folder_paths
        import torch

        encoders = headless.pack_module("encoders")
        engine = encoders.__name__.rsplit(".nodes.", 1)[0] + ".streaming_cache"
        builder = importlib.import_module(f"{engine}.builder")
        prepare = importlib.import_module(f"{engine}.prepare")
        folder_mod = importlib.import_module(f"{engine}.train.folder")
        parts = encoders.FolderParts(resolution, frames=1, fps=0.0, start=0.0, alpha_masks=False)
        items, _ = folder_mod.folder_items(os.path.join(folder_paths.get_input_directory(), folder),
                                           media_part=parts.media)
        image, text = encoders.image_encoder(vae, resolution, batch_size), encoders.text_encoder(clip, batch_size)
        pairs = [(it.name, it.parts["latent"]) for it in items]
        batches = [("latent", pairs[i:i + batch_size]) for i in range(0, len(pairs), batch_size)]
        start = time.perf_counter()
        lookahead = prepare.Lookahead(batches, {"latent": image.prepare}, ahead=len(batches))
        pixels = [[value for _, _, value in lookahead.take(k)] for k in range(len(batches))]
        lookahead.close()
        decode = time.perf_counter() - start
        for batch in pixels:
            for value in batch:
                if isinstance(value, Exception):
                    raise value
        captions = list(dict.fromkeys(it.parts["cond"].data for it in items))
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in pixels:
                image.encode(batch)
            for i in range(0, len(captions), batch_size):
                text.encode([builder.Part(data=c) for c in captions[i:i + batch_size]])
        RESULTS["baselines"] = {"decode": decode, "encoders": time.perf_counter() - start,
                                "images": len(items), "captions": len(captions)}
        return {}


class BenchSink:
    """Takes the latents and conditionings ComfyUI's path produced (an output node, so the path runs)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latents": ("LATENT",), "conditioning": ("CONDITIONING",)}}

    INPUT_IS_LIST = True
    RETURN_TYPES = ()
    FUNCTION = "take"
    OUTPUT_NODE = True
    CATEGORY = "benchmark"

    def take(self, latents: list, conditioning: list):
        RESULTS["comfyui_latents"] = sum(int(lat["samples"].shape[0]) for lat in latents)
        return {}


def write_folder(folder: str, count: int, size: int, seed: int = 0) -> None:
    """``count`` square JPEGs of ``size`` pixels that compress like photos (smooth shapes plus grain), each with
    a caption; every fourth caption repeats an earlier one, as tags do in real datasets."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC)
        grain = rng.normal(0, 6, (size, size, 3))
        arr = np.clip(np.asarray(img, dtype=np.float32) + grain, 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(os.path.join(folder, f"img{i:04d}.jpg"), quality=90)
        caption = f"photo {i // 4 * 4}, a test subject, outdoors" if i % 4 == 3 else f"photo {i}, a test subject"
        with open(os.path.join(folder, f"img{i:04d}.txt"), "w", encoding="utf-8") as f:
            f.write(caption)


def comfyui_path(folder: str, resolution: int) -> dict:
    """ComfyUI's own nodes from the folder to latents and conditionings at ``resolution`` square."""
    import nodes

    if "LoadImageTextDataSetFromFolder" in nodes.NODE_CLASS_MAPPINGS:
        return {"10": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": folder}},
                "11": {"class_type": "ResizeImagesByShorterEdge",
                       "inputs": {"images": ["10", 0], "shorter_edge": resolution}},
                "12": {"class_type": "CenterCropImages",
                       "inputs": {"images": ["11", 0], "width": resolution, "height": resolution}},
                "13": {"class_type": "MakeTrainingDataset",
                       "inputs": {"images": ["12", 0], "vae": ["1", 2], "clip": ["1", 1], "texts": ["10", 1]}},
                "14": {"class_type": "BenchSink", "inputs": {"latents": ["13", 0], "conditioning": ["13", 1]}}}
    return {"10": {"class_type": "LoadImageTextSetFromFolderNode",
                   "inputs": {"folder": folder, "clip": ["1", 1], "resize_method": "Crop", "width": resolution,
                              "height": resolution}},
            "11": {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["1", 2]}},
            "14": {"class_type": "BenchSink", "inputs": {"latents": ["11", 0], "conditioning": ["10", 1]}}}


def encode_prompt(folder: str, cache_name: str, resolution: int, batch_size: int) -> dict:
    inputs = dict(headless.node_defaults("StreamingCacheEncode"), vae=["1", 2], clip=["1", 1], folder=folder,
                  cache_name=cache_name, resolution=resolution, batch_size=batch_size)
    return {"20": {"class_type": "StreamingCacheEncode", "inputs": inputs}}


def preview_seconds(cache_name: str, repeats: int = 3) -> float:
    """The best of ``repeats`` timings of the dataset preview Encode Dataset draws after encoding (its first page,
    the bucket histogram over every sample), on the cache just built: its share of the encode's wall time."""
    folders, preview = headless.pack_module("folders"), headless.pack_module("dataset_preview")
    shared_reader = headless.pack_module("dataset", part="streaming_cache").shared_reader
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        preview.preview(shared_reader(folders.cache_path(cache_name)), folders.MANIFEST, 1, name=cache_name)
        best = min(best, time.perf_counter() - start)
    return round(best, 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", help="ComfyUI folder (default: COMFYUI_PATH or the custom_nodes parent)")
    p.add_argument("--checkpoint", help="a checkpoint file with a VAE and a text encoder (default: a random-weight "
                                        "SD1.x-shaped one built here)")
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--source-size", type=int, default=1024, help="side of the square source JPEGs, in pixels")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="4 images of 96 px at 64 px: checks the script")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.images, args.source_size, args.resolution, args.batch_size = 4, 96, 64, 2
    workdir = tempfile.mkdtemp(prefix="bench_encode_")  # checkpoint link, folders and caches; removed at the end
    try:
        return _bench(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _bench(args: argparse.Namespace, workdir: str) -> int:
    server = headless.boot(headless.find_comfyui(args.comfyui), ["--base-directory", workdir], quiet=True)
    import folder_paths

    import nodes

    nodes.NODE_CLASS_MAPPINGS.update(BenchEncoders=BenchEncoders, BenchSink=BenchSink)
    ckpt_dir = folder_paths.get_folder_paths("checkpoints")[0]
    if args.checkpoint:
        os.makedirs(ckpt_dir, exist_ok=True)
        ckpt = os.path.basename(args.checkpoint)
        os.symlink(os.path.abspath(args.checkpoint), os.path.join(ckpt_dir, ckpt))
    else:
        ckpt = demo_assets.CKPT
        demo_assets.tiny_checkpoint(os.path.join(ckpt_dir, ckpt))
    input_dir = folder_paths.get_input_directory()
    write_folder(os.path.join(input_dir, "warmup"), 1, args.source_size, seed=1)
    write_folder(os.path.join(input_dir, "bench"), args.images, args.source_size)
    executor = headless.pack_module("backend.compat").prompt_executor(server)
    loader = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}}}
    results: dict[str, dict] = {}

    def timed(name: str, prompt: dict) -> None:
        start = time.perf_counter()
        ok, _, error = headless.run({**loader, **prompt}, server, executor=executor)
        results[name] = {"ok": ok, "error": error, "seconds": round(time.perf_counter() - start, 3)}
        print(f"[bench] {name}: {results[name]}", file=sys.stderr, flush=True)

    timed("warmup", encode_prompt("warmup", "warmup", args.resolution, args.batch_size))  # loads the checkpoint
    baselines = {"30": {"class_type": "BenchEncoders",
                        "inputs": {"vae": ["1", 2], "clip": ["1", 1], "folder": "bench",
                                   "resolution": args.resolution, "batch_size": args.batch_size}}}
    timed("baselines", baselines)
    timed("encode_dataset", encode_prompt("bench", "bench", args.resolution, args.batch_size))
    timed("comfyui", comfyui_path("bench", args.resolution))
    preview = preview_seconds("bench") if results["encode_dataset"]["ok"] else None
    del results["warmup"]
    base = RESULTS.get("baselines") or {}
    if base:
        results["decode"] = {"ok": True, "error": "", "seconds": round(base["decode"], 3)}
        results["encoders"] = {"ok": True, "error": "", "seconds": round(base["encoders"], 3)}
    for r in results.values():
        r["images_per_s"] = round(args.images / r["seconds"], 3) if r["ok"] and r["seconds"] > 0 else None
    ours, theirs = results["encode_dataset"], results["comfyui"]
    floor = max(results["decode"]["seconds"], results["encoders"]["seconds"]) if base else 0.0
    report = {"images": args.images, "source_size": args.source_size, "resolution": args.resolution,
              "batch_size": args.batch_size, "checkpoint": args.checkpoint or "random-weight SD1.x (real VAE, CLIP-L)",
              "results": {k: v for k, v in results.items() if k != "baselines"},
              "wall_vs_max_decode_encoders": round(ours["seconds"] / floor, 3) if ours["ok"] and floor else None,
              "images_per_s_vs_comfyui": round(theirs["seconds"] / ours["seconds"], 3)
              if ours["ok"] and theirs["ok"] else None,
              "comfyui_latents": RESULTS.get("comfyui_latents"),
              "preview_seconds": preview,
              "preview_share_of_encode": round(preview / ours["seconds"], 4) if preview and ours["ok"] else None}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.images} JPEGs of {args.source_size} px -> {args.resolution} px, VAE batch {args.batch_size}, "
              f"{report['checkpoint']}")
        print(f"{'configuration':16} {'seconds':>8} {'images/s':>9}")
        for name in ("decode", "encoders", "encode_dataset", "comfyui"):
            r = results.get(name)
            if r is None:
                continue
            if not r["ok"]:
                print(f"{name:16} failed: {r['error']}")
                continue
            print(f"{name:16} {r['seconds']:>8.2f} {r['images_per_s']:>9.2f}")
        print(f"Encode Dataset wall / max(decode, encoders): {report['wall_vs_max_decode_encoders']} (goal <= 1.15)")
        print(f"Encode Dataset images/s / ComfyUI's: {report['images_per_s_vs_comfyui']}")
        print(f"dataset preview: {report['preview_seconds']} s, {report['preview_share_of_encode']} of the encode's "
              "wall time")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
