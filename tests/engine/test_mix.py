"""Several datasets in one loader (``streaming_cache.mix``): batches of one dataset each, with that dataset's batch
size, repeats and weight; deterministic and resumable; split between processes like any global batch."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import streaming_cache as sc
from streaming_cache.loader import BatchLoader
from streaming_cache.mix import DatasetMix, MixPart, as_mix


def _cache(path, prefix: str, rows: int, shapes=((4, 8, 8),)) -> sc.DatasetHandle:
    with sc.CacheWriter(path) as w:
        for i in range(rows):
            w.put(f"{prefix}{i:03d}", {"samples": torch.full(shapes[i % len(shapes)], float(i)), "tag": prefix})
    return sc.open_cache(path).dataset()


@pytest.fixture(scope="module")
def style(tmp_path_factory):
    """12 rows in two shape buckets."""
    return _cache(tmp_path_factory.mktemp("mix") / "style", "s", 12, shapes=((4, 8, 8), (4, 8, 12)))


@pytest.fixture(scope="module")
def regular(tmp_path_factory):
    """40 rows of one shape."""
    return _cache(tmp_path_factory.mktemp("mix") / "reg", "r", 40)


def _source(batch) -> str:
    tags = set(batch["tag"]) if isinstance(batch["tag"], list) else {batch["tag"]}
    assert len(tags) == 1, "a batch holds one dataset's rows"
    return tags.pop()


def test_each_batch_comes_from_one_dataset_with_its_batch_size_and_the_epoch_holds_each_weighted_share(style,
                                                                                                      regular):
    mix = DatasetMix([MixPart(style, "style", repeats=2, batch_size=3), MixPart(regular, "reg", weight=0.5)])
    loader = BatchLoader(mix, 4, seed=1, workers=0, shares=True)
    shards = list(loader)
    sizes = collections.defaultdict(list)
    for shard in shards:
        sizes[_source(shard.batch)].append(shard.batch["samples"].shape[0])
        assert mix.parts[shard.source].name == {"s": "style", "r": "reg"}[_source(shard.batch)]
    assert sum(sizes["s"]) == 24 and max(sizes["s"]) == 3, "style: every row twice, in batches of 3"
    assert len(sizes["r"]) == 5 and set(sizes["r"]) == {4}, "reg: half of its 10 batches of 4 per epoch"
    assert len(loader) == len(shards) == len(sizes["s"]) + 5
    sources = [s.source for s in shards]
    assert sources != sorted(sources), "the datasets' batches are shuffled together"


def test_a_weight_below_one_covers_the_whole_dataset_over_epochs(style, regular):
    mix = DatasetMix([MixPart(style, "style"), MixPart(regular, "reg", weight=0.25)])
    loader = BatchLoader(mix, 4, seed=3, workers=0)
    seen: collections.Counter = collections.Counter()
    for _ in range(4):
        for batch in loader:
            if _source(batch) == "r":
                seen.update(int(v) for v in batch["samples"][:, 0, 0, 0])
    assert sorted(seen) == list(range(40)) and set(seen.values()) == {1}, "four epochs: each reg row once"


def test_a_mix_resumes_exactly_and_refuses_other_settings(style, regular):
    mix = DatasetMix([MixPart(style, "style", batch_size=2), MixPart(regular, "reg", weight=0.5)])
    full = [(_source(b), b["samples"].sum().item()) for b in BatchLoader(mix, 4, seed=5, workers=0)]
    run = BatchLoader(mix, 4, seed=5, workers=0)
    it = iter(run)
    head = [next(it) for _ in range(4)]
    state = run.state_dict()
    run.close()
    again = BatchLoader(mix, 4, seed=5, workers=1)
    again.load_state_dict(state)
    rest = list(again)
    assert [(_source(b), b["samples"].sum().item()) for b in head + rest] == full
    other = DatasetMix([MixPart(style, "style", batch_size=2), MixPart(regular, "reg", weight=0.6)])
    with pytest.raises(sc.CacheError):
        BatchLoader(other, 4, seed=5).load_state_dict(state)
    with pytest.raises(sc.CacheError, match="mix"):
        BatchLoader(style, 4, seed=5).load_state_dict(state)


def test_processes_split_each_global_batch_of_a_mix(style, regular):
    """Two processes with batch sizes (3, the training's 4) see the batches one process sees with (6, 8)."""
    whole = [(_source(b), [int(v) for v in b["samples"][:, 0, 0, 0]])
             for b in BatchLoader(DatasetMix([MixPart(style, "style", batch_size=6), MixPart(regular, "reg")]), 8,
                                  seed=2, workers=0)]
    half = DatasetMix([MixPart(style, "style", batch_size=3), MixPart(regular, "reg")])
    shares = [list(BatchLoader(half, 4, seed=2, workers=0, rank=r, world_size=2, shares=True)) for r in (0, 1)]
    joined = [(_source(a.batch), [int(v) for v in a.batch["samples"][:, 0, 0, 0]] +
               [int(v) for v in b.batch["samples"][:, 0, 0, 0]]) for a, b in zip(*shares)]
    assert joined == whole
    assert all(a.source == b.source and a.total == b.total for a, b in zip(*shares))


def test_fingerprint_follows_content_and_settings(style, regular):
    a = DatasetMix([MixPart(style, "style"), MixPart(regular, "reg")])
    assert a.fingerprint() == DatasetMix([MixPart(style, "style"), MixPart(regular, "reg")]).fingerprint()
    assert a.fingerprint() != DatasetMix([MixPart(style, "style"), MixPart(regular, "reg", weight=2)]).fingerprint()
    assert a.fingerprint() != DatasetMix([MixPart(style, "style2"), MixPart(regular, "reg")]).fingerprint()
    assert as_mix(style).parts[0].handle is style


def test_a_mix_refuses_what_cannot_train():
    with pytest.raises(ValueError, match="at least one"):
        DatasetMix([])
    empty = sc.DatasetHandle()
    with pytest.raises(ValueError, match="empty"):
        MixPart(empty, "x")


def test_bad_part_settings_are_refused(style):
    for bad in ({"weight": 0.0}, {"weight": float("nan")}, {"repeats": 0}, {"batch_size": -1},
                {"caption_dropout": 1.5}, {"name": ""}):
        with pytest.raises(ValueError):
            MixPart(style, **{"name": "x", **bad})
    with pytest.raises(ValueError, match="named 'x'"):
        DatasetMix([MixPart(style, "x"), MixPart(style, "x")])
    mix = DatasetMix([MixPart(style, "x")])
    with pytest.raises(sc.CacheError, match="one dataset"):
        DatasetMix([MixPart(style, "a"), MixPart(style, "b")]).collate([0, 12])
    assert np.array_equal(mix.groups(), np.zeros(12))
