"""What TrainLoRA shows while it trains: sample images from the LoRA being trained, and the loss plot, as the
node's live preview (ComfyUI's progress-bar preview, the same channel KSampler's previews use).

Samples are drawn by ComfyUI's own sampler with the LoRA as it is at that step. Prompts are encoded once, before
training starts, so the text encoder is never loaded while the diffusion model trains; images are saved with
their step number so a run's progress can be compared afterwards.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

import comfy.sample
import comfy.utils

from ..streaming_cache.train.plot import loss_plot
from .ui import log

SAMPLER, SCHEDULER = "euler", "simple"


@dataclass(frozen=True)
class PreviewSettings:
    prompts: tuple[str, ...]
    every: int
    steps: int
    cfg: float
    seed: int

    @staticmethod
    def parse(text: str, every: int, steps: int, cfg: float, seed: int) -> "PreviewSettings":
        prompts = tuple(line.strip() for line in (text or "").splitlines() if line.strip())
        return PreviewSettings(prompts, every, steps, cfg, seed)

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)


def to_pil(image: torch.Tensor) -> Image.Image:
    """A ComfyUI IMAGE ([1, H, W, 3] or [H, W, 3], floats in 0..1) as a PIL image."""
    arr = image.detach().to("cpu", torch.float32)
    arr = arr[0] if arr.dim() == 4 else arr
    return Image.fromarray((arr.clamp(0, 1).numpy() * 255).round().astype(np.uint8))


def grid(images: list[torch.Tensor]) -> torch.Tensor:
    """Images side by side ([1, H, sum W, 3]), shorter ones padded white at the bottom."""
    height = max(int(i.shape[-3]) for i in images)
    padded = [torch.nn.functional.pad(i[0] if i.dim() == 4 else i, (0, 0, 0, 0, 0, height - int(i.shape[-3])),
                                      value=1.0) for i in images]
    return torch.cat(padded, dim=1)[None]


def stack(top: torch.Tensor | None, bottom: torch.Tensor) -> torch.Tensor:
    """``top`` above ``bottom`` (both [1, H, W, 3]), centred, on white."""
    if top is None:
        return bottom
    width = max(top.shape[2], bottom.shape[2])

    def widen(t: torch.Tensor) -> torch.Tensor:
        extra = width - t.shape[2]
        return torch.nn.functional.pad(t, (0, 0, extra // 2, extra - extra // 2), value=1.0)

    return torch.cat([widen(top), widen(bottom)], dim=1)


class Previews:
    """Encodes the prompts now; :meth:`render` samples them with the model as it is (LoRA included), decodes
    them with the VAE, saves them as ``<folder>/<name>_s<step>_<n>.png`` and returns them side by side."""

    def __init__(self, settings: PreviewSettings, clip: Any, vae: Any, folder: str, name: str):
        if settings.enabled and (clip is None or vae is None):
            raise ValueError("sample previews need the text encoder and the VAE: connect 'clip' and 'vae' to Train "
                             "LoRA, or leave sample_prompts empty")
        self.settings, self.vae, self.folder, self.name = settings, vae, folder, name
        self.positive = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in settings.prompts] \
            if settings.enabled else []
        self.negative = clip.encode_from_tokens_scheduled(clip.tokenize("")) if settings.enabled else None
        self.saved: list[str] = []

    def due(self, step: int, last: int) -> bool:
        every = self.settings.every
        return self.settings.enabled and (step == last or (every > 0 and step % every == 0))

    def render(self, model: Any, latent_shape: tuple[int, ...], step: int) -> torch.Tensor:
        s = self.settings
        latent = torch.zeros((1, *latent_shape[1:]))
        images = []
        os.makedirs(self.folder, exist_ok=True)
        with torch.no_grad():
            for n, positive in enumerate(self.positive):
                noise = comfy.sample.prepare_noise(latent, s.seed + n)
                samples = comfy.sample.sample(model, noise, s.steps, s.cfg, SAMPLER, SCHEDULER, positive,
                                              self.negative, latent, seed=s.seed + n, disable_pbar=True)
                decoded = self.vae.decode(samples)
                image = decoded.reshape(-1, *decoded.shape[-3:])[:1].to("cpu", torch.float32)  # video: first frame
                path = os.path.join(self.folder, f"{self.name}_s{step:06d}_{n + 1:02d}.png")
                to_pil(image).save(path)
                self.saved.append(path)
                images.append(image)
        log.info("saved %d sample previews at step %d in %s", len(images), step, self.folder)
        return grid(images)


class LivePreview:
    """The node's preview while training: the latest samples above the loss plot, sent at most every
    ``interval`` seconds (and whenever new samples arrive)."""

    def __init__(self, progress_bar: comfy.utils.ProgressBar, interval: float = 3.0):
        self.bar, self.interval = progress_bar, interval
        self.samples: torch.Tensor | None = None
        self.last = 0.0

    def image(self, losses: list[float], validation: list[tuple[int, float]] | None = None) -> torch.Tensor:
        return stack(self.samples, loss_plot(losses, validation=validation or None))

    def update(self, step: int, total: int, losses: list[float], validation: list[tuple[int, float]] | None = None,
               *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        self.bar.update_absolute(step, total, ("PNG", to_pil(self.image(losses, validation)), 1024))
