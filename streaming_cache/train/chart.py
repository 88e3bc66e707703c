"""The training curves as data for the browser to draw (the pack's frontend extension): loss, its moving average,
validation, learning rate, each dataset of a mix, with the time of each step.

The node sends this while it trains and keeps the last one in its output, so the chart survives the job and a
page reload (the prompt's history holds it). A long run is thinned to at most ``max_points`` steps, evenly, always
keeping the last one; the moving average is computed on every step before thinning, so it does not depend on how
many points are drawn. Values that are not finite are sent as None (JSON has no NaN).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .plot import smooth

MAX_POINTS = 2000
EVENT = "streaming_cache.chart"
"""The name of the message the browser listens for."""


def _finite(v: float | None) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _kept(n: int, max_points: int) -> list[int]:
    """Indices of ``n`` steps thinned to at most ``max_points``, evenly, the last one always kept."""
    if n <= max_points:
        return list(range(n))
    stride = n / (max_points - 1)
    return sorted({min(n - 1, round(i * stride)) for i in range(max_points - 1)} | {n - 1})


def _pairs(values: Sequence[tuple[int, float]], max_points: int) -> list[list[Any]]:
    return [[int(values[i][0]), _finite(values[i][1])] for i in _kept(len(values), max_points)]


def chart_series(losses: Sequence[float], *, first_step: int = 1, total: int | None = None,
                 validation: Sequence[tuple[int, float]] = (), learning_rates: Callable[[int], Any] | None = None,
                 times: Sequence[float | None] | None = None,
                 datasets: Mapping[str, Sequence[tuple[int, float]]] | None = None, log_scale: bool = False,
                 max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The chart's data: ``losses`` (one per optimizer step, the first being step ``first_step``), ``total`` steps
    planned, ``validation`` (step, loss), ``learning_rates(n)`` (the rate of each of the first n steps),
    ``times`` (seconds since the run started, per step, None for steps of an earlier run), each dataset's
    (step, loss), and whether the loss axis starts logarithmic. JSON-serialisable."""
    n = len(losses)
    keep = _kept(n, max_points)
    average = smooth([v if math.isfinite(v) else 0.0 for v in losses]).tolist() if n else []
    rates = list(learning_rates(n)) if learning_rates is not None and n else []
    return {
        "steps": [first_step + i for i in keep],
        "loss": [_finite(losses[i]) for i in keep],
        "average": [_finite(float(average[i])) for i in keep],
        "lr": [_finite(float(rates[i])) for i in keep] if len(rates) == n else [],
        "time": [_finite(times[i]) for i in keep] if times is not None and len(times) == n else [],
        "validation": _pairs(list(validation), max_points),
        "datasets": {name: _pairs(list(values), max_points) for name, values in (datasets or {}).items()},
        "total": int(total if total is not None else first_step + n - 1),
        "scale": "log" if log_scale else "linear",
    }


class StepTimes:
    """When each step of a run finished (``perf_counter`` seconds), for the chart's times and the time per step.

    The training loop reads several steps' losses at once and reports them together (``loop.TrainHooks``'s
    ``report_seconds``), so the steps of one report share the time since the step before them (or since
    ``started``), evenly: their median still times a step, and a preview or validation between two reports
    counts once."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.times: list[float] = []
        self.reported = 0  # steps of the report under way

    def add(self, now: float) -> None:
        """A step reported at ``now``, in the same report as the steps added since :meth:`end_report`."""
        self.times.append(now)
        self.reported += 1

    def end_report(self) -> int:
        """End the report under way, its steps' times spread evenly up to its last; returns its number of steps."""
        n, self.reported = self.reported, 0
        if n > 1:
            base, now = self.times[-n - 1] if len(self.times) > n else self.started, self.times[-1]
            self.times[-n:] = [base + (now - base) * (i + 1) / n for i in range(n)]
        return n

    def seconds_per_step(self) -> float | None:
        """The median time of the last 32 steps (None before two)."""
        recent = self.times[-33:]
        gaps = [b - a for a, b in zip(recent, recent[1:])]
        return statistics.median(gaps) if gaps else None
