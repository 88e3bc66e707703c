"""A page of a cached dataset as one image: what the trainer will see, before hours are spent on it.

A person about to train wants to check each sample as it was cropped into its bucket, its caption, its loss mask,
how many samples each bucket holds, and which files failed and why. :func:`dataset_page` draws that from a cache
and one of its manifests: the bucket histogram and the failures come from the index and the manifest alone (no
tensor is read); only the samples of the requested page are read, so a dataset of any size is shown a page at a
time in bounded memory. The tiles show the cached latents themselves through a linear latent-to-RGB projection
(the one ComfyUI's sampler previews use, given by the caller), so they cost no VAE decode and show exactly the
crop that was encoded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .manifest import Manifest
from .reader import CacheReader
from .train.plot import draw_text, fit_text, text_height

PER_PAGE = 24
MAX_PER_PAGE = 96
_TILE = 160
_BG, _TEXT, _DIM, _BAR, _MASK = (1.0, 1.0, 1.0), (0.15, 0.15, 0.15), (0.45, 0.45, 0.45), (0.10, 0.30, 0.80), \
    (0.90, 0.10, 0.10)

LatentToRGB = Callable[[torch.Tensor], torch.Tensor]
"""Turns one cached latent ``[C, H, W]`` (or a clip's ``[C, T, H, W]``, shown by its middle frame) into RGB
``[H, W, 3]`` in [0, 1]: the caller's model-specific projection, or :func:`channels_as_rgb`."""


@dataclass(frozen=True)
class Sample:
    """One manifest row as the index describes it: no tensor data."""

    name: str
    repeats: int
    index: int  # the latent entry's position in the cache
    shape: tuple[int, ...]  # the latent's shape

    @property
    def bucket(self) -> tuple[int, ...]:
        """The latent's spatial size (frames, height, width for clips; height, width for images)."""
        return self.shape[1:]


@dataclass
class DatasetPage:
    """What :func:`dataset_page` found: the image, and the numbers the node's text reports."""

    image: np.ndarray  # H x W x 3 float32 in [0, 1]
    page: int  # 1-based, clamped to the pages there are
    pages: int
    samples: int  # rows counted with their repeats
    rows: int
    buckets: dict[tuple[int, ...], int]  # spatial latent size -> samples (with repeats), largest first
    failures: list[tuple[str, str]]  # (item, reason) as the manifest recorded them


def samples_of(reader: CacheReader, manifest: Manifest, column: str = "latent") -> list[Sample]:
    """Every row of ``manifest`` with its ``column`` entry's shape, from the index (a row whose entry is missing
    is left out: the handle would refuse it too)."""
    out = []
    for row in manifest.rows:
        key = row.keys.get(column)
        i = None if key is None else reader.index_of(key)
        if i is None:
            continue
        infos = reader.tensor_info(i)
        if infos:
            out.append(Sample(row.name, row.repeats, i, _unbatched(tuple(max(infos, key=lambda t: t.nbytes).shape))))
    return out


def _unbatched(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A latent's shape without the batch of one VAE encoders return (``[1, C, H, W]`` -> ``[C, H, W]``)."""
    return shape[1:] if len(shape) in (4, 5) and shape[0] == 1 else shape


def bucket_counts(samples: Sequence[Sample]) -> dict[tuple[int, ...], int]:
    """Samples per bucket (spatial latent size), repeats counted, the fullest bucket first."""
    counts: Counter[tuple[int, ...]] = Counter()
    for s in samples:
        counts[s.bucket] += s.repeats
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def bucket_label(bucket: tuple[int, ...], scale: int | None) -> str:
    """``W x H`` in pixels (the latent size times the VAE's ``scale``; the latent's own size where the scale is
    not known), with the frames of a clip."""
    *frames, h, w = bucket
    size = f"{w * scale}x{h * scale}" if scale else f"latent {w}x{h}"
    return f"{size}, {frames[0]} latent frames" if frames else size


def middle_frame(latent: torch.Tensor) -> torch.Tensor:
    """``[C, H, W]`` of a latent, a clip's ``[C, T, H, W]`` by its middle frame."""
    return latent[:, latent.shape[1] // 2] if latent.dim() == 4 else latent


def channels_as_rgb(latent: torch.Tensor) -> torch.Tensor:
    """A projection for latents of an unknown model: the first three channels, each stretched to [0, 1]."""
    x = middle_frame(latent).float()[:3]
    if x.shape[0] < 3:
        x = torch.cat([x, x[-1:].expand(3 - x.shape[0], *x.shape[1:])])
    lo = x.flatten(1).min(1).values.view(3, 1, 1)
    hi = x.flatten(1).max(1).values.view(3, 1, 1)
    return ((x - lo) / (hi - lo).clamp_min(1e-6)).permute(1, 2, 0)


def _picture(latent: torch.Tensor, to_rgb: LatentToRGB) -> np.ndarray:
    if latent.dim() not in (3, 4):
        raise ValueError(f"a latent of shape {tuple(latent.shape)} cannot be shown")
    return to_rgb(latent).clamp(0, 1).to(torch.float32).numpy()


def _resize(image: np.ndarray, h: int, w: int) -> np.ndarray:
    """Nearest-neighbour resize (tiles are small; no filtering dependency)."""
    ys = np.minimum((np.arange(h) + 0.5) * image.shape[0] / h, image.shape[0] - 1).astype(int)
    xs = np.minimum((np.arange(w) + 0.5) * image.shape[1] / w, image.shape[1] - 1).astype(int)
    return image[ys][:, xs]


def _outline(mask: np.ndarray) -> np.ndarray:
    """The border pixels of the region where ``mask`` >= 0.5 (the loss is counted inside it)."""
    inside = mask >= 0.5
    padded = np.pad(inside, 1, mode="edge")
    interior = padded[1:-1, 1:-1] & padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return inside & ~interior


def _tile(canvas: np.ndarray, x: int, y: int, size: int, picture: np.ndarray, mask: np.ndarray | None,
          lines: Sequence[str]) -> None:
    h, w = picture.shape[:2]
    k = size / max(h, w)
    th, tw = max(1, round(h * k)), max(1, round(w * k))
    px, py = x + (size - tw) // 2, y + (size - th) // 2
    canvas[py:py + th, px:px + tw] = _resize(picture, th, tw)
    if mask is not None and mask.size:
        edge = _outline(_resize(mask.astype(np.float32), th, tw))
        canvas[py:py + th, px:px + tw][edge] = _MASK
    line_h = text_height()
    for i, line in enumerate(lines):
        draw_text(canvas, fit_text(line, size), x, y + size + 2 + i * line_h, _TEXT if i == 0 else _DIM)


def _histogram(canvas: np.ndarray, x: int, y: int, width: int, buckets: Mapping[tuple[int, ...], int],
               scale: int | None, rows: int) -> None:
    line_h = text_height()
    shown = list(buckets.items())[:rows]
    if len(buckets) > rows:
        rest = sum(list(buckets.values())[rows - 1:])
        shown = shown[:rows - 1] + [((), rest)]
    labels = [bucket_label(b, scale) if b else f"{len(buckets) - rows + 1} more buckets" for b, _ in shown]
    label_w = min(width // 2, max((len(s) for s in labels), default=1) * 7 + 8)
    top = max(buckets.values(), default=1)
    for i, ((_, n), label) in enumerate(zip(shown, labels)):
        yy = y + i * (line_h + 4)
        draw_text(canvas, fit_text(label, label_w - 6), x, yy, _TEXT)
        bar = max(1, round((width - label_w - 60) * n / top))
        canvas[yy + 2:yy + line_h - 1, x + label_w:x + label_w + bar] = _BAR
        draw_text(canvas, str(n), x + label_w + bar + 6, yy, _TEXT)


def read_manifest(reader: CacheReader, name: str) -> Manifest:
    """Manifest ``name`` of the cache, validated (a cache's bytes are untrusted)."""
    return Manifest.from_json(reader.manifest_bytes(name), f"{reader.index.path}: manifest {name!r}")


def dataset_page(reader: CacheReader, manifest: str | Manifest = "default", *, page: int = 1,
                 per_page: int = PER_PAGE,
                 to_rgb: LatentToRGB | None = None, captions: Mapping[str, str] | None = None,
                 scale: int | None = None, title: str = "", column: str = "latent", mask_column: str = "mask",
                 columns: int = 6) -> DatasetPage:
    """Page ``page`` (1-based, clamped) of ``manifest``'s samples, ``per_page`` tiles each with its name,
    bucket (``scale``: the VAE's pixels per latent pixel) and caption (``captions``: row name -> text, where the
    caller knows them; a cache keeps only their encodings), the loss mask's outline where the row has one, then
    the bucket histogram and the failures. Reads the tensors of this page's rows only."""
    if isinstance(manifest, str):
        manifest = read_manifest(reader, manifest)
    per_page = max(1, min(int(per_page), MAX_PER_PAGE))
    samples = samples_of(reader, manifest, column)
    pages = max(1, math.ceil(len(samples) / per_page))
    page = min(max(1, int(page)), pages)
    shown = samples[(page - 1) * per_page:page * per_page]
    buckets = bucket_counts(samples)
    failures = [(f.item, f.error) for f in manifest.failed]
    to_rgb = to_rgb or channels_as_rgb

    line_h = text_height()
    cols = max(1, min(columns, len(shown) or 1))
    cell_w, cell_h = _TILE + 12, _TILE + 3 * line_h + 10
    grid_rows = math.ceil(len(shown) / cols) if shown else 0
    hist_rows = min(len(buckets), 8)
    fail_rows = min(len(failures), 5) + (1 if len(failures) > 5 else 0)
    width = max(cols * cell_w + 12, 480)
    height = 10 + line_h + 8 + grid_rows * cell_h + (line_h + 6) + hist_rows * (line_h + 4) + 8 + \
        ((line_h + 6) + fail_rows * line_h if failures else 0) + 8
    canvas = np.empty((height, width, 3), dtype=np.float32)
    canvas[:] = _BG
    total = sum(s.repeats for s in samples)
    head = f"{title + ': ' if title else ''}{total} samples in {len(buckets)} buckets; page {page} of {pages}"
    draw_text(canvas, fit_text(head, width - 20), 10, 10, _TEXT)
    y0 = 10 + line_h + 8
    mask_keys = {row.name: row.keys.get(mask_column) for row in manifest.rows}
    for k, s in enumerate(shown):
        entry = reader.materialize(s.index)
        latent = entry["samples"] if isinstance(entry, dict) and "samples" in entry else entry
        if not isinstance(latent, torch.Tensor):
            raise ValueError(f"entry {s.name!r}: column {column!r} holds no latent tensor")
        latent = latent[0] if latent.dim() in (4, 5) and latent.shape[0] == 1 else latent
        mask = None
        key = mask_keys.get(s.name)
        j = None if key is None else reader.index_of(key)
        if j is not None:
            m = reader.materialize(j)
            m = m.get("mask") if isinstance(m, dict) else m
            if isinstance(m, torch.Tensor) and m.dim() >= 2 and m.numel() and float(m.min()) < 0.5:
                mask = m.float().reshape(-1, *m.shape[-2:])[0].numpy()
        caption = (captions or {}).get(s.name)
        lines = [f"{s.name}" + (f" x{s.repeats}" if s.repeats > 1 else ""), bucket_label(s.bucket, scale),
                 caption if caption is not None else "(no caption in the cache)"]
        x, y = 10 + (k % cols) * cell_w, y0 + (k // cols) * cell_h
        _tile(canvas, x, y, _TILE, _picture(latent, to_rgb), mask, lines)
    y = y0 + grid_rows * cell_h
    draw_text(canvas, "samples per bucket", 10, y, _TEXT)
    _histogram(canvas, 10, y + line_h + 6, width - 20, buckets, scale, max(1, hist_rows))
    y += (line_h + 6) + hist_rows * (line_h + 4) + 8
    if failures:
        draw_text(canvas, f"{len(failures)} failed", 10, y, _MASK)
        for i, (item, error) in enumerate(failures[:5]):
            draw_text(canvas, fit_text(f"{item}: {error}", width - 30), 20, y + (i + 1) * line_h + 4, _DIM)
        if len(failures) > 5:
            draw_text(canvas, f"... and {len(failures) - 5} more (in the node's text)", 20, y + 6 * line_h + 4, _DIM)
    return DatasetPage(canvas, page, pages, total, len(samples), buckets, failures)
