"""The memory settings a run trains with: the fastest that fit the GPU, or those set, with a warning.

Memory & Precision's ``plan`` ``auto`` (the default, also without the node) chooses, before the first step, from
:data:`LADDER`: the settings from fastest to leanest. Each is estimated for this model, resolution and batch (the
caller's ``estimate``: peak device bytes of one training step, counted on the ``meta`` device) and the first whose
estimate fits the device's free memory with :func:`fits`'s margin is taken. A setting changed from its default is
kept as set in every candidate, so auto changes only what was left alone; ``manual`` trains with the settings as
set and only warns when their estimate does not fit.

What auto chooses does not change what a run learns (gradient checkpointing, the share recomputed, CUDA graphs and
offloading compute the same step), so the run's identity is that of the settings as given: a run queued again
continues, whatever the memory free then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PLANS = ("auto", "manual")
GIB = 1 << 30
MARGIN = 0.10
"""Share of the estimate kept free beside it: the allocator's rounding and fragmentation, kernels' workspaces."""
RESERVE = GIB // 2
"""Bytes kept free beside the estimate whatever its size (cuBLAS' and cuDNN's handles, the loader's batches)."""

PLANNED = ("gradient_checkpointing", "checkpoint_share", "cuda_graphs", "offloading")
"""The settings ``auto`` chooses (those of :class:`~.spec.MemoryOptions` that change memory, not results)."""

LADDER: tuple[tuple[str, Mapping[str, Any]], ...] = (
    ("no checkpointing", {"gradient_checkpointing": False, "cuda_graphs": True, "offloading": False}),
    ("half of the blocks recomputed",
     {"gradient_checkpointing": True, "checkpoint_share": 0.5, "cuda_graphs": True, "offloading": False}),
    ("checkpointing",
     {"gradient_checkpointing": True, "checkpoint_share": 1.0, "cuda_graphs": True, "offloading": False}),
    ("checkpointing, graphs off",
     {"gradient_checkpointing": True, "checkpoint_share": 1.0, "cuda_graphs": False, "offloading": False}),
    ("checkpointing, offloading",
     {"gradient_checkpointing": True, "checkpoint_share": 1.0, "cuda_graphs": False, "offloading": True}),
)
"""The candidates, fastest first: each recomputes more or keeps less on the device than the one before. Graphs
replay a step from memory they hold beside the weights, so the leaner candidates turn them off; offloading
streams the frozen weights from RAM, which graphs cannot record."""


GRAPHS_EXTRA = 0.06
"""Memory CUDA graphs hold beside an eager step's, as a share of the step's peak: their recordings allocate what
the eager step allocates, in a pool of their own the allocator cannot share (SDXL at 1024 px on an H200: 8.03 GiB
reserved with graphs, 7.58 without)."""


def step_peak(memory: Any, count: Callable[[int], tuple[int, int]], *, graphs: bool) -> int:
    """The peak device bytes of a step with ``memory``'s settings, from ``count(depth)``: (peak, frozen weights'
    bytes) of a step with every block at checkpoint ``depth`` recomputed (0: none). A share recomputed lies in
    between, linear in the share (each block recomputed keeps its input in place of its activations; counted
    at half, SDXL at 1024 px keeps 10.5 GiB where the line gives 11.1, Flux dev 43.5 for 43.6); with offloading
    the frozen weights stream from RAM (ComfyUI keeps on the device what fits beside the rest); ``graphs``
    (graphs can record on this device) adds :data:`GRAPHS_EXTRA` where ``cuda_graphs`` is on."""
    depth = memory.checkpoint_depth if memory.gradient_checkpointing else 0
    share = memory.checkpoint_share if depth else 0.0
    peak, weights = count(depth if share > 0 else 0)
    if 0 < share < 1:
        none, _ = count(0)
        peak = int(peak + (1.0 - share) * (none - peak))
    if memory.offloading:
        peak -= weights
    elif graphs and memory.cuda_graphs and not memory.bypass_mode:
        peak = int(peak * (1.0 + GRAPHS_EXTRA))
    return peak


def fits(peak: int, free: int) -> bool:
    """Whether a step estimated at ``peak`` bytes fits ``free`` bytes with :data:`MARGIN` and :data:`RESERVE`."""
    return peak * (1.0 + MARGIN) + RESERVE <= free


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Plan:
    """The memory settings to train with and why: ``memory`` (a :class:`~.spec.MemoryOptions`), what auto changed
    (``changed``: name -> value), what it kept as set by hand, the estimate of the settings chosen and the free
    memory it was compared with (None where nothing was estimated)."""

    mode: str
    memory: Any
    changed: dict[str, Any]
    kept: tuple[str, ...]
    peak: int | None
    free: int | None
    label: str = ""
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.peak is None or self.free is None or fits(self.peak, self.free)

    def summary(self) -> str:
        """One line for the node's summary: what the plan chose, with the estimate and the free memory."""
        if self.peak is None or self.free is None:
            return f"memory plan {self.mode}: {self.reason or 'settings as set'}"
        m = self.memory
        what = (f"checkpointing {'on' if m.gradient_checkpointing else 'off'}"
                + (f" (share {m.checkpoint_share:g})" if m.gradient_checkpointing and m.checkpoint_share < 1 else "")
                + f", graphs {'on' if m.cuda_graphs else 'off'}"
                + (", offloading on" if m.offloading else ""))
        streamed = " (the frozen weights streamed from RAM)" if m.offloading else ""
        line = f"memory plan {self.mode}: estimated peak {gib(self.peak)}{streamed} of {gib(self.free)} free: {what}"
        if self.kept:
            line += "; kept as set: " + ", ".join(self.kept)
        if not self.fits:
            line += (". It may run out of memory: lower the resolution or the batch size, or load the model's "
                     "weights in fp8 and train in bypass_mode" if self.mode == "auto" else
                     ". It may run out of memory: set plan to auto, or turn on gradient_checkpointing or "
                     "offloading")
        return line


def _defaults(memory: Any) -> Any:
    return type(memory)()


def candidates(memory: Any) -> list[tuple[str, Any]]:
    """:data:`LADDER` applied to ``memory`` (a :class:`~.spec.MemoryOptions`): each candidate's label and options,
    with the settings changed from their defaults kept as set; candidates that come out equal are given once."""
    default = _defaults(memory)
    kept = {name: getattr(memory, name) for name in PLANNED if getattr(memory, name) != getattr(default, name)}
    out: list[tuple[str, Any]] = []
    for label, settings in LADDER:
        options = dataclasses.replace(memory, **{**settings, **kept})
        if all(options != o for _, o in out):
            out.append((label, options))
    return out


def plan_memory(memory: Any, estimate: Callable[[Any], int], free: int | None, *, reason: str = "",
                can_offload: bool = True) -> Plan:
    """The settings to train with for ``memory``'s ``plan``. ``estimate``: the peak device bytes of a step with
    given options; ``free``: the device's free bytes for this run (None: nothing to fit, e.g. training on the CPU;
    ``reason`` says why, for the summary). ``can_offload``: whether offloading is a candidate (this ComfyUI has
    it)."""
    mode = memory.plan
    if free is None:
        return Plan(mode, memory, {}, (), None, None, reason=reason)
    default = _defaults(memory)
    kept = tuple(n for n in PLANNED if getattr(memory, n) != getattr(default, n))
    if mode == "manual":
        return Plan(mode, memory, {}, (), estimate(memory), free)
    options = [(label, o) for label, o in candidates(memory) if can_offload or not o.offloading]
    peaks: list[int] = []
    for _, chosen in options:
        peaks.append(estimate(chosen))
        if fits(peaks[-1], free):
            break
    label, chosen = options[len(peaks) - 1]
    changed = {n: getattr(chosen, n) for n in PLANNED if getattr(chosen, n) != getattr(memory, n)}
    return Plan(mode, chosen, changed, kept, peaks[-1], free, label=label)
