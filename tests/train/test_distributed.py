"""Data-parallel training on torch.distributed (gloo on CPU), launched by torch's own launcher (torchrun), with the
toy backend: N processes with batch size B train what one process trains with batch size N x B; a killed rank
or a Cancel on rank 0 stops every rank at one step and the next launch resumes exactly, with the same number of
processes or another; a rank that fails ends the job with its error, never a hang."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from helpers.installs import HELPERS, subprocess_env
from helpers.toy_backend import pairs_cache

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(HELPERS, "ddp_toy.py")
TIMEOUT_S = 60  # the collective timeout the jobs run with: a hang would end there, not at the test's timeout


def toy(work, processes: int, *args: str, name: str, state: str | None = None
        ) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run the toy training on ``processes`` processes (torchrun for more than one) with checkpoint file
    ``state`` (default: the run's own ``name``); its output, and the final result rank 0 wrote (None if none)."""
    out = str(work / f"{name}.json")
    cmd = [sys.executable, SCRIPT] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), SCRIPT]
    cmd += [str(work / "cache"), str(work / f"{state or name}.pt"), out, *args]
    env = subprocess_env(STREAMING_CACHE_COLLECTIVE_TIMEOUT=str(TIMEOUT_S), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S * 4)
    with contextlib.suppress(FileNotFoundError), open(out) as f:
        return proc, json.load(f)
    return proc, None


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    path = tmp_path_factory.mktemp("ddp")
    pairs_cache(str(path / "cache"), rows=22)  # 22 rows: global batches of 4 end with a short one of 2
    return path


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert abs(a["w"] - b["w"]) <= tol and abs(a["b"] - b["b"]) <= tol, (a, b)
    assert len(a["losses"]) == len(b["losses"])
    assert all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a["losses"], b["losses"])), (a, b)


@pytest.fixture(scope="module")
def one_process(work):
    """The reference: one process, batch size 4, two micro-steps per step."""
    proc, result = toy(work, 1, "--batch", "4", "--accumulation", "2", "--steps", "8", name="one")
    _ok(proc)
    return result


@pytest.mark.oldest_torch  # how a job starts, fails and ends differs by release
def test_two_processes_with_batch_b_train_what_one_process_trains_with_batch_2b(work, one_process):
    proc, result = toy(work, 2, "--batch", "2", "--accumulation", "2", "--steps", "8", name="two")
    _ok(proc)
    assert result["step"] == one_process["step"] == 8
    _close(result, one_process)
    assert one_process["losses"][-1] < one_process["losses"][0]
    ranks = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert ranks[0]["w"] == ranks[1]["w"] and ranks[0]["b"] == ranks[1]["b"], "every rank ends with the same weights"


def test_a_mix_on_two_processes_trains_what_one_process_trains_with_each_dataset_losses(work):
    args = ("--accumulation", "2", "--steps", "6", "--mix")
    proc, one = toy(work, 1, "--batch", "4", *args, name="mix_one")
    _ok(proc)
    proc, two = toy(work, 2, "--batch", "2", *args, name="mix_two")
    _ok(proc)
    _close(two, one)
    assert set(one["datasets"]) == {"first", "rest"} and one["datasets"]["rest"]
    for name, series in one["datasets"].items():
        assert [s for s, _ in series] == [s for s, _ in two["datasets"][name]]
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(series, two["datasets"][name])), name


@pytest.mark.oldest_torch  # how a job starts, fails and ends differs by release
def test_a_killed_rank_ends_the_job_and_the_next_launch_resumes_exactly(work):
    common = ("--batch", "2", "--steps", "10", "--save-every", "2")
    proc, whole = toy(work, 2, *common, name="whole")
    _ok(proc)
    proc, _ = toy(work, 2, *common, "--kill-rank", "1", "--kill-at", "5", name="killed")
    assert proc.returncode != 0, "the job ends when a rank is killed"
    proc, resumed = toy(work, 2, *common, "--resume", name="resumed", state="killed")
    _ok(proc)
    assert resumed["step"] == 10
    assert (resumed["w"], resumed["b"], resumed["losses"]) == (whole["w"], whole["b"], whole["losses"]), \
        "resumed after the kill: bit for bit the uninterrupted run"


