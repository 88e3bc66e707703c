"""What the demo's two runs print, checked the same way whether headless.py runs them or the installer does."""

from __future__ import annotations

import re

CHATTER = ("Requested to load", "model weight dtype", "setup plugin alembic", "Total VRAM", "UserWarning")


def assert_demo_runs(first: str, second: str) -> None:
    """``first``/``second``: the standard output of the demo's first and second run.

    The first run encodes and trains, the second reuses both; the output reads like a tool's: one progress
    display per node (here not a terminal: a line at each tenth of the way, however many steps), each result
    once, none of ComfyUI's start-up chatter."""
    assert "encoded 10, reused 0, failed 0 (6 samples" in first
    assert "trained demo_lora: steps 1-20 of 20" in first
    assert "encoded 0, reused 10, failed 0" in second
    assert "demo_lora: already trained for 20 steps" in second
    lines = first.splitlines()
    assert not any(" is now " in line for line in lines), "nothing about renamed files a newcomer cannot act on"
    for summary in ("encoded 10, reused 0, failed 0", "trained demo_lora: steps 1-20 of 20", "new run demo_lora"):
        assert sum(summary in line for line in lines) == 1, (summary, lines)
    training = [line for line in lines if line.startswith("[headless] node 3: ") and "/20 (" in line]
    seconds = float(re.search(r"\[headless\] done in ([0-9.]+)s", first).group(1))
    # a line at the first step and at each tenth of the way, and one more for each 30 s the run took: not one a step.
    # A line shows the step text of its own step only: one due where the training sent no text for that step waits
    # for the next text, at most until the next tenth (so two tenths may share a line).
    assert 6 <= len(training) <= 11 + int(seconds // 30), lines
    for line in training:
        count, _, text = line.split(": ", 1)[1].partition("  ")
        assert not text or text.startswith(f"step {count.split('/')[0]}/20 "), line
    assert training[-1].startswith("[headless] node 3: 20/20 (100%)  step 20/20  loss "), lines
    for out in (first, second):
        assert not any(chatter in out for chatter in CHATTER), out
