"""The first two steps of an SDXL training run at 1024 px with CUDA graphs, counted on ``meta`` inside a process
that imports real ComfyUI (see tests/comfy/test_graphs_memory_on_meta.py); prints one JSON line of results.

    python graphs_memory_scenario.py COMFYUI_PATH WORKDIR

ComfyUI's SDXL at full size on the ``meta`` device, nothing loaded from disk, trained two AdamW steps as Train
LoRA trains it (rank 16, bf16, batch 1, gradient checkpointing: ``graphs_estimate.count_graphed_steps``) three
ways: without graphs (the eager steps), with graphs (their pool counted by ``streaming_cache.train.meta_graphs``),
and with graphs where the call that records runs eagerly beside its new recording (:func:`recording_call_eager`:
what graphs did before commit 228b603, the peak the test must see; one step, where that peak is).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

FAMILY, PIXELS, STEPS = "sdxl", 1024, 2


@contextlib.contextmanager
def recording_call_eager(graphs: Any) -> Iterator[None]:
    """The call that records a signature runs eagerly beside its new recording (the recording kept, checked, and
    replayed from the next call on), as ``graphs`` (``streaming_cache.train.graphs``) ran it before its check used
    the last warm-up pass."""
    original = graphs.GraphedForward._new_recording
    served: set[int] = set()

    def new_recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = original(self, *args, **kwargs)
        if rec is not None and id(self) not in served:
            served.add(id(self))
            return None  # kept in self.recordings; the caller runs this call eagerly
        return rec

    graphs.GraphedForward._new_recording = new_recording
    try:
        yield
    finally:
        graphs.GraphedForward._new_recording = original


def main() -> None:
    comfyui = sys.argv[1]
    headless.boot(comfyui, ["--cpu", "--use-pytorch-cross-attention"], quiet=True, others=False)
    estimate = headless.pack_module("backend.graphs_estimate")
    graphs = headless.pack_module("train.graphs", part="streaming_cache")
    result: dict = {"version": headless.pack_module("backend.compat").comfyui_version()}
    result["eager"] = estimate.count_graphed_steps(FAMILY, PIXELS, steps=STEPS, graphs_on=False).to_json()
    result["graphs"] = estimate.count_graphed_steps(FAMILY, PIXELS, steps=STEPS).to_json()
    with recording_call_eager(graphs):
        result["eager_beside"] = estimate.count_graphed_steps(FAMILY, PIXELS, steps=1).to_json()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
