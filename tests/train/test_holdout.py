"""The validation split: stable per image as the dataset grows, never splitting an image's variants."""

from __future__ import annotations

import pytest
import torch

import streaming_cache as sc
from streaming_cache.train.holdout import split


def _cache(path, images: int, variants: int = 1) -> sc.DatasetHandle:
    items = [sc.Item(f"img{i}#{v}", {"latent": sc.Part(data=f"image {i}".encode()),
                                     "cond": sc.Part(data=f"caption {i} {v}".encode())})
             for i in range(images) for v in range(variants)]
    encoders = {"latent": sc.Encoder("vae", lambda parts: [{"samples": torch.zeros(1, 4, 2, 2)} for _ in parts]),
                "cond": sc.Encoder("te", lambda parts: [torch.tensor([float(len(p.data))]) for p in parts])}
    sc.build(str(path), items, encoders)
    return sc.DatasetHandle.from_cache(str(path), "default")


def _images(handle: sc.DatasetHandle) -> set[str]:
    return {k["latent"] for k in handle.keys()}


def test_split_holds_out_about_the_fraction_and_partitions_the_rows(tmp_path):
    data = _cache(tmp_path / "c", 200)
    train, val = split(data, 0.2, seed=3)
    assert len(train) + len(val) == 200
    assert not _images(train) & _images(val)
    assert 20 <= len(val) <= 60, len(val)


def test_adding_images_never_moves_an_image_between_sides(tmp_path):
    small = _cache(tmp_path / "c", 40)
    train, val = split(small, 0.25, seed=1)
    grown = _cache(tmp_path / "c", 60)  # the same cache with 20 more images
    train2, val2 = split(grown, 0.25, seed=1)
    assert _images(val) <= _images(val2) and _images(train) <= _images(train2)


def test_caption_variants_of_one_image_stay_together(tmp_path):
    data = _cache(tmp_path / "c", 30, variants=3)
    train, val = split(data, 0.3)
    assert not _images(train) & _images(val)
    assert len(val) % 3 == 0 and len(val) > 0


def test_tiny_datasets_keep_one_image_on_each_side(tmp_path):
    two = _cache(tmp_path / "two", 2)
    train, val = split(two, 0.01)
    assert len(train) == 1 and len(val) == 1
    train, val = split(two, 0.99)
    assert len(train) == 1 and len(val) == 1
    one = _cache(tmp_path / "one", 1)
    train, val = split(one, 0.5)
    assert len(train) == 1 and len(val) == 0, "a single image is never held out"


def test_zero_fraction_is_no_split_and_bad_fractions_are_refused(tmp_path):
    data = _cache(tmp_path / "c", 5)
    train, val = split(data, 0.0)
    assert len(train) == 5 and len(val) == 0
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="validation fraction"):
            split(data, bad)
