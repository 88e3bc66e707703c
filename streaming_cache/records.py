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

import math
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
_MIX = np.uint64(0x9E3779B97F4A7C15)


def factorize(key: np.ndarray) -> np.ndarray:
    """A number per row of the 2-d integer array ``key`` (or per value of a 1-d one), equal exactly where the rows
    are equal.

    Datasets have few distinct layouts (a handful of buckets), so the values equal to the first one not yet
    numbered are found with one vectorised comparison each, a cost linear in the rows; only past
    :data:`PEEL_LIMIT` distinct values are those left sorted (``np.unique``), which costs n log n. Rows of several
    columns are numbered by a hash of each row, then every row is compared with the first row of its number; should
    two different rows share a hash, they are numbered by sorting instead."""
    if key.ndim == 1:
        return _factorize_values(key)
    if key.shape[1] == 1:
        return _factorize_values(key[:, 0])
    packed = _packed(key)
    if packed is not None:
        return _factorize_values(packed)
    codes = _factorize_values(row_hash(key))
    if len(codes) and not (key == key[first_of(codes)[codes]]).all():
        codes = np.unique(key, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return codes


def _packed(key: np.ndarray) -> np.ndarray | None:
    """Each row of a signed integer array as one int64, where every row fits (each column's range times the
    others' below 2**62): equal exactly where the rows are equal. None where they do not fit."""
    if key.dtype.kind != "i" or not key.size:
        return None
    lo, hi = key.min(axis=0).tolist(), key.max(axis=0).tolist()
    spans = [b - a + 1 for a, b in zip(lo, hi)]
    if math.prod(spans) >= 2**62:
        return None
    out = np.zeros(len(key), dtype=np.int64)
    for column, low, span in zip(key.T, lo, spans):
        out *= span
        out += column
        out -= low
    return out


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[k], ..., starts[k] + lengths[k] - 1`` of every ``k``, one range after the other: how a
    ragged selection (keys of a blob, a rank's rows of each batch) is gathered with one array operation."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    return np.repeat(np.asarray(starts, dtype=np.int64) - (np.cumsum(lengths) - lengths), lengths) + \
        np.arange(total, dtype=np.int64)


def row_hash(key: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of an integer array (equal rows, equal hashes; not the other way round)."""
    h = np.full(len(key), np.uint64(key.shape[1]), dtype=np.uint64)
    for column in key.T:
        h ^= column.astype(np.uint64, copy=False)
        h *= _MIX
        h ^= h >> np.uint64(29)
    return h


def first_of(codes: np.ndarray) -> np.ndarray:
    """For each number of ``codes`` (0 to its maximum), the position of a row that has it."""
    top = int(codes.max()) if len(codes) else -1
    if top <= 0:
        return np.zeros(top + 1, dtype=np.int64)
    out = np.zeros(top + 1, dtype=np.int64)
    out[codes] = np.arange(len(codes))
    return out


def _factorize_values(values: np.ndarray) -> np.ndarray:
    n = len(values)
    if not n or values.min() == values.max():  # one value (a dataset of one bucket): nothing to tell apart
        return np.zeros(n, dtype=np.int64)
    codes = np.empty(n, dtype=np.int64)
    left = np.arange(n, dtype=np.int64)
    rest = values
    found = 0
    while len(left) and found < PEEL_LIMIT:
        same = rest == rest[0]
        codes[left[same]] = found
        found += 1
        keep = ~same
        left, rest = left[keep], rest[keep]
    if len(left):
        _, inverse = np.unique(rest, return_inverse=True)
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
    ok, record_layout, uniform = _record_layouts(rows, shapes, n_shards)
    found = _in_order_layouts(record_layout, uniform, len(ok), skeletons, skeleton_count, leaf_offsets, leaves)
    if found is not None:
        return RecordTable(ok, rows["begin"], rows["shard"], *found)
    layout, shapes = _entry_layouts(record_layout, ok, skeletons, skeleton_count, leaf_offsets, leaves)
    return RecordTable(ok, rows["begin"], rows["shard"], layout, shapes)


def record_layouts(rows: np.ndarray, shapes: np.ndarray, n_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor record of a ``tensors.rows`` section: whether it passes every check, and a number equal exactly
    where the records' dtype and shape are equal (-1 for a record that does not pass)."""
    ok, layout, _ = _record_layouts(rows, shapes, n_shards)
    return ok, layout


def _record_layouts(rows: np.ndarray, shapes: np.ndarray, n_shards: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """:func:`record_layouts`, and whether every record passes and has layout 0 (one dtype and shape, the
    common dataset: then the entries' layouts need no lookup per record)."""
    known, itemsize = _codes()
    found = _shared_shapes(rows, shapes, n_shards, known, itemsize)
    if found is not None:
        return found
    # The columns as views of the index (no copy); numpy reads them in place.
    code, ndim, start = rows["dtype"], rows["ndim"], rows["shape_start"]
    begin, end, shard = rows["begin"], rows["end"], rows["shard"]
    n_dims = len(shapes)
    readable = known[code] & (ndim <= n_dims) & (start <= np.uint64(n_dims) - ndim)  # per (dtype, ndim, start)
    ok = readable & (shard < n_shards) & (end >= begin)
    span = end - begin
    if len(start) and int(start.max()) < 2**46:  # (start, dtype, ndim) as one number: exact, and one array pass
        shared = start << np.uint64(16)
        shared |= code
        shared |= np.left_shift(ndim, 8, dtype=np.uint64)
        shared = factorize(shared.reshape(-1, 1))
    else:
        shared = factorize(np.stack([code.astype(np.uint64), ndim.astype(np.uint64), start], axis=1))
    if len(shared) and int(shared.max()) < MAX_SHARED_SHAPES:
        return ok, _layouts_by_shape(shared, readable, ok, span, code, ndim, start, shapes, itemsize), False
    return ok, _layouts_per_record(ok, span, code, ndim, start, shapes, itemsize), False


TABLE_CHUNK = 1 << 16  # records checked at once by _shared_shapes: their temporaries stay in the CPU's cache


def _shared_shapes(rows: np.ndarray, shapes: np.ndarray, n_shards: int, known: np.ndarray,
                   itemsize: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """:func:`_record_layouts` where the records share their shapes (the writer stores each distinct shape once,
    so the tensors of a dataset of a few resolutions have a few distinct (dtype, dimension count, shape start)):
    each distinct one is read and checked once, when first met, and every record is checked against it in one pass
    over the table, a chunk at a time. None where the records have more than :data:`MAX_SHARED_SHAPES` distinct
    ones (caches of earlier releases, which stored a shape per record), found in the same pass."""
    n = len(rows)
    if not n:
        return None
    keys = np.zeros(0, dtype=np.uint64)  # the distinct (shape start, dimension count, dtype) met, sorted
    sizes = np.zeros(0, dtype=np.int64)  # per key: its tensors' bytes, -1 where no tensor can have it
    key_layouts = np.zeros(0, dtype=np.int16)  # per key: its layout (equal for equal dtype and shape), -1 likewise
    layout_ids: dict[tuple[int, tuple[int, ...]], int] = {}
    ok = np.empty(n, dtype=bool)
    layout = np.empty(n, dtype=np.int16)
    for lo in range(0, n, TABLE_CHUNK):
        part = rows[lo:lo + TABLE_CHUNK]
        start = part["shape_start"]
        if int(start.max()) >= 2**46:
            return None
        key = start << np.uint64(16)
        key |= part["dtype"]
        key |= np.left_shift(part["ndim"], 8, dtype=np.uint64)
        mine = ok[lo:lo + TABLE_CHUNK]
        if len(keys) == 1 and (key == keys[0]).all():  # one shape so far, the common case: no lookup per record
            size = int(sizes[0])
            np.equal(part["end"] - part["begin"], np.uint64(max(size, 0)), out=mine)
            mine &= part["shard"] < n_shards
            mine &= size >= 0
            np.copyto(layout[lo:lo + TABLE_CHUNK], np.where(mine, key_layouts[0], -1))
            continue
        pos = np.searchsorted(keys, key)
        if not len(keys) or not (keys[np.minimum(pos, len(keys) - 1)] == key).all():
            new = np.setdiff1d(key, keys)
            if len(keys) + len(new) > MAX_SHARED_SHAPES:
                return None
            new_sizes, new_layouts = [], []
            for k in new.tolist():
                c, d, a = k & 0xFF, (k >> 8) & 0xFF, k >> 16
                size, layout_id = -1, -1
                if known[c] and d <= len(shapes) and a <= len(shapes) - d:
                    shape = tuple(shapes[a:a + d].tolist())
                    size = _shape_bytes(c, shape, itemsize)
                    layout_id = layout_ids.setdefault((c, shape), len(layout_ids))
                new_sizes.append(size)
                new_layouts.append(layout_id)
            keys = np.concatenate([keys, new])
            order = np.argsort(keys, kind="stable")
            keys = keys[order]
            sizes = np.concatenate([sizes, np.array(new_sizes, dtype=np.int64)])[order]
            key_layouts = np.concatenate([key_layouts, np.array(new_layouts, dtype=np.int16)])[order]
            pos = np.searchsorted(keys, key)
        size = sizes[pos]
        # a size of -1 reads as 2**64 - 1, which a span can be (end one below begin): hence the sign check
        np.equal(part["end"] - part["begin"], size.astype(np.uint64), out=mine)
        mine &= part["shard"] < n_shards
        mine &= size >= 0
        np.copyto(layout[lo:lo + TABLE_CHUNK], np.where(mine, key_layouts[pos], -1))
    if len(layout_ids) == 1 and ok.all():
        return ok, np.zeros(n, dtype=np.int8), True
    return ok, layout.astype(np.int8) if len(layout_ids) < 128 else layout, False


def _in_order_layouts(record_layout: np.ndarray, uniform: bool, records: int, skeletons: np.ndarray,
                      skeleton_count: int, leaf_offsets: np.ndarray,
                      leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_entry_layouts` where each entry holds one tensor, the entries' tensors listed in entry order (as the
    writer lists them), and every entry names a record and a skeleton that exist: an entry's layout without its
    skeleton is then its record's (0 for all where the records are ``uniform``), found with one lookup an entry.
    None where that is not so (the general way then finds out which entries fall short)."""
    entries = len(skeletons)
    if not entries or int(leaf_offsets[0]) != 0 or int(leaf_offsets[-1]) != entries or entries > len(leaves):
        return None
    # rising offsets from 0 to the entry count: one tensor an entry, the entries' tensors in order
    if entries > 1 and not bool((leaf_offsets[1:] > leaf_offsets[:-1]).all()):
        return None
    mine = leaves[:entries]
    if int(mine.max()) >= records or int(skeletons.max()) >= skeleton_count:
        return None
    shapes = np.zeros(entries, dtype=np.int8) if uniform else record_layout[mine]
    if int(skeletons.min()) == int(skeletons.max()):
        return shapes, shapes
    layout = factorize(np.stack([skeletons.astype(np.int64), shapes.astype(np.int64)], axis=1))
    layout = np.where(shapes >= 0, layout, -1)
    return layout.astype(_small_codes(int(layout.max())), copy=False), shapes


def _small_codes(top: int) -> np.dtype:
    """The smallest signed integer dtype holding -1 to ``top``."""
    for dtype in (np.int8, np.int16, np.int32):
        if top <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


MAX_SHARED_SHAPES = 4096  # distinct (dtype, dimension count, shape) records checked one by one


def _shape_bytes(code: int, shape: tuple[int, ...], itemsize: np.ndarray) -> int:
    """The bytes a tensor of dtype ``code`` and ``shape`` holds; -1 for a shape no tensor can have."""
    if any(d < 0 for d in shape):
        return -1
    size = int(itemsize[code])
    if math.prod(d for d in shape if d) * size >= fmt.MAX_TENSOR_ELEMENTS_BYTES:
        return -1
    return math.prod(shape) * size


def _layouts_by_shape(shared: np.ndarray, readable: np.ndarray, ok: np.ndarray, span: np.ndarray, code: np.ndarray,
                      ndim: np.ndarray, start: np.ndarray, shapes: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Record layouts where records share their shapes (the writer stores each distinct shape once: ``shared``
    numbers the distinct (dtype, dimension count, shape start) of the records): each distinct one is read and
    checked once, then every record is checked against it with a few array passes. Checks ``ok`` in place."""
    first = first_of(shared)
    nbytes = np.full(len(first), -1, dtype=np.int64)
    layout_of: dict[tuple[int, tuple[int, ...]], int] = {}
    layout = np.full(len(first), -1, dtype=np.int64)
    for k, i in enumerate(first.tolist()):
        if readable[i]:
            c, a = int(code[i]), int(start[i])
            shape = tuple(shapes[a:a + int(ndim[i])].tolist())
            nbytes[k] = _shape_bytes(c, shape, itemsize)
            layout[k] = layout_of.setdefault((c, shape), len(layout_of))
    size = nbytes[shared]
    ok &= (size >= 0) & (span == size.astype(np.uint64))
    return np.where(ok, layout[shared], -1)


def _layouts_per_record(ok: np.ndarray, span: np.ndarray, code: np.ndarray, ndim: np.ndarray, start: np.ndarray,
                        shapes: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Record layouts where records do not share shapes (caches of earlier releases): every record's shape read
    and checked with numpy, one dimension count at a time. Checks ``ok`` in place."""
    key = np.full(len(ok), np.uint64(2**64 - 1), dtype=np.uint64)  # records not ok keep this; they are never used
    for d in np.unique(ndim[ok]).tolist():  # the records of each dimension count together (usually one count)
        sel = np.flatnonzero(ok & (ndim == d))
        dims = shapes[start[sel].astype(np.int64)[:, None] + np.arange(d)].astype(np.uint64)
        as_float = dims.astype(np.float64)
        size = itemsize[code[sel]]
        fits = np.prod(as_float, axis=1) * size < _LIMIT
        empty = np.flatnonzero((dims == 0).any(axis=1))
        if len(empty):  # an empty tensor whose other dimensions are huge: no tensor can have its strides
            fits[empty] &= np.prod(np.where(as_float[empty] == 0, 1.0, as_float[empty]), axis=1) * size[empty] < _LIMIT
        exact = np.prod(dims, axis=1) * size.astype(np.uint64)  # exact where it fits (below 2**62)
        good = fits & (exact == span[sel])
        ok[sel] = good
        key[sel] = row_hash(np.concatenate([code[sel, None].astype(np.uint64), dims], axis=1))
    return _exact_layouts(key, ok, code, ndim, start, shapes)


def _exact_layouts(hashes: np.ndarray, ok: np.ndarray, code: np.ndarray, ndim: np.ndarray, start: np.ndarray,
                   shapes: np.ndarray) -> np.ndarray:
    """Per record, a number equal exactly where the records' dtype and shape are equal (-1 for records not ``ok``):
    numbered by the hash of each, then each record compared with the first of its number; where two layouts share
    a hash, by sorting the layouts themselves."""
    out = np.full(len(ok), -1, dtype=np.int64)
    good = np.flatnonzero(ok)
    if not len(good):
        return out
    codes = _factorize_values(hashes[good])
    first = good[first_of(codes)[codes]]
    same = (code[first] == code[good]) & (ndim[first] == ndim[good])
    for d in np.unique(ndim[good]).tolist():
        sel = np.flatnonzero(same & (ndim[good] == d))
        if d and len(sel):
            steps = np.arange(d)
            mine = shapes[start[good[sel]].astype(np.int64)[:, None] + steps]
            theirs = shapes[start[first[sel]].astype(np.int64)[:, None] + steps]
            same[sel] &= (mine == theirs).all(axis=1)
    if not same.all():
        width = int(ndim[good].max())
        key = np.full((len(good), 2 + width), -1, dtype=np.int64)
        key[:, 0], key[:, 1] = code[good], ndim[good]
        for d in range(1, width + 1):
            sel = np.flatnonzero(ndim[good] == d)
            key[sel, 2:2 + d] = shapes[start[good[sel]].astype(np.int64)[:, None] + np.arange(d)]
        codes = np.unique(key, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    out[good] = codes
    return out


def _single_leaf_layouts(record_layout: np.ndarray, ok: np.ndarray, skeletons: np.ndarray, skeleton_count: int,
                         records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_entry_layouts` where every entry holds one tensor (``records``: each entry's): an entry's layout
    without its skeleton is its record's, and with it, the same where every entry has one skeleton."""
    valid = records < len(ok)
    if not valid.all():
        records = np.where(valid, records, 0)
    fast = valid & ok[records] & (skeletons < skeleton_count)
    shapes = np.where(fast, record_layout[records], -1)
    if int(skeletons.min()) == int(skeletons.max()):
        return shapes, shapes
    layout = factorize(np.stack([skeletons.astype(np.int64), shapes], axis=1))
    return np.where(fast, layout, -1), shapes


def _entry_layouts(record_layout: np.ndarray, ok: np.ndarray, skeletons: np.ndarray, skeleton_count: int,
                   leaf_offsets: np.ndarray, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per entry, its layout with and without its skeleton (see :class:`RecordTable`)."""
    entries = len(skeletons)
    count = leaf_offsets[1:] - leaf_offsets[:-1]
    if entries and int(count.min()) == int(count.max()) == 1 and int(leaf_offsets[-1]) <= len(leaves):
        return _single_leaf_layouts(record_layout, ok, skeletons, skeleton_count, leaves[leaf_offsets[:-1]])
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
    if width == 1 and bool((count == 1).all()):  # one tensor an entry: its record's layout says it all
        shapes = key[:, 2].copy()
    else:
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
