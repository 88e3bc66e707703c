"""Where things are in a cache directory, and the file operations the writer, reader and cleaner share.

A cache is a directory holding ``index.scc`` (the commit point), ``shards/*.safetensors`` (immutable tensor
files) and ``.lock`` (the writer lock). Files an interrupted write leaves behind (temporary index or shard
files, shards no index lists) are *leftovers*; only a process holding the writer lock removes them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("streaming_cache")

INDEX_NAME = "index.scc"
SHARD_DIR = "shards"
LOCK_NAME = ".lock"
TMP_SUFFIX = ".tmp"
SHARD_SUFFIX = ".safetensors"


def index_path(cache: str) -> str:
    return os.path.join(cache, INDEX_NAME)


def shard_dir(cache: str) -> str:
    return os.path.join(cache, SHARD_DIR)


def shard_path(cache: str, name: str) -> str:
    return os.path.join(cache, SHARD_DIR, name)


def lock_path(cache: str) -> str:
    return os.path.join(cache, LOCK_NAME)


def is_cache_dir(path: str) -> bool:
    return os.path.isfile(index_path(path))


def is_shard_name(name: str) -> bool:
    """A shard name an index may use: one plain file name, not hidden (never a path)."""
    return bool(name) and os.path.basename(name) == name and not name.startswith(".") and "\\" not in name \
        and "\0" not in name and name not in (".", "..")


def fsync_dir(path: str) -> None:
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_leftovers(cache: str, shards: set[str]) -> list[str]:
    """Temporary files and shards no index lists: what an interrupted write leaves behind."""
    found = []
    for directory, keep in ((cache, None), (shard_dir(cache), shards)):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in names:
            if keep is None:
                leftover = name.startswith(INDEX_NAME + TMP_SUFFIX)
            else:
                leftover = name not in keep and (name.endswith(SHARD_SUFFIX) or TMP_SUFFIX in name)
            full = os.path.join(directory, name)
            if leftover and os.path.isfile(full):
                found.append(full)
    return found


def remove_leftovers(cache: str, shards: set[str]) -> int:
    """Delete what :func:`find_leftovers` finds. Call only while holding the writer lock."""
    removed = 0
    for full in find_leftovers(cache, shards):
        try:
            os.remove(full)
            removed += 1
        except OSError as exc:  # e.g. still mapped by a reader on Windows; retried next time
            log.debug("could not remove leftover %s: %s", full, exc)
    if removed:
        log.info("%s: removed %d file(s) left by an interrupted write", cache, removed)
    return removed
