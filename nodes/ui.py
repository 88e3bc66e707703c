"""What the nodes show and pass: the pack's socket types, its node schema, and the text a node leaves behind.

A node's summary (what it did and why) is returned as its ``ui`` text: ComfyUI keeps it in the prompt's history
and sends it to the browser, where the pack's frontend extension (``web/streaming_cache.js``) shows it on the
node and keeps it there after the job ends. Progress text (``send_text``) is for while the node runs only.
"""

from __future__ import annotations

import logging
from typing import Any

from comfy_api.latest import io

from .backend import compat

log = compat.log


class _WarnOnce(logging.Filter):
    """Each distinct warning of the pack once per node run (:func:`new_run`): one repeated at every step or
    batch is read once, on the server's console as in a headless run."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


if not any(isinstance(f, _WarnOnce) for f in log.filters):  # once, also when the pack is imported again
    log.addFilter(_WarnOnce())


def new_run() -> None:
    """A node starts its work: its warnings are shown again, once each."""
    for f in log.filters:
        if isinstance(f, _WarnOnce):
            f.seen.clear()

# The lazy dataset handle (keys only, no tensors) that flows between the pack's nodes.
StreamingDataset = io.Custom("STREAMING_DATASET")
# The option groups chained from the option nodes into Train LoRA (``streaming_cache.train.spec.TrainOptions``).
TrainOptionsType = io.Custom("STREAMING_TRAIN_OPTIONS")
# Encode Dataset's video, caption-variant and mask settings (``nodes.encode.EncodeOptions``).
EncodeOptionsType = io.Custom("STREAMING_ENCODE_OPTIONS")

CATEGORY = "training/streaming cache"
OPTIONS_CATEGORY = "training/streaming cache/options"


def node_schema(node_id: str, display_name: str, description: str, inputs: list, outputs: list, *,
                output_node: bool = False, category: str = CATEGORY, deprecated: bool = False,
                search_aliases: list[str] | None = None) -> io.Schema:
    """A node of this pack: in the pack's category, told its own id (for text under it). ``search_aliases`` are
    used where the ComfyUI version knows them."""
    extra: dict[str, Any] = {}
    if search_aliases and "search_aliases" in io.Schema.__dataclass_fields__:
        extra["search_aliases"] = search_aliases
    return io.Schema(node_id=node_id, display_name=display_name, category=category, description=description,
                     is_output_node=output_node, is_deprecated=deprecated, inputs=inputs, outputs=outputs,
                     hidden=[io.Hidden.unique_id], **extra)


def show_text(node_id: str | None, text: str, *, log_it: bool = True) -> None:
    """Progress text under the node while it runs; also in the log unless ``log_it`` is False (per-step
    progress, which the terminal's progress bar already shows)."""
    if log_it:
        log.info("%s", text)
    compat.send_text(node_id, text)


_CANCELS = [0]


def note_cancel() -> None:
    """Count a cancel that a node answered by returning what it had done: its fingerprint (see :func:`cancels`)
    then changes, so queueing it again runs it again instead of reusing the cancelled run's outputs."""
    _CANCELS[0] += 1


def cancels() -> int:
    """Cancels noted so far in this process (part of the pack's nodes' fingerprints)."""
    return _CANCELS[0]
