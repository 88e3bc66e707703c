"""What the nodes share: the dataset socket type, ComfyUI's folders, progress reporting."""

from __future__ import annotations

import logging
import os

import folder_paths
from comfy_api.latest import io

from ..streaming_cache.format import INDEX_NAME
from ..streaming_cache.paths import resolve_inside

log = logging.getLogger("streaming_cache")

# The lazy dataset handle (keys only, no tensors) that flows between the pack's nodes.
StreamingDataset = io.Custom("STREAMING_DATASET")

CACHE_FOLDER = "streaming_caches"


def caches_root() -> str:
    """Where caches live: ``<output>/streaming_caches`` (created on demand)."""
    return os.path.join(folder_paths.get_output_directory(), CACHE_FOLDER)


def cache_path(name: str) -> str:
    return resolve_inside(name, [caches_root()], what="cache name")


def dataset_roots() -> list[str]:
    """Folders a dataset folder may come from: ComfyUI's input and output folders."""
    return [folder_paths.get_input_directory(), folder_paths.get_output_directory()]


def dataset_path(name: str) -> str:
    path = resolve_inside(name, dataset_roots(), what="dataset folder")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"dataset folder {name!r} not found (looked for {path}); put the images in a "
                                f"folder under {folder_paths.get_input_directory()} and give its name")
    return path


def list_caches() -> list[str]:
    root = caches_root()
    if not os.path.isdir(root):
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if INDEX_NAME in filenames:
            found.append(os.path.relpath(dirpath, root).replace(os.sep, "/"))
            dirnames.clear()
        dirnames.sort()
    return sorted(found)


def loras_folder() -> str:
    return folder_paths.get_folder_paths("loras")[0]


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
