"""Aspect-ratio buckets: the training resolution for an image of any shape.

Every image is resized (cover) and centre-cropped to the bucket whose aspect ratio is closest to its own,
with about ``resolution**2`` pixels and sides that are multiples of ``step`` (64 keeps SD-family latents whole,
Flux-family patches included). Images in one bucket have identical latent shapes, which is what the loader
batches together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BUCKET_STEPS = (16, 32, 64, 128)
"""The side steps a bucket may take: 64 keeps every family's latents whole (SD's UNets halve the latent three
times); 16 and 32 suit DiTs with 2 x 2 patches of an 8x VAE (Flux, SD3, Qwen-Image), not SD1.x or SDXL."""


def bucket_size(width: int, height: int, resolution: int, *, step: int = 64, max_aspect: float = 4.0,
                min_side: int = 0, max_side: int = 0) -> tuple[int, int]:
    """(width, height) of the bucket for a ``width`` x ``height`` image. ``resolution <= 0`` keeps the image's
    own size, rounded down to ``step``. ``min_side`` / ``max_side`` (0: no limit): no side of a bucket is shorter
    or longer (kohya's ``min_bucket_reso`` / ``max_bucket_reso``); the aspect closest to the image's within them."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    lo = max(step, -(-min_side // step) * step) if min_side else step
    hi = max(lo, max_side // step * step) if max_side else 0

    def bounded(side: int) -> int:
        side = max(lo, side)
        return min(hi, side) if hi else side

    if resolution <= 0:
        return bounded(width // step * step), bounded(height // step * step)
    aspect = min(max(width / height, 1 / max_aspect), max_aspect)
    area = resolution * resolution
    # Candidate widths around the ideal one; pick the aspect closest to the image's, then the larger area.
    ideal = int(math.sqrt(area * aspect) / step) * step
    candidates = []
    for w in range(max(step, ideal - 2 * step), ideal + 3 * step, step):
        bw, bh = bounded(w), bounded(max(step, int(area / w / step) * step))
        candidates.append((abs(math.log((bw / bh) / aspect)), -(bw * bh), bw, bh))
    _, _, w, h = min(candidates)
    return w, h


@dataclass(frozen=True)
class BucketRule:
    """How images are bucketed beyond the resolution: the ``step`` of their sides and the shortest and longest
    side (0: no limit), as kohya's ``bucket_reso_steps``, ``min_bucket_reso`` and ``max_bucket_reso``."""

    step: int = 64
    min_side: int = 0
    max_side: int = 0

    def __post_init__(self) -> None:
        if self.step not in BUCKET_STEPS:
            raise ValueError(f"bucket_step must be one of {', '.join(map(str, BUCKET_STEPS))}, got {self.step}")
        if self.min_side < 0 or self.max_side < 0 or (self.max_side and self.max_side < self.min_side):
            raise ValueError(f"the bucket sides must be 0 (no limit) or positive, the longest no shorter than the "
                             f"shortest; got min {self.min_side}, max {self.max_side}")
        if self.max_side and self.max_side < self.step:
            raise ValueError(f"max_bucket_side {self.max_side} is below the bucket step {self.step}")

    def size(self, width: int, height: int, resolution: int) -> tuple[int, int]:
        """The bucket of a ``width`` x ``height`` image at ``resolution`` (:func:`bucket_size`)."""
        return bucket_size(width, height, resolution, step=self.step, min_side=self.min_side,
                           max_side=self.max_side)

    def settings(self) -> dict[str, Any]:
        """The rule as an encoder's settings (part of every cache key it makes): the limits only where set, so
        a cache made before they came keeps its keys."""
        return {"bucket_step": self.step, **({"bucket_min_side": self.min_side} if self.min_side else {}),
                **({"bucket_max_side": self.max_side} if self.max_side else {})}


def crop_box(width: int, height: int, bucket: tuple[int, int]) -> tuple[float, int, int, int, int]:
    """Scale factor and centre crop (left, top, right, bottom, in scaled pixels) that map an image onto a bucket."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    sw, sh = max(bw, round(width * scale)), max(bh, round(height * scale))
    left, top = (sw - bw) // 2, (sh - bh) // 2
    return scale, left, top, left + bw, top + bh


MAX_RESOLUTIONS = 8


def parse_resolutions(text: str, step: int = 64) -> tuple[int, ...]:
    """The resolutions of a text such as ``"512, 768, 1024"`` (ai-toolkit's ``resolution: [512, 768, 1024]``), in
    order, each once: whole numbers from ``step`` to 4096, at most :data:`MAX_RESOLUTIONS`."""
    out: list[int] = []
    for item in (text or "").replace(";", ",").replace(" ", ",").split(","):
        if not item.strip():
            continue
        if not item.strip().isdigit() or not step <= int(item) <= 4096:
            raise ValueError(f"resolutions: {item.strip()!r} is not a resolution from {step} to 4096 (write them "
                             "separated by commas: 512, 768, 1024)")
        if int(item) not in out:
            out.append(int(item))
    if len(out) > MAX_RESOLUTIONS:
        raise ValueError(f"resolutions: {len(out)} given, at most {MAX_RESOLUTIONS} (each one encodes the dataset "
                         "once more)")
    return tuple(out)


DEFAULT_BUCKETS = BucketRule()
"""Sides in steps of 64, no limits: how every cache before the bucket settings was made."""
