"""The dataset preview of Encode Dataset and Load Streaming Cache: a page of the samples as the trainer sees them
(``streaming_cache.dataset_view``), shown on the node with a pager the browser turns through the pack's route
(no input of the graph changes), given as an IMAGE output for headless runs, and summarised in the node's text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from comfy_api.latest import io

from ..streaming_cache import dataset_view, preview_pages
from ..streaming_cache.builder import Item
from ..streaming_cache.reader import CacheReader
from .backend import compat
from .previews import temp_image
from .ui import log

PAGE_TOOLTIP = (f"The page of the dataset preview the preview output holds and the node shows first "
                f"({dataset_view.PER_PAGE} samples a page, in the order of the dataset): each sample as cropped into "
                "its bucket, its caption and loss mask, then how many samples each bucket holds and which files "
                "failed. Turn pages with the arrows on the node (nothing re-runs). 0 shows none.")


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


PAGES = preview_pages.PreviewPages()
"""The previews the browser can page through (see ``streaming_cache.preview_pages``)."""
ROUTE = "/streaming_cache/dataset_preview"


def answer(query: Mapping[str, str]) -> tuple[int, dict]:
    """``GET ROUTE?token=T&page=K``: page K of the preview registered as T, or an error the browser shows."""
    try:
        page = preview_pages.parse_page(query.get("page", "1"))
        return 200, PAGES.page(str(query.get("token", "")), page).as_json()
    except preview_pages.PreviewGone as exc:
        return 404, {"error": str(exc)}
    except ValueError as exc:
        return 400, {"error": str(exc)}
    except Exception as exc:  # a cache damaged or removed since the run: said on the node, the server goes on
        log.warning("dataset preview page failed: %s: %s", type(exc).__name__, exc)
        return 500, {"error": f"drawing the page failed: {type(exc).__name__}: {exc}"}


def serve() -> None:
    """The route the browser pages through; once per process."""
    global _served
    if not _served:
        _served = compat.serve_json(ROUTE, answer)


_served = False


def preview(reader: CacheReader, manifest: str, page: int, *, name: str, captions: Mapping[str, str] | None = None,
            scale: int | None = None) -> tuple[torch.Tensor, dict[str, Any], str]:
    """The preview ``page`` of ``manifest``: the IMAGE output, the node's ``ui`` entries (its summary line aside)
    and a line of text (buckets and failures counted over the whole dataset). Page 0: a blank image, nothing
    shown and no line.

    The node shows the page in the browser's pager (``ui["dataset_preview"]``: the token that pages it, the page,
    the count and the image file), which comes back after a page reload from the prompt's history."""
    if page <= 0:
        return blank(), {}, ""
    source = preview_pages.PreviewSource(reader.path, manifest, name, dict(captions or {}), scale, _projection())
    shown = preview_pages.draw(source, page)
    image = torch.from_numpy(shown.image)[None]
    token = PAGES.register(source)
    ui = {"dataset_preview": [{"token": token, "route": ROUTE, "page": shown.page, "pages": shown.pages,
                               "line": shown.line, "image": temp_image(f"{name}_dataset", image)}]}
    return image, ui, shown.line


serve()
