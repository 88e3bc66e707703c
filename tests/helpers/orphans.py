"""The processes a test started and left running, found by a variable in the environment they inherit (Linux's
``/proc``; elsewhere none are found)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

LAUNCH_ENV = "STREAMING_CACHE_TEST_LAUNCH"
GRACE_S = 10.0
"""How long a process may take to end after its test: a rank that is still alive after this hangs."""


def launch_token(test_id: str) -> str:
    """A value of :data:`LAUNCH_ENV` that only the processes started during this test (in this pytest process)
    carry."""
    return f"{os.getpid()}-{hashlib.sha1(test_id.encode()).hexdigest()[:16]}"


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:  # ended meanwhile, or not ours to read
        return False
    return marker in environ and state not in (b"Z", b"X")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def alive_with(token: str, variable: str = LAUNCH_ENV) -> list[int]:
    """The live processes (not zombies) whose environment holds ``variable=token``, this one excepted."""
    if not os.path.isdir("/proc"):
        return []
    marker = f"{variable}={token}".encode()
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me and _carries(int(p), marker)]


def outliving(token: str, grace_s: float = GRACE_S, variable: str = LAUNCH_ENV) -> dict[int, str]:
    """The processes started under ``token`` still alive after ``grace_s`` seconds, with their command lines."""
    deadline = time.monotonic() + grace_s
    while True:
        left = alive_with(token, variable)
        if not left or time.monotonic() > deadline:
            return {pid: _command(pid) for pid in left}
        time.sleep(0.2)


def stop(pids: dict[int, str]) -> None:
    """Kill these processes (SIGKILL: a hung rank ignores SIGTERM)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
