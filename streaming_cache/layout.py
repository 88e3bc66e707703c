"""Where things are in a cache directory, and the only code that opens, creates or removes its files.

A cache is a directory holding ``index.scc`` (the commit point), ``shards/*.safetensors`` (immutable tensor
files) and ``.lock`` (the writer lock); while several processes build it together, ``parts/<name>/`` holds each
process's share as a cache of its own until it is merged (readers never look there). Files an interrupted write
leaves behind (temporary index or shard files, shards no index lists) are *leftovers*; only a process holding the
writer lock removes them.

Every byte and path of a cache may come from someone else, so everything here refuses to act through a
symbolic link (``shards/`` must be a real folder; files are opened with ``O_NOFOLLOW``), opens only regular
files (a FIFO, device or socket in their place is refused without blocking on it), creates files exclusively
(never truncating what is there), and removes only regular files inside the cache. Nothing outside the cache
directory is ever created, truncated, written or removed.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import BinaryIO

from .errors import CacheError, CacheFormatError

log = logging.getLogger("streaming_cache")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
MAX_NAME_BYTES = 255

_commits: dict[str, int] = {}  # cache path -> commits made by writers of this process


def note_commit(path: str) -> None:
    """A writer of this process committed to the cache at ``path`` (absolute): readers of it look again."""
    _commits[path] = _commits.get(path, 0) + 1


def commits(path: str) -> int:
    """How many commits writers of this process have made to the cache at ``path`` (absolute)."""
    return _commits.get(path, 0)


INDEX_NAME = "index.scc"
SHARD_DIR = "shards"
PARTS_DIR = "parts"
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


def parts_dir(cache: str) -> str:
    return os.path.join(cache, PARTS_DIR)


def part_path(cache: str, name: str) -> str:
    if not is_shard_name(name):  # one plain, visible file name
        raise CacheError(f"{name!r} is not a valid part name")
    return os.path.join(cache, PARTS_DIR, name)


def list_parts(cache: str) -> list[str]:
    """The parts folders of a cache (real folders only; anything else under ``parts/`` is ignored)."""
    check_dir(parts_dir(cache), "parts folder")
    try:
        names = sorted(os.listdir(parts_dir(cache)))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        full = os.path.join(parts_dir(cache), name)
        if is_shard_name(name) and stat.S_ISDIR(os.lstat(full).st_mode):
            out.append(full)
    return out


def is_cache_dir(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(index_path(path)).st_mode)
    except OSError:
        return False


def is_shard_name(name: str) -> bool:
    """A shard name an index may use: one plain file name, not hidden (never a path), not too long."""
    return bool(name) and os.path.basename(name) == name and not name.startswith(".") and "\\" not in name \
        and "/" not in name and "\0" not in name and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES


def describe(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def check_dir(path: str, what: str) -> None:
    """Refuse a ``path`` that is not a real directory (a symbolic link to one included)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise CacheFormatError(f"{path}: the {what} is {describe(mode)}, not a folder inside the cache; the cache "
                               "is damaged or was tampered with. Move it aside and rebuild it")


def open_file(path: str, what: str, *, write: bool = False, create: bool = False) -> int:
    """A file descriptor of the regular file ``path``: never through a symbolic link, never blocking on a FIFO
    or device in its place (both refused with a clear error). ``create`` creates it if missing (never truncates).
    Other OS errors (missing file, permissions) propagate as OSError."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        if not create:
            raise
    else:
        if not stat.S_ISREG(mode):
            raise CacheFormatError(f"{path}: the {what} is {describe(mode)}, not a regular file; nothing was "
                                   "opened. The cache is damaged or was tampered with: move it aside and rebuild it")
    flags = (os.O_RDWR if write else os.O_RDONLY) | _NOFOLLOW | _NONBLOCK | _CLOEXEC | _BINARY
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise CacheFormatError(f"{path}: the {what} is not a regular file ({exc.strerror}); nothing was "
                                   "opened. Move the cache aside and rebuild it") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped in after the lstat above
        os.close(fd)
        raise CacheFormatError(f"{path}: the {what} is {describe(st.st_mode)}, not a regular file")
    if _NONBLOCK and hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return fd


def open_reader(path: str, what: str) -> BinaryIO:
    """:func:`open_file` for reading, as a binary file object."""
    return os.fdopen(open_file(path, what), "rb")


def create_file(path: str) -> BinaryIO:
    """A new file to write (a temporary shard or index): created exclusively, never through a symbolic link, so
    nothing that was at ``path`` (a planted link included) is ever followed or truncated."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY, 0o644)
    return os.fdopen(fd, "wb")


