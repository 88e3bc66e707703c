"""Settings read from the environment, for what a workflow has no input for (timeouts of the machinery, not of
the training): read when used, so a server picks up a change at its next run."""

from __future__ import annotations

import os


def seconds(name: str, default: float) -> float:
    """``$name`` as a positive number of seconds, ``default`` when unset; a clear error for anything else."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


EMULATE_ENV = "STREAMING_CACHE_EMULATE_DEVICE"


def emulated_device() -> bool:
    """Whether a run on the CPU takes the paths only a GPU takes otherwise (CUDA graphs, the copy stream and its
    events, pinned buffers), through their CPU emulations: ``$STREAMING_CACHE_EMULATE_DEVICE`` is ``1``. For tests
    and CI, which have no GPU: the emulations execute the same code around the device calls, so a mistake in it
    fails there instead of on a user's GPU."""
    raw = os.environ.get(EMULATE_ENV, "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return False
    if raw in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"{EMULATE_ENV}={raw!r}: use 1 (emulate the GPU's paths on the CPU) or 0")
