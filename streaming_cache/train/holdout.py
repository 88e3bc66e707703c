"""A held-out validation split that stays put.

Which rows are held out is decided per image by a hash of its latent's cache key (and the seed), not by position:
adding images to the dataset never moves an existing image between the training and the validation side, so a
validation loss stays comparable across runs on a growing dataset. Caption variants and repeats of one image
share its latent key and so always land on the same side (no leak of a validation image into training).
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..dataset import DatasetHandle


def _image_key(keys: str | dict[str, str]) -> str:
    return keys if isinstance(keys, str) else keys.get("latent") or min(keys.values())


def _scores(dataset: DatasetHandle, seed: int) -> np.ndarray:
    """Per row, its image's place in [0, 1): the image key's seeded xxh3 over 2**64. With seed 0 that is the
    key hash the index already holds, read for all rows at once."""
    columns = dataset.columns
    if seed == 0 and (columns is None or "latent" in columns):
        return dataset.key_hashes(None if columns is None else "latent") / 2.0**64
    scores: dict[str, float] = {}
    row_scores = np.empty(len(dataset), dtype=np.float64)
    for i, keys in enumerate(dataset.keys()):
        image = _image_key(keys)
        if image not in scores:
            scores[image] = xxhash.xxh3_64_intdigest(image.encode("utf-8"), seed=seed & 0xFFFFFFFFFFFFFFFF) / 2.0**64
        row_scores[i] = scores[image]
    return row_scores


def split(dataset: DatasetHandle, fraction: float, seed: int = 0) -> tuple[DatasetHandle, DatasetHandle]:
    """(training rows, validation rows): about ``fraction`` of the images go to validation. With a fraction above
    zero and at least two images, at least one image is held out and at least one is kept for training."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"the validation fraction must be at least 0 and below 1, got {fraction}")
    if fraction == 0.0 or len(dataset) == 0:
        return dataset, dataset.select([])
    row_scores = _scores(dataset, seed)
    held = row_scores < fraction
    distinct = np.unique(row_scores)
    if len(distinct) >= 2:
        if not held.any():
            held = row_scores == distinct[0]
        if held.all():
            held = row_scores != distinct[-1]
    else:
        held[:] = False
    return dataset.select(np.flatnonzero(~held)), dataset.select(np.flatnonzero(held))
