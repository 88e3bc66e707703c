"""The index's tensor records and entries as numpy tables, checked all at once: what collating a batch looks up.

A batch of entries that share one skeleton and their tensors' dtypes and shapes (every batch of a shape bucket)
is read with a handful of array lookups instead of a Python decode per record. Building the tables is one pass of
vectorised checks over the whole index, the same checks :func:`~.format.decode_tensor_record` makes one record at
a time (a record failing any of them is not ``ok``, and the entries using it go the slow, per-entry way, which
names the damage); layouts are compared exactly (numbered by :func:`factorize`), never by hash.

The same tables say which entries have equal tensor dtypes and shapes (``shapes``): the shape buckets the sampler
batches by, found for every entry of the index with a few array passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import format as fmt

MAX_FAST_LEAVES = 16  # entries with more tensors than this are collated entry by entry
_LIMIT = float(fmt.MAX_TENSOR_ELEMENTS_BYTES)


@dataclass(frozen=True)
class RecordTable:
    """Per tensor record: ``ok`` (it passes every check), ``begin`` (of its bytes in its shard's data area) and
    ``shard``; per entry: ``layout``, equal for entries whose skeleton, tensor count and each tensor's dtype and
    shape are equal, -1 for an entry that must be read entry by entry (a damaged record, too many tensors), and
    ``shapes``, the same without the skeleton (equal for entries whose tensors can be stacked together)."""

    ok: np.ndarray
    begin: np.ndarray
    shard: np.ndarray
    layout: np.ndarray
    shapes: np.ndarray


PEEL_LIMIT = 64  # distinct values found one at a time before sorting the rest


def factorize(key: np.ndarray) -> np.ndarray:
    """A number per row of the 2-d integer array ``key``, equal exactly where the rows are equal.

    Datasets have few distinct layouts (a handful of buckets), so the rows equal to the first one not yet numbered
    are found with one vectorised comparison each, a cost linear in the rows; only past :data:`PEEL_LIMIT`
    distinct values are the rows left sorted (``np.unique``), which costs n log n."""
    n = len(key)
    codes = np.empty(n, dtype=np.int64)
    left = np.arange(n, dtype=np.int64)
    rest = key
    found = 0
    while len(left) and found < PEEL_LIMIT:
        same = (rest == rest[0]).all(axis=1)
        codes[left[same]] = found
        found += 1
        left, rest = left[~same], rest[~same]
    if len(left):
        _, inverse = np.unique(rest, axis=0, return_inverse=True)
        codes[left] = found + inverse.reshape(-1)
    return codes


def _codes() -> tuple[np.ndarray, np.ndarray]:
    known = np.zeros(256, dtype=bool)
    itemsize = np.zeros(256, dtype=np.int64)
    for name in fmt.TORCH_DTYPE:
        known[fmt.DTYPE_CODE[name]] = True
        itemsize[fmt.DTYPE_CODE[name]] = fmt.ITEMSIZE[name]
    return known, itemsize


def record_table(rows: np.ndarray, shapes: np.ndarray, n_shards: int, skeletons: np.ndarray,
                 skeleton_count: int, leaf_offsets: np.ndarray, leaves: np.ndarray) -> RecordTable:
    """The tables of one index (its ``tensors.rows``, ``tensors.shapes``, ``entries.skeleton``,
    ``entries.leaf_offsets`` and ``leaves.tensor`` sections; ``skeleton_count`` skeletons)."""
    n = len(rows)
    known, itemsize = _codes()
    code = rows["dtype"].astype(np.int64)
    ndim = rows["ndim"].astype(np.int64)
    start = rows["shape_start"]
    begin, end = rows["begin"], rows["end"]
    n_dims = np.uint64(len(shapes))
    inside = (ndim.astype(np.uint64) <= n_dims) & (start <= n_dims - ndim.astype(np.uint64))
    ok = known[code] & inside & (rows["shard"].astype(np.int64) < n_shards) & (end >= begin)
    max_ndim = int(ndim[ok].max()) if ok.any() else 0
    dims = np.zeros((n, max_ndim), dtype=np.uint64)
    for d in range(1, max_ndim + 1):  # gather each record's shape, one dimension count at a time
        sel = np.flatnonzero(ok & (ndim == d))
        if len(sel):
            dims[sel, :d] = shapes[start[sel].astype(np.int64)[:, None] + np.arange(d)]
    present = np.arange(max_ndim) < ndim[:, None]
    as_float = np.where(present, dims.astype(np.float64), 1.0)
    numel = np.prod(as_float, axis=1)
    nonzero = np.prod(np.where(as_float == 0, 1.0, as_float), axis=1)
    size = itemsize[code].astype(np.float64)
    ok &= (numel * size < _LIMIT) & (nonzero * size < _LIMIT)  # exact in float64 below 2**62? checked next
    exact = np.prod(np.where(present, dims, np.uint64(1)), axis=1) * itemsize[code].astype(np.uint64)
    ok &= exact == (end - begin)
    key = np.concatenate([code[:, None].astype(np.uint64), ndim[:, None].astype(np.uint64), dims], axis=1)
    record_layout = factorize(np.where(ok[:, None], key, np.uint64(2**64 - 1)))
    del key, dims, as_float, present
    layout, shapes = _entry_layouts(record_layout, ok, skeletons, skeleton_count, leaf_offsets, leaves)
    return RecordTable(ok, begin.astype(np.int64), rows["shard"].astype(np.int64), layout, shapes)


def _entry_layouts(record_layout: np.ndarray, ok: np.ndarray, skeletons: np.ndarray, skeleton_count: int,
                   leaf_offsets: np.ndarray, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per entry, its layout with and without its skeleton (see :class:`RecordTable`)."""
    entries = len(skeletons)
    lo, hi = leaf_offsets[:-1].astype(np.int64), leaf_offsets[1:].astype(np.int64)
    count = hi - lo
    fast = (count <= MAX_FAST_LEAVES) & (skeletons.astype(np.int64) < skeleton_count) & (hi <= len(leaves))
    width = int(count[fast].max()) if fast.any() else 0
    key = np.full((entries, 2 + width), -1, dtype=np.int64)
    key[:, 0], key[:, 1] = skeletons, count
    for k in range(width):
        sel = np.flatnonzero(fast & (count > k))
        recs = leaves[lo[sel] + k].astype(np.int64)
        valid = recs < len(ok)
        fast[sel[~valid]] = False
        recs = np.where(valid, recs, 0)
        fast[sel[valid & ~ok[recs]]] = False
        key[sel, 2 + k] = np.where(valid, record_layout[recs], -1)
    if not entries:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    shapes = factorize(key[:, 1:])
    layout = factorize(np.stack([key[:, 0], shapes], axis=1))
    return np.where(fast, layout, -1), np.where(fast, shapes, -1)


@dataclass(frozen=True)
class ShardRecords:
    """The tensor records of each shard: ``order[starts[s]:starts[s + 1]]`` for shard ``s`` (``order`` None when
    the records are already in shard order, as the writer writes them: then the records themselves)."""

    order: np.ndarray | None
    starts: np.ndarray

    def of(self, shard: int) -> np.ndarray:
        a, b = int(self.starts[shard]), int(self.starts[shard + 1])
        return np.arange(a, b, dtype=np.int64) if self.order is None else self.order[a:b]


def shard_records(shard: np.ndarray, n_shards: int) -> ShardRecords:
    """:class:`ShardRecords` of a ``tensors.rows`` shard column: one pass to see whether it is sorted, a sort
    otherwise. A record naming a shard the index does not list belongs to none."""
    column = shard.astype(np.int64)
    order = None
    if len(column) > 1 and bool((column[1:] < column[:-1]).any()):
        order = np.argsort(column, kind="stable")
        column = column[order]
    return ShardRecords(order, np.searchsorted(column, np.arange(n_shards + 1), side="left").astype(np.int64))
