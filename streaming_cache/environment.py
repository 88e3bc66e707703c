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


RECOMPUTE_COPIES_ENV = "STREAMING_CACHE_RECOMPUTE_COPIES"


def recompute_copies_all() -> bool:
    """Whether a recomputed block runs on copies of every input it might update (``all``), or only of those its
    first call updated or returned (``learned``, the default: ``streaming_cache.train.recompute``; fewer launches,
    the same gradients), as ``$STREAMING_CACHE_RECOMPUTE_COPIES`` says. ``all`` copies from the start what a run
    falls back to where a block updates an input at some calls only (``recompute.InputUpdatedLater``)."""
    raw = os.environ.get(RECOMPUTE_COPIES_ENV, "").strip().lower()
    if raw == "all":
        return True
    if raw in ("", "learned"):
        return False
    raise ValueError(f"{RECOMPUTE_COPIES_ENV}={raw!r}: use learned (the default) or all")


DEVICE_MEMORY_ENV = "STREAMING_CACHE_DEVICE_MEMORY"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def device_memory() -> int | None:
    """The device memory a run may use, as ``$STREAMING_CACHE_DEVICE_MEMORY`` gives it (``12GiB``, ``8g``, bytes),
    in place of what the device reports: to plan a run for a smaller GPU than this one, and for tests on the CPU.
    None when unset."""
    raw = os.environ.get(DEVICE_MEMORY_ENV, "").strip().lower().replace(" ", "")
    if not raw:
        return None
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{DEVICE_MEMORY_ENV}={raw!r}: give a size such as 12GiB, 8g or a number of bytes") from None
    if not value > 0:
        raise ValueError(f"{DEVICE_MEMORY_ENV} must be a positive size, got {raw!r}")
    return int(value)


# The PyTorch releases the pack supports, as (major, minor). The oldest: PyTorch 2.5 is the first with everything
# the pack calls (torch.get_autocast_dtype and torch.is_autocast_enabled(device_type) since 2.4, the optimizer
# torch.optim.Adafactor since 2.5); CI runs the engine's and trainer's tests on it (.ci/run). Before 2.8 blocks
# that update tensors in place are not recomputed (train/recompute.py: no reader of the saved-tensor hooks). The
# newest: the release CI tests the whole suite with.
TORCH_OLDEST = (2, 5)
TORCH_NEWEST_TESTED = (2, 13)


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a PyTorch version string (``2.7.1+cu126``, ``2.8.0a0+git1234``), None if it has none."""
    import re

    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _release_text(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"


def torch_too_old(version: str | None = None) -> str | None:
    """The error for a PyTorch older than :data:`TORCH_OLDEST` (``version``: the running one's by default):
    which one is installed, which is needed, and what to do; None for a supported or unreadable version."""
    if version is None:
        import torch

        version = str(torch.__version__)
    release = torch_release(version)
    if release is None or release >= TORCH_OLDEST:
        return None
    oldest = _release_text(TORCH_OLDEST)
    return (f"comfyui-streaming-cache needs PyTorch {oldest} or newer, and this Python has PyTorch {version}: update "
            f"PyTorch in the Python that runs ComfyUI (pip install --upgrade torch torchvision torchaudio, with the "
            f"index for your GPU that PyTorch's install page gives), or use a ComfyUI that ships PyTorch {oldest} or "
            f"newer")


def torch_newer_than_tested(version: str | None = None) -> str | None:
    """A one-line note for a PyTorch newer than :data:`TORCH_NEWEST_TESTED` (never an error), else None."""
    if version is None:
        import torch

        version = str(torch.__version__)
    release = torch_release(version)
    if release is None or release <= TORCH_NEWEST_TESTED:
        return None
    return (f"comfyui-streaming-cache is tested with PyTorch {_release_text(TORCH_OLDEST)} to "
            f"{_release_text(TORCH_NEWEST_TESTED)}; this is PyTorch {version}")


def check_torch(version: str | None = None) -> None:
    """At start-up: ImportError (:func:`torch_too_old`) for a PyTorch the pack does not support, whose missing
    functions would otherwise fail mid-training; the note of :func:`torch_newer_than_tested` logged at INFO."""
    problem = torch_too_old(version)
    if problem is not None:
        raise ImportError(problem)
    note = torch_newer_than_tested(version)
    if note is not None:
        import logging

        logging.getLogger("streaming_cache").info(note)
