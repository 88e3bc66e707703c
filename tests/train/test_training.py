"""Training-side engine pieces: dataset folders, buckets, the training loop with exact resume, the loss plot."""

from __future__ import annotations

import os

import pytest
import torch

import streaming_cache as sc
from streaming_cache.loader import BatchLoader
from streaming_cache.train import checkpoint, loop, optim
from streaming_cache.train.buckets import bucket_size, crop_box
from streaming_cache.train.folder import (
    folder_items,
    folder_stamp,
    read_caption,
    scan_folder,
)
from streaming_cache.train.plot import loss_plot

pytestmark = pytest.mark.oldest_torch


def touch(path, data=b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_scan_folder_kohya_layout(tmp_path):
    touch(tmp_path / "a.png")
    touch(tmp_path / "a.txt", "\ufeffred cat\n\n  blue cat  \n".encode())
    touch(tmp_path / "10_my_style" / "b.JPG")
    touch(tmp_path / "10_my_style" / "c.webp")
    touch(tmp_path / "10_my_style" / "c.txt", b"")
    touch(tmp_path / "10_my_style" / "d.png")
    touch(tmp_path / "10_my_style" / "d.txt", b"\xff\xfe bad")
    touch(tmp_path / "notes.md")
    res = scan_folder(str(tmp_path))
    by = {s.name: s for s in res.samples}
    assert sorted(by) == ["10_my_style/b.JPG", "10_my_style/c.webp", "a.png"]
    assert by["a.png"].captions == ("red cat", "blue cat") and by["a.png"].repeats == 1
    assert by["10_my_style/b.JPG"].captions == ("my style",) and by["10_my_style/b.JPG"].repeats == 10
    assert by["10_my_style/c.webp"].captions == ("my style",), "an empty caption falls back to the class words"
    assert len(res.problems) == 1 and res.problems[0][0] == "10_my_style/d.png"
    assert "not UTF-8" in res.problems[0][1] and "d.txt" in res.problems[0][1]
    with pytest.raises(FileNotFoundError, match="no such dataset folder"):
        scan_folder(str(tmp_path / "missing"))


def test_scan_folder_finds_audio_and_video_with_their_kind(tmp_path):
    touch(tmp_path / "song.wav")
    touch(tmp_path / "song.txt", b"a calm piano")
    touch(tmp_path / "beat.FLAC")
    touch(tmp_path / "clip.mp4")
    for ext in ("mp3", "ogg", "m4a", "opus"):
        touch(tmp_path / f"more.{ext}")
    res = scan_folder(str(tmp_path))
    by = {s.name: s.kind for s in res.samples}
    assert by == {"beat.FLAC": "audio", "clip.mp4": "video", "more.m4a": "audio", "more.mp3": "audio",
                  "more.ogg": "audio", "more.opus": "audio", "song.wav": "audio"}
    assert next(s for s in res.samples if s.name == "song.wav").captions == ("a calm piano",)


def test_scan_folder_does_not_follow_symlink_loops(tmp_path):
    touch(tmp_path / "sub" / "a.png")
    os.symlink(tmp_path, tmp_path / "sub" / "loop")
    assert [s.name for s in scan_folder(str(tmp_path)).samples] == ["sub/a.png"]


def test_folder_items_variants_repeats_and_stamp(tmp_path):
    touch(tmp_path / "a.png")
    touch(tmp_path / "a.txt", b"one\ntwo")
    touch(tmp_path / "3_x" / "b.png")
    items, problems = folder_items(str(tmp_path))
    assert [(i.name, i.repeats, i.parts["cond"].data) for i in items] == [
        ("a.png#1", 1, b"one"), ("a.png#2", 1, b"two"), ("3_x/b.png", 3, b"x")]
    assert items[0].parts["latent"].path == items[1].parts["latent"].path == str(tmp_path / "a.png")
    assert problems == []
    stamp = folder_stamp(str(tmp_path))
    assert folder_stamp(str(tmp_path)) == stamp
    touch(tmp_path / "c.png")
    assert folder_stamp(str(tmp_path)) != stamp


def test_folder_items_extra_parts_join_every_variant_and_a_failing_maker_fails_its_sample(tmp_path):
    from streaming_cache import Part

    touch(tmp_path / "a.png")
    touch(tmp_path / "a.txt", b"one\ntwo")
    touch(tmp_path / "b.png")

    def start(s):
        if s.name == "b.png":
            raise ValueError("cannot read b.png")
        return Part(path=s.image, params={"node": "WanImageToVideo"})

    items, problems = folder_items(str(tmp_path), extra_parts={"start": start})
    assert [i.name for i in items] == ["a.png#1", "a.png#2"]
    assert all(i.parts["start"].path == str(tmp_path / "a.png") for i in items)
    assert problems == ["b.png: cannot read b.png"]


def test_flip_columns_add_a_mirrored_copy_of_each_image_and_clip_but_not_of_audio(tmp_path):
    from streaming_cache import Part

    touch(tmp_path / "a.png")
    touch(tmp_path / "a.txt", b"one\ntwo")
    touch(tmp_path / "a_mask.png")
    touch(tmp_path / "song.wav")
    start = {"start": lambda s: Part(path=s.image, params={"bucket": [64, 64]})}
    items, _ = folder_items(str(tmp_path), extra_parts=start, flip_columns=frozenset({"latent", "mask", "start"}))
    assert [i.name for i in items] == ["a.png#1", "a.png#2", "a.png#1 (flipped)", "a.png#2 (flipped)", "song.wav"]
    by = {i.name: i for i in items}
    plain, mirrored = by["a.png#1"], by["a.png#1 (flipped)"]
    for column in ("latent", "mask", "start"):
        assert mirrored.parts[column].params == {**plain.parts[column].params, "flip": True}, column
        assert mirrored.parts[column].path == plain.parts[column].path
    assert mirrored.parts["cond"] == plain.parts["cond"], "the caption is shared"
    assert not any("flip" in p.params for i in items if i.name.startswith("song") for p in i.parts.values())
    assert folder_items(str(tmp_path), extra_parts=start)[0] == [i for i in items if "flipped" not in i.name]


def test_read_caption_variants(tmp_path):
    touch(tmp_path / "c.txt", b"one\r\ntwo\r\n")
    assert read_caption(str(tmp_path / "c.txt")) == ("one", "two")


@pytest.mark.parametrize("w,h", [(512, 512), (1024, 768), (768, 1024), (1920, 1080), (100, 3000), (33, 65)])
def test_buckets_keep_area_and_aspect(w, h):
    bw, bh = bucket_size(w, h, 512)
    assert bw % 64 == 0 and bh % 64 == 0
    assert 0.75 * 512 * 512 <= bw * bh <= 1.1 * 512 * 512
    if 0.25 <= w / h <= 4:
        assert abs((bw / bh) / (w / h) - 1) < 0.2
    scale, left, top, right, bottom = crop_box(w, h, (bw, bh))
    assert (right - left, bottom - top) == (bw, bh) and left >= 0 and top >= 0
    assert round(w * scale) >= bw - 1 and round(h * scale) >= bh - 1


def test_bucket_native_resolution_and_bad_size():
    assert bucket_size(1000, 700, 0) == (960, 640)
    with pytest.raises(ValueError):
        bucket_size(0, 10, 512)


def test_lr_schedules():
    assert optim.lr_factor("constant", 50, 100, 10) == 1.0
    assert optim.lr_factor("cosine", 0, 100, 10) == pytest.approx(0.1)
    assert optim.lr_factor("cosine", 10, 100, 10) == pytest.approx(1.0)
    assert optim.lr_factor("cosine", 100, 100, 10) == pytest.approx(0.0)
    assert optim.lr_factor("linear", 55, 100, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown learning-rate schedule"):
        optim.lr_factor("exp", 1, 2, 0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        loop.TrainConfig(steps=1, optimizer="Lamb")


@pytest.fixture
def toy(tmp_path):
    """A cache of (x, y) pairs with y = 3x + 1 and a loader over it."""
    path = str(tmp_path / "cache")
    with sc.CacheWriter(path) as w:
        for i in range(24):
            x = torch.tensor([i / 24.0])
            w.put(f"k{i}", {"x": x, "y": 3 * x + 1})
    return sc.open_cache(path).dataset()


def fit(handle, steps, *, resume=None, save=None, on_step=None, save_every=0):
    params = {"w": torch.zeros(1, requires_grad=True), "b": torch.zeros(1, requires_grad=True)}
    loader = BatchLoader(handle, 4, seed=1, workers=0)

    def loss_fn(batch, micro):
        g = loop.step_generator(7, micro)
        noise = torch.randn(batch["x"].shape, generator=g) * 0.01
        return ((params["w"] * (batch["x"] + noise) + params["b"] - batch["y"]) ** 2).mean()

    cfg = loop.TrainConfig(steps=steps, learning_rate=0.1, schedule="cosine", warmup_steps=2, grad_accumulation=2,
                               save_every=save_every)
    result = loop.train(params, loader, loss_fn, cfg, resume=resume, hooks=loop.TrainHooks(save=save, on_step=on_step))
    return params, result


def test_training_loop_learns(toy):
    _, result = fit(toy, 40)
    assert result.step == 40 and len(result.losses) == 40
    assert result.losses[-1] < result.losses[0] / 5


def test_interrupted_training_resumes_exactly(toy, tmp_path):
    ref_params, ref = fit(toy, 12)
    saved = {}

    def cancel_at_5(step, loss):
        if step == 5:
            raise KeyboardInterrupt

    def save(state, final):
        checkpoint.save_checkpoint(str(tmp_path / "ck.pt"), state)
        saved["final"] = final

    with pytest.raises(KeyboardInterrupt):
        fit(toy, 12, save=save, on_step=cancel_at_5)
    assert saved == {"final": False}, "the interrupt saved the progress"
    state = checkpoint.load_checkpoint(str(tmp_path / "ck.pt"))
    assert state["step"] == 5
    params, result = fit(toy, 12, resume=state)
    assert result.losses == pytest.approx(ref.losses, abs=1e-6)
    for k in params:
        assert torch.allclose(params[k], ref_params[k], atol=1e-6)


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_weight_decay_shrinks_an_untouched_weight_by_the_learning_rate_times_the_decay_every_step(toy, optimizer):
    """A weight whose gradient is zero (as an adapter no sample reaches) keeps its value without weight decay and
    shrinks by (1 - learning rate x weight_decay) at each of AdamW's decoupled steps; SGD adds the decay to the
    gradient, which with a learning rate of 0.1 is the same factor."""
    def run(weight_decay):
        params = {"w": torch.zeros(1, requires_grad=True), "idle": torch.full((3,), 2.0, requires_grad=True)}
        loader = BatchLoader(toy, 4, seed=1, workers=0)

        def loss_fn(batch, micro):
            return ((params["w"] * batch["x"] - batch["y"]) ** 2).mean() + 0.0 * params["idle"].sum()

        cfg = loop.TrainConfig(steps=10, learning_rate=0.1, optimizer=optimizer, weight_decay=weight_decay)
        loop.train(params, loader, loss_fn, cfg)
        return params

    plain, decayed = run(0.0), run(0.5)
    assert torch.equal(plain["idle"], torch.full((3,), 2.0))
    assert decayed["idle"].tolist() == pytest.approx([2.0 * (1 - 0.1 * 0.5) ** 10] * 3, rel=1e-5)
    assert plain["w"].item() != 0 and decayed["w"].item() != 0
    with pytest.raises(ValueError, match="weight_decay"):
        loop.TrainConfig(steps=1, weight_decay=-0.1)


def test_periodic_checkpoints(toy):
    steps = []
    fit(toy, 7, save=lambda state, final: steps.append((state["step"], final)), save_every=3)
    assert steps == [(3, False), (6, False), (7, True)]


def test_checkpoint_for_another_layout_is_refused(toy, tmp_path):
    fit(toy, 2, save=lambda s, f: checkpoint.save_checkpoint(str(tmp_path / "c.pt"), s))
    state = checkpoint.load_checkpoint(str(tmp_path / "c.pt"))
    state["params"]["extra"] = torch.zeros(1)
    with pytest.raises(sc.CacheError, match="different LoRA layout"):
        fit(toy, 4, resume=state)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(sc.CacheError, match="delete it to start over"):
        checkpoint.load_checkpoint(str(tmp_path / "junk.pt"))


def test_nan_loss_is_a_clear_error(toy):
    params = {"w": torch.zeros(1, requires_grad=True)}
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        loop.train(params, BatchLoader(toy, 4, workers=0), lambda b, m: params["w"].sum() * float("nan"),
                       loop.TrainConfig(steps=3))


def test_save_lora_is_atomic_and_readable(tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "l.safetensors")
    checkpoint.save_lora(path, {"a.lora_up.weight": torch.ones(2, 3).t()}, {"ss_steps": "3"})
    assert load_file(path)["a.lora_up.weight"].shape == (3, 2)
    assert os.listdir(tmp_path) == ["l.safetensors"]


def test_loss_plot_draws_the_curve():
    img = loss_plot([1.0 / (i + 1) for i in range(50)], 512, 256)
    assert img.shape == (1, 256, 512, 3) and img.dtype == torch.float32
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    blue = (img[0, :, :, 2] > 0.7) & (img[0, :, :, 0] < 0.3)
    assert blue[:, 100:].any(), "the smoothed curve is drawn"
    assert blue[170:235, 400:500].any() and not blue[:100, 400:].any(), "falling loss ends low on the right"
    assert loss_plot([], 50, 40).shape == (1, 40, 50, 3)


def test_more_resolutions_are_read_in_order_once_each_and_bad_ones_named():
    from streaming_cache.train.buckets import parse_resolutions

    assert parse_resolutions("512, 768 1024;768") == (512, 768, 1024)
    assert parse_resolutions("") == ()
    with pytest.raises(ValueError, match="'32' is not a resolution from 64 to 4096"):
        parse_resolutions("512, 32")
    with pytest.raises(ValueError, match="'big' is not a resolution"):
        parse_resolutions("big")
    with pytest.raises(ValueError, match="9 given, at most 8"):
        parse_resolutions(", ".join(str(64 * i) for i in range(1, 10)))


def test_a_bucket_rule_bounds_the_sides_and_keeps_the_keys_of_caches_made_before_it():
    from streaming_cache.train.buckets import DEFAULT_BUCKETS, BucketRule, bucket_size

    assert DEFAULT_BUCKETS.settings() == {"bucket_step": 64}, "the encoder settings every earlier cache was keyed by"
    assert DEFAULT_BUCKETS.size(1920, 1080, 1024) == bucket_size(1920, 1080, 1024)
    wide = BucketRule(min_side=512).size(4000, 500, 1024)
    assert min(wide) >= 512 and wide[0] > wide[1], "a very wide image gets a wide bucket no thinner than 512"
    assert max(BucketRule(max_side=1024).size(4000, 500, 1024)) <= 1024
    fine = BucketRule(step=16).size(1000, 700, 512)
    assert fine[0] % 16 == 0 and fine[1] % 16 == 0 and (fine[0] % 64 or fine[1] % 64), fine
    assert BucketRule(16, 256, 1024).settings() == {"bucket_step": 16, "bucket_min_side": 256,
                                                    "bucket_max_side": 1024}
    for bad, message in (({"step": 48}, "bucket_step must be one of 16, 32, 64, 128"),
                         ({"min_side": 512, "max_side": 256}, "the longest no shorter than the shortest"),
                         ({"max_side": 32}, "below the bucket step")):
        with pytest.raises(ValueError, match=message):
            BucketRule(**bad)
