"""An exclusive, non-blocking writer lock on a cache directory.

The lock is an OS advisory lock on ``<cache>/.lock`` (``flock`` on POSIX, ``msvcrt.locking`` on Windows), so it
is released by the kernel when the holder dies: a killed build never leaves a stale lock behind. Readers never
take it. The file also records the holder's pid and start time, only to make the error message useful.
"""

from __future__ import annotations

import os
import time

from .errors import CacheLockedError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt


class WriterLock:
    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
        return True

    def acquire(self, cache_path: str, wait: float = 2.0) -> None:
        """Take the lock, waiting up to ``wait`` seconds (a reader may hold it for a moment to clean up)."""
        deadline = time.monotonic() + wait
        while not self.try_acquire():
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            try:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    holder = f.read().strip() or "unknown process"
            except OSError:
                holder = "unknown process"
            raise CacheLockedError(
                f"{cache_path}: another process is writing to this cache ({holder}). Wait for it to finish or "
                "stop it; reading the cache meanwhile is safe"
            )
        return

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        finally:
            os.close(fd)
