"""ComfyUI's own trainer (its TrainLoraNode) on a sweep family's model and data, for the families table's comparison (docs/families.md).

The node gets what ComfyUI's own dataset nodes would give it: the samples' latents stacked as one LATENT and one
conditioning per sample (with what the family's conditioning nodes add: a reference latent, an image-to-video
start frame), and trains one step. Called in the ComfyUI process, under ``inference_mode`` as the executor runs
nodes; the result says whether it trained, or the error it stopped with.
"""

from __future__ import annotations

import time
import traceback


def run(model, latents: list, conds: list, steps: int = 1) -> dict:
    """One step of TrainLoraNode on ``model`` (a ModelPatcher) with the ``latents`` (LATENT dicts, one per sample)
    and ``conds`` (one CONDITIONING per sample); ``{"ok": ..., "error": ..., "seconds": ...}``."""
    import torch
    from comfy_extras import nodes_train

    settings = {"batch_size": 1, "grad_accumulation_steps": 1, "steps": steps, "learning_rate": 1e-4, "rank": 4,
                "optimizer": "AdamW", "loss_function": "MSE", "seed": 0, "training_dtype": "bf16",
                "lora_dtype": "bf16", "algorithm": "LoRA", "gradient_checkpointing": True, "existing_lora": "[None]"}
    samples = torch.cat([lat["samples"] for lat in latents])
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            node = nodes_train.TrainLoraNode
            if hasattr(node, "define_schema"):  # the V3 node of newer ComfyUI takes every input as a list
                extra = {"quantized_backward": False, "checkpoint_depth": 1, "offloading": False,
                         "bucket_mode": False, "bypass_mode": False}
                inputs = {k: [v] for k, v in {**settings, **extra}.items()}
                node.execute(model=[model], latents=[{"samples": samples}], positive=conds, **inputs)
            else:  # the V1 node of ComfyUI v0.3.x: plain inputs, one conditioning entry per image
                node().train(model=model, latents={"samples": samples}, positive=[e for c in conds for e in c],
                             **settings)
        return {"ok": True, "error": "", "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001  (what stopped it is the result)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "seconds": time.perf_counter() - t0,
                "traceback": traceback.format_exc()[-1500:]}
