"""An exponential moving average (EMA) of the trainable weights, saved with the checkpoint so a resume is exact.

After every optimizer step each averaged tensor moves towards the trained one:
``avg = d * avg + (1 - d) * w`` with ``d = min(decay, (1 + n) / (10 + n))`` at the n-th update (0-based). The
warm-up of ``d`` (as in diffusers' ``EMAModel``) keeps the first updates from being dominated by the initial
weights: a LoRA's up matrices start at zero, and a plain decay of 0.999 would keep the average near zero for
thousands of steps. The averages are kept in float32 whatever the weights' dtype (bf16 cannot resolve the small
per-step moves of a slow average).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CacheError


class EMA:
    """The moving average of ``params`` (name -> tensor; the tensors themselves, updated in place by the
    optimizer, are read at each :meth:`update`)."""

    def __init__(self, params: Mapping[str, torch.Tensor], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be between 0 and 1 (exclusive), got {decay}")
        self.params = dict(params)
        self.decay = float(decay)
        self.updates = 0
        self.shadow = {k: v.detach().to(torch.float32, copy=True) for k, v in self.params.items()}

    def current_decay(self) -> float:
        """The decay the next :meth:`update` uses (warmed up, see the module docstring)."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, keep: torch.Tensor | None = None) -> None:
        """Move every average towards the current weights; call once after each optimizer step. ``keep``: a
        0-d flag on the device, false for a step skipped there (the averages then stay as they are, read on the
        device; the update still counts for the decay's warm-up, which the host keeps)."""
        weight = 1.0 - self.current_decay()
        weights: dict[torch.device, torch.Tensor] = {}
        for k, v in self.params.items():
            shadow = self.shadow[k]
            if keep is not None:
                if shadow.device not in weights:
                    weights[shadow.device] = keep.to(shadow.device, torch.float32) * weight
                shadow.lerp_(v.detach().to(torch.float32), weights[shadow.device])
            else:
                shadow.lerp_(v.detach().to(torch.float32), weight)
        self.updates += 1

    def averaged(self) -> dict[str, torch.Tensor]:
        """Copies of the averaged weights, in each weight's own dtype and device (a LoRA to save or apply)."""
        return {k: self.shadow[k].to(dtype=v.dtype, device=v.device, copy=True) for k, v in self.params.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates,
                "shadow": {k: v.detach().clone() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`. The decay stays the one this EMA was made with."""
        shadow = state.get("shadow")
        if not isinstance(shadow, Mapping) or set(shadow) != set(self.shadow):
            raise CacheError("the checkpoint's EMA weights do not match the LoRA layout; use the same model, rank "
                             "and algorithm, or start a new run")
        for k, v in self.shadow.items():
            saved = shadow[k]
            if not isinstance(saved, torch.Tensor) or saved.shape != v.shape:
                raise CacheError(f"the checkpoint's EMA tensor {k} does not match the LoRA layout; start a new run")
            v.copy_(saved)
        self.updates = int(state.get("updates", 0))
