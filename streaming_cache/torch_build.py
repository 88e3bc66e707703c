"""Which build of PyTorch this process runs, for the device decisions that differ between them.

PyTorch's ROCm build runs on AMD GPUs through the same ``torch.cuda`` API as the CUDA build runs on NVIDIA's:
the devices are ``cuda`` devices, ``torch.cuda.is_available()`` is True and ``torch.version.cuda`` is None while
``torch.version.hip`` names the HIP version. A decision that branches on the device type alone therefore takes its
CUDA branch on AMD GPUs too; each such decision either is checked to work there or asks :func:`is_rocm` and stays
off. The pack's: the fused optimizer step (``train.optim``: on, and tried on each device and dtype before the
first step), the attention settling call (``train.recompute``: on, one tiny attention call), CUDA graphs (decided
by the node's backend).
"""

from __future__ import annotations

import torch


def is_rocm() -> bool:
    """Whether this process runs PyTorch's ROCm (HIP) build, whose "cuda" devices are AMD GPUs. Read at each call
    (a test may stand in another build)."""
    return bool(getattr(torch.version, "hip", None))
