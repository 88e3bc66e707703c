"""Big models on small GPUs, inside a process that boots real ComfyUI (see tests/comfy/test_memory.py); prints one
JSON line of results.

    python memory_scenario.py COMFYUI_PATH WORKDIR

Trains the tiny SD3 DiT through the executor with each memory option and compares the saved LoRAs with a plain
run of the same seed and data: a deeper checkpoint depth and offloading change where activations and weights
live, not what is learned; bypass mode on fp8 weights learns what weight wrappers on the same fp8 weights learn;
fp16 trains with a gradient scaler. On a ComfyUI without offloading or bypass hooks, those options are refused
with a clear message before anything is trained.
"""

from __future__ import annotations

import contextlib
import os
import time

from comfy_scenario import TINY_DIT, dit_cache, lora_changes_output, run_scenario_main, saved_lora, train_from_cache
from values import lora_difference

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

PLAIN = dict(steps=3, batch_size=2, rank=4, optimizer="SGD", learning_rate=0.5, training_dtype="fp32",
             lora_dtype="fp32", seed=3)


class PatchCount:
    """How many modules the pack's gradient checkpointing wraps during a run."""

    def __init__(self) -> None:
        self.module = headless.pack_module("backend.compat")
        self.original, self.count = self.module.checkpoint_module, 0

    def __enter__(self):
        def checkpoint_module(m, *args, **kwargs):
            self.count += 1
            return self.original(m, *args, **kwargs)

        self.module.checkpoint_module = checkpoint_module
        return self

    def __exit__(self, *exc) -> None:
        self.module.checkpoint_module = self.original


def _difference(a: str, b: str) -> dict:
    """How far two saved LoRAs are apart, against how far training moved them (``values.lora_difference``)."""
    return lora_difference(saved_lora(a)["tensors"], saved_lora(b)["tensors"])


def flux_block_gradients() -> dict:
    """The gradient of the loss with respect to a scale of a real Flux double and single block's inputs, with the
    block recomputed (the pack's gradient checkpointing), kept without recomputation (its input copies), and
    ComfyUI's own checkpoint wrapper, against a float64 central difference of the forward pass. Each block
    updates its input in place after norms saved it."""
    import comfy.model_management
    import comfy.ops
    import torch
    from comfy.ldm.flux.layers import DoubleStreamBlock, EmbedND, SingleStreamBlock

    compat = headless.pack_module("backend.compat")
    recompute = headless.pack_module("train.recompute", "streaming_cache")
    torch.manual_seed(0)
    ops = comfy.ops.disable_weight_init
    blocks = {"double": DoubleStreamBlock(64, 4, 2.0, qkv_bias=True, dtype=torch.float64, device="cpu",
                                          operations=ops),
              "single": SingleStreamBlock(64, 4, 2.0, dtype=torch.float64, device="cpu", operations=ops)}
    img0, txt0, vec0 = (torch.randn(1, 16, 64, dtype=torch.float64), torch.randn(1, 8, 64, dtype=torch.float64),
                        torch.randn(1, 64, dtype=torch.float64))
    pe = EmbedND(dim=16, theta=10000, axes_dim=[4, 6, 6])(torch.zeros(1, 24, 3)).to(torch.float64)
    out: dict = {}
    saved = getattr(comfy.model_management, "in_training", False)
    comfy.model_management.in_training = True  # newer ComfyUI: the differentiable RoPE
    try:
        for kind, block in blocks.items():
            for p in block.parameters():
                torch.nn.init.normal_(p, std=0.2)

            def loss(w, block=block, kind=kind):
                if kind == "double":
                    i, t = block(img=img0 * w, txt=txt0 * w, vec=vec0 * w, pe=pe)
                    return i.square().sum() + t.square().sum()
                return block(torch.cat((txt0, img0), 1) * w, vec=vec0 * w, pe=pe).square().sum()

            def gradient(context) -> float:
                w = torch.ones((), dtype=torch.float64, requires_grad=True)
                with context, compat.differentiable_kernels():
                    value = loss(w)
                value.backward()
                return float(w.grad)

            eps = 1e-6
            with torch.no_grad():
                reference = float((loss(1 + eps) - loss(1 - eps)) / (2 * eps))
            comfy_wrapper = compat.nodes_train
            comfy_wrapper.patch(block)
            try:
                comfyui = gradient(contextlib.nullcontext())
            finally:
                comfy_wrapper.unpatch(block)
            out[kind] = {"reference": reference,
                         "recomputed": gradient(compat.gradient_checkpointing([block])),
                         "kept": gradient(recompute.inputs_kept([block])),
                         "comfyui_checkpoint": comfyui}
    finally:
        comfy.model_management.in_training = saved
    return out


