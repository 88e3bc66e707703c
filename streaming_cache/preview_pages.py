"""The dataset previews a server can page through: which cache and dataset a preview shows, under a token.

A node that shows a dataset preview (Encode Dataset, Load Streaming Cache) registers what the page needs - the
cache folder, the dataset's manifest, the captions it knows, the VAE's scale, the latent-to-RGB projection - and
hands the browser only the token. The browser then asks for any page by token and page number, so turning a page
changes no input of the graph and re-runs nothing; the cache is read only for the rows of that page
(:func:`~.dataset_view.dataset_page`).

A token names only what a node registered: a request cannot name a path. The registry keeps the
``MAX_PREVIEWS`` most recent previews (a caption table can be large), so it never grows with the number of runs;
a token it no longer holds (the server restarted, or many other previews came since) is answered with what to do.
"""

from __future__ import annotations

import base64
import collections
import io
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import xxhash
from PIL import Image

from . import dataset_view
from .dataset import shared_reader
from .dataset_view import LatentToRGB

MAX_PREVIEWS = 32
MAX_PAGE = 1_000_000


class PreviewGone(LookupError):
    """The registry holds no preview under the token asked for."""


@dataclass(frozen=True)
class PreviewSource:
    """What drawing a page of one dataset preview needs."""

    cache: str
    manifest: str
    name: str
    captions: Mapping[str, str] = field(default_factory=dict)
    scale: int | None = None
    to_rgb: LatentToRGB | None = None


@dataclass(frozen=True)
class PreviewPage:
    """One drawn page and what the node's text and the browser's pager say about it."""

    image: np.ndarray  # H x W x 3 float32 in [0, 1]
    page: int
    pages: int
    line: str

    def as_json(self) -> dict[str, object]:
        """The page for the browser: numbers, the line and the image as a PNG data URL."""
        return {"page": self.page, "pages": self.pages, "line": self.line, "image": png_data_url(self.image)}


def png_data_url(image: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray((np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def summary_line(view: dataset_view.DatasetPage, scale: int | None) -> str:
    """``preview page 1 of 3 (40 samples an epoch, repeats counted); 2 buckets: 512x512 30, ...``"""
    buckets = ", ".join(f"{dataset_view.bucket_label(b, scale)} {n}" for b, n in list(view.buckets.items())[:4])
    more = f", {len(view.buckets) - 4} more" if len(view.buckets) > 4 else ""
    return (f"preview page {view.page} of {view.pages} ({view.samples} samples an epoch, repeats counted); "
            f"{len(view.buckets)} buckets: {buckets}{more}"
            + (f"; {len(view.failures)} failed in the cache" if view.failures else ""))


def draw(source: PreviewSource, page: int) -> PreviewPage:
    """Page ``page`` of ``source`` (clamped to the pages there are)."""
    view = dataset_view.dataset_page(shared_reader(source.cache), source.manifest, page=page, to_rgb=source.to_rgb,
                                     captions=source.captions, scale=source.scale, title=source.name)
    return PreviewPage(view.image, view.page, view.pages, summary_line(view, source.scale))


class PreviewPages:
    """Token -> :class:`PreviewSource`, the ``limit`` most recently registered or read; pages drawn one at a time
    (a drawing reads the cache and may run a model's projection)."""

    def __init__(self, limit: int = MAX_PREVIEWS):
        self.limit = int(limit)
        self._sources: collections.OrderedDict[str, PreviewSource] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._drawing = threading.Lock()

    def register(self, source: PreviewSource) -> str:
        """The token of ``source``: the same for the same cache, dataset, captions and scale, so a re-run's
        token still pages the preview it showed."""
        digest = xxhash.xxh3_128()
        for part in (source.cache, source.manifest, source.name, repr(source.scale)):
            digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
        for name, caption in sorted(source.captions.items()):
            digest.update(name.encode("utf-8", "surrogatepass") + b"\0" + caption.encode("utf-8", "surrogatepass")
                          + b"\0")
        token = digest.hexdigest()
        with self._lock:
            self._sources[token] = source
            self._sources.move_to_end(token)
            while len(self._sources) > self.limit:
                self._sources.popitem(last=False)
        return token

    def source(self, token: str) -> PreviewSource:
        with self._lock:
            source = self._sources.get(token)
            if source is None:
                raise PreviewGone("this dataset preview is no longer held by the server (ComfyUI restarted, or "
                                  f"{self.limit} newer previews came since): run the node again to page through it")
            self._sources.move_to_end(token)
            return source

    def page(self, token: str, page: int) -> PreviewPage:
        """Page ``page`` of the preview registered as ``token``; :class:`PreviewGone` if it is not held."""
        source = self.source(token)
        with self._drawing:
            return draw(source, page)


def parse_page(text: str | None) -> int:
    """A page number from a request: a whole number from 1 to ``MAX_PAGE`` (larger pages are clamped when
    drawn); ValueError with what was wrong."""
    try:
        page = int(str(text).strip())
    except ValueError:
        raise ValueError(f"page must be a whole number, got {text!r}") from None
    if not 1 <= page <= MAX_PAGE:
        raise ValueError(f"page must be from 1 to {MAX_PAGE}, got {page}")
    return page
