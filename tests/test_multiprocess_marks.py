"""Tests whose processes work together (ranks launched by torchrun, several processes on one cache) are marked
``multiprocess``, which ``.ci/run`` runs a second time: a race that fails one run in several is caught there."""

from __future__ import annotations

import os

from helpers.installs import ROOT

LAUNCHES = ("torch.distributed.run", "--nproc-per-node", "subprocess.Popen(")
FOLDERS = ("tests/engine", "tests/train", "tests/reliability")


def test_every_test_file_that_launches_processes_together_marks_them():
    launching, unmarked = [], []
    for folder in FOLDERS:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            with open(os.path.join(ROOT, folder, name), encoding="utf-8") as f:
                text = f.read()
            if any(launch in text for launch in LAUNCHES):
                launching.append(name)
                if "pytest.mark.multiprocess" not in text:
                    unmarked.append(f"{folder}/{name}")
    assert len(launching) >= 5, launching
    assert not unmarked, f"mark the tests that launch processes with @pytest.mark.multiprocess: {unmarked}"


def test_ci_runs_the_marked_tests_a_second_time_after_the_readmes_test_command():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line and not line.startswith("#")]
    readme_command = next(i for i, line in enumerate(lines) if line == "python3 scripts/test.py")
    assert any("-m multiprocess" in line and " ".join(FOLDERS) in line for line in lines[readme_command + 1:]), lines
