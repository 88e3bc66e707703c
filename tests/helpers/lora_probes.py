"""Weight deltas seen through random probes: how the LoRA-format tests compare what ComfyUI applies (in its child
process) with what diffusers applies (in the test process) without moving gigabytes of deltas between them.

``probe(name, delta)`` is ``delta`` (flattened to 2-D) times a random matrix seeded by ``name``: equal deltas give
equal probes, and different ones give different probes with probability one. In float32, as the deltas are: equal
deltas summed in another order differ by about 1e-6 of the largest probe. Needs torch only."""

from __future__ import annotations

import zlib

import torch

PROBES = 4


def probe(name: str, delta: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    flat = delta.detach().float().reshape(delta.shape[0], -1)
    return flat @ torch.randn(flat.shape[1], PROBES, generator=g)
