"""Which rows go into which batch: seeded shuffling, shape buckets, rank split, resumable positions.

Rows whose tensors have equal shapes and dtypes (equal :meth:`DatasetHandle.signatures`) form a bucket, and a
batch never mixes buckets, so batches can always be stacked; resolution/aspect buckets fall out of the cached
latents with no bookkeeping by the user.

An epoch's list of *global* batches (``batch_size * world_size`` rows each, fewer for the last one of a bucket
unless ``drop_last``) is a pure function of (signatures, seed, epoch, global batch size, settings), the same on
every rank. Each rank takes its contiguous slice of every global batch: the first ``batch_size`` rows to rank 0,
the next to rank 1, and a short batch split as evenly as possible. So a run on N processes with batch size B
sees exactly the batches of a run on one process with batch size N x B, a position (global batches consumed)
means the same whatever the number of processes, and a resumed run skips exactly what it already saw. A rank
whose slice of a short batch is empty gets one row of it to compute on, marked as holding no sample
(:attr:`Slice.samples` 0), so every rank always runs the same steps.

Memory, for datasets of millions of rows: the sampler keeps no signatures, only each row's bucket number in a
byte or two (nothing when all rows are of one bucket); an epoch's plan keeps this rank's rows, 4 bytes each, and
8 bytes a batch. Planning holds the epoch's whole shuffle (12 to 20 bytes a row) for a moment, on every rank: the
order of an epoch is one permutation of all rows, the same for every number of processes. Past
:data:`SHUFFLE_BLOCK` rows that permutation is made in cache-sized blocks (:func:`permutation`): 10 million rows
are shuffled in about half a second, not one. A loader does not wait for that: each block is shuffled by a
generator of its own, so the rows of an epoch's first batches follow from the blocks that hold them
(:meth:`BucketSampler.epoch_head`, about a quarter of the whole plan's time at 10M rows), and the whole plan is made
behind them (:class:`LazyPlan`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

import numpy as np

from .errors import CacheError
from .records import factorize, ranges


class SamplingOptions(TypedDict, total=False):
    """The keyword options of :class:`BucketSampler` (``BatchLoader`` passes them through)."""

    shuffle: bool  # shuffle rows and batches, differently every epoch (default True)
    seed: int  # seeds the shuffle (default 0)
    drop_last: bool  # drop each bucket's last incomplete (global) batch (default False)
    rank: int  # this process's slice of every global batch (default 0)
    world_size: int  # number of processes sharing each global batch (default 1)
    repeats: int  # each row this many times per epoch (default 1)


class GroupOptions(NamedTuple):
    """How the rows of one group (one dataset of a mix, :mod:`.mix`) are batched: ``batch_size`` rows per process,
    each row ``repeats`` times per epoch, and ``weight`` times the group's batches per epoch (0.5: half of them,
    the other half the next epoch; 2: each twice)."""

    batch_size: int
    weight: float = 1.0
    repeats: int = 1


class Slice(NamedTuple):
    """One rank's part of a global batch: its ``rows``, where they start in the global batch (``first``), how
    many of them are samples (``samples``: 0 when the rank's share of a short batch is empty and ``rows`` holds a
    stand-in row to compute on) and the rows of the whole global batch (``total``)."""

    rows: np.ndarray
    first: int
    samples: int
    total: int
    group: int = 0  # the dataset of a mix the rows come from


def index_dtype(count: int) -> type[np.signedinteger[Any]]:
    """The integer type a plan holds row numbers and positions below ``count`` in: int32 where they fit (half the
    memory of int64 per row), else int64."""
    return np.int32 if count < 2**31 else np.int64


def code_dtype(count: int) -> type[np.unsignedinteger[Any]]:
    """The smallest unsigned integer type that numbers ``count`` things (bucket and group numbers per row)."""
    return np.uint8 if count <= 1 << 8 else np.uint16 if count <= 1 << 16 else np.uint32


SHUFFLE_BLOCK = 1 << 16
"""Rows up to which a shuffle is numpy's one-pass permutation; past it, :func:`permutation` shuffles in blocks of
about this many rows (int64 row numbers: 512 KB, which the CPU's cache holds)."""
ORDER = 3
"""How this release shuffles (:func:`permutation`), recorded in a loader's state; a resumed run keeps the order its
state was saved with. 1: numpy's one-pass permutation of every row, what releases up to 0.5.0 did; 2: rows dealt
into blocks and the blocks shuffled one after the other with the epoch's generator; 3: the same blocks, each
shuffled with a generator of its own, so that the rows at a few positions are known without shuffling every
block (:class:`BlockShuffle`). All three are numpy's one pass for up to :data:`SHUFFLE_BLOCK` rows."""

ORDERS = (1, 2, 3)


def permutation(n: int, rng: np.random.Generator, order: int = ORDER) -> np.ndarray:
    """A uniformly random permutation of ``0 .. n - 1`` (int64), drawn from ``rng``, that stays fast at millions of
    rows.

    numpy's permutation swaps each row with a row anywhere else: past a few million rows nearly every swap misses
    the CPU's caches (about 1 s for 10M rows). Past :data:`SHUFFLE_BLOCK` rows (``order`` 2 and 3), each row is
    dealt one of a power of two of blocks of about that size at random, the rows are grouped by block (a radix
    sort of the block numbers, linear in the rows) and each block is shuffled in place while it is in the cache.
    Ordering rows by independent uniform keys (their block, then their place in it) is ordering them by independent
    uniform keys: the permutation is as uniform as one pass over all of them, and takes about half the time.
    ``order`` 1 is numpy's one pass whatever the size (a state saved by an earlier release); ``order`` 3 is
    :class:`BlockShuffle`'s."""
    if order not in ORDERS:
        raise ValueError(f"unknown shuffle order {order!r}")
    if order == 1 or n <= SHUFFLE_BLOCK:
        return rng.permutation(n)
    if order == 3:
        return BlockShuffle(n, rng).whole()
    block, blocks = _deal(n, rng)
    out = np.argsort(block, kind="stable")
    ends = np.cumsum(np.bincount(block, minlength=blocks)).tolist()
    del block
    start = 0
    for end in ends:
        rng.shuffle(out[start:end])
        start = end
    return out


def _deal(n: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Each of ``n`` rows' block, drawn from ``rng`` (one of a power of two of blocks of about
    :data:`SHUFFLE_BLOCK` rows), and the number of blocks."""
    blocks = 1 << math.ceil(math.log2(-(-n // SHUFFLE_BLOCK)))
    bits = np.dtype("<u2") if blocks <= 1 << 16 else np.dtype("<u4")
    return np.bitwise_and(np.frombuffer(rng.bytes(n * bits.itemsize), dtype=bits), bits.type(blocks - 1)), blocks


class BlockShuffle:
    """The permutation of ``0 .. n - 1`` that :func:`permutation` makes with ``order`` 3, whole or at a few
    positions.

    Making it draws everything from ``rng`` at once: each row's block (as ``order`` 2 deals them) and a seed per
    block. Block ``b`` holds the permutation's positions from ``bounds[b]``, its rows in increasing order shuffled
    by a generator of that seed. So the values at a few positions need one pass over the block numbers and the
    shuffles of the blocks that hold them (:meth:`at`: the first batches of an epoch of 10M rows in tens of
    milliseconds), and :meth:`whole` gives the same values everywhere. It keeps the block numbers, 2 bytes a row."""

    def __init__(self, n: int, rng: np.random.Generator):
        self.n = int(n)
        self.block, blocks = _deal(self.n, rng)
        self.seeds = np.frombuffer(rng.bytes(8 * blocks), dtype="<u8")
        self.bounds = np.zeros(blocks + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.block, minlength=blocks), out=self.bounds[1:])

    def _shuffle(self, b: int, rows: np.ndarray) -> np.ndarray:
        """Block ``b``'s rows (in increasing order), shuffled in place: its positions of the permutation."""
        if len(rows) > 1:  # a block of one row or none stays as it is, whatever its generator
            np.random.default_rng(int(self.seeds[b])).shuffle(rows)
        return rows

    def whole(self) -> np.ndarray:
        """Every position's value (int64)."""
        out = np.argsort(self.block, kind="stable")
        for b, (start, end) in enumerate(zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist())):
            self._shuffle(b, out[start:end])
        return out

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The values at ``positions`` (int64), ``whole()[positions]``, shuffling only the blocks that hold them."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and not (0 <= positions.min() and positions.max() < self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        of = np.searchsorted(self.bounds, positions, side="right") - 1
        needed = np.unique(of)
        wanted = np.zeros(len(self.bounds) - 1, dtype=bool)
        wanted[needed] = True
        rows = np.flatnonzero(wanted[self.block])  # the needed blocks' rows, in increasing order
        rows = rows[np.argsort(self.block[rows], kind="stable")]  # grouped by block, still increasing in each
        out = np.empty(len(positions), dtype=np.int64)
        start = 0
        for b in needed.tolist():
            first, end = int(self.bounds[b]), int(self.bounds[b + 1])
            shuffled = self._shuffle(b, rows[start:start + end - first])
            here = of == b
            out[here] = shuffled[positions[here] - first]
            start += end - first
        return out


