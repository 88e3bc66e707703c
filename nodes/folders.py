"""The folders the nodes read and write, all inside ComfyUI's own: caches, dataset folders, LoRAs and training
state. Names from a workflow are confined to them by real path (``streaming_cache.train.paths``)."""

from __future__ import annotations

import os

from ..streaming_cache.layout import INDEX_NAME
from ..streaming_cache.train.paths import resolve_inside
from .backend import compat

LEGACY_CACHE_FOLDER = "streaming_caches"


def cache_roots() -> list[str]:
    """Where caches live, in order: ComfyUI's ``datasets`` folders (newer ComfyUI; where its own training
    datasets are kept), then ``output/streaming_caches`` (older ComfyUI, and caches made by earlier versions of
    this pack, which keep working where they are)."""
    return compat.datasets_folders() + [os.path.join(compat.output_folder(), LEGACY_CACHE_FOLDER)]


def roots_text() -> str:
    return " or ".join(cache_roots())


def cache_path(name: str) -> str:
    """The cache called ``name``: an existing one in any cache folder, else a new one in the first."""
    roots = cache_roots()
    candidates = [resolve_inside(name, [root], what="cache name") for root in roots]
    for path in candidates:
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return path
    return candidates[0]


def existing_cache_path(name: str) -> str:
    """A cache to read: a name from :func:`list_caches`, or the absolute path of a cache directory anywhere
    (reading a cache never changes it, and a hostile one is refused with an error)."""
    if isinstance(name, str) and os.path.isabs(name.strip()):
        path = os.path.realpath(name.strip())
    else:
        path = cache_path(name)
    if not os.path.isfile(os.path.join(path, INDEX_NAME)):
        raise FileNotFoundError(f"no streaming cache {name!r} (looked for {os.path.join(path, INDEX_NAME)}); "
                                f"build one with Encode Dataset, pick one from the list (caches in "
                                f"{roots_text()}), or give the full path of a cache folder")
    return path


def dataset_roots() -> list[str]:
    """Folders a dataset folder may come from: ComfyUI's input and output folders."""
    return [compat.input_folder(), compat.output_folder()]


def dataset_path(name: str) -> str:
    path = resolve_inside(name, dataset_roots(), what="dataset folder")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"dataset folder {name!r} not found (looked for {path}); put the images in a "
                                f"folder under {compat.input_folder()} and give its name")
    return path


def list_caches() -> list[str]:
    """Names of the caches in every cache folder (a name found in two folders is listed once: the first)."""
    found: set[str] = set()
    for root in cache_roots():
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            if INDEX_NAME in filenames:
                found.add(os.path.relpath(dirpath, root).replace(os.sep, "/"))
                dirnames.clear()
            dirnames.sort()
    return sorted(found)


# The manifests of a cache made by Encode Dataset: the dataset, and one row with the empty caption's conditioning
# (for caption dropout while training).
MANIFEST = "default"
EMPTY_CAPTION = "empty_caption"


def loras_folder() -> str:
    return compat.loras_folder()


def state_folder() -> str:
    """Where TrainLoRA keeps the resume state of each LoRA: ``output/lora_training``."""
    return os.path.join(compat.output_folder(), "lora_training")


def output_folder() -> str:
    return compat.output_folder()


def temp_folder() -> str:
    """ComfyUI's temporary folder (emptied when ComfyUI starts): images a node shows but nobody keeps."""
    return compat.temp_folder()


NO_FOLDERS = "(no folders in input/)"


def dataset_folders() -> list[str]:
    """The folders under ComfyUI's input folder, for Encode Dataset's drop-down."""
    return compat.input_subfolders() or [NO_FOLDERS]
