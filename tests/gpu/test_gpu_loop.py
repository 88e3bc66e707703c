"""The training loop on a CUDA GPU waits for the device once per micro-step, and once before the first step where
it checks a fused optimizer step against the plain one (skipped without CUDA).

Each wait for the device leaves the host idle until every queued kernel has run, and the device idle while the
host then prepares the next step. The loop reads a micro-step's loss before it queues the backward pass, so
backward pass, clipping, optimizer step, learning-rate schedule and EMA run on the device while the host already
fetches and prepares the next batch; PyTorch's sync debug mode reports every operation that waits.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from streaming_cache.train.conditioning import upload
from streaming_cache.train.loop import TrainConfig, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _waits(work) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            work()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("optimizer", ["AdamW", "Adam", "SGD"])
def test_the_loop_waits_for_the_device_once_per_micro_step(optimizer):
    torch.manual_seed(0)
    weight = torch.zeros(64, 64, device="cuda", requires_grad=True)
    batches = [torch.randn(8, 64, device="cuda") for _ in range(4)]

    def loss_fn(batch: torch.Tensor, micro: int) -> torch.Tensor:
        return ((batch @ weight - 1.0) ** 2).mean()

    config = TrainConfig(steps=3, optimizer=optimizer, grad_accumulation=2, max_grad_norm=1.0, ema_decay=0.9,
                         schedule="cosine", warmup_steps=1)
    result = None

    def work() -> None:
        nonlocal result
        result = train({"w": weight}, batches, loss_fn, config)

    trial = 1 if optimizer in ("AdamW", "Adam") else 0  # the fused step checked once against the plain one
    assert _waits(work) == config.steps * config.grad_accumulation + trial
    assert result is not None and len(result.losses) == 3 and result.losses[-1] < result.losses[0]


def test_upload_does_not_wait_for_queued_work():
    big = torch.randn(2048, 2048, device="cuda")

    def work() -> None:
        for _ in range(8):
            big @ big  # queued, still running when the upload is made
        moved = upload(torch.arange(16, dtype=torch.float32), torch.device("cuda"))
        assert moved.device.type == "cuda"

    assert _waits(work) == 0
    assert torch.equal(upload(torch.arange(16.0), torch.device("cuda")).cpu(), torch.arange(16.0))
