"""A self-contained demonstration of the engine on a generated sample dataset.

It writes small PPM images with kohya-style captions (``name.txt`` beside ``name.ppm``, some captions shared),
encodes them with two toy encoders standing in for a VAE and a text encoder, then shows what the cache does:
a second build encodes nothing, editing one image re-encodes exactly that image, identical captions are
encoded once, and every entry verifies.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from .builder import BuildReport, Encoder, Item, Part, build
from .reader import open_cache

_CAPTIONS = ["a red square", "a blue circle", "a green triangle", "a red square", "a yellow star", "a blue circle"]


def write_ppm(path: str, seed: int, size: int = 64) -> None:
    g = torch.Generator().manual_seed(seed)
    img = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8)
    with open(path, "wb") as f:
        f.write(f"P6 {size} {size} 255\n".encode() + img.numpy().tobytes())


def read_ppm(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        raw = f.read()
    magic, w, h, maxval, data = raw.split(maxsplit=4)
    if magic != b"P6" or maxval != b"255":
        raise ValueError(f"{path}: not a binary 8-bit PPM image")
    w, h = int(w), int(h)
    if len(data) < w * h * 3:
        raise ValueError(f"{path}: truncated image data")
    pixels = torch.frombuffer(bytearray(data[: w * h * 3]), dtype=torch.uint8).reshape(h, w, 3)
    return pixels.permute(2, 0, 1).float() / 255.0


def toy_vae(parts: list[Part]) -> list[dict[str, Any]]:
    """Stands in for a VAE: 8x average pooling to a 4-channel latent, batched."""
    images = torch.stack([read_ppm(p.path) for p in parts])  # type: ignore[arg-type]
    pooled = torch.nn.functional.avg_pool2d(images, 8)
    latents = torch.cat([pooled, pooled.mean(1, keepdim=True)], dim=1)
    return [{"samples": latents[i:i + 1].clone()} for i in range(len(parts))]


def toy_text_encoder(parts: list[Part]) -> list[list[Any]]:
    """Stands in for CLIP: a hashed bag-of-words embedding, in ComfyUI's CONDITIONING layout."""
    out = []
    for p in parts:
        words = (p.data or b"").decode("utf-8").split()
        tokens = torch.zeros(1, 8, 32)
        for i, w in enumerate(words[:8]):
            g = torch.Generator().manual_seed(sum(w.encode()))
            tokens[0, i] = torch.randn(32, generator=g)
        out.append([[tokens, {"pooled_output": tokens.mean(1)}]])
    return out


def sample_items(folder: str) -> list[Item]:
    items = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".ppm"):
            with open(os.path.join(folder, name[:-4] + ".txt"), "rb") as f:
                caption = f.read().strip()
            items.append(Item(name, {"latent": Part(path=os.path.join(folder, name)), "cond": Part(data=caption)}))
    return items


def run_demo(workdir: str, json_output: bool = False, out: Callable[..., None] = print) -> int:
    images = os.path.join(workdir, "images")
    cache = os.path.join(workdir, "cache")
    os.makedirs(images, exist_ok=True)
    for i, caption in enumerate(_CAPTIONS * 4):
        write_ppm(os.path.join(images, f"img{i:03d}.ppm"), seed=i)
        with open(os.path.join(images, f"img{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(caption)
    encoders = {"latent": Encoder("toy-vae-v1", toy_vae, {"downscale": 8}, batch_size=8),
                "cond": Encoder("toy-text-v1", toy_text_encoder, batch_size=8)}
    steps: dict[str, BuildReport] = {}
    steps["first build"] = build(cache, sample_items(images), encoders, manifest="demo")
    steps["second build (nothing changed)"] = build(cache, sample_items(images), encoders, manifest="demo")
    write_ppm(os.path.join(images, "img005.ppm"), seed=1000)
    steps["after editing img005.ppm"] = build(cache, sample_items(images), encoders, manifest="demo")
    with open_cache(cache) as reader:
        handle = reader.dataset("demo")
        first = handle[0].materialize()
        verify = reader.verify()
    result = {
        "cache": os.path.abspath(cache),
        "builds": {k: {"encoded": r.encoded, "reused": r.reused, "deduplicated": r.deduplicated,
                       "failed": r.failed, "rows": r.rows, "seconds": round(r.seconds, 3)} for k, r in steps.items()},
        "rows": len(handle),
        "first_row": {"latent": list(first["latent"]["samples"].shape), "cond": list(first["cond"][0][0].shape)},
        "verify_ok": verify.ok,
    }
    if json_output:
        out(json.dumps(result, indent=2))
    else:
        out(f"sample dataset: {len(_CAPTIONS) * 4} images in {images} ({len(set(_CAPTIONS))} distinct captions)")
        for label, r in steps.items():
            out(f"{label:>32}: {r.summary()}")
        out(f"dataset handle: {handle}")
        out(f"first row: latent {result['first_row']['latent']}, conditioning {result['first_row']['cond']}")
        out(f"verify: {'OK' if verify.ok else verify.damaged}")
        out(f"inspect it with: python -m streaming_cache info {cache}")
    return 0 if verify.ok else 1
