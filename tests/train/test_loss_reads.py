"""When the loop reads the steps' losses (``loop`` module docstring): with an optimizer that can skip a step on the
device (a fused AdamW step, as on a GPU), the losses wait there and are read together, every
``TrainHooks.report_seconds``, at the most unread steps, before a checkpoint and at the end. When they are read
changes what is reported when, never what is trained."""

from __future__ import annotations

import math

import pytest
import torch

from streaming_cache.train import loop, optim

pytestmark = pytest.mark.oldest_torch

INF = float("inf")


class _Loader:
    """Batches in a fixed order, with the state a checkpoint keeps."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches, self.position = batches, 0

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _train(steps: int, hooks: loop.TrainHooks, *, nan_at: int | None = None, fused: bool = True,
           **config) -> tuple[loop.TrainResult, dict[str, torch.Tensor], list[str]]:
    """A small run whose calls of ``on_step`` ("step N") and ``on_read`` ("read") are logged in order."""
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.zeros(8, requires_grad=True)}
    batches = [torch.randn(8, generator=g) for _ in range(16)]
    log: list[str] = []

    def loss_fn(batch: torch.Tensor, micro: int) -> torch.Tensor:
        loss = (params["w"] - batch).square().mean()
        return loss * float("nan") if nan_at is not None and micro == nan_at - 1 else loss

    def on_step(step: int, value: float) -> None:
        log.append(f"step {step}")
        if hooks.on_step is not None:
            hooks.on_step(step, value)

    logged = loop.TrainHooks(on_step=on_step, on_read=lambda: log.append("read"), save=hooks.save,
                             stop_at=hooks.stop_at, report_seconds=hooks.report_seconds)
    previous = optim._fused
    optim._fused = (lambda groups: True) if fused else previous  # the fused AdamW step a CUDA device takes
    try:
        result = loop.train(params, _Loader(batches), loss_fn, loop.TrainConfig(steps=steps, learning_rate=0.05, **config),
                            hooks=logged)
    finally:
        optim._fused = previous
    return result, params, log


def test_reading_every_step_or_only_at_the_end_trains_the_same_weights_and_reports_the_same_steps():
    every, w_every, log_every = _train(10, loop.TrainHooks(report_seconds=0.0), ema_decay=0.9)
    once, w_once, log_once = _train(10, loop.TrainHooks(report_seconds=INF), ema_decay=0.9)
    assert once.losses == every.losses and len(once.losses) == 10
    assert torch.equal(w_once["w"], w_every["w"]) and all(
        torch.equal(once.ema_weights[k], every.ema_weights[k]) for k in w_once)
    steps = [f"step {s}" for s in range(1, 11)]
    assert log_every == [x for s in steps for x in (s, "read")]
    assert log_once == steps + ["read"], "read once, at the end"


def test_unread_losses_are_read_after_at_most_a_bounded_number_of_steps(monkeypatch):
    monkeypatch.setattr(loop, "MOST_UNREAD", 4)
    _, _, log = _train(10, loop.TrainHooks(report_seconds=INF))
    assert [i for i, x in enumerate(log) if x == "read"] == [4, 9, 12]


def test_a_checkpoint_reads_and_reports_the_steps_before_it():
    saved: list[tuple[int, int]] = []
    result, _, log = _train(6, loop.TrainHooks(report_seconds=INF, save=lambda s, final: saved.append(
        (s["step"], len(s["losses"])))), save_every=4)
    assert saved == [(4, 4), (6, 6)] and log.index("read") == 4 and len(result.losses) == 6


def test_a_run_stops_before_step_stop_at_with_its_steps_reported():
    result, _, log = _train(10, loop.TrainHooks(report_seconds=INF, stop_at=3))
    assert result.stopped and result.step == 3 and log == ["step 1", "step 2", "step 3", "read"]


@pytest.mark.parametrize("fused", [True, False], ids=["skipped on the device", "refused before the step"])
def test_a_non_finite_loss_stops_the_run_and_the_checkpoint_keeps_every_good_step(fused):
    saved: list[dict] = []
    with pytest.raises(FloatingPointError, match="loss is nan at step 3") as caught:
        _train(8, loop.TrainHooks(report_seconds=INF, save=lambda s, final: saved.append(s)), nan_at=3, fused=fused)
    (state,) = saved
    if fused:  # read at the end: steps 4 to 8 trained without the skipped one
        assert "the run went on to step 8" in str(caught.value)
        assert state["step"] == 8 and len(state["losses"]) == 8 and math.isnan(state["losses"][2])
        assert all(math.isfinite(v) for i, v in enumerate(state["losses"]) if i != 2)
        reference, _, _ = _train(2, loop.TrainHooks())
        assert state["losses"][:2] == reference.losses
    else:  # read before the step: it stops there
        assert state["step"] == 2 and len(state["losses"]) == 2
    assert all(v.isfinite().all() for v in state["weights"].values())
