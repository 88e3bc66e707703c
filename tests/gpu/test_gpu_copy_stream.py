"""The loader's copy stream on a CUDA GPU (skipped without CUDA): batches copied on the side stream while the
default stream is busy arrive intact, and reused pinned buffers are never overwritten before their copy ends."""

from __future__ import annotations

import pytest
import torch

import streaming_cache as sc
from streaming_cache.loader import BatchLoader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    """96 rows of 1 MiB, each filled with its own number."""
    path = tmp_path_factory.mktemp("copy") / "cache"
    with sc.CacheWriter(path) as w:
        for i in range(96):
            w.put(f"r{i:03d}", {"samples": torch.full((4, 256, 256), float(i))})
    return sc.open_cache(path).dataset()


def test_batches_arrive_intact_while_the_default_stream_computes(handle):
    a = torch.randn(4096, 4096, device="cuda")
    seen: list[int] = []
    with BatchLoader(handle, 8, seed=3, device="cuda", workers=3, prefetch=4) as loader:
        for _ in range(3):
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
    assert sorted(seen) == sorted(list(range(96)) * 3)
