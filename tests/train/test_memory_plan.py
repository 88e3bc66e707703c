"""Memory & Precision's ``plan`` (``streaming_cache.train.memory_plan``): ``auto`` takes the fastest settings whose
estimate fits the free memory, changes only settings left at their defaults, and says what it chose; ``manual``
keeps the settings and warns when they will not fit."""

from __future__ import annotations

import dataclasses

import pytest

from streaming_cache import environment
from streaming_cache.train import memory_plan
from streaming_cache.train.memory_plan import GIB, fits, plan_memory
from streaming_cache.train.spec import MemoryOptions, TrainSpec

# SDXL at 1024 px, rank 16, bf16, batch 1, in GiB: the shape of the estimates (no checkpointing keeps every
# activation; half the blocks recomputed keeps half; graphs hold their inputs and gradients beside the step;
# offloading leaves part of the weights in RAM)
PEAKS = {(False, 1.0, True, False): 19.0, (True, 0.5, True, False): 12.0, (True, 1.0, True, False): 7.6,
         (True, 1.0, False, False): 7.2, (True, 1.0, False, True): 3.9, (False, 1.0, False, False): 18.6,
         (True, 0.5, False, False): 11.6}


def estimate(m: MemoryOptions) -> int:
    share = m.checkpoint_share if m.gradient_checkpointing else 1.0
    return int(PEAKS[(m.gradient_checkpointing, share, m.cuda_graphs, m.offloading)] * GIB)


@pytest.mark.parametrize("free_gib, chosen, line", [
    (80, "no checkpointing", "memory plan auto: estimated peak 19.0 GiB of 80.0 GiB free: checkpointing off, "
                             "graphs on"),
    (24, "no checkpointing", "memory plan auto: estimated peak 19.0 GiB of 24.0 GiB free: checkpointing off, "
                             "graphs on"),
    (16, "half of the blocks recomputed", "memory plan auto: estimated peak 12.0 GiB of 16.0 GiB free: "
                                          "checkpointing on (share 0.5), graphs on"),
    (12, "checkpointing", "memory plan auto: estimated peak 7.6 GiB of 12.0 GiB free: checkpointing on, graphs on"),
    (8, "checkpointing, offloading", "memory plan auto: estimated peak 3.9 GiB (the frozen weights streamed from "
                                     "RAM) of 8.0 GiB free: checkpointing on, graphs off, offloading on"),
])
def test_auto_takes_the_fastest_settings_that_fit(free_gib, chosen, line):
    plan = plan_memory(MemoryOptions(), estimate, free_gib * GIB)
    assert plan.label == chosen
    assert plan.summary() == line
    assert plan.fits and fits(estimate(plan.memory), free_gib * GIB)


def test_the_margin_leaves_room_beside_the_estimate():
    # 7.6 GiB with 10 % and 0.5 GiB beside it needs 8.86 GiB: not 8.5, so graphs go off at 8.5 GiB
    assert plan_memory(MemoryOptions(), estimate, int(8.5 * GIB)).label == "checkpointing, graphs off"
    assert plan_memory(MemoryOptions(), estimate, int(8.9 * GIB)).label == "checkpointing"


def test_auto_changes_only_settings_left_at_their_defaults():
    set_by_hand = MemoryOptions(cuda_graphs=False)
    plan = plan_memory(set_by_hand, estimate, 80 * GIB)
    assert plan.memory.cuda_graphs is False and plan.memory.gradient_checkpointing is False
    assert plan.kept == ("cuda_graphs",) and plan.changed == {"gradient_checkpointing": False}
    assert plan.summary().endswith("graphs off; kept as set: cuda_graphs")
    # an explicit share is kept in every candidate, so the candidates that differ only by the share collapse
    names = [label for label, _ in memory_plan.candidates(MemoryOptions(checkpoint_share=0.5))]
    assert names == ["no checkpointing", "half of the blocks recomputed", "checkpointing, graphs off",
                     "checkpointing, offloading"]


