"""Device optimizations that gave up during a run, and why.

A training run on a GPU uses optimizations the plain path does without: CUDA graphs of the model's step, a
copy stream for batches, pinned host memory, fused optimizer kernels, compiled blocks. None of them may crash a
run or change what it learns: each one that raises (or, for graphs, disagrees with the plain path) is switched
off for the rest of the run, the run goes on on the plain path, and the reason is noted here once. The node's
summary and the log say which optimization fell back and why (:meth:`Fallbacks.lines`).

One :class:`Fallbacks` belongs to one run; the loader's worker threads note into it too, so it is thread-safe.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

GRAPHS = "CUDA graphs"
COPY_STREAM = "copy stream"
PINNED_MEMORY = "pinned memory"
FUSED_OPTIMIZER = "fused optimizer"
COMPILED_BLOCKS = "compiled blocks"


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (CUDA errors run to many lines), with
    the next line where the first only introduces it (``backend='inductor' raised:``)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Fallbacks:
    """The optimizations a run switched off, each with the reason it first gave (later ones are not kept)."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}
        self._lock = threading.Lock()

    def note(self, feature: str, reason: str) -> bool:
        """``feature`` is off for the rest of the run because of ``reason``; logged as a warning the first time.
        Returns whether this was the first time."""
        with self._lock:
            if feature in self._reasons:
                return False
            self._reasons[feature] = reason
        log.warning("%s: off for the rest of the run, training goes on without it (%s)", feature, reason)
        return True

    def reason(self, feature: str) -> str | None:
        """Why ``feature`` fell back, or None if it did not."""
        with self._lock:
            return self._reasons.get(feature)

    def lines(self) -> list[str]:
        """One line per optimization that fell back, in the order they did: for the node's summary."""
        with self._lock:
            return [f"{feature} fell back to the plain path: {reason}" for feature, reason in self._reasons.items()]

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._reasons)
