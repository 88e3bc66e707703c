"""The loss plot: curves where the numbers say, readable axes and legend, fast enough to redraw live."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from streaming_cache.train import plot

RAW, SMOOTH, VALID, TEXT, AXIS, LR = (np.array(c, dtype=np.float32) for c in
                                      (plot._RAW, plot._SMOOTH, plot._VALID, plot._TEXT, plot._AXIS, plot._LR))
PRINTABLE = "".join(chr(c) for c in range(32, 127))


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


def where(ink: np.ndarray, text: str, *, vertical: bool = False, scale: int = 1) -> list[tuple[int, int]]:
    """(row, column) of the top-left corner of every place ``text`` is drawn in ``ink``."""
    mask = plot.text_mask(text, scale)
    if vertical:
        mask = np.rot90(mask)
    if ink.shape[0] < mask.shape[0] or ink.shape[1] < mask.shape[1]:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(ink, mask.shape)
    return [(int(r), int(c)) for r, c in zip(*np.nonzero((windows == mask).all(axis=(-2, -1))))]


def contains(ink: np.ndarray, text: str, *, vertical: bool = False, scale: int = 1) -> bool:
    return bool(where(ink, text, vertical=vertical, scale=scale))


def curve_row(mask: np.ndarray, col: int, top: int, bottom: int) -> float:
    """The middle row of ``mask``'s pixels in column ``col`` inside the plot area."""
    rows = np.flatnonzero(mask[top:bottom + 1, col]) + top
    assert len(rows), col
    return float(np.median(rows))


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
    rates = np.minimum(1.0, np.arange(1, 100_001) / 1000) * 1e-4
    options = {"log_scale": True, "learning_rates": rates, "status": plot.status_line(100_000, 200_000, 0.3, 100_000)}
    for name, kwargs in (("", {}), (" with log scale, learning rate and status", options)):
        plot.loss_plot(losses, validation=validation, **kwargs)  # warm-up
        start = time.perf_counter()
        img = plot.loss_plot(losses, validation=validation, **kwargs)
        elapsed = time.perf_counter() - start
        print(f"loss_plot of 100k steps{name}: {elapsed * 1000:.1f} ms")
        left, right, _, _ = frame(img[0].numpy())
        curve = colored(img[0].numpy(), SMOOTH)
        assert curve[:, right - 2].any() and curve[:, left + 2].any(), "the curve spans the whole width"
    lr_curve = colored(img[0].numpy(), LR)
    assert lr_curve[:, left + 2].any() and lr_curve[:, right - 2].any(), "so does the learning rate"


@pytest.mark.parametrize("text", ["0123456789", ".-+e", "loss step smoothed validation"])
def test_font_has_the_glyphs_it_needs(text):
    mask = plot.text_mask(text, 2)
    assert mask.shape == (plot.text_height(2), plot.text_width(text, 2)) and mask.any()
    assert plot.text_height(2) > plot.text_height(1) and plot.text_width(text, 2) > plot.text_width(text, 1)


