"""Aspect-ratio buckets: the training resolution for an image of any shape.

Every image is resized (cover) and centre-cropped to the bucket whose aspect ratio is closest to its own,
with about ``resolution**2`` pixels and sides that are multiples of ``step`` (64 keeps SD-family latents whole,
Flux-family patches included). Images in one bucket have identical latent shapes, which is what the loader
batches together.
"""

from __future__ import annotations

import math


def bucket_size(width: int, height: int, resolution: int, *, step: int = 64,
                max_aspect: float = 4.0) -> tuple[int, int]:
    """(width, height) of the bucket for a ``width`` x ``height`` image. ``resolution <= 0`` keeps the image's
    own size, rounded down to ``step``."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if resolution <= 0:
        return max(step, width // step * step), max(step, height // step * step)
    aspect = min(max(width / height, 1 / max_aspect), max_aspect)
    area = resolution * resolution
    # Candidate widths around the ideal one; pick the aspect closest to the image's, then the larger area.
    ideal = int(math.sqrt(area * aspect) / step) * step
    candidates = []
    for w in range(max(step, ideal - 2 * step), ideal + 3 * step, step):
        h = max(step, int(area / w / step) * step)
        candidates.append((abs(math.log((w / h) / aspect)), -(w * h), w, h))
    _, _, w, h = min(candidates)
    return w, h


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
