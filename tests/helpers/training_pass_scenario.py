"""How Train LoRA runs ComfyUI's layers, in real ComfyUI (see tests/comfy/test_training_pass.py); prints one JSON
line of results.

    python training_pass_scenario.py COMFYUI_PATH WORKDIR

Fused layers: the tiny SD1.x checkpoint (linear, conv and norm layers with trained LoRAs and bias and norm
differences) trains with the pack's fused layers (by default, where its small layers take the merged form; and
with every LoRA in the low-rank form, ``STREAMING_CACHE_FUSED_LORA=lowrank``) and, with ``..._FUSED_LORA=0``,
through ComfyUI's weight wrappers: in fp32 with SGD the three LoRAs agree to float precision.

Weights moved after loading: a model whose weights were moved outside inference mode after a node loaded it
(what loading it onto a GPU does) trains, and learns what the unmoved one learns.

Checkpoint recomputation while free memory changes:
On the CPU ComfyUI runs sub-quadratic attention, which picks its chunk sizes from the free memory it reads at
each call. Here that reading is plenty during the forward pass and almost nothing inside the backward pass (where
checkpointed blocks are recomputed): the situation of a GPU whose memory fills between the two. ComfyUI's own
TrainLoraNode then recomputes its attention in other chunks than its forward pass ran and fails in PyTorch's
check; Train LoRA replays the forward pass's readings and trains the LoRA it trains when memory stays put.
"""

from __future__ import annotations

from comfy_scenario import CKPT, random_cache, run_scenario_main, saved_lora, train_from_cache
from values import lora_difference

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

SETTINGS = dict(steps=2, batch_size=2, rank=4, optimizer="SGD", learning_rate=0.5, training_dtype="fp32",
                lora_dtype="fp32", seed=5, gradient_checkpointing=True)
LATENT = (1, 4, 32, 32)  # 1024 tokens in the UNet's attention: more than its smallest query chunk
SMALL = (1, 4, 8, 8)  # the fused-layer comparisons need no long attention


class MemoryThatFillsInBackward:
    """``comfy.model_management.get_free_memory`` reading 1 TiB free, except inside a backward pass, where it
    reads 32 MiB: enough for sub-quadratic attention to run in query chunks (which train), too little for one
    chunk of the 1024 tokens of a 32x32 latent; counts the readings of each kind."""

    def __init__(self) -> None:
        import comfy.model_management

        self.module = comfy.model_management
        self.original = comfy.model_management.get_free_memory
        self.forward_reads = self.backward_reads = 0

    def __enter__(self):
        import torch

        def get_free_memory(dev=None, torch_free_too=False):
            in_backward = torch._C._current_graph_task_id() != -1
            if in_backward:
                self.backward_reads += 1
            else:
                self.forward_reads += 1
            value = 32 << 20 if in_backward else 1 << 40
            return (value, value) if torch_free_too else value

        self.module.get_free_memory = get_free_memory
        return self

    def __exit__(self, *exc) -> None:
        self.module.get_free_memory = self.original


def comfyui_trainer(latent_shape: tuple, cond: list) -> dict:
    """ComfyUI's TrainLoraNode on the tiny checkpoint, one step, two samples."""
    import comfy_trainer
    import torch

    import nodes

    with torch.inference_mode():
        model = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[0]
    g = torch.Generator().manual_seed(0)
    latents = [{"samples": torch.randn(latent_shape, generator=g)} for _ in range(2)]
    return comfy_trainer.run(model, latents, [cond, cond], steps=1)


def _difference(a: str, b: str) -> dict:
    """How far two saved LoRAs are apart, against how far training moved them (``values.lora_difference``)."""
    return lora_difference(saved_lora(a)["tensors"], saved_lora(b)["tensors"])


