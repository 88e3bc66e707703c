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


SCENARIO = """import subprocess, sys, time
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(sys.argv[2], "w") as f:
    f.write(str(server.pid))
time.sleep(300)
"""


def test_a_scenario_past_its_timeout_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    """A scenario that hangs (here: one that started a server and sleeps) fails its test at the timeout, and the
    server it started is stopped with it instead of outliving the test."""
    from helpers import installs

    (tmp_path / "hangs.py").write_text(SCENARIO)
    monkeypatch.setattr(installs, "HELPERS", str(tmp_path))
    pid_file = tmp_path / "server.pid"
    with pytest.raises(installs.ScenarioFailed, match="did not finish within 20 s"):
        installs.run_scenario(installs.ComfyInstall(str(tmp_path), sys.executable), "hangs.py", str(pid_file),
                              timeout=20)
    assert pid_file.exists(), "the scenario did not start its server within the 20 s it had"
    server = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{server}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    break
        except OSError:
            break
        time.sleep(0.1)
    else:
        os.kill(server, 9)
        pytest.fail("the server the scenario started outlived it")
