"""The hang limit of the running test (armed by tests/conftest.py): a test still running after
:func:`limit` seconds (``$STREAMING_CACHE_TEST_HANG_S``; 0 never) is taken for hung, and faulthandler writes every
thread's stack to the terminal and ends the run with status 1. faulthandler's watchdog is a thread of its own that
needs no GIL, so it also ends a hang that holds the GIL (PyTorch 2.5's process-group destroy did, in CI, which then
ran on to its own limit with nothing to say where it stood).

A test that waits on a subprocess with a timeout of its own longer than the limit (a ComfyUI scenario, the install
command) calls :func:`allow` first, so the subprocess's own timeout, which stops what it started and says so, comes
first."""

from __future__ import annotations

import faulthandler
import os
import time

ENV = "STREAMING_CACHE_TEST_HANG_S"
DEFAULT_S = 1200.0
"""The slowest tests take a few minutes on a two-core machine, apart from the subprocesses that :func:`allow` more."""
MARGIN_S = 120.0
"""What :func:`allow` adds to a subprocess's timeout: time for the test to stop it and fail with its output."""

_report_fd: int | None = None
_deadline = 0.0


def limit() -> float:
    return float(os.environ.get(ENV, DEFAULT_S))


def open_report() -> None:
    """Keep a copy of the terminal's stderr to write the stacks to (while a test runs, pytest captures fd 2)."""
    global _report_fd
    _report_fd = os.dup(2)


def arm(seconds: float) -> None:
    global _deadline
    if _report_fd is None or seconds <= 0:
        return
    faulthandler.dump_traceback_later(seconds, exit=True, file=_report_fd)
    _deadline = time.monotonic() + seconds


def disarm() -> None:
    global _deadline
    faulthandler.cancel_dump_traceback_later()
    _deadline = 0.0


def allow(seconds: float) -> None:
    """Let the running test wait ``seconds`` (plus :data:`MARGIN_S`) from now where its limit would end sooner."""
    if limit() > 0 and _deadline and seconds + MARGIN_S > _deadline - time.monotonic():
        arm(seconds + MARGIN_S)
