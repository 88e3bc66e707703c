"""The loss plot: curves where the numbers say, readable axes and legend, fast enough to redraw live."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from streaming_cache.train import plot

RAW, SMOOTH, VALID, TEXT, AXIS = (np.array(c, dtype=np.float32) for c in
                                  (plot._RAW, plot._SMOOTH, plot._VALID, plot._TEXT, plot._AXIS))


def colored(img: np.ndarray, color: np.ndarray) -> np.ndarray:
    return np.abs(img - color).max(axis=-1) < 1e-3


def frame(img: np.ndarray) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) of the plot area, found from the axis lines."""
    axis = colored(img, AXIS)
    bottom = int(axis.sum(axis=1).argmax())
    left = int(axis.sum(axis=0).argmax())
    cols = np.flatnonzero(axis[bottom])
    rows = np.flatnonzero(axis[:, left])
    return left, int(cols.max()), int(rows.min()), bottom


def contains(ink: np.ndarray, text: str, *, vertical: bool = False) -> bool:
    mask = plot.text_mask(text)
    if vertical:
        mask = np.rot90(mask)
    if ink.shape[0] < mask.shape[0] or ink.shape[1] < mask.shape[1]:
        return False
    windows = np.lib.stride_tricks.sliding_window_view(ink, mask.shape)
    return bool((windows == mask).all(axis=(-2, -1)).any())


def test_curve_is_where_the_values_say_with_axes_legend_and_validation():
    losses = [i / 100 for i in range(101)]  # steps 1..101, loss rising linearly from 0 to 1
    validation = [(6, 0.9), (16, 0.95), (31, 0.85)]
    img = plot.loss_plot(losses, 512, 256, validation=validation)[0].numpy()
    assert img.shape == (256, 512, 3)
    left, right, top, bottom = frame(img)
    assert 20 < left < 80 and right > 480 and top > 8 and 200 < bottom < 240
    ylo, yhi = -0.05, 1.05  # the values' range plus 5% on each side

    def row(v):
        return top + (yhi - v) / (yhi - ylo) * (bottom - top)

    def col(step):
        return left + (step - 1) / 100 * (right - left)

    raw = colored(img, RAW) | colored(img, SMOOTH)
    for step in (11, 51, 91):
        rows = np.flatnonzero(raw[:, round(col(step))])
        assert len(rows) and abs(rows.min() - row((step - 1) / 100)) <= 3, step
    valid = colored(img, VALID)
    for step, value in validation:
        c, r = round(col(step)), round(row(value))
        assert valid[r - 1:r + 2, c - 1:c + 2].any(), (step, value)
    assert not valid[:, :left].any() and not valid[bottom + 3:].any()
    ink = colored(img, TEXT)
    assert contains(ink[:, :left], "0.6") and contains(ink[:, :left], "1.0"), "y tick labels"
    assert contains(ink[bottom:], "100") and contains(ink[bottom:], "40"), "x tick labels"
    assert contains(ink[bottom:], "step") and contains(ink[:, :left], "loss", vertical=True), "axis titles"
    assert all(contains(ink[:top], w) for w in ("loss", "smoothed", "validation")), "legend"


def test_tick_labels_for_tiny_and_huge_values():
    assert plot._label(2.5e-5, 5e-6) == "2.5e-5"
    assert plot._label(0.25, 0.05) == "0.25"
    assert plot._label(1500, 500) == "1500"
    assert plot._label(0, 0.1) == "0"
    img = plot.loss_plot([1e-4 * (1 + 1 / (i + 1)) for i in range(40)], 300, 150)[0].numpy()
    ink = colored(img, TEXT)
    assert contains(ink, "2e-4") or contains(ink, "1.5e-4")


def test_legacy_call_and_degenerate_inputs():
    img = plot.loss_plot([1.0 / (i + 1) for i in range(50)], 200, 100)
    assert img.shape == (1, 100, 200, 3) and img.dtype == torch.float32
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    for losses in ([], [3.0], [2.0, 2.0, 2.0], [float("nan"), 1.0, float("inf")]):
        assert plot.loss_plot(losses, 120, 80).shape == (1, 80, 120, 3)
    assert plot.loss_plot([], 512, 256, validation=[(3, 0.5)]).shape == (1, 256, 512, 3)
    assert plot.loss_plot([1.0, 0.5], 20, 10).shape == (1, 10, 20, 3), "too small for text: curves only"


def test_smooth_matches_the_running_average():
    values = np.random.default_rng(0).random(3000)
    for weight in (0.0, 0.5, 0.9, 0.999):
        acc, expected = 0.0, []
        for i, v in enumerate(values):
            acc = weight * acc + (1 - weight) * v
            expected.append(acc / (1 - weight ** (i + 1)) if weight else v)
        assert np.allclose(plot.smooth(values, weight), expected)


def test_plot_of_100k_steps_is_fast():
    rng = np.random.default_rng(1)
    losses = np.exp(-np.arange(100_000) / 20_000) + 0.1 * rng.random(100_000)
    validation = [(s, 0.5) for s in range(5000, 100_001, 5000)]
    plot.loss_plot(losses, validation=validation)  # warm-up
    start = time.perf_counter()
    img = plot.loss_plot(losses, validation=validation)
    elapsed = time.perf_counter() - start
    print(f"loss_plot of 100k steps: {elapsed * 1000:.1f} ms")
    left, right, _, _ = frame(img[0].numpy())
    curve = colored(img[0].numpy(), SMOOTH)
    assert curve[:, right - 2].any() and curve[:, left + 2].any(), "the curve spans the whole width"


@pytest.mark.parametrize("text", ["0123456789", ".-+e", "loss step smoothed validation"])
def test_font_has_the_glyphs_it_needs(text):
    mask = plot.text_mask(text, 2)
    assert mask.shape == (14, plot.text_width(text, 2)) and mask.any()
