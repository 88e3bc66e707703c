"""A loss plot drawn with numpy alone, returned as a ComfyUI IMAGE tensor (``[1, H, W, 3]``, floats in 0..1).

The plot has numbered axes ("step" across, "loss" up, linear or logarithmic), a legend, the raw losses (light),
their moving average (dark), optionally a validation series (orange points, joined), the learning rate (a thin
green curve on an axis of its own on the right) and a status line (step, speed, time left; ``status_line``).
Text is drawn in Pillow's own font (the TrueType font it ships), which also captions sample previews
(``label_image``). The plot is redrawn live during training, so every series is reduced to one span per pixel
column before drawing: the cost grows with the number of steps only through a few vectorised passes, each
allocating as few step-sized arrays as it can (a few milliseconds for 100k steps, all options on).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_BG, _GRID, _AXIS, _TEXT = (1.0, 1.0, 1.0), (0.90, 0.90, 0.92), (0.35, 0.35, 0.35), (0.15, 0.15, 0.15)
_RAW, _SMOOTH, _VALID = (0.62, 0.75, 0.95), (0.10, 0.30, 0.80), (0.90, 0.45, 0.05)
_LR = (0.13, 0.50, 0.22)
_DATASETS = ((0.58, 0.20, 0.70), (0.00, 0.55, 0.55), (0.80, 0.15, 0.45), (0.55, 0.40, 0.10), (0.35, 0.35, 0.35))

_FONT_PX = 11
"""Text size in pixels at scale 1 (the font's em size; a line of text is its ascent plus descent tall)."""


@functools.lru_cache(maxsize=8)
def _font(scale: int) -> Any:
    """Pillow's own font (a TrueType font it ships) at ``_FONT_PX * scale`` pixels; on Pillow older than 10.1,
    which ships only a bitmap font, that one at its single size."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=_FONT_PX * scale)
    except TypeError:
        return ImageFont.load_default()


def _printable(text: str) -> str:
    """``text`` with every character outside printable ASCII (accents, emoji, tabs, newlines) as ``?``: the font's
    glyphs are sure to exist for these, so a prompt never draws as empty boxes or makes drawing fail."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


@functools.lru_cache(maxsize=8)
def text_height(scale: int = 1) -> int:
    """The height in pixels of a line of text (the font's ascent plus descent)."""
    font = _font(scale)
    if hasattr(font, "getmetrics"):
        ascent, descent = font.getmetrics()
        return int(ascent + descent)
    return int(font.getbbox("Ag|", mode="1")[3]) + 1  # Pillow's bitmap font has no metrics


@functools.lru_cache(maxsize=4096)
def text_width(text: str, scale: int = 1) -> int:
    """The width in pixels of ``text`` drawn by ``text_mask`` (its advance, or its ink where that reaches further)."""
    text = _printable(text)
    if not text:
        return 0
    font = _font(scale)  # measured as drawn: without anti-aliasing, hinting makes glyphs wider
    return max(int(math.ceil(font.getlength(text, mode="1"))), int(font.getbbox(text, mode="1")[2]))


@functools.lru_cache(maxsize=1024)
def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """The pixels of ``text`` in Pillow's font (True = ink), without anti-aliasing so that text keeps one colour:
    ``text_height(scale)`` rows, ``text_width(text, scale)`` columns (at least one). Characters outside printable
    ASCII are drawn as ``?`` (``_printable``). Cached and read-only."""
    from PIL import Image, ImageDraw

    text = _printable(text)
    canvas = Image.new("1", (max(1, text_width(text, scale)), text_height(scale)), 0)
    draw = ImageDraw.Draw(canvas)
    draw.fontmode = "1"
    draw.text((0, 0), text, font=_font(scale), fill=1)
    mask = np.array(canvas, dtype=bool)
    mask.setflags(write=False)
    return mask


def fit_text(text: str, max_width: int, scale: int = 1) -> str:
    """``text`` cut to at most ``max_width`` pixels when drawn, ending in ``...`` where it was cut."""
    text = _printable(text)
    if text_width(text, scale) <= max_width:
        return text
    lo, hi = 0, len(text)  # the longest prefix that fits with "..." after it: widths grow with the prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text_width(text[:mid].rstrip() + "...", scale) <= max_width:
            lo = mid
        else:
            hi = mid - 1
    cut = text[:lo].rstrip() + "..."
    return cut if text_width(cut, scale) <= max_width else ""


def _blit(img: np.ndarray, mask: np.ndarray, x: int, y: int, color: tuple[float, float, float]) -> None:
    h, w, _ = img.shape
    x0, y0, x1, y1 = max(0, x), max(0, y), min(w, x + mask.shape[1]), min(h, y + mask.shape[0])
    if x0 < x1 and y0 < y1:
        region = img[y0:y1, x0:x1]
        region[mask[y0 - y:y1 - y, x0 - x:x1 - x]] = color


def draw_text(img: np.ndarray, text: str, x: int, y: int, color: tuple[float, float, float] = _TEXT, *,
              scale: int = 1, vertical: bool = False) -> None:
    """Draw ``text`` with its top-left corner at (x, y); ``vertical`` reads bottom to top."""
    mask = text_mask(text, scale)
    _blit(img, np.rot90(mask) if vertical else mask, x, y, color)


def smooth(values: Sequence[float] | np.ndarray, weight: float = 0.9) -> np.ndarray:
    """Exponential moving average with bias correction (as TensorBoard's smoothing slider), vectorised."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n == 0 or weight <= 0:
        return v.copy()
    if weight >= 1:
        return np.full(n, v[0])
    # Within a block, acc_k = w^(k+1) acc_in + (1-w) sum_{j<=k} w^(k-j) v_j, computed with scaled cumulative sums;
    # the block length keeps w^-len far from overflowing.
    block = int(min(4096, max(1, 200 / -math.log10(weight))))
    k = np.arange(block, dtype=np.float64)
    up, down = weight ** (-k), weight ** (k + 1)
    out = np.empty(n)
    acc = 0.0
    for start in range(0, n, block):
        chunk = v[start:start + block]
        m = len(chunk)
        acc_k = down[:m] * acc + (1 - weight) * down[:m] / weight * np.cumsum(chunk * up[:m])
        out[start:start + m] = acc_k
        acc = float(acc_k[-1])
    return out / (1 - weight ** np.arange(1, n + 1, dtype=np.float64))


def _nice_step(span: float, target: int) -> float:
    raw = span / max(1, target)
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _ticks(lo: float, hi: float, target: int, integer: bool = False) -> tuple[list[float], float]:
    step = _nice_step(hi - lo, target)
    if integer and step < 10:  # whole steps: 1, 2, 5 (never 2.5 or fractions)
        step = 1.0 if step <= 1 else 2.0 if step <= 2 else 5.0
    first = math.ceil(lo / step - 1e-9) * step
    ticks, i = [], 0
    while first + i * step <= hi + step * 1e-9:
        ticks.append(first + i * step)
        i += 1
    return ticks, step


def _sci_label(v: float) -> str:
    """``v`` in e-notation with at most two decimals in the mantissa: ``1e-4``, ``2.5e-5``, ``0``."""
    if v == 0:
        return "0"
    exp = math.floor(math.log10(abs(v)) + 1e-9)  # 9.999999e-5 is 1e-4, not 10e-5
    mantissa = f"{v / 10 ** exp:.2f}".rstrip("0").rstrip(".")
    if mantissa.lstrip("-") == "10":
        mantissa, exp = mantissa.replace("10", "1"), exp + 1
    return f"{mantissa}e{exp}"


def _label(v: float, step: float) -> str:
    """A tick label: fixed-point with as many decimals as the tick spacing needs, or e-notation for very small
    or large values (``2.5e-5``)."""
    if v == 0:
        return "0"
    big = max(abs(v), step)
    if 1e-3 <= step and big < 1e6:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        if step * 10 ** decimals % 1 > 1e-6:  # 2.5, 0.25, ...
            decimals += 1
        return f"{v:.{decimals}f}"
    return _sci_label(v)


def _log_ticks(lo: float, hi: float, pixels: float, min_gap: float) -> tuple[list[float], list[str]]:
    """Ticks for a logarithmic axis from ``10**lo`` to ``10**hi`` drawn over ``pixels`` pixels: their log10
    positions and labels. The densest of 1-2-5 per decade, every decade, or every 2, 3, 5, 10... decades whose
    neighbours stay ``min_gap`` pixels apart. When fewer than three of those fall in the range (under a decade or
    so), evenly spaced values (0.3, 0.4, 0.5) replace them if more of those fit. Labels are fixed-point
    (``0.05``, ``20``) when all lie within 0.001..50000, else e-notation (``1e-5``)."""
    per_decade = pixels / max(hi - lo, 1e-12)
    ladder = [(1, (1, 2, 5))] + [(k, (1,)) for k in (1, 2, 3, 5, 10, 20, 50, 100)]
    stride, mantissas = next(((k, m) for k, m in ladder
                              if (math.log10(2) if len(m) > 1 else k) * per_decade >= min_gap), ladder[-1])
    marks = [(m, e) for e in range(math.floor(lo), math.ceil(hi) + 1) if e % stride == 0 for m in mantissas
             if lo - 1e-9 <= e + math.log10(m) <= hi + 1e-9]
    fixed = all(-3 <= e <= 4 for _, e in marks)
    positions = [e + math.log10(m) for m, e in marks]
    labels = [(str(m * 10 ** e) if e >= 0 else f"{m * 10.0 ** e:.{-e}f}") if fixed else f"{m}e{e}"
              for m, e in marks]
    if len(positions) < 3:
        for target in range(8, 1, -1):
            values, step = _ticks(10 ** lo, 10 ** hi, target)
            values = [v for v in values if v > 0]
            logs = [math.log10(v) for v in values]
            if len(logs) > len(positions) and all((b - a) * per_decade >= min_gap
                                                   for a, b in itertools.pairwise(logs)):
                return logs, [_label(v, step) for v in values]
    return positions, labels


def _spans(xs: np.ndarray, ys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel column 0..width-1, the lowest and highest row the polyline through (xs, ys) covers there
    (NaN where it does not reach). ``xs`` in pixels, ascending."""
    lo = np.full(width, np.nan)
    hi = np.full(width, np.nan)
    if len(xs) == 0:
        return lo, hi
    cols = np.clip(np.rint(xs).astype(np.int64), 0, width - 1)
    starts = np.flatnonzero(np.r_[True, cols[1:] != cols[:-1]])
    used = cols[starts]
    lo[used] = np.minimum.reduceat(ys, starts)
    hi[used] = np.maximum.reduceat(ys, starts)
    if len(xs) > 1:  # segments between points: their values at the column edges they cross
        edges = np.arange(math.ceil(xs[0] - 0.5) + 0.5, xs[-1], 1.0)
        edges = edges[edges > xs[0]]
        if len(edges):
            ye = np.interp(edges, xs, ys)
            left = np.clip(np.floor(edges).astype(np.int64), 0, width - 1)
            right = np.clip(left + 1, 0, width - 1)
            for c in (left, right):
                lo[c] = np.fmin(lo[c], ye)
                hi[c] = np.fmax(hi[c], ye)
    return lo, hi


def _paint_spans(img: np.ndarray, x0: int, y0: int, lo: np.ndarray, hi: np.ndarray,
                 color: tuple[float, float, float], thick: int, height: int) -> None:
    """Fill each column's span (rows relative to y0), widened to ``thick`` pixels, clipped to ``height`` rows."""
    ok = ~np.isnan(lo)
    if not ok.any():
        return
    half = (thick - 1) / 2
    top = np.where(ok, np.floor(np.nan_to_num(lo) - half + 0.5), 1)
    bot = np.where(ok, np.floor(np.nan_to_num(hi) + half + 0.5), 0)
    rows = np.arange(height)[:, None]
    mask = (rows >= top[None, :]) & (rows <= bot[None, :])
    if thick > 1:
        mask[:, 1:] |= mask[:, :-1].copy()
    region = img[y0:y0 + height, x0:x0 + len(lo)]
    region[mask[:region.shape[0], :region.shape[1]]] = color


def _linear_map(v0: float, v1: float, p0: float, p1: float) -> Callable[[np.ndarray | float], np.ndarray]:
    """The affine map taking ``v0`` to ``p0`` and ``v1`` to ``p1`` (values to pixels). It is applied to every
    step's value on each redraw, so it allocates one array and works in place."""

    def apply(v: np.ndarray | float) -> np.ndarray:
        out = np.subtract(v, v0, dtype=np.float64)
        out /= v1 - v0
        out *= p1 - p0
        out += p0
        return out

    return apply


@dataclass
class _Series:
    """What a loss plot draws, as arrays: finite values only (positive ones only on a log axis), sorted by step."""

    log: bool  # the loss axis is logarithmic
    values: np.ndarray  # the losses drawn
    steps: np.ndarray  # their steps
    every_step: bool  # every loss is drawn (``steps`` is 1..n)
    val: np.ndarray  # validation (step, value) rows
    datasets: list[tuple[str, np.ndarray]]  # each dataset's (step, value) rows
    rates: np.ndarray  # the learning rates drawn
    rate_steps: np.ndarray | None  # their steps; None: 1..len(rates)

    def y(self, values: np.ndarray) -> np.ndarray:
        """``values`` as positions on the loss axis (their log10 on a log axis)."""
        return np.log10(values) if self.log else values


def _series(losses: Sequence[float], validation: Sequence[tuple[int, float]] | None, log_scale: bool,
            learning_rates: Sequence[float] | None,
            datasets: Mapping[str, Sequence[tuple[int, float]]] | None) -> _Series:
    """The plot's inputs as :class:`_Series`: values that cannot be drawn left out (not finite; on a log axis, not
    positive), the learning rates cut to the losses' length."""
    values: np.ndarray = np.asarray(losses, dtype=np.float64).reshape(-1)
    count = len(values)
    keep = np.isfinite(values)
    val = np.asarray([(float(s), float(v)) for s, v in (validation or ()) if math.isfinite(float(v))],
                     dtype=np.float64).reshape(-1, 2)
    log = bool(log_scale) and bool((values[keep] > 0).any() or (val[:, 1] > 0).any())
    if log:
        keep &= values > 0
        val = val[val[:, 1] > 0]
    every_step = bool(keep.all())
    steps: np.ndarray
    if every_step:
        steps = np.arange(1, count + 1, dtype=np.float64)
    else:
        values, steps = values[keep], np.flatnonzero(keep) + 1.0
    val = val[np.argsort(val[:, 0], kind="stable")] if len(val) else val
    series = []
    for name, pairs in (datasets or {}).items():
        points = np.asarray([(float(st), float(v)) for st, v in pairs if math.isfinite(float(v))
                             and (not log or float(v) > 0)], dtype=np.float64).reshape(-1, 2)
        if len(points):
            series.append((name, points[np.argsort(points[:, 0], kind="stable")]))
    rates = np.asarray(learning_rates if learning_rates is not None else (), dtype=np.float64).reshape(-1)[:count]
    rate_keep = np.isfinite(rates)
    rate_steps = None if rate_keep.all() else np.flatnonzero(rate_keep) + 1.0
    if rate_steps is not None:
        rates = rates[rate_keep]
    return _Series(log, values, steps, every_step, val, series, rates, rate_steps)


def _ranges(data: _Series) -> tuple[float, float, float, float]:
    """The axes' ranges ``(xlo, xhi, ylo, yhi)``: every step and every loss-axis value shown, the loss axis padded
    (5 %, or around a single value) and a single step widened to a range."""
    shown = [a for a in (data.y(data.values), data.y(data.val[:, 1]), *(data.y(p[:, 1]) for _, p in data.datasets))
             if len(a)]
    ylo, yhi = (min(float(a.min()) for a in shown), max(float(a.max()) for a in shown)) if shown else (0.0, 1.0)
    xspans = [(float(a[0]), float(a[-1])) for a in (data.steps, data.val[:, 0], data.rate_steps)
              if a is not None and len(a)]
    if len(data.rates) and data.rate_steps is None:
        xspans.append((1.0, float(len(data.rates))))
    xlo, xhi = (min(a for a, _ in xspans), max(b for _, b in xspans)) if xspans else (1.0, 2.0)
    if yhi - ylo <= 1e-12 * max(1.0, abs(yhi)):
        pad = 0.1 if data.log else abs(yhi) * 0.1 or 1.0
        ylo, yhi = ylo - pad, yhi + pad
    else:
        pad = (yhi - ylo) * 0.05
        ylo, yhi = ylo - pad, yhi + pad
    if xhi <= xlo:
        xlo, xhi = xlo - 1, xhi + 1
    return xlo, xhi, ylo, yhi


@dataclass
class _Layout:
    """Where a loss plot's parts go: the plot area (``left``..``right``, ``top``..``bottom``, inclusive), its
    ranges, ticks and legend. ``labelled`` False: too small for text, the curves fill the image."""

    width: int
    height: int
    scale: int  # text and line scale: 2 on large images
    ch: int  # the height of a line of text
    left: int
    right: int
    top: int
    bottom: int
    labelled: bool
    xlo: float
    xhi: float
    ylo: float
    yhi: float
    rlo: float  # the learning-rate axis
    rhi: float
    yticks: list[float]
    ylabels: list[str]
    rticks: list[float]
    rlabels: list[str]
    entries: list[tuple[str, tuple[float, float, float]]]  # the legend: (name, colour)
    colours: dict[str, tuple[float, float, float]]  # each dataset's colour

    @property
    def pw(self) -> int:
        return self.right - self.left + 1

    @property
    def ph(self) -> int:
        return self.bottom - self.top + 1


def _rate_axis(rates: np.ndarray, height: int, ch: int) -> tuple[float, float, list[float], list[str]]:
    """The learning-rate axis: its range (from 0, padded 5 %), ticks and their labels; none without rates."""
    if not len(rates):
        return 0.0, 1.0, [], []
    rlo, rhi = min(0.0, float(rates.min())), max(0.0, float(rates.max()))
    rlo, rhi = (rlo, rhi) if rhi > rlo else (0.0, 1.0)
    rpad = (rhi - rlo) * 0.05
    rlo, rhi = rlo - rpad, rhi + rpad
    rticks = _ticks(rlo, rhi, max(2, height // (ch * 3)))[0]
    return rlo, rhi, rticks, [_sci_label(t) for t in rticks]


def _layout(data: _Series, width: int, height: int, status: str | None) -> _Layout:
    """The y title and tick labels on the left, x tick labels and title below, the legend (and status) above, the
    learning-rate tick labels and title on the right; the status gets a row of its own above the legend when they
    would touch."""
    scale = 2 if width >= 1024 and height >= 512 else 1
    ch = text_height(scale)
    xlo, xhi, ylo, yhi = _ranges(data)
    top = ch + 8 * scale
    bottom = height - (2 * ch + 10 * scale)
    if data.log:  # spaced for the plot height left when the status line needs a row of its own
        yticks, ylabels = _log_ticks(ylo, yhi, bottom - top - (ch + 4 * scale if status else 0), ch + 8 * scale)
    else:
        yticks, ystep = _ticks(ylo, yhi, max(2, height // (ch * 3)))
        ylabels = [_label(t, ystep) for t in yticks]
    rlo, rhi, rticks, rlabels = _rate_axis(data.rates, height, ch)
    left = 3 * scale + ch + 4 * scale + max((text_width(s, scale) for s in ylabels), default=0) + 4 * scale
    margin = max(6 * scale, text_width(_label(xhi, 1), scale) // 2 + 2)
    if len(data.rates):
        margin = max(margin, 7 * scale + max(text_width(s, scale) for s in rlabels) + 4 * scale + ch + 3 * scale)
    right = width - margin
    colours = {name: _DATASETS[i % len(_DATASETS)] for i, (name, _) in enumerate(data.datasets)}
    entries = [("loss", _RAW), ("smoothed", _SMOOTH)] + ([("validation", _VALID)] if len(data.val) else []) \
        + ([("lr", _LR)] if len(data.rates) else []) + [(fit_text(name, 96 * scale, scale), colours[name])
                                                        for name, _ in data.datasets]
    legend_end = left + sum(27 * scale + text_width(name, scale) for name, _ in entries) - 12 * scale
    own_row = bool(status) and legend_end + 12 * scale + text_width(status or "", scale) > width - 3 * scale
    top += ch + 4 * scale if own_row else 0
    labelled = not (right - left < 16 or bottom - top < 16)
    if not labelled:  # too small for text: curves only
        left, right, top, bottom = 2, width - 3, 2, height - 3
    return _Layout(width, height, scale, ch, left, right, top, bottom, labelled, xlo, xhi, ylo, yhi, rlo, rhi,
                   yticks, ylabels, rticks, rlabels, entries, colours)


def _draw_grid(img: np.ndarray, lay: _Layout, px: Callable[[Any], np.ndarray],
               py: Callable[[Any], np.ndarray]) -> None:
    """The grid lines at the loss and step ticks, with their labels (and the step ticks' marks) when labelled."""
    scale, ch, left, right, top, bottom = lay.scale, lay.ch, lay.left, lay.right, lay.top, lay.bottom
    cw = text_width("0", scale) + scale
    xticks, xstep = _ticks(lay.xlo, lay.xhi, max(2, lay.pw // (cw * 8)), integer=True)
    for t, s in zip(lay.yticks, lay.ylabels):
        r = top + round(float(py(t)))
        if top <= r <= bottom:
            img[r, left:right + 1] = _GRID
            if lay.labelled:
                draw_text(img, s, left - 4 * scale - text_width(s, scale), r - ch // 2, scale=scale)
    for t in xticks:
        c = left + round(float(px(t)))
        if left <= c <= right:
            img[top:bottom + 1, c] = _GRID
            if lay.labelled:
                s = _label(t, xstep)
                img[bottom + 1:bottom + 1 + 3 * scale, c] = _AXIS
                draw_text(img, s, c - text_width(s, scale) // 2, bottom + 4 * scale, scale=scale)


def _draw_rate_axis(img: np.ndarray, lay: _Layout, pr: Callable[[Any], np.ndarray]) -> None:
    """The learning-rate axis on the right: its line, tick marks and labels, and its title read bottom to top."""
    scale, ch, right, top, bottom = lay.scale, lay.ch, lay.right, lay.top, lay.bottom
    img[top:bottom + 1, right] = _LR
    for t, s in zip(lay.rticks, lay.rlabels):
        r = top + round(float(pr(t)))
        if top <= r <= bottom:
            img[r, right + 1:right + 1 + 3 * scale] = _LR
            draw_text(img, s, right + 7 * scale, r - ch // 2, _LR, scale=scale)
    title = "learning rate"
    draw_text(img, title, lay.width - 3 * scale - ch, top + (lay.ph - text_width(title, scale)) // 2, scale=scale,
              vertical=True)


def _draw_titles(img: np.ndarray, lay: _Layout, status: str | None) -> None:
    """The axis titles, the legend above the plot (a line of each entry's colour, then its name) and the status
    at the top right."""
    scale, ch, top = lay.scale, lay.ch, lay.top
    draw_text(img, "step", lay.left + (lay.pw - text_width("step", scale)) // 2, lay.height - ch - 2 * scale,
              scale=scale)
    draw_text(img, "loss", 3 * scale, top + (lay.ph + text_width("loss", scale)) // 2 - text_width("loss", scale),
              scale=scale, vertical=True)
    x = lay.left
    for name, color in lay.entries:
        img[top - ch // 2 - 4 * scale - scale:top - ch // 2 - 4 * scale + scale + 1, x:x + 12 * scale] = color
        draw_text(img, name, x + 15 * scale, top - ch - 4 * scale, scale=scale)
        x += 15 * scale + text_width(name, scale) + 12 * scale
    if status:
        line = fit_text(status, lay.width - 6 * scale, scale)
        draw_text(img, line, lay.width - 3 * scale - text_width(line, scale), 4 * scale, scale=scale)


def _smoothed(values: np.ndarray, log: bool) -> np.ndarray:
    """The moving average drawn for ``values`` (over about a hundredth of them, at least 10), as loss-axis
    positions."""
    tau = max(10.0, len(values) / 100)
    curve = smooth(values, 1 - 1 / tau)
    if log:  # an average of the values lies within their range; rounding must not reach 0 (log10 = -inf)
        curve = np.log10(np.clip(curve, values.min(), values.max(), out=curve))
    return curve


def _draw_curves(plot: np.ndarray, data: _Series, lay: _Layout, px: Callable[[Any], np.ndarray],
                 py: Callable[[Any], np.ndarray], pr: Callable[[Any], np.ndarray]) -> None:
    """The curves into the plot area, back to front: the raw losses, the learning rate, the moving average, each
    dataset's moving average, the validation series (joined points)."""
    pw, ph, scale = lay.pw, lay.ph, lay.scale
    xs = px(data.steps)
    if len(data.values):
        lo, hi = _spans(xs, py(data.y(data.values)), pw)
        _paint_spans(plot, 0, 0, lo, hi, _RAW, 1, ph)
    rates = data.rates
    if len(rates):
        if data.rate_steps is None:  # steps 1..len(rates): the losses' positions when every loss is drawn
            rate_xs = xs[:len(rates)] if data.every_step else px(np.arange(1, len(rates) + 1, dtype=np.float64))
        else:
            rate_xs = px(data.rate_steps)
        lo, hi = _spans(rate_xs, pr(rates), pw)
        _paint_spans(plot, 0, 0, lo, hi, _LR, scale, ph)
    if len(data.values):
        lo, hi = _spans(xs, py(_smoothed(data.values, data.log)), pw)
        _paint_spans(plot, 0, 0, lo, hi, _SMOOTH, 2 * scale, ph)
    for name, points in data.datasets:
        lo, hi = _spans(px(points[:, 0]), py(_smoothed(points[:, 1], data.log)), pw)
        _paint_spans(plot, 0, 0, lo, hi, lay.colours[name], scale, ph)
    if len(data.val):
        xs, ys = px(data.val[:, 0]), py(data.y(data.val[:, 1]))
        lo, hi = _spans(xs, ys, pw)
        _paint_spans(plot, 0, 0, lo, hi, _VALID, 2 * scale, ph)
        for x, y in zip(np.rint(xs).astype(int), np.rint(ys).astype(int)):
            plot[max(0, y - 2 * scale):y + 2 * scale + 1, max(0, x - 2 * scale):x + 2 * scale + 1] = _VALID


def loss_plot(losses: Sequence[float], width: int = 512, height: int = 256, *,
              validation: Sequence[tuple[int, float]] | None = None, log_scale: bool = False,
              learning_rates: Sequence[float] | None = None, status: str | None = None,
              datasets: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> torch.Tensor:
    """Raw losses (light) and their moving average (dark, "smoothed") against steps (loss ``i`` is step ``i + 1``),
    and the ``validation`` series ((step, value) pairs) if given; numbered axes, axis titles and a legend. The y range
    spans every finite value shown. Returns ``[1, height, width, 3]`` float32.

    ``log_scale`` draws the loss axis logarithmically (ticks at 1-2-5 or whole decades); losses and validation
    values that are not positive are left out, and with none positive the axis stays linear.
    ``learning_rates`` (the rate at step ``i + 1``; as long as ``losses`` or shorter, extra values ignored) adds a
    thin green curve on a linear axis of its own on the right, from 0 up, titled "learning rate" and listed as
    "lr" in the legend. ``status`` (one short line, e.g. from ``status_line``) is drawn at the top right, beside
    the legend or above it when they would touch. ``datasets`` (name -> (step, value) pairs: each dataset's
    loss in a mix) adds each dataset's moving average in a colour of its own, named in the legend."""
    img = np.empty((height, width, 3), dtype=np.float32)
    img[:] = _BG
    data = _series(losses, validation, log_scale, learning_rates, datasets)
    lay = _layout(data, width, height, status)
    px = _linear_map(lay.xlo, lay.xhi, 0.0, lay.pw - 1.0)
    py = _linear_map(lay.yhi, lay.ylo, 0.0, lay.ph - 1.0)
    pr = _linear_map(lay.rhi, lay.rlo, 0.0, lay.ph - 1.0)
    _draw_grid(img, lay, px, py)
    if lay.labelled and len(data.rates):
        _draw_rate_axis(img, lay, pr)
    img[lay.bottom, lay.left:lay.right + 1] = _AXIS
    img[lay.top:lay.bottom + 1, lay.left] = _AXIS
    if lay.labelled:
        _draw_titles(img, lay, status)
    _draw_curves(img[lay.top:lay.bottom + 1, lay.left:lay.right + 1], data, lay, px, py, pr)
    return torch.from_numpy(img)[None]


def _duration(seconds: float) -> str:
    """``45s``, ``2m31s``, ``1h04m``: to the second below an hour, to the minute above."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def status_line(step: int, total: int, seconds_per_step: float | None, remaining_steps: int) -> str:
    """The training status for the plot's ``status``: ``step 120/500  3.2 it/s  2m31s left``. The speed reads in
    steps per second when at least one step a second (``3.2 it/s``), else in seconds per step (``4.5 s/it``); the
    time left is ``remaining_steps * seconds_per_step`` (the steps this run still has to do, which need not be
    ``total - step``). Unknown parts are left out: the total when not positive, the speed and time left when
    ``seconds_per_step`` is None or not a positive number, the time left when ``remaining_steps`` is negative."""
    parts = [f"step {step}/{total}" if total > 0 else f"step {step}"]
    if seconds_per_step is not None and math.isfinite(seconds_per_step) and seconds_per_step > 0:
        rate = 1 / seconds_per_step
        parts.append(f"{rate:.1f} it/s" if rate >= 1 else f"{seconds_per_step:.1f} s/it")
        if remaining_steps >= 0:
            parts.append(f"{_duration(remaining_steps * seconds_per_step)} left")
    return "  ".join(parts)


def label_image(image: torch.Tensor, lines: Sequence[str], *, scale: int | None = None) -> torch.Tensor:
    """``image`` (a ComfyUI IMAGE, ``[B, H, W, 3]`` or ``[H, W, 3]``) with a white band above it holding ``lines``
    of dark text, one per row: ``[B, H + band, W, 3]`` in the image's dtype and device, the image's own pixels
    unchanged below the band. Used to caption sample previews with their step and prompt. Runs of whitespace
    (newlines in a prompt) become one space, and a line too wide for the image is cut with ``...``. The text is
    the font at ``scale`` times its size; by default 2 for images at least 512 pixels wide, else 1. No lines: the image
    as it is (with a batch dimension)."""
    if image.dim() == 3:
        image = image[None]
    if image.dim() != 4 or image.shape[-1] != 3:
        raise ValueError(f"expected an image [B, H, W, 3] or [H, W, 3], got shape {tuple(image.shape)}")
    batch, _, width, _ = image.shape
    texts = [" ".join(str(line).split()) for line in lines]
    if not texts:
        return image
    s = max(1, int(scale)) if scale is not None else 2 if width >= 512 else 1
    ch, pad, gap = text_height(s), 4 * s, 3 * s
    band = np.empty((2 * pad + len(texts) * ch + (len(texts) - 1) * gap, width, 3), dtype=np.float32)
    band[:] = _BG
    for i, text in enumerate(texts):
        draw_text(band, fit_text(text, width - 2 * pad, s), pad, pad + i * (ch + gap), scale=s)
    top = torch.from_numpy(band).to(device=image.device, dtype=image.dtype)[None].expand(batch, -1, -1, -1)
    return torch.cat([top, image], dim=1)
