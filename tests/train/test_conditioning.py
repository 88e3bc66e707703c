"""Collated batches as one CONDITIONING: each sample keeps its caption, equal options are given once, samples
that differ in a scalar option split into groups, edit references and caption dropout per sample."""

from __future__ import annotations

import pytest
import torch

from streaming_cache.train.conditioning import (
    EQUAL_SAMPLES,
    HOST_ROWS,
    append_reference,
    batch_conditioning,
    drop_captions,
    flatten_batch,
    host_rows_applied,
    keep_on_host,
    mark_equal_samples,
    option_groups,
    pick_rows,
    set_default,
    step_conditioning,
    take_rows,
    to_device,
)
from streaming_cache.train.graph_devices import READ, HostWaits

pytestmark = pytest.mark.oldest_torch


def collated(n: int = 3, *, mask_equal: bool = True) -> list:
    """What collate gives for ``n`` entries of a one-entry CONDITIONING: tensors stacked on a new first dim."""
    text = torch.arange(n * 4 * 2, dtype=torch.float32).reshape(n, 1, 4, 2)
    mask = torch.ones(n, 1, 4) if mask_equal else torch.stack([torch.ones(1, 4) * i for i in range(n)])
    return [[text, {"pooled_output": torch.arange(n * 3, dtype=torch.float32).reshape(n, 1, 3),
                    "attention_mask": mask, "width": [512] * n, "guidance": [3.5, 3.5, 1.0][:n]}]]


def test_batch_conditioning_keeps_each_caption_and_gives_equal_options_once():
    (c, extra), = batch_conditioning(collated())
    assert c.shape == (3, 4, 2) and torch.equal(c[1], collated()[0][0][1, 0]), "one row per sample, its own caption"
    assert extra["pooled_output"].shape == (3, 3), "options that differ are stacked"
    assert extra["attention_mask"].shape == (1, 4), "an option every sample has alike is given once (Lumina 2)"
    assert extra["width"] == 512, "per-sample scalars of one batch are equal: given once"
    (_, differing), = batch_conditioning(collated(mask_equal=False))
    assert differing["attention_mask"].shape == (3, 4)


def test_samples_that_differ_in_a_scalar_option_are_grouped():
    cond = collated()
    assert option_groups(cond, 3) == [[0, 1], [2]], "guidance 3.5, 3.5, 1.0"
    part = take_rows({"cond": cond, "latent": {"samples": torch.zeros(3, 1, 4, 8, 8)}}, [2])
    (c, extra), = part["cond"]
    assert c.shape == (1, 1, 4, 2) and extra["guidance"] == [1.0] and extra["width"] == [512]
    assert part["latent"]["samples"].shape == (1, 1, 4, 8, 8)
    assert option_groups(collated(2), 2) == [[0, 1]], "guidance 3.5, 3.5: one call"


