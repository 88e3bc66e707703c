"""Reader leases: a cache keeps the shards an open reader may still read, whatever writers do meanwhile.

A reader reads one committed generation to the end. Writers add, remove and compact: compaction rewrites shards
and deletes the old files, which an open reader of an older generation may still need. As SQLite's WAL readers
and LMDB's reader table keep old pages alive, every open reader holds a *lease*: a file
``leases/g<generation>-<pid>-<random>.lease`` on which it keeps an OS advisory lock (``flock`` on POSIX,
``msvcrt.locking`` on Windows) for as long as it is open. Locks belong to the open file, so a lease is seen as held
from another thread of the same process as from another process, and the kernel releases it when its holder dies:
a crashed reader never blocks deletion forever.

A lease file lists the shards of its generation, one name a line. A writer deletes a shard file that no index
lists (after compaction, or a leftover) only when no live lease lists it (:func:`needed_shards`); the files a lease
keeps are removed by a later writer (the next compaction, ``clean``) once it is gone. So a reader that stays open
for days keeps only its own generation's files, however often the cache is compacted meanwhile. A lease whose lock
can be taken is dead and is removed by the writer. A reader verifies, after taking its lease, that the index still
has its generation, so a compaction that committed in between is noticed and the reader opens the new generation
instead.

Where no lease can be made (a read-only cache, a file system without locks) the reader works without one; a shard
deleted under it then reads as a :class:`~.errors.StaleCacheError` that says to open the cache again.

The folder and its files are inside the cache and read as strictly as the rest: names are parsed, not trusted;
links, folders and FIFOs in the way are left alone; at most :data:`MAX_LEASES` entries of at most
:data:`MAX_LEASE_BYTES` each are read (beyond that every file counts as needed: nothing is deleted, and nothing
this module does grows without bound).
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
MAX_LEASE_BYTES = 1 << 20
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


def take(cache: str, generation: int, shards: list[str]) -> Lease | None:
    """A lease on ``generation``, whose index lists ``shards``, or None where the cache cannot hold one (read-only,
    no locks): the reader then works without."""
    listing = "".join(f"{name}\n" for name in shards).encode("utf-8", "surrogatepass")
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
        try:
            f.write(listing)
            f.flush()
        except OSError:
            f.close()
            layout.remove_file(path)
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


def needed_shards(cache: str, *, remove_dead: bool = False) -> set[str] | None:
    """The shard names live leases of the cache list (an empty set: no live lease), or None when they cannot all be
    read (more than :data:`MAX_LEASES` entries, a lease over :data:`MAX_LEASE_BYTES`): then every file counts as
    needed. With ``remove_dead`` (a writer holding the writer lock) the files of dead leases, and anything else in
    the folder that is no lease, are removed."""
    folder = lease_dir(cache)
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return set()  # a file or link where the folder belongs: readers take no lease there
        names = []
        with os.scandir(folder) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > MAX_LEASES:
                    return None
    except FileNotFoundError:
        return set()
    needed: set[str] = set()
    for name in names:
        path = os.path.join(folder, name)
        if _NAME.fullmatch(name) is None:
            if remove_dead:
                layout.remove_file(path)
            continue
        try:
            fd = layout.open_file(path, "reader lease")
        except (OSError, CacheError):  # gone meanwhile, or not a regular file (left alone)
            continue
        try:
            if _lock(fd):  # dead: its holder is gone
                if remove_dead:
                    layout.remove_file(path)
                continue
            with os.fdopen(os.dup(fd), "rb") as f:
                listing = f.read(MAX_LEASE_BYTES + 1)
        finally:
            os.close(fd)  # also drops a lock just taken
        if len(listing) > MAX_LEASE_BYTES:
            return None
        needed.update(n for n in listing.decode("utf-8", "replace").splitlines() if layout.is_shard_name(n))
    return needed