def test_nothing_fits_takes_the_leanest_and_says_what_to_do():
    plan = plan_memory(MemoryOptions(), estimate, 4 * GIB)
    assert plan.label == "checkpointing, offloading" and not plan.fits
    assert "may run out of memory: lower the resolution or the batch size" in plan.summary()


def test_manual_keeps_the_settings_and_warns_when_they_do_not_fit():
    manual = MemoryOptions(plan="manual", gradient_checkpointing=False)
    plan = plan_memory(manual, estimate, 12 * GIB)
    assert plan.memory is manual and plan.changed == {} and not plan.fits
    assert plan.summary().startswith("memory plan manual: estimated peak 19.0 GiB of 12.0 GiB free: "
                                   "checkpointing off, graphs on. It may run out of memory")
    assert "set plan to auto" in plan.summary()
    assert plan_memory(manual, estimate, 40 * GIB).summary().endswith("checkpointing off, graphs on")


def test_without_a_device_to_fit_nothing_is_estimated():
    calls = []
    plan = plan_memory(MemoryOptions(), lambda m: calls.append(m) or 0, None, reason="training on the CPU")
    assert plan.memory == MemoryOptions() and calls == []
    assert plan.summary() == "memory plan auto: training on the CPU"


def test_the_plan_is_not_part_of_the_run_identity():
    base = TrainSpec(lora_name="x")
    manual = dataclasses.replace(base, memory=MemoryOptions(plan="manual"))
    assert base.identity_settings() == manual.identity_settings()
    with pytest.raises(ValueError, match="plan must be one of auto, manual"):
        MemoryOptions(plan="fastest")


def test_a_steps_peak_from_the_two_counts():
    counted = []

    def count(depth: int) -> tuple[int, int]:
        counted.append(depth)
        return {1: (7 * GIB, 5 * GIB), 2: (9 * GIB, 5 * GIB), 0: (15 * GIB, 5 * GIB)}[depth]

    step = memory_plan.step_peak
    assert step(MemoryOptions(cuda_graphs=False), count, graphs=True) == 7 * GIB and counted == [1]
    assert step(MemoryOptions(checkpoint_depth=2, cuda_graphs=False), count, graphs=True) == 9 * GIB
    assert step(MemoryOptions(gradient_checkpointing=False), count, graphs=False) == 15 * GIB
    assert step(MemoryOptions(checkpoint_share=0.0), count, graphs=False) == 15 * GIB
    counted.clear()
    assert step(MemoryOptions(checkpoint_share=0.25), count, graphs=False) == 13 * GIB and counted == [1, 0]
    assert step(MemoryOptions(offloading=True), count, graphs=True) == 2 * GIB  # the weights stream from RAM
    graphed = step(MemoryOptions(), count, graphs=True)
    assert graphed == int(7 * GIB * (1 + memory_plan.GRAPHS_EXTRA)) > 7 * GIB
    assert step(MemoryOptions(bypass_mode=True), count, graphs=True) == 7 * GIB  # graphs do not record bypass hooks


@pytest.mark.parametrize("raw, expected", [("12GiB", 12 * GIB), ("8g", 8 * GIB), (" 1.5 GiB ", int(1.5 * GIB)),
                                           ("512m", 512 << 20), ("1000000", 1_000_000), ("", None)])
def test_the_device_memory_can_be_given(monkeypatch, raw, expected):
    monkeypatch.setenv("STREAMING_CACHE_DEVICE_MEMORY", raw)
    assert environment.device_memory() == expected


@pytest.mark.parametrize("raw", ["12 parsecs", "GiB", "-1g", "0"])
def test_a_device_memory_that_is_no_size_is_refused_clearly(monkeypatch, raw):
    monkeypatch.setenv("STREAMING_CACHE_DEVICE_MEMORY", raw)
    with pytest.raises(ValueError, match="STREAMING_CACHE_DEVICE_MEMORY"):
        environment.device_memory()
