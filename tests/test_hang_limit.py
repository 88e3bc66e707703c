"""A hung test ends the run with every thread's stack (tests/conftest.py's hang limit), even one that holds the
GIL, instead of running on until CI's own limit with nothing to say where it stood; a test that says it waits
longer (``hang_limit.allow``: a subprocess with a timeout of its own) is not ended at the limit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the hung test calls libc's sleep through ctypes")


def test_a_test_that_hangs_holding_the_gil_ends_the_run_with_its_stack():
    env = dict(os.environ, STREAMING_CACHE_TEST_HANG_S="2")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/helpers/hung.py",
                          "-k", "holding_the_gil"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)  # it would sleep 120 s
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "Timeout (0:00:02)!" in out and "in test_hangs_holding_the_gil" in out, out


def test_a_test_that_allows_itself_longer_is_not_ended_at_the_limit():
    env = dict(os.environ, STREAMING_CACHE_TEST_HANG_S="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/helpers/hung.py",
                          "-k", "waits_longer"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
