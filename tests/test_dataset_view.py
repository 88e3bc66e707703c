"""The dataset preview (``streaming_cache.dataset_view``): a page of samples as the trainer sees them, the bucket
histogram and the failures, read from the index and the manifest, with only the page's tensors read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import streaming_cache as sc
from streaming_cache import dataset_view as dv


def _latent(part) -> dict:
    i = int(part.data.decode().split(":")[1])
    h, w = (8, 8) if i % 3 else (8, 12)  # two buckets: 20 square samples, 10 wide ones
    return {"samples": torch.full((1, 4, h, w), i / 30.0)}


def _mask(part) -> dict:
    m = torch.ones(1, 8, 8, dtype=torch.float16)
    m[:, :, :4] = 0  # the left half does not count in the loss
    return {"mask": m}


def _fail_on_bad(part):
    if part.data == b"latent:bad":
        raise ValueError("not an image")
    return part


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("view") / "cache"
    items = [sc.Item(f"img{i:02d}", {"latent": sc.Part(data=f"latent:{i}".encode()),
                                     "cond": sc.Part(data=b"a photo")}, repeats=2 if i == 1 else 1)
             for i in range(30)]
    items[4].parts["mask"] = sc.Part(data=b"mask")
    for item in items:
        item.parts.setdefault("mask", sc.Part(data=b"none"))
    items.append(sc.Item("bad", {"latent": sc.Part(data=b"latent:bad"), "cond": sc.Part(data=b"x"),
                                 "mask": sc.Part(data=b"none")}))
    encoders = {
        "latent": sc.Encoder("latent-v1", lambda parts: [_latent(p) for p in parts], prepare=_fail_on_bad),
        "cond": sc.Encoder("text-v1", lambda parts: [torch.zeros(2) for _ in parts]),
        "mask": sc.Encoder("mask-v1", lambda parts: [_mask(p) if p.data == b"mask" else
                                                     {"mask": torch.ones(1, 8, 8, dtype=torch.float16)}
                                                     for p in parts]),
    }
    report = sc.build(path, items, encoders)
    assert report.failed == 1
    return sc.open_cache(path), "default"


def _colour(i: int) -> tuple[float, float, float]:
    return (i / 30.0, 0.5, 1.0 - i / 30.0)


def _to_rgb(latent: torch.Tensor) -> torch.Tensor:
    v = float(latent.flatten()[0])
    return torch.tensor([v, 0.5, 1.0 - v]).expand(*latent.shape[-2:], 3)


def _has(image: np.ndarray, colour, atol: float = 1e-3) -> bool:
    return bool(np.all(np.abs(image - np.array(colour, dtype=np.float32)) < atol, axis=-1).any())


def test_counts_buckets_and_failures_come_from_the_index(cache):
    reader, manifest = cache
    page = dv.dataset_page(reader, manifest, to_rgb=_to_rgb)
    assert page.rows == 30 and page.samples == 31  # img01 repeats twice
    assert page.buckets == {(8, 8): 20 + 1, (8, 12): 10}
    assert [item for item, _ in page.failures] == ["bad"] and "not an image" in page.failures[0][1]
    assert dv.bucket_label((8, 12), 8) == "96x64" and dv.bucket_label((5, 8, 8), 16) == "128x128, 5 latent frames"


def test_pages_show_their_samples_and_read_only_them(cache, monkeypatch):
    reader, manifest = cache
    read = []
    original = reader.materialize
    monkeypatch.setattr(reader, "materialize", lambda i, **kw: read.append(i) or original(i, **kw))
    first = dv.dataset_page(reader, manifest, to_rgb=_to_rgb, per_page=24)
    assert (first.page, first.pages) == (1, 2)
    assert all(_has(first.image, _colour(i)) for i in range(24))
    assert not _has(first.image, _colour(27))
    latents_read = len(read)
    assert latents_read <= 24 * 2  # each shown row's latent and mask, nothing else
    read.clear()
    last = dv.dataset_page(reader, manifest, to_rgb=_to_rgb, per_page=24, page=9)  # clamped to the last page
    assert (last.page, last.pages) == (2, 2)
    assert all(_has(last.image, _colour(i)) for i in range(24, 30)) and not _has(last.image, _colour(3))
    assert len(read) <= 6 * 2


def test_a_mask_is_outlined_on_its_sample_only(cache):
    reader, manifest = cache
    with_mask = dv.dataset_page(reader, manifest, to_rgb=_to_rgb, per_page=5, page=1)  # img00-img04: img04 masked
    without = dv.dataset_page(reader, manifest, to_rgb=_to_rgb, per_page=4, page=1)
    red = dv._MASK
    region = with_mask.image[:, :, :]
    tile_rows = slice(30, 30 + dv._TILE)
    assert _has(region[tile_rows], red)
    assert not _has(without.image[tile_rows], red)


def test_the_projection_for_unknown_models_stretches_three_channels():
    latent = torch.stack([torch.linspace(-3, 3, 16).view(4, 4)] * 2)  # two channels: the last repeats
    rgb = dv.channels_as_rgb(latent)
    assert rgb.shape == (4, 4, 3) and float(rgb.min()) == 0.0 and float(rgb.max()) == 1.0


def test_a_registered_preview_pages_by_token_without_naming_a_path(cache):
    """The browser pages a node's preview by token: page 2 is the page ``dataset_page`` draws, the token names
    no path (a request cannot reach another folder), and a token the registry no longer holds (only the most
    recent previews are kept) is answered with what to do."""
    import base64
    import io

    from PIL import Image

    from streaming_cache import preview_pages as pp

    reader, manifest = cache
    pages = pp.PreviewPages(limit=2)
    source = pp.PreviewSource(reader.path, manifest, "view", {"img01": "a dog"}, 8, _to_rgb)
    token = pages.register(source)
    assert reader.path not in token and pages.register(source) == token, "the same preview keeps its token"
    page = pages.page(token, 2)
    expected = dv.dataset_page(reader, manifest, page=2, to_rgb=_to_rgb, captions={"img01": "a dog"}, scale=8,
                               title="view")
    assert (page.page, page.pages) == (2, expected.pages) and np.array_equal(page.image, expected.image)
    assert page.line.startswith(f"preview page 2 of {expected.pages} (31 samples an epoch")
    sent = page.as_json()
    png = Image.open(io.BytesIO(base64.b64decode(sent["image"].split(",", 1)[1])))
    assert png.size == (expected.image.shape[1], expected.image.shape[0]) and sent["pages"] == expected.pages
    assert pages.page(token, 999).page == expected.pages, "a page past the end is the last one"
    for n in range(2):  # two newer previews push the first one out
        pages.register(pp.PreviewSource(reader.path, manifest, f"other{n}"))
    with pytest.raises(pp.PreviewGone, match="run the node again"):
        pages.page(token, 1)
    with pytest.raises(pp.PreviewGone):
        pages.page("../../etc/passwd", 1)
    for bad in ("two", "0", "-3", str(pp.MAX_PAGE + 1), None):
        with pytest.raises(ValueError, match="page must be"):
            pp.parse_page(bad)
    assert pp.parse_page(" 7 ") == 7
