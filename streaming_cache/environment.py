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
