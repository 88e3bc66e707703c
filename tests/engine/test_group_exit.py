"""A job's processes exit 0 when their work is done, even with collectives still in flight: the pack's way out
(:func:`streaming_cache.group.leave`) and, for any other way out, the exit handler joining registers. Without them
the same job aborts at exit in most runs (``group_exit.py bare``: a gloo worker thread frees a collective's tensor
while Python shuts down), so each launch here would fail if the group were not ended before that."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.installs import HELPERS, subprocess_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.oldest_torch]

SCRIPT = os.path.join(HELPERS, "group_exit.py")
LAUNCHES = 2


def _launch(mode: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, mode]
    return subprocess.run(cmd, env=subprocess_env(STREAMING_CACHE_COLLECTIVE_TIMEOUT="60", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("mode", ["leave", "exit"])
def test_a_finished_job_exits_0_on_every_rank_with_collectives_in_flight(mode):
    for _ in range(LAUNCHES):
        proc = _launch(mode)
        assert proc.stdout.count("done") == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
