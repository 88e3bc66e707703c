"""Toy stand-ins for a VAE and a text encoder, and folders of small images with captions beside them.

The demo, the crash harness and the tests build caches from these when no real model is at hand. Images are
binary PPM files (readable with no imaging library); the toy VAE 8x average-pools their pixels into a
4-channel latent, and the toy text encoder embeds each word with a generator seeded by the word, in ComfyUI's
CONDITIONING layout. Both are deterministic, so a resumed build can be compared with an uninterrupted one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..builder import Encoder, Item, Part


def write_ppm(path: str, seed: int, size: int = 64) -> None:
    g = torch.Generator().manual_seed(seed)
    img = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8)
    with open(path, "wb") as f:
        f.write(f"P6 {size} {size} 255\n".encode() + img.numpy().tobytes())


def read_ppm(path: str) -> torch.Tensor:
    """A binary 8-bit PPM as a [3, H, W] float tensor in 0..1."""
    with open(path, "rb") as f:
        raw = f.read()
    parts = raw.split(maxsplit=4)
    if len(parts) != 5 or parts[0] != b"P6" or parts[3] != b"255":
        raise ValueError(f"{path}: not a binary 8-bit PPM image")
    w, h, data = int(parts[1]), int(parts[2]), parts[4]
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
        words = (p.data or b"").decode("utf-8", errors="replace").split()
        tokens = torch.zeros(1, 8, 32)
        for i, w in enumerate(words[:8]):
            g = torch.Generator().manual_seed(sum(w.encode()))
            tokens[0, i] = torch.randn(32, generator=g)
        out.append([[tokens, {"pooled_output": tokens.mean(1)}]])
    return out


def toy_encoders(batch_size: int = 8, sleep_s: float = 0.0) -> dict[str, Encoder]:
    """``latent`` and ``cond`` encoders; ``sleep_s`` per part simulates a model's time (for kill tests)."""

    def slow(fn: Any) -> Any:
        def encode(parts: list[Part]) -> Any:
            time.sleep(sleep_s * len(parts))
            return fn(parts)
        return encode

    return {"latent": Encoder("toy-vae-v1", slow(toy_vae), {"downscale": 8}, batch_size),
            "cond": Encoder("toy-text-v1", slow(toy_text_encoder), batch_size=batch_size)}


def write_folder(folder: str, captions: list[str], *, seed: int = 0, size: int = 64) -> None:
    """``img000.ppm`` + ``img000.txt`` ... one per caption, with distinct random pixels."""
    os.makedirs(folder, exist_ok=True)
    for i, caption in enumerate(captions):
        write_ppm(os.path.join(folder, f"img{i:03d}.ppm"), seed=seed + i, size=size)
        with open(os.path.join(folder, f"img{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(caption)


def folder_items(folder: str) -> list[Item]:
    """One item per ``*.ppm`` with its ``.txt`` caption (the bytes as they are), in name order."""
    items = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".ppm"):
            with open(os.path.join(folder, name[:-4] + ".txt"), "rb") as f:
                caption = f.read().strip()
            items.append(Item(name, {"latent": Part(path=os.path.join(folder, name)), "cond": Part(data=caption)}))
    return items
