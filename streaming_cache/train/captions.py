"""Caption augmentation: kohya-style tag shuffling and caption dropout, deterministic so caches and resumes are
exact.

Shuffled captions are made before encoding (:func:`caption_variants`: each variant is one more cached
conditioning, encoded once), so training needs no text encoder. Caption dropout (train on the empty caption
with some probability) is decided per step and sample by :func:`dropout`, a function of (seed, step, index)
only, independent of the noise generator (``loop.step_generator``): a resumed run drops exactly the captions
the uninterrupted run would have dropped.
"""

from __future__ import annotations

import random

import torch

Shuffler = int | random.Random | torch.Generator


def split_tags(caption: str, separator: str = ",") -> list[str]:
    """The tags of ``caption``: split at ``separator``, stripped, empty ones left out."""
    if not separator:
        raise ValueError("the tag separator must not be empty")
    return [t.strip() for t in caption.split(separator) if t.strip()]


def _joiner(separator: str) -> str:
    return separator + " " if separator.strip() else separator


def _permutation(n: int, generator_or_seed: Shuffler) -> list[int]:
    if isinstance(generator_or_seed, torch.Generator):
        return torch.randperm(n, generator=generator_or_seed, device=generator_or_seed.device).tolist()
    rng = generator_or_seed if isinstance(generator_or_seed, random.Random) else random.Random(generator_or_seed)
    order = list(range(n))
    rng.shuffle(order)
    return order


def shuffle_tags(caption: str, *, keep_tokens: int, generator_or_seed: Shuffler, separator: str = ",") -> str:
    """kohya's ``shuffle_caption``: the first ``keep_tokens`` tags stay in place, the others are shuffled. Tags
    are re-joined with ``separator`` and one space (``"a, b, c"``). ``generator_or_seed``: an int seed (Python's
    ``random``, stable across versions), a ``random.Random`` or a ``torch.Generator`` (both advanced)."""
    if keep_tokens < 0:
        raise ValueError(f"keep_tokens must not be negative, got {keep_tokens}")
    tags = split_tags(caption, separator)
    kept, rest = tags[:keep_tokens], tags[keep_tokens:]
    rest = [rest[i] for i in _permutation(len(rest), generator_or_seed)]
    return _joiner(separator).join(kept + rest)


def drop_tags(caption: str, *, keep_tokens: int, probability: float, rng: random.Random, separator: str = ",") -> str:
    """kohya's ``caption_tag_dropout_rate``: each tag after the first ``keep_tokens`` is left out with
    ``probability``, drawn from ``rng``."""
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"the tag dropout must be between 0 and 1, got {probability}")
    tags = split_tags(caption, separator)
    kept = tags[:keep_tokens] + [t for t in tags[keep_tokens:] if rng.random() >= probability]
    return _joiner(separator).join(kept)


def caption_variants(caption: str, *, shuffles: int, keep_tokens: int, seed: int, separator: str = ",",
                     tag_dropout: float = 0.0) -> list[str]:
    """``caption`` itself, then up to ``shuffles`` shuffled variants (:func:`shuffle_tags`), each a function of
    (``seed``, the caption, its number) only, so the same folder gives the same variants (and cache keys) every
    time. Variants whose tag order equals the caption's or an earlier variant's are left out, so fewer come
    back when there are few orders to choose from (a caption of one tag has none). ``tag_dropout``: each variant
    also leaves tags out (:func:`drop_tags`, with a generator of its own, so the variants without dropout are
    the ones made before it came)."""
    if shuffles < 0:
        raise ValueError(f"shuffles must not be negative, got {shuffles}")
    out, seen = [caption], {tuple(split_tags(caption, separator))}
    for k in range(shuffles):
        rng = random.Random(f"shuffle:{seed}:{k}:{caption}")  # str seeds are hashed with SHA-512: stable
        variant = shuffle_tags(caption, keep_tokens=keep_tokens, generator_or_seed=rng, separator=separator)
        if tag_dropout > 0:
            variant = drop_tags(variant, keep_tokens=keep_tokens, probability=tag_dropout,
                                rng=random.Random(f"tag-dropout:{seed}:{k}:{caption}"), separator=separator)
        key = tuple(split_tags(variant, separator))
        if key not in seen:
            seen.add(key)
            out.append(variant)
    return out


def dropout(seed: int, step: int, probability: float, index: int = 0) -> bool:
    """Whether sample ``index`` of micro-step ``step`` trains on the empty caption: true with ``probability``,
    decided by a generator keyed on (``seed``, ``step``, ``index``) alone (never the noise generator), so
    resumes are exact. ``probability <= 0`` never drops, ``>= 1`` always does."""
    if probability <= 0:
        return False
    if probability >= 1:
        return True
    return random.Random(f"caption-dropout:{seed}:{step}:{index}").random() < probability