def remove_file(path: str) -> bool:
    """Remove ``path`` if it is a regular file (a symbolic link or anything else is left alone: removing a link
    would be harmless, but it was not made by this program). Returns whether it was removed."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            log.warning("%s: not a regular file; left alone", path)
            return False
        os.remove(path)  # removes a name; never follows a link
        return True
    except FileNotFoundError:
        return False


def writable_error(cache: str, exc: OSError) -> CacheError:
    """What to tell a user whose cache cannot be written (read-only folder or disk, permissions, disk full)."""
    if exc.errno == errno.ENOSPC:
        reason = "the disk is full"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        reason = f"the folder is read-only or not yours ({exc.strerror})"
    else:
        reason = exc.strerror or str(exc)
    return CacheError(f"{cache}: cannot write to this cache: {reason}. It can still be read; to change it, make "
                      "the folder writable or copy the cache somewhere writable")


def fsync_dir(path: str) -> None:
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_leftovers(cache: str, shards: set[str]) -> list[str]:
    """Temporary files and shards no index lists, as regular files inside the cache: what an interrupted write
    leaves behind."""
    check_dir(shard_dir(cache), "shards folder")
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
            if leftover:
                try:
                    regular = stat.S_ISREG(os.lstat(full).st_mode)
                except OSError:
                    continue
                if regular:
                    found.append(full)
    return found


def remove_leftovers(cache: str, shards: set[str], *, keep: set[str] | None = None) -> int:
    """Delete what :func:`find_leftovers` finds, except complete shard files named in ``keep`` (readers of older
    generations still read them); ``keep`` None keeps every complete shard file (temporary files go). Only the
    writer does this, holding the writer lock."""
    removed = 0
    for full in find_leftovers(cache, shards):
        name = os.path.basename(full)
        if name.endswith(SHARD_SUFFIX) and os.path.dirname(full) == shard_dir(cache) and \
                (keep is None or name in keep):
            continue
        try:
            removed += remove_file(full)
        except OSError as exc:  # e.g. still mapped by a reader on Windows; retried next time
            log.debug("could not remove leftover %s: %s", full, exc)
    if removed:
        log.info("%s: removed %d file(s) left by an interrupted write", cache, removed)
    return removed


def adopt_file(src: str, dst: str, what: str) -> int:
    """Give the regular file ``src`` a second name ``dst`` in another folder of the same cache: a hard link where
    the filesystem allows one, otherwise a copy (written under a temporary name, fsynced, renamed). Never through
    a symbolic link, never over an existing file. Returns the file's size."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        raise CacheFormatError(f"{src}: the {what} is {describe(st.st_mode)}, not a regular file; nothing was "
                               "taken from it")
    try:
        os.link(src, dst, follow_symlinks=False)
        return st.st_size
    except FileExistsError:
        there = os.lstat(dst)
        if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):  # linked by an earlier, interrupted merge
            return st.st_size
        raise CacheFormatError(f"{dst}: a different file of that name exists; the cache is damaged") from None
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EACCES):
            raise
    tmp = dst + TMP_SUFFIX
    size = 0
    with open_reader(src, what) as f, create_file(tmp) as out:
        while chunk := f.read(1 << 24):
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dst)
    return size


def remove_part(part: str) -> bool:
    """Remove a merged part folder: its regular files, then its folders (nothing else is touched; a part holding
    anything unexpected is left with a warning). Only the writer of the cache does this. Returns whether the
    folder is gone."""
    for sub in (os.path.join(part, SHARD_DIR), part):
        try:
            names = os.listdir(sub)
        except FileNotFoundError:
            continue
        for name in names:
            full = os.path.join(sub, name)
            if sub == part and name == SHARD_DIR:
                continue
            remove_file(full)
        try:
            os.rmdir(sub)
        except OSError as exc:
            log.warning("%s: could not remove a merged part's folder (%s); it is merged and may be deleted",
                        sub, exc.strerror or exc)
            return False
    return True
