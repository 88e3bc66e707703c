"""A toy :class:`~streaming_cache.train.backend.TrainBackend` (a linear regression with per-sample noise) and its
dataset, for trainer tests that need no model: one process, or several under torchrun (``ddp_toy.py``)."""

from __future__ import annotations

import torch

import streaming_cache as sc


def pairs_cache(path: str, rows: int = 24) -> str:
    """A cache of (x, y) pairs with y = 3x + 1 (one entry per row); returns ``path``."""
    with sc.CacheWriter(path) as w:
        for i in range(rows):
            x = torch.tensor([i / rows])
            w.put(f"k{i}", {"x": x, "y": 3 * x + 1})
    return path


def linear_pairs_cache(path: str, rows: int) -> str:
    """A cache of (x, y) pairs with y = A x + 1 for a fixed random 4x4 A (one entry per row); returns ``path``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 4, generator=g)
    with sc.CacheWriter(path) as w:
        for i in range(rows):
            x = torch.randn(4, generator=g)
            w.put(f"k{i}", {"x": x, "y": a @ x + 1})
    return path


class Toy:
    """A TrainBackend: y = w x + b, the loss of a batch with a little noise on x, drawn per sample. ``fail``:
    raise ValueError on the first batch holding that x (a sample that cannot be trained)."""

    def __init__(self, fail: float | None = None) -> None:
        self.params = {"w": torch.zeros(1, requires_grad=True), "b": torch.zeros(1, requires_grad=True)}
        self.runs, self.micros, self.fail = 0, [], fail

    def parameters(self):
        return self.params

    def loss(self, batch, draws, *, t=None):
        self.micros.append(draws.micro)
        x = batch["x"]
        if self.fail is not None and bool((x == self.fail).any()):
            raise ValueError(f"cannot train on x={self.fail}")
        noise = 0.0 if t is not None else draws.randn((1,), x.shape[0])[0] * 0.01
        pred = self.params["w"] * (x + noise) + self.params["b"]
        return ((pred - batch["y"]) ** 2).mean()

    def run(self, work):
        self.runs += 1
        return work(torch.device("cpu"))
