"""Planning an epoch from the index's numpy tables gives exactly what the per-entry way gave: the same signatures,
buckets, batches, holdout and key lookups, for caches of several layouts, columns and generations."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch
import xxhash

from streaming_cache import DatasetHandle, Encoder, Item, Part, build, records
from streaming_cache import format as fmt
from streaming_cache import sampler as sampler_module
from streaming_cache.dataset import shared_reader
from streaming_cache.errors import CacheError, StaleCacheError
from streaming_cache.loader import BatchLoader
from streaming_cache.reader import open_cache
from streaming_cache.records import PEEL_LIMIT, factorize
from streaming_cache.sampler import BucketSampler
from streaming_cache.train import holdout
from streaming_cache.writer import CacheWriter


def _per_entry_signatures(handle: DatasetHandle) -> np.ndarray:
    """The signatures as earlier releases computed them: row by row, entry by entry."""
    out = []
    for row in handle:
        reader, entries = row._entries()
        h = xxhash.xxh3_64()
        for e in entries:
            sig = xxhash.xxh3_64_intdigest(repr([(t.dtype, t.shape) for t in reader.tensor_info(e)]).encode())
            h.update(sig.to_bytes(8, "little"))
        out.append(h.intdigest())
    return np.array(out, dtype=np.uint64)


def _mixed_cache(path: str, offset: int = 0) -> None:
    with CacheWriter(path) as w:
        for i in range(60):
            side = 2 + i % 3
            if i % 7 == 0:
                w.put(f"k{i}", {"t": [torch.full((1,), float(j)) for j in range(20)]})  # more than 16 tensors
            elif i % 5 == 0:
                w.put(f"k{i}", {"latent": torch.full((4, side, side), float(i + offset)), "id": i})  # another skeleton
            else:
                w.put(f"k{i}", torch.full((4, side, side), float(i + offset), dtype=torch.float16 if i % 2 else
                                          torch.float32))


def test_signatures_equal_the_per_entry_ones(tmp_path):
    _mixed_cache(str(tmp_path / "a"))
    _mixed_cache(str(tmp_path / "b"), 1000)
    handle = DatasetHandle.from_cache(tmp_path / "a") + DatasetHandle.from_cache(tmp_path / "b")[::3]
    fast = handle.signatures()
    assert fast.tolist() == _per_entry_signatures(handle).tolist()
    assert len(set(fast.tolist())) == 7  # 3 sizes x 2 dtypes (a dict of one latent stacks with them), the list


def test_signatures_of_a_dataset_with_columns(tmp_path):
    def encode(column):
        def run(parts):
            return [torch.zeros(4, 2 + p.params["n"] % 2, 3) if column == "latent" else
                    torch.zeros(1 + p.params["n"] % 3, 8) for p in parts]
        return Encoder(fingerprint=column, encode=run, batch_size=4)

    items = [Item(f"im{i}", {"latent": Part(data=b"x%d" % i, params={"n": i}),
                             "cond": Part(data=b"c%d" % (i % 5), params={"n": i % 5})}) for i in range(24)]
    build(str(tmp_path / "c"), items, {"latent": encode("latent"), "cond": encode("cond")})
    handle = DatasetHandle.from_cache(tmp_path / "c", "default")
    assert handle.columns is not None and len(handle.columns) == 2
    assert handle.signatures().tolist() == _per_entry_signatures(handle).tolist()
    assert len(set(handle.signatures().tolist())) == 6


def test_factorize_is_exact_past_the_peeled_values():
    rng = np.random.default_rng(0)
    key = rng.integers(0, 9, size=(5000, 3))  # up to 729 distinct rows, past PEEL_LIMIT
    codes = factorize(key)
    assert len(np.unique(codes)) == len(np.unique(key, axis=0)) > PEEL_LIMIT
    first = {}
    for row, code in zip(map(tuple, key.tolist()), codes.tolist()):
        assert first.setdefault(row, code) == code
    assert len(set(first.values())) == len(first)


def _reference_batches(sampler: BucketSampler, signatures: np.ndarray, epoch: int) -> list[list[int]]:
    """An epoch's batches as earlier releases made them (a lexsort by each bucket's first row)."""
    _, bucket_of = np.unique(signatures, return_inverse=True)
    rng = np.random.default_rng([sampler.seed, epoch])
    rows = np.tile(np.arange(len(bucket_of), dtype=np.int64), sampler.repeats)
    if sampler.shuffle:
        rows = rows[rng.permutation(len(rows))]
    buckets = bucket_of[rows]
    first_seen = np.full(bucket_of.max() + 1, len(rows), dtype=np.int64)
    np.minimum.at(first_seen, buckets, np.arange(len(rows)))
    order = np.lexsort((np.arange(len(rows)), first_seen[buckets]))
    rows, buckets = rows[order], buckets[order]
    batches = []
    starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
    size = sampler.global_batch_size
    for group in np.split(rows, starts[1:]):
        for i in range(0, len(group), size):
            if len(group[i:i + size]) == size or not sampler.drop_last:
                batches.append(group[i:i + size])
    if sampler.shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return [b.tolist() for b in batches]


@pytest.mark.parametrize("buckets", [1, 5, 300])
@pytest.mark.parametrize("settings", [dict(), dict(shuffle=False), dict(drop_last=True, repeats=3),
                                      dict(world_size=2, rank=1, seed=7)])
def test_batches_equal_the_earlier_releases(buckets, settings):
    rng = np.random.default_rng(buckets)
    signatures = rng.integers(0, 2**63, size=buckets, dtype=np.uint64)[rng.integers(0, buckets, size=3000)]
    sampler = BucketSampler(signatures, 4, **settings)
    for epoch in range(3):
        assert [b.tolist() for b in sampler.global_batches(epoch)] == _reference_batches(sampler, signatures, epoch)


def test_holdout_from_the_index_equals_the_per_key_scores(tmp_path):
    _mixed_cache(str(tmp_path / "a"))
    handle = DatasetHandle.from_cache(tmp_path / "a")
    expected = [xxhash.xxh3_64_intdigest(k.encode()) / 2.0**64 for k in handle.keys()]
    assert holdout._scores(handle, 0).tolist() == expected
    train, val = holdout.split(handle, 0.3)
    assert sorted(val.keys()) == sorted(k for k, s in zip(handle.keys(), expected) if s < 0.3)
    assert len(train) + len(val) == len(handle) and 0 < len(val) < len(handle)


def test_a_handle_follows_its_keys_into_a_later_generation(tmp_path):
    path = str(tmp_path / "c")
    with CacheWriter(path) as w:
        for i in range(50):
            w.put(f"k{i}", torch.full((2,), float(i)))
    handle = DatasetHandle.from_cache(path)[10:20]
    with CacheWriter(path) as w:  # later keys and a value moved: entry numbers change
        w.remove(["k0", "k1", "k2"])
        w.put("k15", torch.full((2,), 115.0))
        for i in range(50, 80):
            w.put(f"k{i}", torch.full((2,), float(i)))
    values = [float(row.materialize()[0]) for row in handle]
    assert values == [float(i) if i != 15 else 115.0 for i in range(10, 20)]
    assert shared_reader(path).indices_of(b"k3k49nope", np.array([0, 2, 5, 9])).tolist()[:2] == \
        [open_cache(path).index_of("k3"), open_cache(path).index_of("k49")]
    with CacheWriter(path) as w:
        w.remove(["k12"])
    with pytest.raises(StaleCacheError, match="refers to 1 entries the cache no longer has .*k12"):
        handle.signatures()


def test_keys_of_equal_hash_are_told_apart(tmp_path, monkeypatch):
    from streaming_cache import format as fmt
    monkeypatch.setattr(fmt, "key_hash", lambda key: 7)  # every key collides, in the writer and the reader
    monkeypatch.setattr(fmt, "key_hashes", lambda keys, count: np.full(count, 7, dtype=np.uint64))
    path = str(tmp_path / "c")
    with CacheWriter(path) as w:
        for i in range(6):
            w.put(f"k{i}", torch.full((1,), float(i)))
    reader = open_cache(path)
    assert [reader.index_of(f"k{i}") for i in range(6)] == list(range(6))
    found = reader.indices_of(b"k4k0k9", np.array([0, 2, 4, 6]))
    assert found.tolist() == [4, 0, -1]


def test_a_bare_tensor_is_stored_as_any_value_is(tmp_path):
    from streaming_cache.skeleton import encode_skeleton
    from streaming_cache.writer import _TENSOR_SKELETON
    t = torch.randn(3, 4)
    assert encode_skeleton(t, [t]) == _TENSOR_SKELETON
    values = {"plain": torch.randn(2, 3), "transposed": torch.randn(3, 5).t(), "channels_last":
              torch.randn(1, 3, 4, 5).to(memory_format=torch.channels_last), "bf16": torch.randn(4).bfloat16(),
              "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "parameter": torch.nn.Parameter(torch.ones(2))}
    path = str(tmp_path / "c")
    expect = {key: value.detach().clone() for key, value in values.items()}
    with CacheWriter(path) as w:
        for key, value in values.items():
            w.put(key, value)
        values["plain"].add_(1)  # the writer holds its own copy
    with open_cache(path) as r:
        for key in values:
            got, expected = r[key].materialize(), expect[key]
            assert type(got) is torch.Tensor  # a parameter comes back as its data, as it always has
            assert got.dtype == expected.dtype and torch.equal(got, expected), key


def test_put_many_stores_what_put_one_by_one_stores(tmp_path):
    from streaming_cache.errors import CacheError
    values = torch.randn(50, 2, 3).bfloat16()
    values[7] = values[3]  # deduplicated
    keys = [f"k{i}" for i in range(50)]
    keys[9] = "k2"  # a later key replaces an earlier one
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    with CacheWriter(one) as w:
        for key, row in zip(keys, values):
            w.put(key, row)
    with CacheWriter(many) as w:
        w.put_many(keys, values)
        values.zero_()  # the writer holds its own copy
        w.put_many(["n0", "n1"], np.arange(6, dtype=np.int16).reshape(2, 3))
        with pytest.raises(CacheError, match="one key per row"):
            w.put_many(["x"], torch.zeros(2, 3))
        with pytest.raises(CacheError, match="non-empty strings"):
            w.put_many(["y", ""], torch.zeros(2, 3))
        with pytest.raises(CacheError, match="not valid Unicode"):
            w.put_many(["z", "bad\udc80"], torch.zeros(2, 3))
        assert "y" not in w and "z" not in w  # a bad key stages none of the batch
    with open_cache(one) as a, open_cache(many) as b:
        assert list(b.keys())[:-2] == list(a.keys()) and len(b) == 51
        assert b.index.info.tensors == a.index.info.tensors + 2 == 50
        for key in a.keys():
            assert torch.equal(a[key].materialize(), b[key].materialize()), key
            assert a.entry_digest(a.index_of(key)) == b.entry_digest(b.index_of(key))
        assert isinstance(b["n1"].materialize(), np.ndarray) and b["n1"].materialize().tolist() == [3, 4, 5]


def test_layouts_stay_exact_when_every_hash_collides(tmp_path, monkeypatch):
    from streaming_cache import records
    _mixed_cache(str(tmp_path / "a"))
    with open_cache(tmp_path / "a") as reader:
        expected = [reader.shape_signature(i) for i in range(len(reader))]  # entry by entry
    monkeypatch.setattr(records, "row_hash", lambda key: np.zeros(len(key), dtype=np.uint64))
    with open_cache(tmp_path / "a") as reader:
        table = reader._table()
        assert reader.shape_signatures().tolist() == expected
        sig_of = {}
        for entry, layout in enumerate(table.shapes.tolist()):
            if layout >= 0:
                assert sig_of.setdefault(layout, expected[entry]) == expected[entry]
        assert len(sig_of) == len({s for e, s in enumerate(expected) if table.shapes[e] >= 0}) == 6
    key = np.array([[1, 2], [3, 4], [1, 2], [5, 6]])
    codes = factorize(key)
    assert codes[0] == codes[2] and len({codes[0], codes[1], codes[3]}) == 3


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_ranks_plan_holds_its_slices_of_the_global_batches(world, mixed):
    rng = np.random.default_rng(world)
    signatures = rng.integers(0, 4, size=500).astype(np.uint64)
    options = dict(groups=np.repeat([0, 1], 250), group_options=[(3, 1.0, 1), (2, 0.5, 2)]) if mixed else {}
    for rank in range(world):
        sampler = BucketSampler(signatures, 3, rank=rank, world_size=world, seed=5, **options)
        for epoch in range(2):
            plan = sampler.epoch_plan(epoch)
            expected = [sampler.rank_slice(b) for b in sampler.global_batches(epoch)]
            assert len(plan) == len(expected) == sampler.epoch_length(epoch)
            for got, want in zip(plan, expected):
                assert got.rows.tolist() == want.rows.tolist()
                assert (got.first, got.samples, got.total, got.group) == (want.first, want.samples, want.total,
                                                                          want.group)
            assert plan.rows_held() == sum(len(s.rows) for s in expected)
            assert plan.rows_held() < sum(s.total for s in expected) or world == 1


def _per_row_fingerprint(handle: DatasetHandle) -> str:
    """The fingerprint as earlier releases computed it, row by row."""
    h = xxhash.xxh3_128()
    for p in handle._parts:
        reader = shared_reader(p.cache)
        index = p.keys.resolve(reader)
        h.update(repr(p.columns).encode())
        for row in p.rows:
            for k in row:
                h.update(p.keys.key(int(k)).encode())
                h.update(b"\0")
                h.update(reader.entry_digest(int(index[k])))
    return h.hexdigest()


def test_fingerprints_equal_the_per_row_ones(tmp_path, monkeypatch):
    from streaming_cache import dataset
    _mixed_cache(str(tmp_path / "a"))
    _mixed_cache(str(tmp_path / "b"), 1000)
    handle = DatasetHandle.from_cache(tmp_path / "a") + DatasetHandle.from_cache(tmp_path / "b")[::-2]
    assert handle.fingerprint() == _per_row_fingerprint(handle)
    monkeypatch.setattr(dataset, "_FINGERPRINT_ROWS", 7)  # rows laid out a few at a time
    assert handle.fingerprint() == _per_row_fingerprint(handle)
    repeated = handle[[3, 3, 40, 3]]
    assert repeated.fingerprint() == _per_row_fingerprint(repeated) != handle.fingerprint()


def test_fingerprints_of_a_dataset_with_columns(tmp_path):
    def encode(parts):
        return [{"t": torch.full((2,), float(p.params["n"]))} for p in parts]

    items = [Item(f"im{i}", {"latent": Part(data=b"x%d" % i, params={"n": i}),
                             "cond": Part(data=b"c%d" % (i % 3), params={"n": i % 3})}, repeats=1 + i % 2)
             for i in range(12)]
    build(str(tmp_path / "c"), items, {c: Encoder(fingerprint=c, encode=encode) for c in ("latent", "cond")})
    handle = DatasetHandle.from_cache(tmp_path / "c", "default")
    assert handle.fingerprint() == _per_row_fingerprint(handle)


def test_one_tensor_an_entry_with_several_skeletons(tmp_path):
    path = str(tmp_path / "c")
    with CacheWriter(path) as w:
        for i in range(40):
            t = torch.full((2, 1 + i % 2), float(i), dtype=torch.float16 if i % 3 else torch.float32)
            w.put(f"k{i}", {"latent": t} if i % 4 == 0 else t)
    handle = DatasetHandle.from_cache(path)
    assert handle.signatures().tolist() == _per_entry_signatures(handle).tolist()
    with open_cache(path) as reader:
        table = reader._table()
        assert (table.layout >= 0).all() and len(set(table.layout.tolist())) == 6  # dicts: (2, 1) only
        assert len(set(table.shapes.tolist())) == 4
        for rows in ([0, 12, 24], [1, 7, 13], [2, 14, 26]):  # same skeleton, dtype and shape: read together
            assert len({int(table.layout[r]) for r in rows}) == 1
            batch = reader.collate(rows)
            got = batch["latent"] if isinstance(batch, dict) else batch
            assert got[:, 0, 0].tolist() == [float(r) for r in rows]


def _plan_digest(plan) -> str:
    h = xxhash.xxh3_64()
    for s in plan:
        h.update(np.asarray(s.rows, dtype=np.int64).tobytes())
        h.update(np.array([s.first, s.samples, s.total, s.group], dtype=np.int64).tobytes())
    return h.hexdigest()


def test_an_epochs_batches_for_a_seed_never_change():
    """A resumed run skips the batches its position counts, so the batches of (seed, epoch, settings) must stay what
    earlier releases planned: these digests are of plans made by the release before the plan was held per rank."""
    signatures = (np.arange(5000, dtype=np.uint64) * np.uint64(7919)) % np.uint64(3)
    settings = [dict(), dict(world_size=2, rank=1, seed=7), dict(world_size=3, rank=2, drop_last=True, repeats=2),
                dict(shuffle=False, world_size=2, rank=0)]
    got = [_plan_digest(BucketSampler(signatures, 8, **kw).epoch_plan(1)) for kw in settings]
    mix = BucketSampler(signatures, 4, seed=3, world_size=2, rank=1, groups=np.arange(5000) % 2,
                        group_options=[(4, 0.5, 1), (2, 1.0, 2)])
    got.append(_plan_digest(mix.epoch_plan(1)))
    assert got == ["3ebd7522f577497f", "c506c8535d24e901", "1d83f73b0b663ab0", "2ba1d1b7cadd9528", "d60dfd8809a91c9e"]


def _held(signatures: np.ndarray, rank: int, world_size: int) -> int:
    """Bytes a sampler and its first epoch's plan keep (numpy reports its buffers to tracemalloc)."""
    BucketSampler(signatures[:100], 16, rank=rank, world_size=world_size).epoch_plan(0)  # imports done before
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sampler = BucketSampler(signatures, 16, seed=3, rank=rank, world_size=world_size)
        plan = sampler.epoch_plan(0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert plan.rows_held() >= len(signatures) // world_size
    return held


@pytest.mark.parametrize("buckets", [1, 5])
def test_a_rank_of_eight_keeps_an_eighth_of_the_plan(buckets):
    """No signature kept, a row number in 4 bytes, a bucket number in 1 (none for one bucket), only the rank's
    rows: one process keeps 4 bytes a row and 8 a batch (plus a byte a row with buckets) and each of 8 ranks an
    eighth of that, plus the bucket numbers every rank needs to plan the next epoch."""
    n = 400_000
    signatures = np.arange(n, dtype=np.uint64) % np.uint64(buckets)
    one = _held(signatures, 0, 1)
    table = 0 if buckets == 1 else n  # the bucket numbers
    assert one <= 4 * n + 8 * (n // 16) + table + 16 * 1024  # 4 bytes a row, 8 a batch
    for rank in (0, 7):
        assert _held(signatures, rank, 8) <= (one - table) / 8 + table + 32 * 1024


def _table_parts(damage: str) -> tuple:
    """The sections :func:`records.record_table` reads, of 300 entries of one float32 4x4 tensor each (the shape
    stored once, the records in three shards), with one ``damage``."""
    n, size = 300, 64
    rows = np.zeros(n, dtype=fmt.TENSOR_ROW)
    rows["dtype"], rows["ndim"], rows["shard"] = fmt.DTYPE_CODE["F32"], 2, np.arange(n) % 3
    rows["begin"] = np.arange(n) * size
    rows["end"] = rows["begin"] + size
    shapes = np.array([4, 4], dtype=np.int64)
    skeletons, skeleton_count = np.zeros(n, dtype=np.uint32), 1
    offsets, leaves = np.arange(n + 1, dtype=np.uint64), np.arange(n, dtype=np.uint32)
    if damage == "span":
        rows["end"][200] += 1
    elif damage == "end_before_begin":
        rows["end"][201] = rows["begin"][201] - size
    elif damage == "shard":
        rows["shard"][202] = 3
    elif damage == "dtype":  # another dtype of the same size: another layout, read together with its own
        rows["dtype"][203] = fmt.DTYPE_CODE["I32"]
    elif damage == "unknown_dtype":
        rows["dtype"] = 255
    elif damage == "shape":  # another shape, stored after the first
        shapes = np.array([4, 4, 2, 8], dtype=np.int64)
        rows["shape_start"][250:] = 2
    elif damage == "leaf_past_records":
        leaves[204] = n
    elif damage == "skeleton_past_count":
        skeletons[205] = 1
    elif damage == "two_skeletons":
        skeletons[::2], skeleton_count = 1, 2
    elif damage == "two_leaves":
        offsets = np.r_[0, np.arange(2, n + 2)].astype(np.uint64)
        leaves = np.r_[leaves, leaves[:1]].astype(np.uint32)
    elif damage == "empty":
        rows, skeletons, offsets, leaves = rows[:0], skeletons[:0], offsets[:1], leaves[:0]
    return rows, shapes, 3, skeletons, skeleton_count, offsets, leaves


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two code arrays are equal up to numbering: -1 at the same places, equal codes at the same places."""
    if a.shape != b.shape or ((a < 0) != (b < 0)).any():
        return False
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len({x for x, _ in pairs}) == len({y for _, y in pairs})


@pytest.mark.parametrize("damage", ["none", "span", "end_before_begin", "shard", "dtype", "unknown_dtype", "shape",
                                    "leaf_past_records", "skeleton_past_count", "two_skeletons", "two_leaves",
                                    "empty"])
def test_the_tables_of_one_shape_are_those_the_general_way_finds(damage, monkeypatch):
    """Where every record has one dtype and shape, the tables are found in one chunked pass (and entries of one
    tensor each without a lookup per record): the same ``ok``, layouts and shape codes, up to numbering, as the
    general way, whatever is damaged, in whichever chunk."""
    monkeypatch.setattr(records, "TABLE_CHUNK", 64)  # the damage lies in a later chunk than the first
    parts = _table_parts(damage)
    fast, fast_records = records.record_table(*parts), records.record_layouts(*parts[:3])
    taken = []
    monkeypatch.setattr(records, "_shared_shapes", lambda *a: taken.append(a) and None)
    monkeypatch.setattr(records, "_in_order_layouts", lambda *a: taken.append(a) and None)
    general, general_records = records.record_table(*parts), records.record_layouts(*parts[:3])
    assert len(taken) == 3  # the general ways ran
    assert fast_records[0].tolist() == general_records[0].tolist()
    assert _same_partition(fast_records[1], general_records[1])
    assert fast.ok.tolist() == general.ok.tolist()
    assert _same_partition(fast.layout, general.layout) and _same_partition(fast.shapes, general.shapes)
    bad = {"span": [200], "end_before_begin": [201], "shard": [202], "unknown_dtype": list(range(300)),
           "leaf_past_records": [204], "skeleton_past_count": [205], "empty": []}.get(damage)
    if bad is not None:
        assert np.flatnonzero(fast.layout < 0).tolist() == bad
    layouts = {"none": 1, "dtype": 2, "shape": 2, "two_skeletons": 2, "two_leaves": 2}.get(damage)
    if layouts is not None:
        assert len(set(fast.layout.tolist())) == layouts and (fast.layout >= 0).all()


def test_a_blocked_shuffle_is_a_uniform_permutation(monkeypatch):
    """Past :data:`sampler.SHUFFLE_BLOCK` rows the shuffle deals rows into blocks and shuffles each with a generator
    of its own: every one of the 120 orders of 5 rows comes up as often as chance says (blocks of 2 rows: 4 blocks,
    some empty), and rows of a million are a permutation. (Order 2, which resumed runs may still use, passed the
    same check when it came; its permutations are pinned by their digests below.)"""
    order = 3
    monkeypatch.setattr(sampler_module, "SHUFFLE_BLOCK", 2)
    draws = 24_000
    seen = Counter(tuple(sampler_module.permutation(5, np.random.default_rng([seed]), order).tolist())
                   for seed in range(draws))
    assert len(seen) == 120
    expected = draws / 120
    chi2 = sum((count - expected) ** 2 / expected for count in seen.values())
    assert chi2 < 190  # 119 degrees of freedom: a uniform draw exceeds 190 with probability below 1e-4
    first = Counter(sampler_module.permutation(5, np.random.default_rng([seed]), order=1)[0] for seed in range(500))
    assert len(first) == 5  # order 1 is numpy's own
    monkeypatch.undo()
    n = 1_000_000
    got = sampler_module.permutation(n, np.random.default_rng(0), order)
    assert np.array_equal(np.sort(got), np.arange(n)) and not np.array_equal(got[:1000], np.arange(1000))
    assert np.array_equal(sampler_module.permutation(1000, np.random.default_rng(3), order),
                          np.random.default_rng(3).permutation(1000))  # up to a block: numpy's, as before


@pytest.mark.parametrize("order, n, digest", [
    (2, 65_537, "c85a36da3febbdf6"), (2, 200_000, "23d96141be762e8a"), (2, 1_000_003, "9134f66f8d4f9fec"),
    (3, 65_537, "50b804ca40742383"), (3, 200_000, "cd53483ef74f9b55"), (3, 1_000_003, "f547ce3347c10299")])
def test_the_blocked_shuffles_stay_the_ones_saved_runs_planned_with(order, n, digest):
    """A run saved with order 2 or 3 resumes with exactly the permutation it planned with: these digests are of the
    permutations each order made when it came (row numbers as int64), whatever type they are held in since."""
    got = sampler_module.permutation(n, np.random.default_rng(7), order)
    assert xxhash.xxh3_64_hexdigest(got.astype(np.int64).tobytes()) == digest


@pytest.mark.parametrize("n", [65_537, 300_001])
def test_a_block_shuffle_at_a_few_positions_is_the_whole_shuffle_there(n):
    """:meth:`BlockShuffle.at` shuffles only the blocks that hold the positions asked for, and gives what the whole
    permutation holds there: at the first and last position, at the bounds of blocks, at random positions and at
    one position asked twice; a position outside is refused."""
    whole = sampler_module.BlockShuffle(n, np.random.default_rng(11)).whole()
    shuffle = sampler_module.BlockShuffle(n, np.random.default_rng(11))
    bounds = shuffle.bounds[1:-1]
    positions = np.concatenate([[0, n - 1, 5, 5], bounds, bounds - 1, np.random.default_rng(1).integers(0, n, 300)])
    assert np.array_equal(shuffle.at(positions), whole[positions])
    assert np.array_equal(shuffle.at(np.arange(n)), whole)
    assert len(shuffle.at(np.zeros(0, dtype=np.int64))) == 0
    with pytest.raises(IndexError):
        shuffle.at(np.array([n]))


@pytest.mark.parametrize("settings", [dict(), dict(world_size=2, rank=1, seed=4), dict(drop_last=True, repeats=2),
                                      dict(world_size=3, rank=2, repeats=3), dict(world_size=8, rank=7)])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_an_epochs_first_batches_come_without_the_whole_plan_and_are_the_plans(settings, batch_size):
    """Rows of one bucket past :data:`SHUFFLE_BLOCK`: a rank's batches from any position are what its whole plan
    holds there (rows, their type, where they start, samples, total), up to the epoch's end, short batches and
    stand-in rows included."""
    sampler = BucketSampler(np.zeros(70_001, np.uint64), batch_size, **{"seed": 3, **settings})
    for epoch in (0, 2):
        plan = sampler.epoch_plan(epoch)
        for first in (0, 5, len(plan) - 2):
            head = sampler.epoch_head(epoch, first, 4)
            expected = [plan[k] for k in range(first, min(first + 4, len(plan)))]
            assert len(head) == len(expected)
            for got, want in zip(head, expected):
                assert got.rows.dtype == want.rows.dtype and got.rows.tolist() == want.rows.tolist()
                assert tuple(got)[1:] == tuple(want)[1:]


def test_the_first_batches_of_other_epochs_come_from_the_whole_plan(monkeypatch):
    """Where an epoch is not one shuffle of every row cut into batches (several buckets, a mix, no shuffle, a state
    of order 2, few rows), there is no head and a lazy plan is the whole plan at once."""
    monkeypatch.setattr(sampler_module, "SHUFFLE_BLOCK", 16)
    one = np.zeros(200, np.uint64)
    cases = [BucketSampler(np.arange(200, dtype=np.uint64) % np.uint64(2), 4),
             BucketSampler(one, 4, groups=np.arange(200) % 2, group_options=[(4, 1.0, 1), (2, 1.0, 1)]),
             BucketSampler(one, 4, shuffle=False), BucketSampler(one[:16], 4)]
    ordered = BucketSampler(one, 4)
    ordered.resume_order({"order": 2})
    for sampler in cases + [ordered]:
        assert sampler.epoch_head(0, 0, 3) is None
        lazy = sampler.lazy_plan(0, 0, 3)
        assert lazy.made() and [s.rows.tolist() for s in lazy] == [s.rows.tolist() for s in sampler.epoch_plan(0)]
    lazy = BucketSampler(one, 4).lazy_plan(1, 10, 3)
    assert not lazy.made() and lazy.rows_held() == 12
    assert lazy[11].rows.tolist() == BucketSampler(one, 4).epoch_plan(1)[11].rows.tolist() and not lazy.made()
    assert lazy[-1].rows.tolist() == BucketSampler(one, 4).epoch_plan(1)[-1].rows.tolist() and lazy.made()
    assert lazy.rows_held() == 200


def test_a_resumed_run_shuffles_as_the_run_that_saved_its_state(monkeypatch):
    """A state of an earlier release (no ``order``) resumes with numpy's one-pass shuffle, which that release
    planned with; a state of order 2 with the blocks shuffled by the epoch's generator; a state of this release
    with blocks of their own generators; a state of a newer release is refused."""
    monkeypatch.setattr(sampler_module, "SHUFFLE_BLOCK", 16)
    signatures = np.arange(500, dtype=np.uint64) % np.uint64(2)
    sampler = BucketSampler(signatures, 4, seed=5)
    state = sampler.state_dict()
    assert state["order"] == sampler_module.ORDER == 3
    earlier = {k: v for k, v in state.items() if k != "order"}
    resumed = BucketSampler(signatures, 4, seed=5)
    resumed.check_state(earlier)
    resumed.resume_order(earlier)
    reference = _reference_batches(resumed, signatures, 1)  # as earlier releases planned: numpy's permutation
    assert [b.tolist() for b in resumed.global_batches(1)] == reference
    assert [b.tolist() for b in sampler.global_batches(1)] != reference
    resumed.resume_order({**state, "order": 2})
    second = [b.tolist() for b in resumed.global_batches(1)]
    assert second not in (reference, [b.tolist() for b in sampler.global_batches(1)])
    rng = np.random.default_rng([5, 1])
    rows = sampler_module.permutation(500, rng, 2)  # order 2's own shuffle, then its batches as _cut makes them
    assert sorted(map(tuple, second)) == sorted(tuple(b.tolist()) for b in _cut_by_bucket(rows, signatures, 4))
    resumed.resume_order(state)
    assert [b.tolist() for b in resumed.global_batches(1)] == [b.tolist() for b in sampler.global_batches(1)]
    with pytest.raises(CacheError, match="newer release"):
        resumed.resume_order({**state, "order": 4})


def _cut_by_bucket(rows: np.ndarray, signatures: np.ndarray, size: int) -> list[np.ndarray]:
    """``rows`` grouped by bucket in the order of each bucket's first row and cut into batches of ``size``."""
    buckets = signatures[rows]
    out = []
    for bucket in dict.fromkeys(buckets.tolist()):
        group = rows[buckets == bucket]
        out += [group[i:i + size] for i in range(0, len(group), size)]
    return out


def test_a_loader_resumes_with_the_order_its_state_was_saved_with(tmp_path, monkeypatch):
    monkeypatch.setattr(sampler_module, "SHUFFLE_BLOCK", 4)
    with CacheWriter(str(tmp_path / "c")) as w:
        for i in range(40):
            w.put(f"k{i}", torch.full((2,), float(i)))
    handle = DatasetHandle.from_cache(tmp_path / "c")
    state = BatchLoader(handle, 4, seed=1).state_dict()
    loader = BatchLoader(handle, 4, seed=1)
    loader.load_state_dict({k: v for k, v in state.items() if k != "order"})
    assert loader.sampler.order == 1
    loader.load_state_dict(state)
    assert loader.sampler.order == sampler_module.ORDER
