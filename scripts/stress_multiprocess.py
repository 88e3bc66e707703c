"""Launch every torchrun job of the engine's and the trainer's tests many times, on each PyTorch given, and say
whether any run failed, waited out a collective timeout, or left a process behind. Run before submitting a change
to multi-process code; CI runs these tests too, but only two or three times, so a race that fails one run in
twenty passes there.

    python3 scripts/stress_multiprocess.py [--runs 20] [--python PY ...] [--busy N] [-- PYTEST ARGS]

``--python``: the interpreters to run the tests with (default: this one), e.g. CI's PyTorch 2.5.1 venv
(``~/.cache/streaming-cache-ci/torch-2.5.1/bin/python``) and the test venv (``.venv-test/bin/python``).
``--busy N``: N processes spinning on the CPU beside the tests, as on a loaded CI machine.

Each run is one pytest over the test files that launch torchrun (found as ``tests/test_multiprocess_marks.py``
finds launching files). pytest's own checks cover the exit status of every rank (torchrun fails when one does) and
the processes left behind (``tests/conftest.py`` fails a multi-process test whose processes outlive it). This
script adds the timing: a test that took a collective timeout longer than its median over the runs waited one out.
After each run it also looks for any process the run started that is still alive. Exits 1 when any run failed in any
of these ways.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from helpers.orphans import outliving, stop  # noqa: E402  (tests/, put on the path above)

FOLDERS = ("tests/engine", "tests/train")
LAUNCHER = "torch.distributed.run"
STRESS_ENV = "STREAMING_CACHE_STRESS_RUN"
"""Set in the environment of every process a run starts, so that what a run leaves behind is told from the
processes of anything else running on the machine."""
COLLECTIVE_TIMEOUT_S = 60.0
"""The collective timeout the tests give their jobs (``STREAMING_CACHE_COLLECTIVE_TIMEOUT``)."""


def torchrun_test_files() -> list[str]:
    """The test files of :data:`FOLDERS` that launch torchrun."""
    found = []
    for folder in FOLDERS:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = os.path.join(folder, name)
            if name.startswith("test_") and name.endswith(".py"):
                with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                    if LAUNCHER in f.read():
                        found.append(path)
    return found


def durations(junit: str) -> dict[str, float]:
    """Seconds per test (setup, call and teardown together) from pytest's JUnit XML report."""
    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        out[name] = out.get(name, 0.0) + float(case.get("time") or 0.0)
    return out


def failures(junit: str) -> list[str]:
    root = ET.parse(junit).getroot()
    return [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None]


def run_once(python: str, files: list[str], extra: list[str], junit: str, token: str) -> tuple[int, float]:
    started = time.monotonic()
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           *extra, *files], cwd=ROOT, env=dict(os.environ, **{STRESS_ENV: token}), check=False)
    return proc.returncode, time.monotonic() - started


def stress(python: str, runs: int, files: list[str], extra: list[str], work: str) -> list[str]:
    """Run the files ``runs`` times with ``python``; the problems found, one line each."""
    problems: list[str] = []
    times: dict[str, list[float]] = {}
    for i in range(1, runs + 1):
        junit = os.path.join(work, f"run-{i}.xml")
        token = f"{os.getpid()}-{i}-{python}"
        code, seconds = run_once(python, files, extra, junit, token)
        print(f"[stress] {python}: run {i}/{runs} exit {code} in {seconds:.0f} s", flush=True)
        if code != 0:
            failed = failures(junit) if os.path.exists(junit) else []
            problems.append(f"run {i}: pytest exited {code}: {', '.join(failed) or 'see its output above'}")
        if os.path.exists(junit):
            for name, t in durations(junit).items():
                times.setdefault(name, []).append(t)
        left = outliving(token, grace_s=5.0, variable=STRESS_ENV)
        if left:
            stop(left)
            problems.append(f"run {i}: processes left after pytest ended (killed): {list(left.values())[:4]}")
    for name, ts in sorted(times.items()):
        median = statistics.median(ts)
        slow = [round(t) for t in ts if t - median >= 0.9 * COLLECTIVE_TIMEOUT_S]
        print(f"[stress]   {name}: median {median:.1f} s, max {max(ts):.1f} s", flush=True)
        if slow:
            problems.append(f"{name}: runs of {slow} s against a median of {median:.0f} s (a collective timeout "
                            "waited out?)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--python", action="append", help="interpreter to run the tests with (repeatable)")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU beside the tests")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    files = torchrun_test_files()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    problems: dict[str, list[str]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="stress-") as work:
            for python in args.python or [sys.executable]:
                problems[python] = stress(python, args.runs, files, args.pytest_args, work)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for python, found in problems.items():
        print(f"[stress] {python}: {args.runs} runs of {len(files)} files: "
              + ("no problem" if not found else f"{len(found)} problem(s)"), flush=True)
        for line in found:
            print(f"[stress]   {line}", flush=True)
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
