"""What Train LoRA shows while it trains: sample images from the LoRA being trained, and the loss plot, as the
node's live preview (ComfyUI's progress-bar preview, the same channel KSampler's previews use), and the final
view it keeps after the run.

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

from ..streaming_cache.train.plot import label_image, loss_plot
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
VIEW_WIDTH = 1024  # the live view is at most this wide


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
    """The node's view while training: the latest samples above the loss plot (with the learning rate and, at
    the top, steps, speed and time left). Sent to the node at most every ``interval`` seconds, whenever new
    samples arrive, and once more at the end, so the last view shows the last step."""

    def __init__(self, progress_bar: Any, *, log_scale: bool = False, learning_rates: Any = None,
                 interval: float = 3.0):
        self.bar, self.interval, self.log_scale = progress_bar, interval, log_scale
        self.learning_rates = learning_rates
        self.samples: torch.Tensor | None = None
        self.datasets: dict[str, list[tuple[int, float]]] = {}  # a mix: each dataset's loss, as far as known
        self.last = 0.0

    def image(self, losses: list[float], validation: list[tuple[int, float]] | None = None,
              status: str | None = None) -> torch.Tensor:
        rates = self.learning_rates(len(losses)) if self.learning_rates is not None else None
        samples = self.samples
        if samples is not None and samples.shape[2] > VIEW_WIDTH:
            samples = resized(samples, VIEW_WIDTH)
        width = min(VIEW_WIDTH, max(512, samples.shape[2] if samples is not None else 0))
        plot = loss_plot(losses, width, width // 2, validation=validation or None, log_scale=self.log_scale,
                         learning_rates=rates, status=status, datasets=self.datasets or None)
        return stack(samples, plot)

    def update(self, step: int, total: int, losses: list[float], validation: list[tuple[int, float]] | None = None,
               *, status: str | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        self.bar.update_absolute(step, total, ("PNG", to_pil(self.image(losses, validation, status)), 1024))