def _flux(train) -> dict:
    """Flux updates its blocks' inputs in place (``img += ...``, the next block gets the same tensor), feeds the
    noisy latent straight into a top-level linear layer (img_in) and adds to that layer's output in place: the
    cases gradient checkpointing, blocks that are not recomputed and ComfyUI's offload-aware checkpointing get
    wrong unless handled. Without recomputation (``flux_none``) the gradients are the forward pass's own."""
    from family_recipes import BY_KEY
    from family_sweep import detect, prepare

    recipe = BY_KEY["Flux dev"]
    flux = prepare(recipe, detect(recipe)[0])
    out: dict = {}
    for name, options in (("flux_plain", {}), ("flux_none", {"gradient_checkpointing": False}),
                          ("flux_share", {"checkpoint_share": 0.5}), ("flux_offload", {"offloading": True})):
        out[name] = train(name, model=flux["model_file"], cache=flux["name"], **options)
    for name in ("flux_plain", "flux_share", "flux_offload"):
        if out[name]["ok"] and out["flux_none"]["ok"]:
            out[f"{name}_vs_none"] = _difference(name, "flux_none")
    if out["flux_offload"]["ok"]:
        out["flux_offloading_vs_plain"] = _difference("flux_offload", "flux_plain")
        out["flux_offload_img_in_moved"] = float(saved_lora("flux_offload")["tensors"]["diffusion_model.img_in.lora_up.weight"]
                                                 .abs().max())
    return out


def scenario(server) -> dict:
    compat = headless.pack_module("backend.compat")
    cond, latent = dit_cache("mem")
    out: dict = {"has_offloading": compat.HAS_OFFLOADING, "has_bypass": compat.HAS_BYPASS}

    def train(name: str, model: str = TINY_DIT, cache: str = "mem", **options) -> dict:
        start = time.perf_counter()
        with PatchCount() as patched:
            res = train_from_cache(server, model, cache, name, **{**PLAIN, **options})
        res["checkpointed_modules"] = patched.count
        res["seconds"] = round(time.perf_counter() - start, 2)
        return res

    out["plain"] = train("plain")
    import torch

    cpu = torch.device("cpu")  # where the memory plan reads a GPU's memory on one: the calls run here too
    out["loaded_on_cpu"], out["memory_for_training"] = compat.models_loaded_on(cpu), compat.memory_for_training(cpu)
    os.environ["STREAMING_CACHE_DEVICE_MEMORY"] = "8GiB"  # a plan to make, for a model the estimate does not know
    try:
        out["planned"] = train("planned", steps=1)
    finally:
        del os.environ["STREAMING_CACHE_DEVICE_MEMORY"]
    out["depth2"] = train("depth2", checkpoint_depth=2)
    out["depth2_vs_plain"] = _difference("depth2", "plain") if out["depth2"]["ok"] else None
    out["share"] = train("share", checkpoint_share=0.5)
    out["share_vs_plain"] = _difference("share", "plain") if out["share"]["ok"] else None
    out["fp16"] = train("half", training_dtype="fp16", lora_dtype="bf16", optimizer="AdamW", learning_rate=1e-3)
    out["offloading"] = train("offload", offloading=True)
    if out["offloading"]["ok"]:
        out["offloading_vs_plain"] = _difference("offload", "plain")
    out["fp8_wrapped"] = train("fp8_wrapped", weight_dtype="fp8_e4m3fn")
    out["fp8_bypass"] = train("fp8_bypass", weight_dtype="fp8_e4m3fn", bypass_mode=True)
    if out["fp8_bypass"]["ok"]:
        out["bypass_vs_wrapped"] = _difference("fp8_bypass", "fp8_wrapped")
        out["bypass_lora"] = lora_changes_output(TINY_DIT, "fp8_bypass", cond, latent, weight_dtype="fp8_e4m3fn")
    out["bypass_loha"] = train("loha_bypass", bypass_mode=True, algorithm="LoHa")
    out["continued"] = train("plain", steps=4, checkpoint_depth=2, offloading=compat.HAS_OFFLOADING)
    out["flux_blocks"] = flux_block_gradients()
    if compat.HAS_OFFLOADING:  # on the newest ComfyUI only (the oldest builds Flux far more slowly on the CPU)
        out.update(_flux(train))
    return out


if __name__ == "__main__":
    run_scenario_main(scenario)
