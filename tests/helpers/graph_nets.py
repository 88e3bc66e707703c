"""The small model the CUDA-graph tests record and replay (``tests/train/test_graph_replay.py``,
``tests/train/test_graphs_memory.py``)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


class Net(torch.nn.Module):
    """Checkpointed blocks whose adapters are held outside the parameters (as ComfyUI's weight wrappers hold a
    LoRA's). ``sync``: each pass reads a value on the host (which cannot be recorded). ``device``: an emulated graph
    device told of each pass (``model_pass``)."""

    def __init__(self, d: int = 16, blocks: int = 3, sync: bool = False, device=None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))
        for lin in self.blocks:
            torch.nn.init.normal_(lin.weight, std=0.3, generator=g)
        self.requires_grad_(False)
        self.sync, self.device = sync, device
        self.adapters = [((torch.randn(4, d, generator=g) * 0.1).requires_grad_(),
                          (torch.randn(d, 4, generator=g) * 0.1).requires_grad_()) for _ in range(blocks)]

    def params(self) -> list[torch.Tensor]:
        return [t for pair in self.adapters for t in pair]

    def forward(self, x: torch.Tensor, context: torch.Tensor, transformer_options: dict | None = None) -> torch.Tensor:
        if self.device is not None:
            self.device.model_pass()
        if self.sync and float(x.sum()) == 12345.0:  # a value read on the host: cannot be recorded
            x = x + 1
        for lin, (down, up) in zip(self.blocks, self.adapters):
            def block(h: torch.Tensor, lin=lin, down=down, up=up) -> torch.Tensor:
                return torch.nn.functional.gelu(lin(h) + (h @ down.t()) @ up.t()) * context
            x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False) + x
        return x
