"""The check that fails a multi-process test whose processes outlive it (tests/conftest.py) finds a process left
running, ignores one that ended, and kills what it found."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.orphans import LAUNCH_ENV, alive_with, launch_token, outliving, stop

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc (Linux)")


def test_a_process_left_running_is_found_and_killed_and_one_that_ended_is_not():
    token = launch_token("test_orphans")
    env = dict(os.environ, **{LAUNCH_ENV: token})
    ended = subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    assert ended.returncode == 0
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env=dict(os.environ, **{LAUNCH_ENV: launch_token("another test")}))
    try:
        found = outliving(token, grace_s=0.5)
        assert list(found) == [left.pid] and "time.sleep(120)" in found[left.pid]
        stop(found)
        assert left.wait(timeout=30) == -9
        deadline = time.monotonic() + 10
        while alive_with(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive_with(token) == []
    finally:
        for p in (left, other):
            p.kill()
            p.wait()
