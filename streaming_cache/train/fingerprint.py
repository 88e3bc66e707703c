"""Fingerprints of model weights: cheap, yet different whenever the weights differ.

An encoder's fingerprint goes into every cache key, so a different VAE or text encoder never reuses another's
entries. Hashing every weight of a multi-GB model would cost seconds; instead the fingerprint covers every
tensor's name, dtype and shape plus a strided sample of its values (up to ``samples`` elements spread over the
whole tensor, first and last included). Fine-tunes, merges and LoRA-patched weights change the sampled values.

Floating-point samples are hashed by value (as float64), not by storage dtype: ComfyUI may load the same
checkpoint in fp16 or fp32 depending on free memory, and those are the same weights, so they must not
invalidate a cache. A lossy conversion (fp32 weights cast to fp16 or fp8) changes values and so the fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash


def _sample(t: torch.Tensor, samples: int) -> bytes:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return b""
    if n > samples:
        # Integer arithmetic: float positions round past the end for tensors of more than 2**24 elements.
        idx = torch.arange(samples, dtype=torch.int64, device=flat.device) * (n - 1) // (samples - 1)
        # fp8 tensors: indexed as bytes (PyTorch before 2.6 has no CPU indexing for them)
        flat = flat.view(torch.uint8)[idx].view(flat.dtype) if flat.element_size() == 1 else flat[idx]
    flat = flat.to("cpu")
    if flat.dtype.is_floating_point:
        flat = flat.to(torch.float64)  # the value, not its storage type (see module docstring)
    return flat.contiguous().numpy().tobytes()


def fingerprint_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                        samples: int = 256, extra: Any = None) -> str:
    """xxh3-128 hex of names, dtypes, shapes and a strided value sample of every tensor, plus ``repr(extra)``."""
    items = sorted(tensors.items() if isinstance(tensors, Mapping) else tensors, key=lambda kv: kv[0])
    h = xxhash.xxh3_128()
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            continue
        kind = "float" if t.dtype.is_floating_point else str(t.dtype)
        h.update(f"{name}|{kind}|{tuple(t.shape)}|".encode())
        h.update(_sample(t, samples))
    h.update(repr(extra).encode())
    return h.hexdigest()
