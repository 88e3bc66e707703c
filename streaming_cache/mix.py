"""Several datasets in one training, each sampled its own way: the "concepts" of OneTrainer, the dataset lists of
ai-toolkit and SimpleTuner (a style set beside regularisation images, a subject beside its class).

A :class:`DatasetMix` holds dataset handles (:class:`~.dataset.DatasetHandle`, keys only) with, for each, a name
and how it is sampled: ``repeats`` (every row that many times per epoch, as kohya's ``N_name`` folders),
``weight`` (how many of its batches an epoch holds, relative to its size: 0.5 half of them, the rest the next
epoch; 2 each twice), its own ``batch_size`` and ``caption_dropout`` (None: the training's), and ``loss_weight``,
how much its batches' loss counts (sd-scripts' ``prior_loss_weight``, OneTrainer's and ai-toolkit's per-dataset
loss weight: 0.5 for regularisation images that should pull half as hard), and ``preserve``: the dataset's
target is what the base model (the adapters off) predicts for the same noisy input and conditioning, not its
latents (differential output preservation: OneTrainer's prior prediction, ai-toolkit's
``diff_output_preservation``), so that regularisation data keeps the model's outputs for its captions as they
were instead of teaching its images. A batch never mixes datasets, so datasets with different resolutions,
columns or batch sizes train together. To the loader a mix looks like one handle over the datasets' rows one after
the other, with each row's group (its dataset).

Like a handle, a mix is immutable, picklable and cheap; its :meth:`~DatasetMix.fingerprint` covers every
dataset's content and settings, so a changed weight is another run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xxhash

from .dataset import DatasetHandle, Row
from .errors import CacheError
from .sampler import GroupOptions


@dataclass(frozen=True)
class MixPart:
    """One dataset of a mix and how it is sampled (see the module docstring)."""

    handle: DatasetHandle
    name: str
    weight: float = 1.0
    repeats: int = 1
    batch_size: int = 0  # 0: the training's batch size
    caption_dropout: float | None = None  # None: the training's
    loss_weight: float = 1.0
    preserve: bool = False

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 64:
            raise ValueError(f"a dataset of a mix needs a name of 1 to 64 characters, got {self.name!r}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"{self.name}: weight must be a positive number, got {self.weight!r}")
        if self.repeats < 1 or self.batch_size < 0:
            raise ValueError(f"{self.name}: repeats must be at least 1 and batch_size at least 0 (0: the "
                             f"training's), got {self.repeats} and {self.batch_size}")
        if self.caption_dropout is not None and not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError(f"{self.name}: caption_dropout must be between 0 and 1, got {self.caption_dropout!r}")
        if not (self.loss_weight > 0 and math.isfinite(self.loss_weight)):
            raise ValueError(f"{self.name}: loss_weight must be a positive number (1: as the others), got "
                             f"{self.loss_weight!r}")
        if len(self.handle) == 0:
            raise ValueError(f"{self.name}: the dataset is empty")

    def settings(self) -> dict[str, Any]:
        out = {"name": self.name, "weight": float(self.weight), "repeats": int(self.repeats),
               "batch_size": int(self.batch_size), "caption_dropout": self.caption_dropout}
        if self.loss_weight != 1.0:  # a mix saved before it came trained at 1, and keeps its fingerprint
            out["loss_weight"] = float(self.loss_weight)
        if self.preserve:
            out["preserve"] = True
        return out


class DatasetMix:
    """Datasets trained together (see the module docstring). Rows are numbered dataset after dataset."""

    __slots__ = ("parts", "_starts")

    def __init__(self, parts: Sequence[MixPart]):
        self.parts = tuple(parts)
        if not self.parts:
            raise ValueError("a mix needs at least one dataset")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"two datasets of the mix are named {dup!r}; give each its own name")
        self._starts = np.concatenate([[0], np.cumsum([len(p.handle) for p in self.parts])]).astype(np.int64)

    def map_parts(self, fn: Any) -> DatasetMix:
        """The mix with ``fn(part) -> DatasetHandle`` as each dataset's rows (e.g. a validation split)."""
        return DatasetMix([replace(p, handle=fn(p)) for p in self.parts])

    # ---- what the loader asks of a dataset
    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset number, row within it) of row ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range (the mix has {len(self)} rows)")
        p = int(np.searchsorted(self._starts, i, side="right")) - 1
        return p, i - int(self._starts[p])

    def __getitem__(self, i: int) -> Row:
        p, j = self.locate(int(i))
        return self.parts[p].handle[j]

    def __iter__(self) -> Iterator[Row]:
        for p in self.parts:
            yield from p.handle

    def signatures(self) -> np.ndarray:
        return np.concatenate([p.handle.signatures() for p in self.parts])

    def groups(self) -> np.ndarray:
        """Each row's dataset number."""
        return np.repeat(np.arange(len(self.parts), dtype=np.int64), [len(p.handle) for p in self.parts])

    def group_options(self, batch_size: int) -> list[GroupOptions]:
        """How each dataset is batched, ``batch_size`` standing for the training's."""
        return [GroupOptions(p.batch_size or batch_size, p.weight, p.repeats) for p in self.parts]

    def collate(self, indices: Sequence[int], pin: bool = False, allocate: Any = None) -> Any:
        """Rows ``indices``, all of one dataset, as one batch (see :meth:`DatasetHandle.collate`)."""
        if len(indices) == 0:
            raise CacheError("cannot collate an empty batch: give at least one row")
        located = [self.locate(int(i)) for i in indices]
        part = located[0][0]
        if any(p != part for p, _ in located):
            raise CacheError("a batch of a mix holds rows of one dataset only")
        return self.parts[part].handle.collate([j for _, j in located], pin, allocate)

    @property
    def caches(self) -> list[str]:
        return sorted({c for p in self.parts for c in p.handle.caches})

    def fingerprint(self) -> str:
        """Changes exactly when a dataset's content, its name or a sampling setting changes."""
        h = xxhash.xxh3_128()
        for p in self.parts:
            h.update(repr(sorted(p.settings().items())).encode())
            h.update(p.handle.fingerprint().encode())
        return "mix-" + h.hexdigest()

    def __repr__(self) -> str:
        return f"DatasetMix({', '.join(f'{p.name}: {len(p.handle)} rows' for p in self.parts)})"


def as_mix(data: DatasetHandle | DatasetMix, name: str = "dataset") -> DatasetMix:
    """``data`` as a mix (a handle is a mix of one dataset with the training's settings)."""
    return data if isinstance(data, DatasetMix) else DatasetMix([MixPart(data, name)])
