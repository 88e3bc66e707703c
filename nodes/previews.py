"""What Train LoRA shows while it trains: sample images from the LoRA being trained, as the node's live preview
(ComfyUI's progress-bar preview, the same channel KSampler's previews use).

Samples are drawn by ComfyUI's own sampler with the LoRA as it is at that step. Prompts are encoded once, before
training starts, so the text encoder is never loaded while the diffusion model trains; images are saved with
their step number so a run's progress can be compared afterwards, and shown labelled with step and prompt.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..streaming_cache.train.plot import label_image
from ..streaming_cache.train.spec import PreviewOptions
from .backend import media
from .folders import temp_folder
from .ui import log


def to_pil(image: torch.Tensor) -> Image.Image:
    """A ComfyUI IMAGE ([1, H, W, 3] or [H, W, 3], floats in 0..1) as a PIL image."""
    arr = image.detach().to("cpu", torch.float32)
    arr = arr[0] if arr.dim() == 4 else arr
    return Image.fromarray((arr.clamp(0, 1).numpy() * 255).round().astype(np.uint8))


def temp_image(name: str, image: torch.Tensor) -> dict[str, str]:
    """``image`` saved as a temporary PNG that a node shows in its ``ui`` images (gone when ComfyUI restarts)."""
    folder = temp_folder()
    os.makedirs(folder, exist_ok=True)
    filename = f"{name}_view_{int(time.time() * 1000)}.png"
    to_pil(image).save(os.path.join(folder, filename))
    return {"filename": filename, "subfolder": "", "type": "temp"}


SAMPLE_WIDTH = (256, 512)  # each sample is shown this wide at least and at most (its file keeps its own size)
VIEW_WIDTH = 1024  # the live samples are shown at most this wide


def resized(image: torch.Tensor, width: int) -> torch.Tensor:
    """An IMAGE ([B, H, W, 3]) scaled to ``width`` pixels wide, aspect kept."""
    b, h, w, c = image.shape
    if w == width:
        return image
    out = torch.nn.functional.interpolate(image.permute(0, 3, 1, 2).float(), size=(max(1, round(h * width / w)), width),
                                          mode="bilinear", antialias=width < w, align_corners=False)
    return out.clamp(0, 1).permute(0, 2, 3, 1)


def grid(images: list[torch.Tensor]) -> torch.Tensor:
    """Images side by side ([1, H, sum W, 3]), shorter ones padded white at the bottom."""
    height = max(int(i.shape[-3]) for i in images)
    padded = [torch.nn.functional.pad(i[0] if i.dim() == 4 else i, (0, 0, 0, 0, 0, height - int(i.shape[-3])),
                                      value=1.0) for i in images]
    return torch.cat(padded, dim=1)[None]


class Previews:
    """Encodes the prompts now; :meth:`render` samples them with the model as it is (LoRA included), decodes
    them with the VAE, saves them as ``<folder>/<name>_s<step>_<n>.png`` and returns them side by side, each
    labelled with its step and prompt."""

    def __init__(self, options: PreviewOptions, clip: Any, vae: Any, folder: str, name: str):
        if options.sample_prompts and (clip is None or vae is None):
            raise ValueError("sample previews need the text encoder and the VAE: connect 'clip' and 'vae' to the "
                             "previews options node (or Train LoRA), or leave sample_prompts empty")
        self.options, self.vae, self.folder, self.name = options, vae, folder, name
        prompts = options.sample_prompts
        self.positive = [media.encode_text(clip, p) for p in prompts] if prompts else []
        self.negative = media.encode_text(clip, "") if prompts else None
        self.saved: list[str] = []

    @property
    def enabled(self) -> bool:
        return bool(self.options.sample_prompts)

    def render(self, model: Any, latent_shape: tuple[int, ...], step: int) -> torch.Tensor:
        o = self.options
        latent = torch.zeros((1, *latent_shape[1:]))
        images = []
        os.makedirs(self.folder, exist_ok=True)
        with torch.no_grad():
            for n, (prompt, positive) in enumerate(zip(o.sample_prompts, self.positive)):
                samples = media.sample(model, positive, self.negative, latent, steps=o.sample_steps,
                                       cfg=o.sample_cfg, seed=o.sample_seed + n)
                decoded = self.vae.decode(samples)
                image = decoded.reshape(-1, *decoded.shape[-3:])[:1].to("cpu", torch.float32)  # video: first frame
                path = os.path.join(self.folder, f"{self.name}_s{step:06d}_{n + 1:02d}.png")
                to_pil(image).save(path)
                self.saved.append(path)
                shown = resized(image, min(max(image.shape[2], SAMPLE_WIDTH[0]), SAMPLE_WIDTH[1]))
                images.append(label_image(shown, [f"step {step}", prompt]))
        log.info("saved %d sample previews at step %d in %s", len(images), step, self.folder)
        return grid(images)


class LivePreview:
    """The node's live view while training: the latest sample images, sent through ComfyUI's progress-bar preview
    (the channel KSampler's previews use) when they are drawn. The loss is not drawn here: the browser draws it
    as the node's chart, and the loss plot is an output."""

    def __init__(self, progress_bar: Any):
        self.bar = progress_bar
        self.samples: torch.Tensor | None = None

    def show(self, step: int, total: int, samples: torch.Tensor) -> None:
        self.samples = samples
        shown = resized(samples, VIEW_WIDTH) if samples.shape[2] > VIEW_WIDTH else samples
        self.bar.update_absolute(step, total, ("PNG", to_pil(shown), None))  # None: shown at its own size
