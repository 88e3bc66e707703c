"""The encoders EncodeDataset caches with: ComfyUI's VAE for images, its CLIP for captions, each with a
fingerprint of its weights (part of every cache key), and image loading into aspect buckets."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

import node_helpers

from ..streaming_cache.builder import Encoder, Item, Part
from ..streaming_cache.train.buckets import bucket_size, crop_box
from ..streaming_cache.train.fingerprint import fingerprint_tensors


def vae_fingerprint(vae: Any) -> str:
    return "vae:" + fingerprint_tensors(vae.first_stage_model.state_dict(),
                                        extra=(type(vae.first_stage_model).__name__, str(vae.vae_dtype)))


def _patch_tensors(patches: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for key, plist in sorted(patches.items()):
        for n, p in enumerate(plist):
            value = p[1] if len(p) > 1 else None
            weights = getattr(value, "weights", value)
            for m, t in enumerate(weights if isinstance(weights, (tuple, list)) else [weights]):
                if isinstance(t, torch.Tensor):
                    out.append((f"{key}#{n}.{m}", t))
    return out


# Weights ComfyUI may leave uninitialised because checkpoints lack them (SD1.x has no text projection; ComfyUI
# ignores both when it reports missing keys): their bytes differ from load to load, so they cannot be hashed.
_NOT_LOADED = ("text_projection.weight", "logit_scale")


def clip_fingerprint(clip: Any) -> str:
    """Weights, clip-skip layer and any LoRA patches applied to the text encoder."""
    patches = getattr(getattr(clip, "patcher", None), "patches", {}) or {}
    strengths = sorted((k, [(p[0], p[2]) for p in v]) for k, v in patches.items())
    extra = (type(clip.cond_stage_model).__name__, getattr(clip, "layer_idx", None), strengths)
    weights = [(k, v) for k, v in clip.cond_stage_model.state_dict().items() if not k.endswith(_NOT_LOADED)]
    return "clip:" + fingerprint_tensors(weights + _patch_tensors(patches), extra=extra)


def load_image(path: str) -> Image.Image:
    img = node_helpers.pillow(Image.open, path)
    img = node_helpers.pillow(ImageOps.exif_transpose, img)
    if img.mode == "I":
        img = img.point(lambda i: i * (1 / 255))
    return img.convert("RGB")


def to_bucket(img: Image.Image, resolution: int) -> torch.Tensor:
    """Cover-resize and centre-crop to the image's aspect bucket; [H, W, 3] floats in 0..1."""
    bucket = bucket_size(img.width, img.height, resolution)
    scale, left, top, right, bottom = crop_box(img.width, img.height, bucket)
    size = (max(bucket[0], round(img.width * scale)), max(bucket[1], round(img.height * scale)))
    if size != img.size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    img = img.crop((left, top, right, bottom))
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)


def image_encoder(vae: Any, resolution: int, batch_size: int) -> Encoder:
    def encode(parts: list[Part]) -> list[dict[str, torch.Tensor]]:
        pixels = []
        for p in parts:
            if p.path is not None:
                pixels.append(to_bucket(load_image(p.path), resolution))
            else:  # an IMAGE from another node, carried as float32 bytes
                h, w, c = p.params["shape"]
                arr = torch.frombuffer(bytearray(p.data or b""), dtype=torch.float32).reshape(h, w, c)[..., :3]
                img = Image.fromarray((arr.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
                pixels.append(to_bucket(img, resolution))
        out: list[Any] = [None] * len(parts)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixels):
            by_shape.setdefault(tuple(px.shape), []).append(i)
        for idx in by_shape.values():
            latents = vae.encode(torch.stack([pixels[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i] = {"samples": latents[j:j + 1].to("cpu").contiguous()}
        return out

    return Encoder(vae_fingerprint(vae), encode, {"resolution": resolution, "bucket_step": 64}, batch_size)


def text_encoder(clip: Any, batch_size: int) -> Encoder:
    def encode(parts: list[Part]) -> list[Any]:
        out = []
        for p in parts:
            text = (p.data or b"").decode("utf-8")
            cond = clip.encode_from_tokens_scheduled(clip.tokenize(text))
            out.append([[c.to("cpu").contiguous(), {k: (v.to("cpu").contiguous() if isinstance(v, torch.Tensor) else v)
                                                     for k, v in extra.items()}] for c, extra in cond])
        return out

    return Encoder(clip_fingerprint(clip), encode, {}, batch_size)


def tensor_items(images: torch.Tensor, captions: str) -> list[Item]:
    lines = captions.splitlines() if captions else []
    items = []
    for i in range(images.shape[0]):
        img = images[i].detach().to("cpu", torch.float32).contiguous()
        caption = lines[min(i, len(lines) - 1)].strip() if lines else ""
        items.append(Item(f"image{i:05d}", {
            "latent": Part(data=img.numpy().tobytes(), params={"shape": list(img.shape)}),
            "cond": Part(data=caption.encode("utf-8"))}))
    return items
