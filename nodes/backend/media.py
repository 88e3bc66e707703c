"""ComfyUI's VAE, text encoder, image loading and sampler as the encoders and the previews use them: the weights a
fingerprint is made of, how files are opened, how a video VAE counts frames, and one image sampled with a
model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import comfy.sample
import node_helpers
import torch
from PIL import Image, ImageOps

SAMPLER, SCHEDULER = "euler", "simple"

# Weights ComfyUI may leave uninitialised because checkpoints lack them (SD1.x has no text projection; ComfyUI
# ignores both when it reports missing keys): their bytes differ from load to load, so they cannot be hashed.
_NOT_LOADED = ("text_projection.weight", "logit_scale")


def vae_weights(vae: Any) -> tuple[dict[str, torch.Tensor], tuple]:
    """The VAE's weights and what else decides its output (model class, dtype), for its fingerprint."""
    model = vae.first_stage_model
    return model.state_dict(), (type(model).__name__, str(vae.vae_dtype))


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


def clip_weights(clip: Any) -> tuple[list[tuple[str, torch.Tensor]], tuple]:
    """The text encoder's weights with any LoRA patched onto it, and what else decides its output (model class,
    clip-skip layer, patch strengths), for its fingerprint."""
    patches = getattr(getattr(clip, "patcher", None), "patches", {}) or {}
    strengths = sorted((k, [(p[0], p[2]) for p in v]) for k, v in patches.items())
    extra = (type(clip.cond_stage_model).__name__, getattr(clip, "layer_idx", None), strengths)
    weights = [(k, v) for k, v in clip.cond_stage_model.state_dict().items() if not k.endswith(_NOT_LOADED)]
    return weights + _patch_tensors(patches), extra


def encode_text(clip: Any, text: str) -> list:
    """A prompt as CONDITIONING, as CLIPTextEncode makes it."""
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def is_video_vae(vae: Any) -> bool:
    """Whether the VAE's latents have a time axis (Wan, HunyuanVideo, LTXV, ...)."""
    return getattr(vae, "latent_dim", 2) == 3


def frame_reducer(vae: Any) -> Callable[[int], int] | None:
    """The function that maps a clip's frame count to its latent frame count, for a video VAE (else None)."""
    ratio = getattr(vae, "downscale_ratio", None)
    return ratio[0] if isinstance(ratio, tuple) and ratio and callable(ratio[0]) else None


def open_image(path: str) -> Image.Image:
    """An image file opened as ComfyUI opens images (its safeguards for large and odd files), EXIF-rotated."""
    img = node_helpers.pillow(Image.open, path)
    return node_helpers.pillow(ImageOps.exif_transpose, img)


def sample(model: Any, positive: list, negative: list, latent: torch.Tensor, *, steps: int, cfg: float,
           seed: int) -> torch.Tensor:
    """One latent sampled from ``latent``'s shape with seeded noise, by ComfyUI's sampler (euler, simple)."""
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, SAMPLER, SCHEDULER, positive, negative, latent, seed=seed,
                               disable_pbar=True)