class FusedCount:
    """How many layers each training pass ran fused."""

    def __init__(self) -> None:
        self.module = headless.pack_module("backend.fused")
        self.original, self.counts = self.module.fused_layers, []

    def __enter__(self):
        import contextlib

        @contextlib.contextmanager
        def fused_layers(*args, **kwargs):
            with self.original(*args, **kwargs) as count:
                self.counts.append(count)
                yield count

        self.module.fused_layers = fused_layers
        return self

    def __exit__(self, *exc) -> None:
        self.module.fused_layers = self.original


def moved_weights_run(server, compat) -> dict:
    """Train LoRA on a model whose weights were moved after loading, outside inference mode, as loading onto a
    GPU moves them (here from fp32 to fp64 and back, which keeps every value): the parameters lose their
    version counter while claiming to be ordinary tensors."""
    import torch

    original = compat.load_models_for_training
    seen: list[bool] = []

    def load_and_move(model, offloading=False):
        original(model, offloading)
        model.model.diffusion_model.to(torch.float64).to(torch.float32)
        weights = [p for p in model.model.diffusion_model.parameters()]
        seen.append(sum(not p.is_inference() and not usable(p) for p in weights) > 0)

    def usable(tensor) -> bool:
        try:
            tensor._version  # noqa: B018
        except RuntimeError:
            return False
        return True

    compat.load_models_for_training = load_and_move
    try:
        res = train_from_cache(server, CKPT, "small", "moved", checkpoint=True, **SETTINGS)
    finally:
        compat.load_models_for_training = original
    res["had_unversioned_weights"] = seen
    if res["ok"]:
        res["vs_unmoved"] = _difference("moved", "fused")
    return res


def scenario(server) -> dict:
    import os

    import comfy.ldm.modules.attention as attention

    compat = headless.pack_module("backend.compat")
    random_cache("small", SMALL, (1, 77, 768), 768)
    cond, latent = random_cache("recompute", LATENT, (1, 77, 768), 768)
    out: dict = {"attention": attention.optimized_attention.__name__}
    replays: list = []
    original_replay = compat.Replay

    def spied_replay(*args, **kwargs):
        replay = original_replay(*args, **kwargs)
        replays.append(replay)
        return replay

    with FusedCount() as fused:
        out["fused"] = train_from_cache(server, CKPT, "small", "fused", checkpoint=True, **SETTINGS)
        for name, mode in (("lowrank", "lowrank"), ("wrapped", "0")):
            os.environ["STREAMING_CACHE_FUSED_LORA"] = mode
            try:
                out[name] = train_from_cache(server, CKPT, "small", name, checkpoint=True, **SETTINGS)
            finally:
                del os.environ["STREAMING_CACHE_FUSED_LORA"]
    out["fused_layers"] = fused.counts
    if all(out[k]["ok"] for k in ("fused", "lowrank", "wrapped")):
        out["fused_vs_wrapped"] = _difference("fused", "wrapped")
        out["lowrank_vs_wrapped"] = _difference("lowrank", "wrapped")
    out["moved"] = moved_weights_run(server, compat)
    out["steady"] = train_from_cache(server, CKPT, "recompute", "steady", checkpoint=True, **SETTINGS)
    with MemoryThatFillsInBackward() as memory:
        out["comfyui"] = comfyui_trainer(LATENT, cond)
        out["comfyui_backward_reads"] = memory.backward_reads
    compat.Replay = spied_replay
    try:
        with MemoryThatFillsInBackward() as memory:
            out["streaming"] = train_from_cache(server, CKPT, "recompute", "filling", checkpoint=True, **SETTINGS)
            out["streaming_reads"] = {"forward": memory.forward_reads, "backward": memory.backward_reads}
    finally:
        compat.Replay = original_replay
    out["replayed"] = sum(r.replayed for r in replays)
    if out["steady"]["ok"] and out["streaming"]["ok"]:
        out["filling_vs_steady"] = _difference("filling", "steady")
    return out


if __name__ == "__main__":
    run_scenario_main(scenario)
