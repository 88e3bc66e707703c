"""Sample values shaped like ComfyUI's LATENT and CONDITIONING."""

from __future__ import annotations

import torch


def latent(seed: int, shape=(1, 4, 8, 8)) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"samples": torch.randn(*shape, generator=g), "batch_index": [seed]}


def conditioning(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(1, 768, generator=g)
    return [[torch.randn(1, 77, 768, generator=g), {"pooled_output": pooled, "guidance": 3.5, "note": "x"}]]
