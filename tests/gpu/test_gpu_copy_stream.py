"""The loader's copy stream on a CUDA GPU (skipped without CUDA): batches copied on the side stream while the
default stream is busy arrive intact, and reused pinned buffers are never overwritten before their copy ends; where
the copy stream's machinery raises, the rest of the run's batches arrive intact the plain way. The same code runs on
the CPU through the emulated device (``tests/engine/test_copy_stream_emulated.py``)."""

from __future__ import annotations

import pytest
import torch

import streaming_cache as sc
from streaming_cache.fallbacks import COPY_STREAM
from streaming_cache.loader import BatchLoader
from streaming_cache.transfers import CudaTransfers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    """96 rows of 1 MiB, each filled with its own number."""
    path = tmp_path_factory.mktemp("copy") / "cache"
    with sc.CacheWriter(path) as w:
        for i in range(96):
            w.put(f"r{i:03d}", {"samples": torch.full((4, 256, 256), float(i))})
    return sc.open_cache(path).dataset()


def _drain(loader: BatchLoader, epochs: int) -> list[int]:
    """Every row id the loader hands out over ``epochs``, each batch checked whole while the default stream is
    kept busy (so the next copies are in flight) and then written to by the consumer."""
    a = torch.randn(4096, 4096, device="cuda")
    seen: list[int] = []
    for _ in range(epochs):
        for batch in loader:
            x = batch["samples"]
            for _ in range(4):  # keeps the default stream busy while the next copies are in flight
                a = torch.tanh(a @ a * 1e-3)
            ids = x[:, 0, 0, 0].round().long()
            expected = ids.view(-1, 1, 1, 1).float().expand_as(x)
            assert torch.equal(x, expected), "a batch was overwritten or read before its copy ended"
            seen += ids.tolist()
            x.mul_(0.0)  # the consumer writes into its batch: must not reach a later batch
    torch.cuda.synchronize()
    return seen


def test_batches_arrive_intact_while_the_default_stream_computes(handle):
    with BatchLoader(handle, 8, seed=3, device="cuda", workers=3, prefetch=4) as loader:
        assert isinstance(loader.transfers, CudaTransfers) and loader.pool.pinning
        seen = _drain(loader, 3)
    assert sorted(seen) == sorted(list(range(96)) * 3)
    assert not loader.fallbacks, loader.fallbacks.lines()
    assert loader.pool.pinned_bytes > 0


class FailingRecordStream(CudaTransfers):
    """CUDA's transfers whose ``record_stream`` raises from its 7th call on (the seventh batch: one tensor each)."""

    def __init__(self) -> None:
        self.calls = 0

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.calls += 1
        if self.calls >= 7:
            raise RuntimeError("CUDA error: injected failure of record_stream")
        super().record_stream(tensor, stream)


def test_after_the_copy_stream_fails_batches_arrive_intact_the_plain_way(handle):
    transfers = FailingRecordStream()
    with BatchLoader(handle, 8, seed=3, device="cuda", workers=3, prefetch=4, transfers=transfers) as loader:
        seen = _drain(loader, 2)
    with BatchLoader(handle, 8, seed=3, device="cuda", workers=3, prefetch=4) as reference:
        expected = _drain(reference, 2)
    assert seen == expected
    assert "injected failure of record_stream" in loader.fallbacks.reason(COPY_STREAM)
    assert transfers.calls == 7, "nothing is tried on the copy stream after it failed"
