"""Reader leases: a cache keeps the shards an open reader may still read, whatever writers do meanwhile.

A reader reads one committed generation to the end. Writers add, remove and compact: compaction rewrites shards
and deletes the old files, which an open reader of an older generation may still need. As SQLite's WAL readers
and LMDB's reader table keep old pages alive, every open reader holds a *lease*: a file
``leases/g<generation>-<pid>-<random>.lease`` on which it keeps an OS advisory lock (``flock`` on POSIX,
``msvcrt.locking`` on Windows) for as long as it is open. Locks belong to the open file, so a lease is seen as held
from another thread of the same process as from another process, and the kernel releases it when its holder dies:
a crashed reader never blocks deletion forever.

A writer deletes a shard file that no index lists (after compaction, or a leftover) only while no live lease
names an older generation than the one it committed (:func:`oldest_live`); otherwise the file stays until a later
writer (the next compaction, ``clean``) finds no such lease. A lease whose lock can be taken is dead and is removed
by the writer. A reader verifies, after taking its lease, that the index still has its generation, so a compaction
that committed in between is noticed and the reader opens the new generation instead.

Where no lease can be made (a read-only cache, a file system without locks) the reader works without one; a shard
deleted under it then reads as a :class:`~.errors.StaleCacheError` that says to open the cache again.

The folder and its files are inside the cache and read as strictly as the rest: names are parsed, not trusted;
links, folders and FIFOs in the way are left alone; at most :data:`MAX_LEASES` entries are looked at (beyond that
every generation counts as leased: nothing is deleted, nothing grows without bound from this side).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import weakref

from . import layout
from .errors import CacheError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt

LEASE_DIR = "leases"
MAX_LEASES = 4096
_NAME = re.compile(r"g([0-9]{1,19})-[0-9]{1,10}-[0-9a-f]{16}\.lease")


def lease_dir(cache: str) -> str:
    return os.path.join(cache, LEASE_DIR)


def _lock(fd: int) -> bool:
    """Take the advisory lock on ``fd`` without waiting; False if another open file holds it."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK):
            return False
        raise


def _release(fd: int, path: str, pid: int) -> None:
    try:
        if os.getpid() == pid:  # a forked child shares the lock with its parent: only the owner ends the lease
            layout.remove_file(path)  # first: a writer that finds the name finds it locked, or not at all
    except OSError:
        pass  # Windows keeps an open file's name: the next writer removes the dead lease
    finally:
        os.close(fd)


class Lease:
    """A reader's lease on ``generation`` of the cache at ``cache``; :meth:`release` (or garbage collection of the
    lease) gives it up. :func:`take` makes one."""

    def __init__(self, path: str, fd: int, generation: int):
        self.path, self.generation = path, generation
        self._finalizer = weakref.finalize(self, _release, fd, path, os.getpid())

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()


def take(cache: str, generation: int) -> Lease | None:
    """A lease on ``generation``, or None where the cache cannot hold one (read-only, no locks): the reader then
    works without."""
    folder = lease_dir(cache)
    for _ in range(3):
        try:
            layout.check_dir(folder, "leases folder")
            os.makedirs(folder, exist_ok=True)
            layout.check_dir(folder, "leases folder")  # not a link someone put there in between
            path = os.path.join(folder, f"g{int(generation)}-{os.getpid()}-{os.urandom(8).hex()}.lease")
            f = layout.create_file(path)
        except (OSError, CacheError):
            return None
        fd = os.dup(f.fileno())
        f.close()
        try:
            locked = _lock(fd)  # a fresh, unique file: only a hostile process could hold its lock
            # A writer that looked between the file's creation and its lock found it unlocked, took it for a dead
            # lease and removed it: then the lease is made again.
            st, there = os.fstat(fd), os.lstat(path)
            if locked and (st.st_dev, st.st_ino) == (there.st_dev, there.st_ino):
                return Lease(path, fd, generation)
        except OSError:
            pass
        os.close(fd)
        layout.remove_file(path)
    return None


def oldest_live(cache: str, *, remove_dead: bool = False) -> int | None:
    """The oldest generation a live lease of the cache names (None: no live lease). With ``remove_dead`` (a writer
    holding the writer lock) the files of dead leases, and anything else that is no lease, are removed. More
    than :data:`MAX_LEASES` entries in the folder count as a lease on generation 0 (everything kept)."""
    folder = lease_dir(cache)
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None  # a file or link where the folder belongs: readers take no lease there, the writer warns
        names = []
        with os.scandir(folder) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > MAX_LEASES:
                    return 0
    except FileNotFoundError:
        return None
    oldest: int | None = None
    for name in names:
        path = os.path.join(folder, name)
        match = _NAME.fullmatch(name)
        if match is None:
            if remove_dead:
                layout.remove_file(path)
            continue
        try:
            fd = layout.open_file(path, "reader lease")
        except (OSError, CacheError):  # gone meanwhile, or not a regular file (left alone)
            continue
        try:
            dead = _lock(fd)
        finally:
            os.close(fd)  # also drops the lock just taken
        if dead:
            if remove_dead:
                layout.remove_file(path)
            continue
        generation = int(match.group(1))
        oldest = generation if oldest is None else min(oldest, generation)
    return oldest
