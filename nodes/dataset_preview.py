"""The dataset preview of Encode Dataset and Load Streaming Cache: a page of the samples as the trainer sees them
(``streaming_cache.dataset_view``), shown on the node, given as an IMAGE output for headless runs, and summarised
in the node's text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from comfy_api.latest import io

from ..streaming_cache import dataset_view
from ..streaming_cache.builder import Item
from ..streaming_cache.reader import CacheReader
from .backend import compat
from .previews import temp_image

PAGE_TOOLTIP = (f"Which page of the dataset preview to show ({dataset_view.PER_PAGE} samples a page, in the order "
                "of the dataset): each sample as cropped into its bucket, its caption and loss mask, then how many "
                "samples each bucket holds and which files failed. 0 shows none.")


def page_input() -> io.Int.Input:
    """Optional: it was added to existing nodes, whose saved prompts lack it."""
    return io.Int.Input("preview_page", default=1, min=0, max=100000, tooltip=PAGE_TOOLTIP, optional=True)


def output() -> io.Image.Output:
    return io.Image.Output("preview", display_name="preview",
                           tooltip="The dataset preview page as an image (for Preview Image or Save Image; a 64 px "
                                   "blank image when preview_page is 0).")


def blank() -> torch.Tensor:
    """The preview output where there is none (page 0, a cancelled or other-rank encode)."""
    return torch.ones(1, 64, 64, 3)


def captions_of(items: Sequence[Item], column: str = "cond") -> dict[str, str]:
    """Row name -> caption text, from the builder items (where the caption is the part's UTF-8 bytes)."""
    out = {}
    for item in items:
        part = item.parts.get(column)
        if part is not None and part.data is not None and part.path is None:
            out[item.name] = bytes(part.data).decode("utf-8", errors="replace")
    return out


def _projection() -> dataset_view.LatentToRGB:
    """ComfyUI's latent-to-RGB preview factors for the latents' channel count, chosen per shape."""
    chosen: dict[tuple[int, bool], dataset_view.LatentToRGB] = {}

    def to_rgb(latent: torch.Tensor) -> torch.Tensor:
        key = (int(latent.shape[0]), latent.dim() == 4)
        if key not in chosen:
            chosen[key] = compat.latent_projection(*key) or dataset_view.channels_as_rgb
        return chosen[key](latent)

    return to_rgb


def vae_scale(vae: Any) -> int | None:
    """Pixels per latent pixel of ``vae`` (ComfyUI's ``downscale_ratio``; a video VAE's spatial one)."""
    ratio = getattr(vae, "downscale_ratio", None)
    if isinstance(ratio, (tuple, list)):
        ratio = ratio[-1]
    return ratio if isinstance(ratio, int) and ratio > 0 else None


def preview(reader: CacheReader, manifest: str, page: int, *, name: str, captions: Mapping[str, str] | None = None,
            scale: int | None = None) -> tuple[torch.Tensor, list[dict[str, str]], str]:
    """The preview ``page`` of ``manifest``: the IMAGE, the node's ``ui`` images and a line of text (buckets and
    failures counted over the whole dataset). Page 0: a blank image and no line."""
    if page <= 0:
        return blank(), [], ""
    view = dataset_view.dataset_page(reader, manifest, page=page, to_rgb=_projection(), captions=captions,
                                     scale=scale, title=name)
    image = torch.from_numpy(view.image)[None]
    buckets = ", ".join(f"{dataset_view.bucket_label(b, scale)} {n}" for b, n in list(view.buckets.items())[:4])
    more = f", {len(view.buckets) - 4} more" if len(view.buckets) > 4 else ""
    text = (f"preview page {view.page} of {view.pages} ({view.samples} samples an epoch, repeats counted); "
            f"{len(view.buckets)} buckets: {buckets}{more}"
            + (f"; {len(view.failures)} failed in the cache" if view.failures else ""))
    return image, [temp_image(f"{name}_dataset", image)], text