def share(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first, count) of ``rank``'s rows of a global batch of ``total`` rows: ``total // world_size`` each, the
    first ``total % world_size`` ranks one more."""
    base, extra = divmod(total, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _buckets(signatures: np.ndarray) -> tuple[int, np.ndarray | None]:
    """(the number of distinct ``signatures``, each row's bucket number in :func:`code_dtype`); no numbers where
    there is at most one bucket, the common case (one resolution), which then costs nothing per row."""
    if not len(signatures) or signatures.min() == signatures.max():
        return min(len(signatures), 1), None
    codes = factorize(signatures)
    count = int(codes.max()) + 1
    return count, codes.astype(code_dtype(count))


class EpochPlan(Sequence[Slice]):
    """One rank's slices of an epoch's global batches, held as three arrays: ``rows``, where each slice starts in
    them (``starts``) and the rows of each global batch (``total``). Where a slice starts in its global batch, how
    many of its rows are samples and so its length follow from ``total``, the rank and the number of processes
    (:func:`share`; a slice with no samples holds one stand-in row). A rank holds only its own rows, in
    :func:`index_dtype`, and a :class:`Slice` is made only when asked for: an epoch costs about 4 bytes per row of
    this rank and 8 per batch, never an object per batch."""

    def __init__(self, sampler: BucketSampler, rows: np.ndarray, starts: np.ndarray, total: np.ndarray):
        self._sampler, self.rows, self.starts, self.total = sampler, rows, starts, total

    @classmethod
    def for_rank(cls, sampler: BucketSampler, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> EpochPlan:
        """The slices of ``sampler``'s rank of the global batches ``rows[starts[k]:ends[k]]``: the rows of a full
        batch split ``batch_size`` each, a short batch as evenly as possible, the first ranks taking one row more
        (as :meth:`BucketSampler.rank_slice` does, for every batch at once)."""
        dtype = index_dtype(max(len(rows), sampler.row_count))
        total = (ends - starts).astype(dtype)
        world, rank = sampler.world_size, sampler.rank
        if world == 1:
            return cls(sampler, rows.astype(dtype, copy=False), starts.astype(dtype), total)
        base, extra = np.divmod(total, world)
        count = base + (rank < extra)
        take = np.maximum(count, 1)
        first = np.where(count > 0, rank * base + np.minimum(rank, extra), 0)
        own = rows[ranges(starts + first, take)].astype(dtype, copy=False)
        return cls(sampler, own, (np.cumsum(take) - take).astype(dtype), total)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, k: int) -> Slice:  # type: ignore[override]
        if not -len(self) <= k < len(self):
            raise IndexError(f"batch {k} out of range (the epoch has {len(self)})")
        total = int(self.total[k])
        first, samples = share(total, self._sampler.world_size, self._sampler.rank)
        start = int(self.starts[k])
        rows = self.rows[start:start + max(samples, 1)]
        return Slice(rows, first, samples, total, self._sampler.group_of(rows))

    def rows_held(self) -> int:
        """The rows this rank's plan holds, all batches together."""
        return len(self.rows)

    def nbytes(self) -> int:
        """The bytes of the arrays the plan holds."""
        return self.rows.nbytes + self.starts.nbytes + self.total.nbytes


class LazyPlan(Sequence[Slice]):
    """An epoch's plan (:class:`EpochPlan`) whose first batches are known before the whole plan is made.

    At 10M rows a whole plan takes about half a second (the permutation of every row), which every rank of a run
    pays before its first batch. This holds the batches ``first`` to ``first + count - 1`` from
    :meth:`BucketSampler.epoch_head` and makes the whole plan the first time another batch is asked for (by a
    loader's worker, while the first batches are being read and trained on); where the head cannot be made the
    whole plan is made at once. Safe to use from several threads: the plan is made once."""

    def __init__(self, sampler: BucketSampler, epoch: int, first: int, count: int):
        self._sampler, self._epoch = sampler, int(epoch)
        self._len = sampler.epoch_length(epoch)
        self._lock = threading.Lock()
        head = sampler.epoch_head(epoch, first, count) if first < self._len and count > 0 else None
        self._head: dict[int, Slice] = dict(zip(range(first, first + len(head)), head)) if head else {}
        self._plan: EpochPlan | None = None if self._head else sampler.epoch_plan(epoch)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, k: int) -> Slice:  # type: ignore[override]
        found = self._head.get(k + self._len if k < 0 else k)
        return found if found is not None else self.plan()[k]

    def plan(self) -> EpochPlan:
        """The whole plan, made on the first call."""
        with self._lock:
            if self._plan is None:
                self._plan = self._sampler.epoch_plan(self._epoch)
                self._head = {}
            return self._plan

    def made(self) -> bool:
        """Whether the whole plan has been made."""
        return self._plan is not None

    def rows_held(self) -> int:
        """The rows held: the whole plan's once made, else the first batches'."""
        plan = self._plan
        return plan.rows_held() if plan is not None else sum(len(s.rows) for s in self._head.values())

    def nbytes(self) -> int:
        """The bytes of the arrays held: the whole plan's once made, else the first batches'."""
        plan = self._plan
        return plan.nbytes() if plan is not None else sum(s.rows.nbytes for s in self._head.values())


