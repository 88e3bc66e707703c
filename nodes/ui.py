"""What the nodes show and pass: the dataset socket type, text under a node."""

from __future__ import annotations

import inspect
import logging

from comfy_api.latest import io

log = logging.getLogger("streaming_cache")

# The lazy dataset handle (keys only, no tensors) that flows between the pack's nodes.
StreamingDataset = io.Custom("STREAMING_DATASET")
CATEGORY = "training/streaming cache"


def node_schema(node_id: str, display_name: str, description: str, inputs: list, outputs: list, *,
                output_node: bool = False) -> io.Schema:
    """A node of this pack: in the pack's category, told its own id (for text under it)."""
    return io.Schema(node_id=node_id, display_name=display_name, category=CATEGORY, description=description,
                     is_output_node=output_node, inputs=inputs, outputs=outputs, hidden=[io.Hidden.unique_id])


def show_text(node_id: str | None, text: str, *, log_it: bool = True) -> None:
    """Text under the node in the UI (when a server is running); also in the log unless ``log_it`` is False
    (per-step progress, which the terminal's progress bar already shows)."""
    if log_it:
        log.info("%s", text)
    try:
        from server import PromptServer

        if PromptServer.instance is not None and node_id is not None:
            PromptServer.instance.send_progress_text(text, node_id)
    except Exception:  # headless runs without a server: the log line is enough
        pass


def _takes_advanced() -> bool:
    return "advanced" in inspect.signature(io.Int.Input.__init__).parameters


# Inputs marked advanced are folded away in the node until the user opens them (ComfyUI 0.33+; older versions
# show every input).
ADVANCED: dict[str, bool] = {"advanced": True} if _takes_advanced() else {}