def test_log_scale_puts_decades_equally_apart_with_their_labels():
    losses = [1.0] * 100 + [0.1] * 100 + [0.01] * 100  # flat long enough for the moving average to settle
    img = plot.loss_plot(losses, 512, 256, log_scale=True)[0].numpy()
    left, right, top, bottom = frame(img)
    lo, hi = -2.1, 0.1  # log10 of the values' range plus 5% on each side

    def row(v):
        return top + (hi - np.log10(v)) / (hi - lo) * (bottom - top)

    def col(step):
        return round(left + (step - 1) / 299 * (right - left))

    curve = colored(img, RAW) | colored(img, SMOOTH)
    rows = {v: curve_row(curve, col(step), top, bottom) for v, step in ((1.0, 90), (0.1, 190), (0.01, 290))}
    for v, r in rows.items():
        assert abs(r - row(v)) <= 2, (v, r, row(v))
    decade = rows[0.1] - rows[1.0]
    assert decade > 40 and abs(rows[0.01] - rows[1.0] - 2 * decade) <= 2, "two decades, twice one decade"
    ink = colored(img[:, :left], TEXT)
    for label, v in (("0.1", 0.1), ("0.01", 0.01)):
        (label_row, _), = where(ink, label)
        assert abs(label_row + plot.text_height() // 2 - rows[v]) <= 2, label  # the label's middle is its tick's row
    assert contains(ink, "0.05") and contains(ink, "0.2"), "1-2-5 ticks within each decade"
    linear = plot.loss_plot(losses, 512, 256)[0].numpy()
    assert abs(curve_row(colored(linear, SMOOTH), col(190), top, bottom) - rows[0.1]) > 40, "log moves the curve"


def test_log_scale_skips_values_that_are_not_positive_and_needs_some():
    positive = [1.0, 0.5, 0.2, 0.3, 0.1] * 20
    with_zeros = [v if i % 7 else (0.0 if i % 2 else -0.5) for i, v in enumerate(positive)]
    with_nans = [v if i % 7 else float("nan") for i, v in enumerate(positive)]
    assert torch.equal(plot.loss_plot(with_zeros, 300, 200, log_scale=True, validation=[(5, 0.4), (9, 0.0)]),
                       plot.loss_plot(with_nans, 300, 200, log_scale=True, validation=[(5, 0.4)]))
    nothing_positive = [0.0, -1.0, -0.5, 0.0]
    assert torch.equal(plot.loss_plot(nothing_positive, 300, 200, log_scale=True),
                       plot.loss_plot(nothing_positive, 300, 200)), "falls back to the linear axis"
    assert plot.loss_plot([], 300, 200, log_scale=True).shape == (1, 200, 300, 3)


def test_log_tick_labels_for_narrow_and_wide_ranges():
    def labels(lo, hi):
        return plot._log_ticks(np.log10(lo), np.log10(hi), 200, 21)[1]

    assert labels(0.009, 1.1) == ["0.01", "0.02", "0.05", "0.1", "0.2", "0.5", "1"]
    assert labels(1e-6, 20) == ["1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "1e-1", "1e0", "1e1"]
    assert labels(0.28, 0.82) == ["0.3", "0.4", "0.5", "0.6", "0.7", "0.8"], "under a decade: even steps"
    assert plot._sci_label(9.999999999e-5) == "1e-4" and plot._sci_label(5e-5) == "5e-5"


def test_learning_rate_curve_on_its_own_right_axis():
    losses = [1.0] * 101  # flat: the loss curve stays on the middle row
    rates = [1e-4 * i / 100 for i in range(101)]  # linear warm-up from 0 to 1e-4 over steps 1..101
    img = plot.loss_plot(losses, 512, 256, learning_rates=rates)[0].numpy()
    left, right, top, bottom = frame(img)
    lo, hi = -5e-6, 1.05e-4  # 0 to the highest rate, plus 5% on each side

    def row(rate):
        return top + (hi - rate) / (hi - lo) * (bottom - top)

    def col(step):
        return round(left + (step - 1) / 100 * (right - left))

    lr = colored(img, LR)
    rows = [curve_row(lr, col(step), top, bottom) for step in (11, 31, 71, 91)]
    for step, r in zip((11, 31, 71, 91), rows):
        assert abs(r - row(rates[step - 1])) <= 2, (step, r, row(rates[step - 1]))
    assert rows == sorted(rows, reverse=True), "rises left to right"
    assert not lr[:, :left].any(), "nothing of it left of the plot"
    ink = colored(img, TEXT)
    (_, legend_col), = where(ink[:top], "lr")
    swatch = np.flatnonzero(lr[:top].any(axis=0))
    assert swatch.tolist() == list(range(legend_col - 15, legend_col - 3)), "above it only the legend's swatch"
    labels = lr[:, right + 1:]
    assert contains(labels, "0") and contains(labels, "4e-5")
    (label_row, _), = where(labels, "1e-4")
    assert abs(label_row + plot.text_height() // 2 - row(1e-4)) <= 2, "the 1e-4 label is at the row of 1e-4"
    assert contains(ink[:, right:], "learning rate", vertical=True) and contains(ink[:top], "lr"), "title, legend"
    assert contains(ink[:, :left], "loss", vertical=True) and contains(ink[bottom:], "step")

    plain = plot.loss_plot(losses, 512, 256)[0].numpy()
    assert not colored(plain, LR).any() and not contains(colored(plain, TEXT), "learning rate", vertical=True)
    shorter = colored(plot.loss_plot(losses, 512, 256, learning_rates=rates[:51])[0].numpy(), LR)
    assert shorter[top:bottom, col(41)].any() and not shorter[top:bottom, col(51) + 2:right].any(), \
        "a shorter list ends at its last step"


def test_status_line_is_drawn_at_the_top_right():
    status = plot.status_line(120, 500, 0.3125, 483)
    losses = [1.0 / (i + 1) for i in range(120)]
    img = plot.loss_plot(losses, 512, 256, validation=[(50, 0.1)], learning_rates=[1e-4] * 120,
                         status=status)[0].numpy()
    _, _, top, _ = frame(img)
    ink = colored(img, TEXT)
    (row, col), = where(ink[:top], status)
    assert col + plot.text_width(status) == 512 - 3, "right-aligned"
    (legend_row, _), = where(ink[:top], "smoothed")
    assert legend_row == row, "beside the legend when there is room"
    narrow = colored(plot.loss_plot(losses, 300, 200, status=status)[0].numpy(), TEXT)
    (row, _), = where(narrow, status)
    (legend_row, _), = where(narrow, "smoothed")
    assert row < legend_row, "above the legend when beside it would touch"
    tiny = colored(plot.loss_plot(losses, 160, 120, status=status)[0].numpy(), TEXT)
    assert contains(tiny, "step 120/500") and contains(tiny, "...") and not contains(tiny, status), "cut to fit"


@pytest.mark.parametrize("step, total, seconds_per_step, remaining, expected", [
    (120, 500, 0.3125, 483, "step 120/500  3.2 it/s  2m31s left"),
    (10, 20, 4.5, 10, "step 10/20  4.5 s/it  45s left"),
    (1000, 5000, 0.96, 4000, "step 1000/5000  1.0 it/s  1h04m left"),
    (250, 1000, 0.05, 740, "step 250/1000  20.0 it/s  37s left"),
    (1, 100, 90.0, 98, "step 1/100  90.0 s/it  2h27m left"),
    (3, 10, 1.0, 0, "step 3/10  1.0 it/s  0s left"),
    (1, 10, 59.6, 1, "step 1/10  59.6 s/it  1m00s left"),
    (1, 2, 3599.7, 1, "step 1/2  3599.7 s/it  1h00m left"),
    (120, 500, None, 380, "step 120/500"),
    (5, 10, float("nan"), 5, "step 5/10"),
    (7, 0, 2.0, -1, "step 7  2.0 s/it"),
])
def test_status_line_formats(step, total, seconds_per_step, remaining, expected):
    assert plot.status_line(step, total, seconds_per_step, remaining) == expected


def test_font_covers_printable_ascii_and_draws_anything_else_as_a_question_mark():
    """Pillow's font, drawn without anti-aliasing: every printable character has a glyph of its own, one line
    height, proportional widths; anything else (accents, CJK, tabs, newlines) is drawn as ``?``."""
    masks = {c: plot.text_mask(c) for c in PRINTABLE}
    assert {m.shape[0] for m in masks.values()} == {plot.text_height()} and plot.text_height() >= 10
    assert not masks[" "].any() and all(m.any() for c, m in masks.items() if c != " ")
    assert len({m.tobytes() + bytes(m.shape) for m in masks.values()}) == len(PRINTABLE), "every glyph is distinct"
    assert plot.text_width("W") > plot.text_width("i"), "a proportional font"
    assert np.array_equal(plot.text_mask("caf\u00e9\tdog\n\u65e5"), plot.text_mask("caf??dog??"))
    assert not plot.text_mask("x").flags.writeable, "cached masks cannot be changed by a caller"
    img = np.ones((20, 200, 3), dtype=np.float32)
    plot.draw_text(img, "Prompt: \u201ca dog\u201d", 1, 1)
    assert contains(colored(img, TEXT), "Prompt: ?a dog?")


def test_label_image_adds_a_band_with_the_text_above_the_image():
    image = torch.rand(1, 64, 600, 3)
    lines = ["step 250", "a photo of sks dog on the beach"]
    out = plot.label_image(image, lines)
    band = out.shape[1] - 64
    assert band > 0 and out.shape == (1, 64 + band, 600, 3) and out.dtype == image.dtype
    assert torch.equal(out[:, band:], image), "the image's pixels are kept below the band"
    top = out[0, :band].numpy()
    ink = colored(top, TEXT)
    assert (top[~ink] == 1.0).all(), "white band, dark text"
    (step_row, _), = where(ink, lines[0], scale=2)  # 600 px wide: twice the font size
    (prompt_row, _), = where(ink, lines[1], scale=2)
    assert step_row < prompt_row

    small = plot.label_image(image[0, :, :240], ["a dog\n\non  the\tsofa", "a photo of sks dog on the beach " * 3])
    band = small.shape[1] - 64
    assert small.shape == (1, 64 + band, 240, 3) and torch.equal(small[0, band:], image[0, :, :240])
    ink = colored(small[0, :band].numpy(), TEXT)
    assert contains(ink, "a dog on the sofa"), "whitespace runs become one space; 1x below 512 px"
    text = "a photo of sks dog on the beach " * 3
    cut = plot.fit_text(text, 240 - 8)
    assert cut.endswith("...") and text.startswith(cut[:-3]) and len(cut) > 30
    assert contains(ink, cut), "a long line is cut with ... to fit"
    longer = {text[:n].rstrip() + "..." for n in range(len(cut) - 2, len(text))} - {cut}
    assert plot.text_width(cut) <= 240 - 8 < min(plot.text_width(t) for t in longer), "as long as fits"
    assert not ink[:, 240 - 4:].any(), "within the width"
    big = plot.label_image(image[:, :20, :100].half(), ["x"], scale=3)
    assert big.dtype == torch.float16 and contains(colored(big[0].float().numpy(), TEXT), "x", scale=3)
    assert plot.label_image(image[0], []).shape == (1, 64, 600, 3)


def test_each_dataset_of_a_mix_gets_its_own_curve_and_legend_entry():
    losses = [1.0 if s % 2 else 3.0 for s in range(1, 101)]  # odd steps from one dataset, even from the other
    datasets = {"style": [(s, 1.0) for s in range(1, 101, 2)], "reg": [(s, 3.0) for s in range(2, 101, 2)]}
    img = plot.loss_plot(losses, 512, 256, datasets=datasets)[0].numpy()
    left, right, top, bottom = frame(img)
    lo, hi = 1.0 - 0.1, 3.0 + 0.1

    def row(value):
        return top + (hi - value) / (hi - lo) * (bottom - top)

    ink = colored(img, TEXT)
    for i, (name, value) in enumerate((("style", 1.0), ("reg", 3.0))):
        curve = colored(img, np.array(plot._DATASETS[i], dtype=np.float32))
        middle = (left + right) // 2
        assert abs(curve_row(curve, middle, top, bottom) - row(value)) <= 2, name
        assert contains(ink[:top], name), "named in the legend"
    plain = plot.loss_plot(losses, 512, 256)[0].numpy()
    assert not colored(plain, np.array(plot._DATASETS[0], dtype=np.float32)).any()


def test_pillow_without_sizable_fonts_still_draws_the_plot_and_labels(monkeypatch):
    """Pillow before 10.1 ships only a bitmap font of one size: the plot and the labels are drawn with it."""
    from PIL import ImageFont

    caches = (plot.text_height, plot.text_width, plot.text_mask)
    for cached in caches:
        cached.cache_clear()
    monkeypatch.setattr(plot, "_font", lambda scale: ImageFont.load_default_imagefont())
    try:
        img = plot.loss_plot([1.0 / (i + 1) for i in range(50)], 512, 256, status="step 50/100")[0].numpy()
        ink = colored(img, TEXT)
        assert contains(ink, "step 50/100") and contains(ink, "smoothed")
        band = plot.label_image(torch.rand(1, 16, 300, 3), ["a dog"])[0, :-16].numpy()
        assert contains(colored(band, TEXT), "a dog")
    finally:
        for cached in caches:
            cached.cache_clear()