# What a saved position depends on: resuming with other values would replay a different sequence of batches.
# The number of processes is not among them: positions count global batches.
_SETTINGS = ("seed", "shuffle", "drop_last", "repeats")


class BucketSampler:
    """An epoch's batches of rows for rows of the given ``signatures`` (see the module docstring).

    Per row it keeps only its bucket's number, in :func:`code_dtype`, and nothing where every row is of one bucket
    (and, for a mix, its group's number and the rows of each group): the signatures are not kept. Each epoch's
    plan (:meth:`epoch_plan`) is made from those with array operations, and holds this rank's rows only."""

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
        groups: np.ndarray | None = None,
        group_options: Sequence[GroupOptions] = (),
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        signatures = np.asarray(signatures, dtype=np.uint64).reshape(-1)
        self.row_count = len(signatures)
        """Rows the sampler batches (row numbers 0 to ``row_count - 1``)."""
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.repeats = int(repeats)
        self.order = ORDER
        """How epochs are shuffled (:func:`permutation`); a resumed run takes its saved state's
        (:meth:`resume_order`)."""
        self.buckets, self._bucket_of = _buckets(signatures)
        """Distinct signatures: a batch never mixes them."""
        self.groups: np.ndarray | None = None
        self.group_options = tuple(GroupOptions(*o) for o in group_options)
        if groups is not None:
            self._set_groups(np.asarray(groups, dtype=np.int64))
            return
        self._len = self._batch_count(None, self.repeats, self.global_batch_size)

    def _set_groups(self, groups: np.ndarray) -> None:
        """Rows grouped (a mix): ``groups[i]`` is row ``i``'s group, batched as ``group_options[group]`` says."""
        if groups.shape != (self.row_count,) or (len(groups) and (groups.min() < 0 or
                                                                  groups.max() >= len(self.group_options))):
            raise ValueError("groups must give every row a group that has options")
        for o in self.group_options:
            if o.batch_size < 1 or o.repeats < 1 or not (o.weight > 0 and np.isfinite(o.weight)):
                raise ValueError(f"group options need a batch size and repeats of at least 1 and a positive weight; "
                                 f"got {o}")
        if self.repeats != 1:
            raise ValueError("repeats apply per group when rows are grouped; leave the sampler's repeats at 1")
        self.groups = groups.astype(code_dtype(len(self.group_options)))
        dtype = index_dtype(self.row_count)
        self._group_rows = [np.flatnonzero(self.groups == g).astype(dtype) for g in range(len(self.group_options))]
        self._group_batches = [self._batch_count(rows, o.repeats, o.batch_size * self.world_size)
                               for rows, o in zip(self._group_rows, self.group_options)]
        self._len = self.epoch_length(0)

    def nbytes(self) -> int:
        """The bytes of the arrays the sampler keeps per row, whatever the epoch (its plans not counted)."""
        arrays = [self._bucket_of, self.groups, *getattr(self, "_group_rows", [])]
        return sum(a.nbytes for a in arrays if a is not None)

    def _takes(self, epoch: int) -> list[tuple[int, int]]:
        """Per group, (first, count) of the batches epoch ``epoch`` takes from the group's endless sequence of its
        own epochs: ``weight`` times its batches per epoch, the fractions carried to the next epoch (a weight of
        0.25 covers the group once every four epochs). An epoch is never empty: when every count rounds to zero,
        the first group with batches gives one."""
        out = []
        for n, o in zip(self._group_batches, self.group_options):
            first, end = math.floor(epoch * n * o.weight + 1e-9), math.floor((epoch + 1) * n * o.weight + 1e-9)
            out.append((first, end - first if n else 0))
        if not any(count for _, count in out):
            g = next((g for g, n in enumerate(self._group_batches) if n), None)
            if g is not None:
                out[g] = (out[g][0], 1)
        return out

    def epoch_length(self, epoch: int) -> int:
        """Batches in ``epoch`` (global batches; the same every epoch unless a mix's weights leave fractions)."""
        if self.groups is None:
            return self._len
        return sum(count for _, count in self._takes(epoch))

    def _bucket_sizes(self, rows: np.ndarray | None) -> np.ndarray:
        """The number of ``rows`` (every row where None) in each bucket that has any."""
        if self._bucket_of is None:
            n = self.row_count if rows is None else len(rows)
            return np.array([n] if n else [], dtype=np.int64)
        counts = np.bincount(self._bucket_of if rows is None else self._bucket_of[rows])
        return counts[counts > 0]

    def _batch_count(self, rows: np.ndarray | None, repeats: int, size: int) -> int:
        counts = self._bucket_sizes(rows) * repeats
        full, partial = counts // size, (counts % size) > 0
        return int(full.sum() + (0 if self.drop_last else partial.sum()))

    @property
    def global_batch_size(self) -> int:
        """Rows of a (full) global batch: ``batch_size`` per process times the number of processes."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Batches in the first epoch (global batches; each rank gets its slice of every one); see
        :meth:`epoch_length`."""
        return self._len

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """Every global batch (an array of row numbers) of ``epoch``, in order; the same on every rank."""
        rows, starts, ends = self._global(epoch)
        return [rows[a:b] for a, b in zip(starts.tolist(), ends.tolist())]

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """This rank's slices of ``epoch``'s global batches, as arrays (see :class:`EpochPlan`). Making it holds
        the epoch's whole shuffle for a moment (the same on every rank, so every rank computes it); what stays is
        this rank's share."""
        return EpochPlan.for_rank(self, *self._global(epoch))

    def epoch_head(self, epoch: int, first: int, count: int) -> list[Slice] | None:
        """This rank's slices of ``epoch``'s global batches ``first`` to ``first + count - 1`` (fewer past the
        epoch's end), as :meth:`epoch_plan` has them, made without planning the whole epoch; None where that cannot
        be done (then take them from :meth:`epoch_plan`).

        It can where the epoch's order is one :class:`BlockShuffle` of every row cut into batches: rows of one
        bucket, not grouped, shuffled with ``order`` 3, past :data:`SHUFFLE_BLOCK` rows (below it a whole plan costs
        about as little). A loader hands out its first batches from here while the rest of the plan is made."""
        total = self.row_count * self.repeats
        if self.groups is not None or self._bucket_of is not None or not self.shuffle or self.order != 3 \
                or total <= SHUFFLE_BLOCK:
            return None
        rng = np.random.default_rng([self.seed, int(epoch)])  # drawn from in the order _global draws
        shuffle = BlockShuffle(total, rng)
        size = self.global_batch_size
        picked = permutation(self._len, rng, self.order)[max(first, 0):max(first, 0) + max(count, 0)]
        starts = picked * size
        lengths = np.minimum(starts + size, total) - starts
        rows = shuffle.at(ranges(starts, lengths))
        if self.repeats > 1:
            rows %= self.row_count  # the shuffle of every row, ``repeats`` times over
        rows = rows.astype(index_dtype(total), copy=False)
        out = []
        for begin, length in zip((np.cumsum(lengths) - lengths).tolist(), lengths.tolist()):
            at, samples = share(length, self.world_size, self.rank)
            take = rows[begin + (at if samples else 0):][:max(samples, 1)]
            out.append(Slice(take, at, samples, length, 0))
        return out

    def lazy_plan(self, epoch: int, first: int, count: int) -> LazyPlan:
        """``epoch``'s plan (as :meth:`epoch_plan`), whose batches ``first`` to ``first + count - 1`` come from
        :meth:`epoch_head` where it can make them, the rest of the plan being made when a later batch is first
        asked for (:class:`LazyPlan`)."""
        return LazyPlan(self, epoch, first, count)

    def _global(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``epoch``'s global batches as ``rows[starts[k]:ends[k]]``."""
        if self.groups is not None:
            return self._mixed(epoch)
        rng = np.random.default_rng([self.seed, int(epoch)])
        rows = self._shuffled(None, self.repeats, rng)
        rows, starts, ends = self._cut(rows, self.global_batch_size, rng)
        assert len(starts) == self._len
        return rows, starts, ends

    def _plan(self, rows: np.ndarray | None, repeats: int, size: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``rows`` (every row where None; each ``repeats`` times), shuffled, grouped by bucket and cut into batches
        of ``size``, the batches shuffled, as ``rows[starts[k]:ends[k]]``: array operations only, whatever the
        number of rows."""
        return self._cut(self._shuffled(rows, repeats, rng), size, rng)

    def _shuffled(self, rows: np.ndarray | None, repeats: int, rng: np.random.Generator) -> np.ndarray:
        """``rows`` (every row where None), each ``repeats`` times, shuffled unless ``shuffle`` is off."""
        if rows is None and self.shuffle and repeats == 1:  # the shuffle of every row, once, is the permutation
            return permutation(self.row_count, rng, self.order).astype(index_dtype(self.row_count), copy=False)
        rows = np.arange(self.row_count, dtype=index_dtype(self.row_count)) if rows is None else rows
        rows = np.tile(rows, repeats) if repeats > 1 else rows
        return rows[permutation(len(rows), rng, self.order)] if self.shuffle else rows

    def _cut(self, rows: np.ndarray, size: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shuffled ``rows`` grouped by bucket and cut into batches of ``size``, the batches shuffled."""
        rows, group_starts, group_ends = self._by_bucket(rows)
        length = group_ends - group_starts
        count = length // size + ((length % size > 0) & (not self.drop_last))
        first = np.cumsum(count) - count  # each group's first batch
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
        starts = np.repeat(group_starts, count) + within * size
        ends = np.minimum(starts + size, np.repeat(group_ends, count))
        if self.shuffle:
            order = permutation(len(starts), rng, self.order)
            starts, ends = starts[order], ends[order]
        return rows, starts, ends

    def _by_bucket(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``rows`` grouped by bucket, keeping their order inside each bucket, and where each group starts and
        ends, the groups in the order of their first row. Stable sorts of small integers (radix sorts, linear in
        the rows)."""
        if not len(rows):
            return rows, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if self._bucket_of is None:
            return rows, np.zeros(1, dtype=np.int64), np.full(1, len(rows), dtype=np.int64)
        buckets = self._bucket_of[rows]
        by_bucket = np.argsort(buckets, kind="stable")
        ordered = buckets[by_bucket]
        del buckets
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        ends = np.r_[starts[1:], len(rows)]
        visit = np.argsort(by_bucket[starts])  # the stable sort puts each bucket's first row first
        return rows[by_bucket], starts[visit], ends[visit]

    def _mixed(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each group's share of ``epoch`` as ``rows[starts[k]:ends[k]]``: ``take`` batches from the endless
        sequence of the group's own epochs (each shuffled with its own seed), continuing where the previous epoch
        stopped; then all of them shuffled together."""
        rows: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        for g, ((start, take), group, o) in enumerate(zip(self._takes(epoch), self._group_rows, self.group_options)):
            n = self._group_batches[g]
            if not take:
                continue
            for own in range(start // n, (start + take - 1) // n + 1):
                rng = np.random.default_rng([self.seed, own, g + 1])
                planned, first, end = self._plan(group, o.repeats, o.batch_size * self.world_size, rng)
                lo, hi = max(start, own * n) - own * n, min(start + take, (own + 1) * n) - own * n
                first, end = first[lo:hi], end[lo:hi]
                rows.append(planned[ranges(first, end - first)])
                sizes.append(end - first)
        size = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
        ends = np.cumsum(size)
        starts = ends - size
        if self.shuffle:
            order = permutation(len(starts), np.random.default_rng([self.seed, int(epoch), 0]), self.order)
            starts, ends = starts[order], ends[order]
        return (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)), starts, ends

    def group_of(self, batch: np.ndarray) -> int:
        """The group a batch's rows belong to (0 when rows are not grouped)."""
        return 0 if self.groups is None or not len(batch) else int(self.groups[batch[0]])

    def rank_slice(self, batch: np.ndarray) -> Slice:
        """This rank's slice of the global ``batch``: ``batch_size`` rows each of a full batch; a short batch
        split as evenly as possible, the first ranks taking one row more."""
        total, group = len(batch), self.group_of(batch)
        if self.world_size == 1:
            return Slice(batch, 0, total, total, group)
        first, count = share(total, self.world_size, self.rank)
        if count == 0:
            return Slice(batch[:1], first, 0, total, group)
        return Slice(batch[first:first + count], first, count, total, group)

    def epoch_slices(self, epoch: int) -> list[Slice]:
        """This rank's slices of ``epoch``'s global batches, in order (as objects: :meth:`epoch_plan` holds them
        as arrays)."""
        return list(self.epoch_plan(epoch))

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches (arrays of row numbers) for ``epoch``, in order (see :meth:`epoch_slices`)."""
        return [s.rows for s in self.epoch_slices(epoch)]

    def state_dict(self) -> dict[str, Any]:
        """The settings an epoch's batches depend on (``batch_size``: the global batch size; a mix's groups with
        theirs), and the number of rows they were made for."""
        state = {**{k: getattr(self, k) for k in _SETTINGS}, "batch_size": self.global_batch_size,
                 "rows": self.row_count, "order": self.order}
        if self.groups is not None:
            state["groups"] = [[o.batch_size * self.world_size, float(o.weight), o.repeats]
                               for o in self.group_options]
        return state

    def resume_order(self, state: dict[str, Any]) -> None:
        """Shuffle as the run that saved ``state`` did (:data:`ORDER`; a state without one is an earlier release's,
        which shuffled with numpy's one pass), so the resumed run sees the batches that run would have seen."""
        order = state.get("order", 1)
        if order not in ORDERS:
            raise CacheError(f"loader state was saved by a newer release of the pack (shuffle order {order!r}); "
                             "update the pack to resume this run, or start a new one")
        self.order = order

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse to resume from a ``state_dict`` of a sampler that would produce different batches. A state of
        an earlier release records its per-process ``batch_size`` with ``world_size`` 1: the same thing."""
        mine = self.state_dict()
        if ("groups" in mine) != ("groups" in state):
            raise CacheError("loader state was saved for a single dataset and this loader has a mix of datasets (or "
                             "the other way round); resume with the same datasets")
        for key, value in mine.items():
            if key != "order" and key in state and state[key] != value:
                if key == "batch_size":
                    raise CacheError(f"loader state was saved with a global batch of {state[key]!r} rows but this "
                                     f"loader has {value!r} (batch size {self.batch_size} x {self.world_size} "
                                     "processes); resume with the same batch size times number of processes")
                raise CacheError(f"loader state was saved with {key}={state[key]!r} but this loader has "
                                 f"{value!r}; resume with the same dataset and settings")
        if state.get("world_size", 1) != 1:
            raise CacheError("loader state was saved by an earlier release that split batches between processes "
                             "differently; start a new run")
