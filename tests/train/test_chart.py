"""The curves Train LoRA sends to the browser's chart (``streaming_cache.train.chart``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from streaming_cache.train.chart import StepTimes, chart_series
from streaming_cache.train.plot import smooth


def test_a_short_run_is_sent_whole_and_as_json():
    losses = [1.0, 0.8, float("nan"), 0.5]
    c = chart_series(losses, total=10, validation=[(2, 0.9)], learning_rates=lambda n: [(i + 1) / 10_000 for i in range(n)],
                     times=[None, None, 1.5, 3.0], datasets={"style": [(1, 1.0), (3, 0.7)]}, log_scale=True)
    assert c["steps"] == [1, 2, 3, 4] and c["loss"] == [1.0, 0.8, None, 0.5]
    assert c["lr"] == [1e-4, 2e-4, 3e-4, 4e-4] and c["time"] == [None, None, 1.5, 3.0]
    assert c["validation"] == [[2, 0.9]] and c["datasets"] == {"style": [[1, 1.0], [3, 0.7]]}
    assert c["total"] == 10 and c["scale"] == "log"
    json.loads(json.dumps(c, allow_nan=False))  # no NaN reaches the browser


def test_a_long_run_is_thinned_evenly_keeping_the_last_step_and_the_full_average():
    losses = list(np.linspace(2.0, 0.1, 50_000))
    c = chart_series(losses, first_step=1, max_points=2000)
    assert len(c["steps"]) <= 2000 and c["steps"][0] == 1 and c["steps"][-1] == 50_000
    gaps = np.diff(c["steps"])
    assert gaps.min() >= 24 and gaps.max() <= 26  # even: 50,000 steps over 2,000 points
    full = smooth(losses)
    for step, avg in zip(c["steps"][::97], c["average"][::97]):
        assert math.isclose(avg, full[step - 1], rel_tol=1e-12), "the average of every step, then thinned"


def test_steps_count_from_the_first_step_given():
    c = chart_series([0.5, 0.4], first_step=11)
    assert c["steps"] == [11, 12] and c["total"] == 12 and c["lr"] == [] and c["time"] == []


def test_steps_reported_together_share_the_time_since_the_step_before_them():
    times = StepTimes(started=100.0)
    for now in (101.0, 102.0):  # read one at a time
        times.add(now)
        assert times.end_report() == 1
    for now in (106.0, 106.001, 106.002, 106.003):  # four steps read at once, 4 s after step 2
        times.add(now)
    assert times.end_report() == 4
    assert times.times == pytest.approx([101.0, 102.0, 103.00075, 104.0015, 105.00225, 106.003], abs=1e-9)
    assert times.seconds_per_step() == pytest.approx(1.00075, abs=1e-9)


def test_the_first_report_of_a_run_is_spread_from_its_start():
    times = StepTimes(started=10.0)
    for now in (14.0, 14.0, 14.0, 14.0):
        times.add(now)
    times.end_report()
    assert times.times == [11.0, 12.0, 13.0, 14.0] and times.seconds_per_step() == 1.0
    assert StepTimes(started=0.0).seconds_per_step() is None