def test_samples_that_differ_in_an_option_without_batch_dimension_are_grouped():
    """Anima's T5 token ids are one 1-D tensor per conditioning: samples with other ids run as separate calls,
    and within a call the ids are given once, as ComfyUI holds them (not flattened into one long row)."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3]])
    cond = [[torch.zeros(3, 1, 4, 2), {"t5xxl_ids": ids, "t5xxl_weights": torch.ones(3, 3)}]]
    assert option_groups(cond, 3) == [[0, 2], [1]]
    (_, extra), = batch_conditioning(take_rows(cond, [0, 2]))
    assert torch.equal(extra["t5xxl_ids"], torch.tensor([1, 2, 3])) and extra["t5xxl_weights"].shape == (3,)
    try:
        batch_conditioning(cond)
    except ValueError as e:
        assert "option_groups" in str(e)
    else:
        raise AssertionError("differing unbatched options are refused, not flattened")


def test_reference_latents_and_defaults_are_added_as_comfyuis_nodes_add_them():
    cond = batch_conditioning(collated(2))
    ref = torch.ones(2, 16, 4, 4)
    with_ref = append_reference(cond, ref)
    assert with_ref[0][1]["reference_latents"] == [ref] and "reference_latents" not in cond[0][1], "a new list"
    again = append_reference(with_ref, ref * 2)
    assert len(again[0][1]["reference_latents"]) == 2
    kept = set_default([[cond[0][0], {"guidance": 3.5}]], "guidance", 1.0)
    assert kept[0][1]["guidance"] == 3.5 and set_default(cond, "guidance", 1.0)[0][1]["guidance"] == 3.5
    fresh = set_default([[cond[0][0], {}]], "guidance", 1.0)
    assert fresh[0][1]["guidance"] == 1.0


def test_dropped_samples_get_the_empty_caption_row_by_row():
    cond = collated()
    empty = [[torch.full((1, 4, 2), -1.0), {"pooled_output": torch.full((1, 3), -1.0)}]]  # as cached
    out = drop_captions(cond, empty, [False, True, False])
    (c, extra), = out
    assert torch.equal(c[1, 0], torch.full((4, 2), -1.0)) and torch.equal(c[0], cond[0][0][0])
    assert torch.equal(extra["pooled_output"][1], torch.full((1, 3), -1.0))
    assert torch.equal(extra["pooled_output"][2], cond[0][1]["pooled_output"][2])
    assert drop_captions(cond, empty, [False] * 3) is cond


def test_a_caption_of_another_length_replaces_the_whole_batch_only_if_its_first_sample_is_dropped():
    cond = collated(2)
    empty = [[torch.zeros(1, 7, 2), {"note": "x"}]]
    whole = drop_captions(cond, empty, [True, False])
    assert whole[0][0].shape == (2, 1, 7, 2) and whole[0][1] == {"note": "x"}
    kept = drop_captions(cond, empty, [False, True])
    assert torch.equal(kept[0][0], cond[0][0])


@pytest.mark.parametrize("length", [4, 7])  # CLIP's fixed length (row by row), another one (the whole batch)
def test_a_dropped_caption_lands_on_the_device_of_the_batch_not_where_it_was_cached(length):
    """The loader has put the batch on the training device; the empty caption is cached on the host. The meta
    device stands for the GPU: any tensor of the result built on the host would fail ``torch.where`` there or show
    here."""
    cond = to_device(collated(2), torch.device("meta"))
    empty = [[torch.full((1, length, 2), -1.0), {"pooled_output": torch.full((1, 3), -1.0)}]]
    (c, extra), = drop_captions(cond, empty, [True, False])
    assert c.device.type == "meta" and extra["pooled_output"].device.type == "meta"
    assert c.shape == (2, 1, length, 2)


def test_flatten_and_device_moves_reach_into_structures():
    assert flatten_batch(torch.zeros(3, 1, 4)).shape == (3, 4) and flatten_batch(torch.zeros(5)).shape == (5,)
    moved = to_device([[torch.zeros(1), {"reference_latents": [torch.ones(1)], "n": 2}]], torch.device("meta"))
    assert moved[0][0].device.type == "meta" and moved[0][1]["reference_latents"][0].device.type == "meta"
    assert moved[0][1]["n"] == 2


def _same(a, b) -> None:
    """The two conditionings are the same: structure, shapes and values."""
    assert len(a) == len(b)
    for (c, extra), (c_ref, extra_ref) in zip(a, b):
        assert torch.equal(c, c_ref) and set(extra) == set(extra_ref)
        for k, v in extra.items():
            if isinstance(v, torch.Tensor):
                assert v.shape == extra_ref[k].shape and torch.equal(v, extra_ref[k]), k
            else:
                assert v == extra_ref[k], k


def with_mask(n: int, masks: list[list[float]]) -> list:
    """``collated(n)`` whose attention masks are ``masks`` (the empty caption's is all ones)."""
    cond = collated(n)
    cond[0][1]["attention_mask"] = torch.tensor(masks).reshape(n, 1, 4)
    return cond


EMPTY = [[torch.full((1, 4, 2), -1.0), {"pooled_output": torch.full((1, 3), -1.0), "attention_mask": torch.ones(1, 4)}]]


@pytest.mark.parametrize("cond", [
    collated(3), collated(3, mask_equal=False),
    with_mask(3, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]),  # the first sample's mask is the empty caption's
], ids=["equal masks", "differing masks", "a mask equal to the empty caption's"])
@pytest.mark.parametrize("drop", [[False] * 3, [True, False, False], [False, True, True], [True] * 3])
def test_marked_on_the_host_the_step_decides_what_comparing_on_the_device_decides(cond, drop):
    """A batch marked on the host (before its copy to the device) gives the conditioning the comparison of its
    values gives, after any caption dropout, without reading a device value."""
    marked = mark_equal_samples(cond, EMPTY)
    with HostWaits() as waits:  # every tensor here stands for a device tensor
        got = step_conditioning(marked, EMPTY, drop)
        groups = option_groups(marked, 3)
    assert waits.counts[READ] == 0, waits.calls
    _same(got, step_conditioning(cond, EMPTY, drop))
    assert groups == option_groups(cond, 3)
    assert all(EQUAL_SAMPLES not in extra for _, extra in got), "ComfyUI never sees the mark"
    if drop == [False, True, True] and cond[0][1]["attention_mask"][0].sum() == 4:
        assert got[0][1]["attention_mask"].shape == (1, 4), "dropped to the one kept sample's mask: given once"


