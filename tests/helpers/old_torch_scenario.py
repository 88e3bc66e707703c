"""Gradient checkpointing of real Flux blocks on a PyTorch that cannot read the saved-tensor hooks in force (before
2.8), inside a process that boots real ComfyUI (see tests/comfy/test_recompute_old_torch.py); prints one JSON line
of results.

    python old_torch_scenario.py COMFYUI_PATH WORKDIR

The PyTorch of the ComfyUI under test has the reader (``torch._C._autograd._top_saved_tensors_default_hooks``):
this process removes it before anything is checkpointed. Then a real Flux double and single block (ComfyUI's
classes, float64) update their input in place after norms saved it: checkpointed by the pack, the double block
(updates between saves) is not recomputed, the single block (its update after its last save) is, and both
gradients are the central difference of their forward pass; with the probe switched off (every block recomputed
without a watch over the checkpoint's hooks) the double block's is not. Flux's last layer updates nothing in place
and is still recomputed. On a ComfyUI with offloading (0.33 and newer), a small Flux dev
trains with every block checkpointed and learns what it learns without gradient checkpointing.
"""

from __future__ import annotations

import contextlib
import logging

from comfy_scenario import run_scenario_main, train_from_cache
from memory_scenario import PLAIN, _difference, flux_block_gradients

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)


class Said(logging.Handler):
    """The warnings logged while it is installed (on the root logger), as text."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)


def last_layer_recomputed() -> dict:
    """Flux's last layer (no in-place update), checkpointed by the pack: its runs in the forward and in the backward
    pass (the first forward call is probed: two runs), and its gradient against the same layer without
    checkpointing."""
    import comfy.ops
    import torch
    from comfy.ldm.flux.layers import LastLayer

    compat = headless.pack_module("backend.compat")
    torch.manual_seed(0)
    layer = LastLayer(64, 2, 16, dtype=torch.float64, device="cpu", operations=comfy.ops.disable_weight_init)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x, vec = torch.randn(1, 16, 64, dtype=torch.float64), torch.randn(1, 64, dtype=torch.float64)
    runs = [0]
    plain = layer.forward

    def counted(*args, **kwargs):
        runs[0] += 1
        return plain(*args, **kwargs)

    def gradient(context) -> tuple[float, int, int]:
        w = torch.ones((), dtype=torch.float64, requires_grad=True)
        runs[0] = 0
        with context:
            value = layer(x * w, vec=vec * w).square().sum()
        forward = runs[0]
        value.backward()
        return float(w.grad), forward, runs[0] - forward

    layer.forward = counted
    reference, _, _ = gradient(contextlib.nullcontext())
    checkpointed, forward, backward = gradient(compat.gradient_checkpointing([layer]))
    return {"reference": reference, "checkpointed": checkpointed, "forward_runs": forward, "backward_runs": backward}


def scenario(server) -> dict:
    import torch

    compat = headless.pack_module("backend.compat")
    recompute = headless.pack_module("train.recompute", "streaming_cache")
    out: dict = {"had_reader": recompute.has_hook_reader()}
    if out["had_reader"]:
        delattr(torch._C._autograd, recompute.HOOK_READER)
    out["has_reader"] = recompute.has_hook_reader()

    kept: list[str] = []
    keep = recompute.Replay.keep

    def noting(self, block):
        kept.append(type(block).__name__)
        return keep(self, block)

    recompute.Replay.keep = noting
    with Said() as said:
        out["flux_blocks"] = flux_block_gradients()
    out["kept_blocks"], out["warnings"] = sorted(set(kept)), [s for s in said.lines
                                                               if recompute.IN_PLACE_RECOMPUTATION in s]
    probe = recompute._probe
    recompute._probe = lambda *args: (frozenset(), frozenset())  # what checkpointing did before the probe
    try:
        out["flux_blocks_without_probe"] = flux_block_gradients()
    finally:
        recompute._probe = probe
    out["last_layer"] = last_layer_recomputed()

    if compat.HAS_OFFLOADING:  # on the newest ComfyUI only (the oldest builds Flux far more slowly on the CPU)
        from family_recipes import BY_KEY
        from family_sweep import detect, prepare

        recipe = BY_KEY["Flux dev"]
        flux = prepare(recipe, detect(recipe)[0])
        kept.clear()
        for name, options in (("flux_plain", {}), ("flux_none", {"gradient_checkpointing": False})):
            out[name] = train_from_cache(server, flux["model_file"], flux["name"], name, **{**PLAIN, **options})
        out["flux_kept_blocks"] = sorted(set(kept))
        if out["flux_plain"]["ok"] and out["flux_none"]["ok"]:
            out["flux_plain_vs_none"] = _difference("flux_plain", "flux_none")
    return out


if __name__ == "__main__":
    run_scenario_main(scenario)