@pytest.mark.oldest_torch  # how a job starts, fails and ends differs by release
def test_cancel_on_rank_0_stops_every_rank_at_one_step_and_one_process_resumes_the_run(work, one_process):
    proc, stopped = toy(work, 2, "--batch", "2", "--accumulation", "2", "--steps", "8", "--stop-at", "3",
                        name="cancelled")
    _ok(proc)
    ranks = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [(r["step"], r["stopped"]) for r in ranks] == [(3, True), (3, True)], "both ranks stop after step 3"
    proc, resumed = toy(work, 1, "--batch", "4", "--accumulation", "2", "--steps", "8", "--resume",
                        name="one_after_two", state="cancelled")
    _ok(proc)
    assert resumed["step"] == 8
    _close(resumed, one_process)


@pytest.mark.oldest_torch  # how a job starts, fails and ends differs by release
def test_a_failing_rank_ends_the_job_with_its_error_and_the_entry(work):
    proc, result = toy(work, 2, "--batch", "2", "--steps", "10", "--fail-rank", "1", "--fail-x", str(5 / 22),
                       name="failing")
    assert proc.returncode != 0 and result is None
    text = proc.stdout + proc.stderr
    assert "cannot train on x=" in text
    assert "on rank 1 of 2" in text and "entries" in text and "'k5'" in text, text[-3000:]


def test_gradients_are_summed_in_buckets_with_zeros_for_tensors_without_one(work):
    env = subprocess_env(STREAMING_CACHE_COLLECTIVE_TIMEOUT=str(TIMEOUT_S), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           SCRIPT, "--grad-check"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S * 4)
    _ok(proc)
    assert proc.stdout.count("gradient sums ok") == 2


def test_the_scaling_benchmark_reports_each_process_count(tmp_path):
    """``bench-scaling`` on a small model: samples/s for 1 and 2 processes, the ratio to linear and the
    all-reduce share, measured in one run (the figures themselves are the machine's, not checked here)."""
    env = subprocess_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "streaming_cache", "bench-scaling", str(tmp_path), "--json",
                           "--processes", "1,2", "--width", "64", "--depth", "2", "--rank", "4", "--rows", "64",
                           "--steps", "4", "--warmup", "1"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S * 4)
    _ok(proc)
    runs = json.loads(proc.stdout)["runs"]
    assert [r["processes"] for r in runs] == [1, 2]
    assert runs[0]["vs_linear"] == 1.0 and runs[1]["vs_linear"] > 0 and runs[0]["allreduce_share"] == 0.0
    assert all(r["samples_per_s"] > 0 and 0 <= r["allreduce_share"] < 1 for r in runs)


@pytest.mark.oldest_torch  # how a job starts, fails and ends differs by release
def test_what_a_rank_receives_inside_inference_mode_can_be_trained_on(tmp_path):
    """ComfyUI runs nodes in inference mode, and rank 0 sends a resume state to the others from inside a node: the
    tensors received must be ordinary ones, updated in place when the optimizer and the LoRA load them (a relaunch
    of two nodes after one was killed failed with "Inplace update to inference tensor outside InferenceMode")."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HELPERS, "group_received.py")]
    proc = subprocess.run(cmd, env=subprocess_env(STREAMING_CACHE_COLLECTIVE_TIMEOUT=str(TIMEOUT_S),
                                                  OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=TIMEOUT_S * 4, cwd=tmp_path)
    _ok(proc)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["inference"] == [False, False, False], result
    assert result["values"] == [[2.0, 2.0, 2.0], [1.0, 1.0], [2.0, 2.0]] and result["step"] == 2, result
