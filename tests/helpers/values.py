"""Sample values shaped like ComfyUI's LATENT and CONDITIONING, and how far two trained LoRAs are apart."""

from __future__ import annotations

import torch


def latent(seed: int, shape=(1, 4, 8, 8)) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"samples": torch.randn(*shape, generator=g), "batch_index": [seed]}


def conditioning(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(1, 768, generator=g)
    return [[torch.randn(1, 77, 768, generator=g), {"pooled_output": pooled, "guidance": 3.5, "note": "x"}]]


TRAINED_FROM_ZERO = (".lora_down.weight", ".diff", ".diff_b")
"""The LoRA tensors a new training starts at zero: ComfyUI's LoRA starts ``lora_down`` at zero and ``lora_up``
random; trained bias and norm differences start at zero."""


def lora_difference(a: dict, b: dict) -> dict:
    """How far two LoRAs of a new training (tensors by key) are apart, against how far training moved them:
    ``moved`` is the largest value of the tensors that start at zero (:data:`TRAINED_FROM_ZERO`), so a bound
    relative to it scales with what the training changed, not with the random initialisation of ``lora_up``."""
    if sorted(a) != sorted(b):
        return {"same_keys": False}
    moved = max(float(a[k].float().abs().max()) for k in a if k.endswith(TRAINED_FROM_ZERO))
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return {"same_keys": True, "moved": moved, "max_difference": diff}
