"""Getting the encoders' inputs ready ahead of them: reading and decoding images and clips on threads while the
VAE and the text encoders work on the batch before.

An :class:`~.builder.Encoder` with a ``prepare`` step (a file's bytes to the encoder's input: decoded, resized,
cropped) has it run by :class:`Lookahead` for the next batches while the current one encodes, on daemon threads,
each part on its own: a file that cannot be decoded fails its own item, and a decode that never returns (a
corrupt clip can hang a video decoder) fails its item after ``timeout`` seconds (``$STREAMING_CACHE_DECODE_TIMEOUT``,
default 600) without holding up the build or the process's exit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import environment

DEFAULT_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
TIMEOUT_ENV = "STREAMING_CACHE_DECODE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
MAX_THREADS = 32  # threads stuck in decoders are replaced up to this many in all


class _Threads:
    """A few daemon threads running submitted calls (unlike ``ThreadPoolExecutor``'s, a thread stuck in a call
    never keeps the process from exiting)."""

    def __init__(self, count: int):
        self.jobs: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        for _ in range(count):
            self.add_thread()

    def add_thread(self) -> bool:
        """One more thread (to stand in for one stuck in a call); False once :data:`MAX_THREADS` run."""
        if len(self.threads) >= MAX_THREADS:
            return False
        t = threading.Thread(target=self._run, name=f"streaming-cache-decode-{len(self.threads)}", daemon=True)
        t.start()
        self.threads.append(t)
        return True

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((future, fn))
        return future

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits for it
                future.set_exception(exc)

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)


class Lookahead:
    """The prepared inputs of ``batches`` (``(column, [(key, part), ...])`` in encoding order), ``ahead`` batches
    in advance: :meth:`take` gives batch ``k``'s ``(key, part, prepared value or the exception)`` triples.
    Columns whose encoder has no prepare step get their parts as they are."""

    def __init__(self, batches: Sequence[tuple[str, list[tuple[str, Any]]]],
                 prepares: dict[str, Callable[[Any], Any] | None], *, threads: int = DEFAULT_THREADS,
                 ahead: int = 2, timeout: float | None = None):
        self.batches, self.prepares, self.ahead = batches, prepares, ahead
        self.timeout = environment.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S) if timeout is None else timeout
        self.pending: dict[int, list[concurrent.futures.Future | None]] = {}
        self.next = 0
        self.pool = _Threads(threads) if any(prepares.values()) else None

    def _submit_until(self, k: int) -> None:
        while self.next < min(k + 1, len(self.batches)):
            column, batch = self.batches[self.next]
            prepare = self.prepares.get(column)
            pool = self.pool
            self.pending[self.next] = [None if prepare is None or pool is None else
                                       pool.submit(functools.partial(prepare, part)) for _, part in batch]
            self.next += 1

    def take(self, k: int) -> list[tuple[str, Any, Any]]:
        """Batch ``k`` prepared (the batches after it start preparing); a part whose preparation raised or took
        longer than the timeout comes with the exception in place of its value."""
        self._submit_until(k + self.ahead)
        futures = self.pending.pop(k)
        out = []
        for (key, part), future in zip(self.batches[k][1], futures):
            if future is None:
                out.append((key, part, part))
                continue
            try:
                out.append((key, part, future.result(timeout=self.timeout)))
            except concurrent.futures.TimeoutError:
                out.append((key, part, TimeoutError(f"reading and decoding it took longer than {self.timeout:g} s; "
                                                    "the file may be damaged")))
                if self.pool is not None:
                    self.pool.add_thread()  # the thread stuck on it is lost: the other parts get another
            except Exception as exc:
                out.append((key, part, exc))
        return out

    def close(self) -> None:
        for futures in self.pending.values():
            for f in futures:
                if f is not None:
                    f.cancel()
        if self.pool is not None:
            self.pool.close()
