"""An exclusive, non-blocking writer lock on a cache directory.

The lock is an OS advisory lock on ``<cache>/.lock`` (``flock`` on POSIX, ``msvcrt.locking`` on Windows), so it
is released by the kernel when the holder dies: a killed build never leaves a stale lock behind. Readers never
take it. The file also records the holder's pid and start time, only to make the error message useful. The lock
file is opened like every file of a cache (``layout.open_file``): a link, folder or FIFO in its place is refused.
A lock whose holder forgot to release it is released when the holder is garbage-collected.
"""

from __future__ import annotations

import os
import time
import weakref

from . import layout
from .errors import CacheLockedError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt


def _unlock(fd: int) -> None:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)


class WriterLock:
    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._finalizer: weakref.finalize | None = None

    def try_acquire(self) -> bool:
        """Take the lock if free. OSError (read-only folder, permissions) and CacheFormatError (no regular file
        at the lock's path) propagate."""
        fd = layout.open_file(self.path, "writer lock", write=True, create=True)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"pid={os.getpid()} since={time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        self._finalizer = weakref.finalize(self, _unlock, fd)
        return True

    def acquire(self, cache_path: str, wait: float = 2.0) -> None:
        """Take the lock, waiting up to ``wait`` seconds for another writer to finish its commit."""
        deadline = time.monotonic() + wait
        while not self.try_acquire():
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = self.holder()
            if holder.startswith(f"pid={os.getpid()} "):
                raise CacheLockedError(f"{cache_path}: this process already has a writer open on this cache; close "
                                       "it (or leave its with-block) before opening another")
            raise CacheLockedError(
                f"{cache_path}: another process is writing to this cache ({holder}). Wait for it to finish or "
                "stop it; reading the cache meanwhile is safe")

    def holder(self) -> str:
        try:
            with layout.open_reader(self.path, "writer lock") as f:
                return f.read(200).decode("utf-8", "replace").strip() or "unknown process"
        except Exception:
            return "unknown process"

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlocks and closes once, also if the holder is collected without calling this
            self._finalizer = None
        self._fd = None
