"""Which rows go into which batch: seeded shuffling, shape buckets, rank split, resumable positions.

Rows whose tensors have equal shapes and dtypes (equal :meth:`DatasetHandle.signatures`) form a bucket, and a
batch never mixes buckets, so batches can always be stacked; resolution/aspect buckets fall out of the cached
latents with no bookkeeping by the user.

An epoch's batch list is a pure function of (signatures, seed, epoch, settings): every rank computes the same
global list and takes every ``world_size``-th batch, like ``torch.utils.data.DistributedSampler``, so ranks
get disjoint shares of equal length (padded by repeating the first batches unless ``drop_last``), and a
resumed run can skip exactly the batches it already saw.
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from .errors import CacheError


class SamplingOptions(TypedDict, total=False):
    """The keyword options of :class:`BucketSampler` (``BatchLoader`` passes them through)."""

    shuffle: bool  # shuffle rows and batches, differently every epoch (default True)
    seed: int  # seeds the shuffle (default 0)
    drop_last: bool  # drop each bucket's last incomplete batch (default False)
    rank: int  # this process's share of the batches, like DistributedSampler (default 0)
    world_size: int  # number of processes sharing the data (default 1)
    repeats: int  # each row this many times per epoch (default 1)

# What a saved position depends on: resuming with other values would replay a different sequence of batches.
_SETTINGS = ("seed", "batch_size", "shuffle", "drop_last", "world_size", "rank", "repeats")


class BucketSampler:
    def __init__(
        self,
        signatures: np.ndarray,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        repeats: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.signatures = np.asarray(signatures, dtype=np.uint64)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.repeats = int(repeats)
        _, self._bucket_of = np.unique(self.signatures, return_inverse=True)
        counts = np.bincount(self._bucket_of) * self.repeats if len(self.signatures) else np.zeros(0, np.int64)
        full, partial = counts // self.batch_size, (counts % self.batch_size) > 0
        total = int(full.sum() + (0 if self.drop_last else partial.sum()))
        if self.world_size > 1:
            total = total // self.world_size if self.drop_last else -(-total // self.world_size)
        self._len = total

    def __len__(self) -> int:
        """Batches per epoch for this rank (the same for every epoch)."""
        return self._len

    @property
    def buckets(self) -> int:
        return int(self._bucket_of.max()) + 1 if len(self._bucket_of) else 0

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches (arrays of row numbers) for ``epoch``, in order."""
        n = len(self.signatures)
        rows = np.tile(np.arange(n, dtype=np.int64), self.repeats)
        rng = np.random.default_rng([self.seed, int(epoch)])
        if self.shuffle:
            rows = rows[rng.permutation(len(rows))]
        buckets = self._bucket_of[rows]
        # Stable grouping keeps the (shuffled or natural) order inside each bucket; buckets appear in the order
        # of their first row.
        first_seen = np.full(self.buckets, len(rows), dtype=np.int64)
        np.minimum.at(first_seen, buckets, np.arange(len(rows)))
        order = np.lexsort((np.arange(len(rows)), first_seen[buckets]))
        rows, buckets = rows[order], buckets[order]
        batches: list[np.ndarray] = []
        if len(rows):
            starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
            for group in np.split(rows, starts[1:]):
                for i in range(0, len(group), self.batch_size):
                    chunk = group[i:i + self.batch_size]
                    if len(chunk) == self.batch_size or not self.drop_last:
                        batches.append(chunk)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.world_size > 1:
            if self.drop_last:
                batches = batches[: len(batches) - len(batches) % self.world_size]
            elif batches and len(batches) % self.world_size:
                pad = self.world_size - len(batches) % self.world_size
                batches = batches + [batches[i % len(batches)] for i in range(pad)]
            batches = batches[self.rank::self.world_size]
        assert len(batches) == self._len
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The settings an epoch's batches depend on, and the number of rows they were made for."""
        return {**{k: getattr(self, k) for k in _SETTINGS}, "rows": len(self.signatures)}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse to resume from a ``state_dict`` of a sampler that would produce different batches."""
        mine = self.state_dict()
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise CacheError(f"loader state was saved with {key}={state[key]!r} but this loader has "
                                 f"{value!r}; resume with the same dataset and settings")
