"""Video clips for EncodeDataset: only the frames a clip needs are decoded (PyAV, which ComfyUI depends on), each
resized and cropped to the clip's bucket as it is decoded, so a long video never sits in memory whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import av
from PIL import Image

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".gif", ".mkv", ".avi", ".m4v")


def frame_multiple(down: Callable[[int], int] | None) -> int:
    """The frame counts a video VAE encodes without loss are ``1 + k * m``; returns ``m`` (1 for image VAEs).
    ``down`` maps a clip's frame count to its latent frame count (``media.frame_reducer``)."""
    if down is None:
        return 1
    for m in range(1, 33):
        if down(1 + m) == 2:
            return m
    return 1


def usable_frames(available: int, wanted: int, multiple: int) -> int:
    """The most frames of the form ``1 + k * multiple`` that are at most ``min(available, wanted)``."""
    n = min(available, wanted)
    if n < 1:
        return 0
    return 1 + (n - 1) // multiple * multiple


def read_frames(path: str, *, frames: int, fps: float, start: float,
                convert: Callable[[Image.Image], Any]) -> list[Any]:
    """Up to ``frames`` frames from ``start`` seconds on, ``fps`` per second (0: the video's own rate), each
    passed through ``convert`` as soon as it is decoded. Raises ValueError naming the file when it has no
    video stream or no frame at ``start``."""
    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream in this file")
        stream = container.streams.video[0]
        native = float(stream.average_rate or stream.guessed_rate or 0) or 25.0
        step = 1.0 / (fps if fps > 0 else native)
        if start > 0 and stream.time_base is not None:
            container.seek(int(start / float(stream.time_base)), stream=stream, any_frame=False, backward=True)
        out: list[Any] = []
        next_time = start
        for frame in container.decode(stream):
            t = float(frame.pts * stream.time_base) if frame.pts is not None and stream.time_base else \
                next_time
            if t + 1e-6 < next_time:
                continue
            out.append(convert(frame.to_image().convert("RGB")))
            next_time += step
            if len(out) >= frames:
                break
    if not out:
        raise ValueError(f"{path}: no frame at {start:g} s (the clip is shorter)")
    return out


def clip_size(path: str) -> tuple[int, int]:
    """(width, height) of a video's frames, from its stream header."""
    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream in this file")
        ctx = container.streams.video[0].codec_context
        return int(ctx.width), int(ctx.height)



def frame_rate(path: str) -> float:
    """A video's own frame rate (25 when its header does not say), as :func:`read_frames` takes it."""
    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream in this file")
        stream = container.streams.video[0]
        return float(stream.average_rate or stream.guessed_rate or 0) or 25.0