def test_a_marked_split_batch_groups_and_gives_options_once_as_before():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3]])
    cond = [[torch.zeros(3, 1, 4, 2), {"t5xxl_ids": ids, "t5xxl_weights": torch.ones(3, 3)}]]
    marked = mark_equal_samples(cond)
    with HostWaits() as waits:
        groups = option_groups(marked, 3)
        parts = [batch_conditioning(take_rows(marked, g)) for g in groups]
    assert waits.counts[READ] == 0 and groups == [[0, 2], [1]]
    for g, part in zip(groups, parts):
        _same(part, batch_conditioning(take_rows(cond, g)))


def test_a_marked_batch_that_takes_an_empty_caption_of_another_length_gives_it_once():
    cond = mark_equal_samples(collated(2), [[torch.zeros(1, 7, 2), {"pooled_output": torch.zeros(1, 3)}]])
    empty = [[torch.zeros(1, 7, 2), {"pooled_output": torch.zeros(1, 3)}]]
    with HostWaits() as waits:
        (c, extra), = step_conditioning(cond, empty, [True, False])
    assert waits.counts[READ] == 0 and c.shape == (2, 7, 2) and extra["pooled_output"].shape == (1, 3)


@pytest.mark.parametrize("length", [4, 7])  # CLIP's fixed length (row by row), another one (the whole batch)
@pytest.mark.parametrize("drop", [[False] * 3, [True, False, True], [False, True, False], [True] * 3])
def test_an_option_kept_on_the_host_follows_the_step_and_reaches_comfyui_from_the_host(length, drop):
    """SDXL's conditioning code reads the pooled output on the host: the step hands it the host copy kept beside
    the batch, with the rows taken and the captions dropped as on the device, given once where the samples hold
    one value, and the other options from the device (``meta`` stands for it)."""
    cond = collated(3)
    cond[0][1]["pooled_output"][2] = cond[0][1]["pooled_output"][0]  # samples 0 and 2 alike
    empty = [[torch.full((1, length, 2), -1.0), {"pooled_output": torch.full((1, 3), -1.0),
                                                 "attention_mask": torch.ones(1, length)}]]
    meta = torch.device("meta")
    batch = to_device(keep_on_host(mark_equal_samples(cond, empty), ["pooled_output"]), meta)
    empty_on_device = to_device(keep_on_host(empty, ["pooled_output"]), meta)
    for rows in ([0, 1, 2], [0, 2], [1]):
        dropped = [drop[i] for i in rows]
        (c, extra), = host_rows_applied(step_conditioning(take_rows(batch, rows), empty_on_device, dropped))
        (c_ref, extra_ref), = step_conditioning(take_rows(cond, rows), empty, dropped)  # all of it on the host
        assert c.device.type == "meta" and c.shape == c_ref.shape
        assert extra["attention_mask"].device.type == "meta" and extra["attention_mask"].shape == \
            extra_ref["attention_mask"].shape
        pooled = extra["pooled_output"]
        assert pooled.device.type == "cpu" and torch.equal(pooled, extra_ref["pooled_output"]), (rows, dropped)
        assert HOST_ROWS not in extra and EQUAL_SAMPLES not in extra, "ComfyUI never sees the marks"


def test_a_dropped_caption_without_the_empty_captions_host_copy_is_refused():
    batch = keep_on_host(collated(2), ["pooled_output"])
    with pytest.raises(ValueError, match="the empty caption has no host copy of pooled_output"):
        step_conditioning(batch, EMPTY, [True, False])
    assert keep_on_host(EMPTY, []) is EMPTY and keep_on_host(EMPTY, ["clip_l"]) == EMPTY


@pytest.mark.parametrize("rows", [[0, 1], [1], [0, 2], [2, 0, 1], [1, 1], []])
def test_rows_are_picked_by_slices_as_an_index_picks_them(rows):
    t = torch.arange(12.0).reshape(4, 3)
    with HostWaits() as waits:
        picked = pick_rows(t, rows)
    assert waits.total == 0 and torch.equal(picked, t[rows])
    with pytest.raises(IndexError):
        pick_rows(t, [4])
