"""A loss plot drawn with numpy alone, returned as a ComfyUI IMAGE tensor (``[1, H, W, 3]``, floats in 0..1)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_BG, _GRID, _AXIS = (1.0, 1.0, 1.0), (0.90, 0.90, 0.92), (0.35, 0.35, 0.35)
_RAW, _SMOOTH = (0.62, 0.75, 0.95), (0.10, 0.30, 0.80)


def smooth(values: Sequence[float], weight: float = 0.9) -> np.ndarray:
    """Exponential moving average with bias correction (as TensorBoard's smoothing slider)."""
    out = np.empty(len(values))
    acc = 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * float(v)
        out[i] = acc / (1 - weight ** (i + 1))
    return out


def _line(img: np.ndarray, xs: np.ndarray, ys: np.ndarray, color: tuple[float, float, float], width: int) -> None:
    h, w, _ = img.shape
    for (x0, y0), (x1, y1) in zip(zip(xs[:-1], ys[:-1]), zip(xs[1:], ys[1:])):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
        px = np.linspace(x0, x1, n).round().astype(int)
        py = np.linspace(y0, y1, n).round().astype(int)
        for d in range(-(width // 2), width - width // 2):
            img[np.clip(py + d, 0, h - 1), np.clip(px, 0, w - 1)] = color
    if len(xs) == 1:
        img[np.clip(int(ys[0]), 0, h - 1), np.clip(int(xs[0]), 0, w - 1)] = color


def loss_plot(losses: Sequence[float], width: int = 512, height: int = 256) -> torch.Tensor:
    """Raw losses (light) and their moving average (dark) against steps; y from the minimum to the maximum."""
    img = np.empty((height, width, 3), dtype=np.float32)
    img[:] = _BG
    left, right, top, bottom = 8, width - 8, 8, height - 8
    for frac in (0.25, 0.5, 0.75):
        img[int(top + frac * (bottom - top)), left:right] = _GRID
        img[top:bottom, int(left + frac * (right - left))] = _GRID
    img[bottom, left:right + 1] = _AXIS
    img[top:bottom + 1, left] = _AXIS
    values = np.asarray([float(v) for v in losses if np.isfinite(v)], dtype=np.float64)
    if len(values):
        lo, hi = float(values.min()), float(values.max())
        span = hi - lo if hi > lo else 1.0
        xs = left + np.arange(len(values)) * ((right - left) / max(1, len(values) - 1))

        def ys(v: np.ndarray) -> np.ndarray:
            return bottom - (v - lo) / span * (bottom - top)

        _line(img, xs, ys(values), _RAW, 1)
        _line(img, xs, ys(smooth(values)), _SMOOTH, 2)
    return torch.from_numpy(img)[None]
