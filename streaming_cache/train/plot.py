"""A loss plot drawn with numpy alone, returned as a ComfyUI IMAGE tensor (``[1, H, W, 3]``, floats in 0..1).

The plot has numbered axes ("step" across, "loss" up), a legend, the raw losses (light), their moving average
(dark) and optionally a validation series (orange points, joined). Text uses a built-in 5x7 bitmap font. It is
redrawn live during training, so every series is reduced to one span per pixel column before drawing: the cost
grows with the number of steps only through a few vectorised passes (about 5 ms for 100k steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

_BG, _GRID, _AXIS, _TEXT = (1.0, 1.0, 1.0), (0.90, 0.90, 0.92), (0.35, 0.35, 0.35), (0.15, 0.15, 0.15)
_RAW, _SMOOTH, _VALID = (0.62, 0.75, 0.95), (0.10, 0.30, 0.80), (0.90, 0.45, 0.05)

# 5x7 glyphs: 7 rows of 5 columns, '#' = ink. Digits, the letters of the labels and legend, and number signs.
_GLYPHS = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("####.", "....#", "....#", ".###.", "....#", "....#", "####."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    ".": (".....", ".....", ".....", ".....", ".....", ".##..", ".##.."),
    "-": (".....", ".....", ".....", ".###.", ".....", ".....", "....."),
    "+": (".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."),
    " ": (".....",) * 7,
    "a": (".....", ".....", ".###.", "....#", ".####", "#...#", ".####"),
    "d": ("....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"),
    "e": (".....", ".....", ".###.", "#...#", "#####", "#....", ".###."),
    "h": ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "i": ("..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."),
    "m": (".....", ".....", "##.#.", "#.#.#", "#.#.#", "#.#.#", "#.#.#"),
    "l": (".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "n": (".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "o": (".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."),
    "p": (".....", ".....", "####.", "#...#", "####.", "#....", "#...."),
    "r": (".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."),
    "s": (".....", ".....", ".####", "#....", ".###.", "....#", "####."),
    "t": (".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."),
    "v": (".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
}
_FONT = {c: np.array([[ch == "#" for ch in row] for row in rows], dtype=bool) for c, rows in _GLYPHS.items()}
_GW, _GH = 5, 7  # glyph size; characters advance by _GW + 1


def text_width(text: str, scale: int = 1) -> int:
    return max(0, len(text) * (_GW + 1) - 1) * scale


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """The pixels of ``text`` in the built-in 5x7 font (True = ink), ``scale`` times enlarged."""
    mask = np.zeros((_GH, max(1, text_width(text))), dtype=bool)
    for i, ch in enumerate(text):
        glyph = _FONT.get(ch)
        if glyph is None:
            raise ValueError(f"the plot font has no glyph for {ch!r}")
        mask[:, i * (_GW + 1):i * (_GW + 1) + _GW] = glyph
    return mask.repeat(scale, axis=0).repeat(scale, axis=1) if scale > 1 else mask


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


def smooth(values: Sequence[float], weight: float = 0.9) -> np.ndarray:
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
    exp = math.floor(math.log10(abs(v)))
    mantissa = f"{v / 10 ** exp:.2f}".rstrip("0").rstrip(".")
    return f"{mantissa}e{exp}"


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


def loss_plot(losses: Sequence[float], width: int = 512, height: int = 256, *,
              validation: Sequence[tuple[int, float]] | None = None) -> torch.Tensor:
    """Raw losses (light) and their moving average (dark, "smoothed") against steps (loss ``i`` is step ``i + 1``), and the
    ``validation`` series ((step, value) pairs) if given; numbered axes, axis titles and a legend. The y range
    spans every finite value shown. Returns ``[1, height, width, 3]`` float32."""
    img = np.empty((height, width, 3), dtype=np.float32)
    img[:] = _BG
    scale = 2 if width >= 1024 and height >= 512 else 1
    ch, cw = _GH * scale, (_GW + 1) * scale
    values = np.asarray(losses, dtype=np.float64).reshape(-1)
    steps = np.arange(1, len(values) + 1, dtype=np.float64)
    finite = np.isfinite(values)
    values, steps = values[finite], steps[finite]
    val = np.asarray([(float(s), float(v)) for s, v in (validation or ()) if math.isfinite(float(v))],
                     dtype=np.float64).reshape(-1, 2)
    val = val[np.argsort(val[:, 0], kind="stable")] if len(val) else val
    all_y = np.concatenate([values, val[:, 1]])
    all_x = np.concatenate([steps, val[:, 0]])
    if len(all_y):
        ylo, yhi = float(all_y.min()), float(all_y.max())
        xlo, xhi = float(all_x.min()), float(all_x.max())
    else:
        ylo, yhi, xlo, xhi = 0.0, 1.0, 1.0, 2.0
    if yhi - ylo <= 1e-12 * max(1.0, abs(yhi)):
        pad = abs(yhi) * 0.1 or 1.0
        ylo, yhi = ylo - pad, yhi + pad
    else:
        pad = (yhi - ylo) * 0.05
        ylo, yhi = ylo - pad, yhi + pad
    if xhi <= xlo:
        xlo, xhi = xlo - 1, xhi + 1
    yticks, ystep = _ticks(ylo, yhi, max(2, height // (ch * 4)))
    ylabels = [_label(t, ystep) for t in yticks]
    # Layout: the y title and tick labels on the left, x tick labels and title below, the legend above.
    left = 3 * scale + ch + 4 * scale + max(text_width(s, scale) for s in ylabels) + 4 * scale
    right = width - max(6 * scale, text_width(_label(xhi, 1), scale) // 2 + 2)
    top = ch + 8 * scale
    bottom = height - (2 * ch + 10 * scale)
    if right - left < 16 or bottom - top < 16:  # too small for text: curves only
        left, right, top, bottom = 2, width - 3, 2, height - 3
        labelled = False
    else:
        labelled = True
    pw, ph = right - left + 1, bottom - top + 1

    def px(x: np.ndarray | float) -> np.ndarray:
        return (np.asarray(x, dtype=np.float64) - xlo) / (xhi - xlo) * (pw - 1)

    def py(y: np.ndarray | float) -> np.ndarray:
        return (yhi - np.asarray(y, dtype=np.float64)) / (yhi - ylo) * (ph - 1)

    xticks, xstep = _ticks(xlo, xhi, max(2, pw // (cw * 8)), integer=True)
    for t, s in zip(yticks, ylabels):
        r = top + round(float(py(t)))
        if top <= r <= bottom:
            img[r, left:right + 1] = _GRID
            if labelled:
                draw_text(img, s, left - 4 * scale - text_width(s, scale), r - ch // 2, scale=scale)
    for t in xticks:
        c = left + round(float(px(t)))
        if left <= c <= right:
            img[top:bottom + 1, c] = _GRID
            if labelled:
                s = _label(t, xstep)
                img[bottom + 1:bottom + 1 + 3 * scale, c] = _AXIS
                draw_text(img, s, c - text_width(s, scale) // 2, bottom + 4 * scale, scale=scale)
    img[bottom, left:right + 1] = _AXIS
    img[top:bottom + 1, left] = _AXIS
    if labelled:
        draw_text(img, "step", left + (pw - text_width("step", scale)) // 2, height - ch - 2 * scale, scale=scale)
        draw_text(img, "loss", 3 * scale, top + (ph + text_width("loss", scale)) // 2 - text_width("loss", scale),
                  scale=scale, vertical=True)
        entries = [("loss", _RAW), ("smoothed", _SMOOTH)] + ([("validation", _VALID)] if len(val) else [])
        x = left
        for name, color in entries:
            img[top - ch // 2 - 4 * scale - scale:top - ch // 2 - 4 * scale + scale + 1,
                x:x + 12 * scale] = color
            draw_text(img, name, x + 15 * scale, top - ch - 4 * scale, scale=scale)
            x += 15 * scale + text_width(name, scale) + 12 * scale
    plot = img[top:bottom + 1, left:right + 1]
    if len(values):
        xs = px(steps)
        lo, hi = _spans(xs, py(values), pw)
        _paint_spans(plot, 0, 0, lo, hi, _RAW, 1, ph)
        tau = max(10.0, len(values) / 100)
        lo, hi = _spans(xs, py(smooth(values, 1 - 1 / tau)), pw)
        _paint_spans(plot, 0, 0, lo, hi, _SMOOTH, 2 * scale, ph)
    if len(val):
        xs, ys = px(val[:, 0]), py(val[:, 1])
        lo, hi = _spans(xs, ys, pw)
        _paint_spans(plot, 0, 0, lo, hi, _VALID, 2 * scale, ph)
        for x, y in zip(np.rint(xs).astype(int), np.rint(ys).astype(int)):
            plot[max(0, y - 2 * scale):y + 2 * scale + 1, max(0, x - 2 * scale):x + 2 * scale + 1] = _VALID
    return torch.from_numpy(img)[None]
