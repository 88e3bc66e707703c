"""A training micro-step makes the host wait for the device nowhere but where the loop means to (its loss): no device
value read on the host, nothing copied to or from the host. ``graph_devices.HostWaits`` counts such calls on the
CPU, which stands for the device here, and refuses them in an emulated CUDA-graph capture.

The step is the engine side of ``ComfyBackend.loss`` (``nodes/backend/training.py``, which needs ComfyUI): an
SDXL-like batch (pooled output, size options) of two samples, marked on the host before its copy to the device as
the loader's worker would, caption dropout with the empty caption kept on the device, the samples' groups and a
split batch's rows, then the loop's fp16 optimizer step through its gradient scaler (a fused AdamW step, as on a
GPU).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from streaming_cache.train import conditioning, loop, optim
from streaming_cache.train.graph_devices import FROM_HOST, READ, TO_HOST, HostWaits
from streaming_cache.train.optim import FusedSteps

pytestmark = pytest.mark.oldest_torch

TOKENS, WIDTH, POOLED = 77, 32, 16


def sdxl_batch(widths: list[int], g: torch.Generator) -> dict[str, Any]:
    """A collated batch as the loader builds it on the host: SDXL's conditioning (tokens, pooled output, sizes)."""
    n = len(widths)
    cond = [[torch.randn(n, 1, TOKENS, WIDTH, generator=g),
             {"pooled_output": torch.randn(n, 1, POOLED, generator=g), "width": list(widths), "height": [1024] * n,
              "crop_w": [0] * n, "crop_h": [0] * n}]]
    return {"cond": cond, "latent": {"samples": torch.randn(n, 1, 4, 8, 8, generator=g)}}


def empty_caption() -> list:
    """The empty caption's conditioning as cached (on the host)."""
    return [[torch.zeros(1, TOKENS, WIDTH), {"pooled_output": torch.zeros(1, POOLED)}]]


def copied(value: Any) -> Any:
    """``value`` as the loader's copy puts it on the device (the emulated copy: new memory)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copied(v) for v in value]
    return value


def model(x: torch.Tensor, cond: list, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A toy model in fp16 (as autocast runs one): the latent and the pooled output through a LoRA-like pair."""
    (c, extra), = cond
    pooled = extra["pooled_output"].flatten(1)
    h = x.flatten(1).half() @ params["down"].half().t() + c.mean(dim=(1, 2))[:, None].half()
    return (h @ params["up"].half().t()).float() + pooled.mean(dim=1, keepdim=True)


def micro_step(batch: dict[str, Any], empty: Any, drop: list[bool], noise: torch.Tensor,
               params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of one micro-step as ``ComfyBackend.loss`` builds it: the samples grouped by their options, each
    group's conditioning (its captions dropped) for one model call on its rows."""
    latent = conditioning.flatten_batch(batch["latent"]["samples"])
    samples = batch["latent"]["samples"].shape[0]
    n = latent.shape[0]
    per = n // samples
    groups = conditioning.option_groups(batch["cond"], samples)
    total = None
    for group in groups:
        whole = len(groups) == 1
        part = batch if whole else conditioning.take_rows(batch, group)
        rows = conditioning.sample_rows(group, per)
        step = conditioning.step_conditioning(part["cond"], empty, [drop[i] for i in group])
        cond = conditioning.to_device(step, latent.device)
        x = conditioning.pick_rows(latent, rows) + conditioning.pick_rows(noise, rows)
        loss = (model(x, cond, params) - 1.0).square().mean() * (len(rows) / n)
        total = loss if total is None else total + loss
    assert total is not None
    return total


@pytest.mark.parametrize("widths", [[1024, 1024], [1024, 768]], ids=["one call", "split into two calls"])
def test_a_micro_step_and_its_fp16_optimizer_step_make_the_host_wait_for_nothing(monkeypatch, widths):
    monkeypatch.setattr(optim, "_fused", lambda groups: True)  # the fused AdamW step a CUDA device takes
    g = torch.Generator().manual_seed(0)
    host = sdxl_batch(widths, g)
    # as the loader's worker does, before the copy
    host["cond"] = conditioning.mark_equal_samples(host["cond"], empty_caption())
    batch, empty = copied(host), copied(empty_caption())  # the empty caption: on the device once per run
    noise = torch.randn(2, 1, 4, 8, 8, generator=g).flatten(0, 1)
    params = {"down": (torch.randn(4, 256, generator=g) * 0.05).requires_grad_(),
              "up": torch.zeros(1, 4, requires_grad=True)}
    run = loop._Run(params, [], lambda b, m: torch.zeros(()),
                    loop.TrainConfig(steps=2, grad_scaling=True, max_grad_norm=1.0), loop.TrainHooks())
    steps = FusedSteps(run.optimizer, run.hooks.fallbacks or optim.Fallbacks(), scaled=True)
    assert run.scaler is not None and steps.fused
    drop = [True, False]  # caption dropout drops the first sample in both micro-steps
    lowered = 0

    def one_step() -> torch.Tensor:
        loss = micro_step(batch, empty, drop, noise, params)
        run.scaler.scale(loss).backward()
        run.apply(steps)
        return loss

    for counted in (False, True):  # the first step checks the fused step once (a wait of the run, not the step)
        scale = run.scaler.get_scale()
        if counted:
            with HostWaits(host=[host, empty_caption()]) as waits:
                loss = one_step()
        else:
            one_step()
        lowered += int(run.scaler.get_scale() < scale)
    assert waits.calls == [], waits.calls
    assert float(loss.detach()) > 0 and lowered >= 1, "fp16 overflows at the first scale: a step is skipped"
    run.count_skipped()  # what a checkpoint or the end of the run reads: the steps whose scale was lowered
    assert run.result.overflow_steps == lowered


def test_the_marked_step_gives_what_comparing_on_the_device_gives():
    g = torch.Generator().manual_seed(1)
    host = sdxl_batch([1024, 1024], g)
    host["cond"][0][1]["pooled_output"][1] = host["cond"][0][1]["pooled_output"][0]  # a caption twice
    marked = conditioning.mark_equal_samples(host["cond"], empty_caption())
    for drop in ([False, False], [True, False], [True, True]):
        with HostWaits() as waits:
            (c, extra), = conditioning.step_conditioning(marked, empty_caption(), drop)
        (c_ref, extra_ref), = conditioning.step_conditioning(host["cond"], empty_caption(), drop)
        assert waits.counts[READ] == 0 and torch.equal(c, c_ref) and set(extra) == set(extra_ref)
        assert torch.equal(extra["pooled_output"], extra_ref["pooled_output"])
        given_once = drop[0] == drop[1]
        assert extra["pooled_output"].shape == ((1, POOLED) if given_once else (2, POOLED)), drop


@pytest.mark.parametrize("call,kind", [
    (lambda x, h: torch.equal(x[0], x[1]), READ),
    (lambda x, h: x.sum().item(), READ),
    (lambda x, h: bool(x.sum() > 0), READ),
    (lambda x, h: x.tolist(), READ),
    (lambda x, h: x.nonzero(), READ),
    (lambda x, h: x[x > 0], READ),
    (lambda x, h: x.cpu(), TO_HOST),
    (lambda x, h: x.to("cpu"), TO_HOST),
    (lambda x, h: torch.tensor([True, False], device=x.device), FROM_HOST),
    (lambda x, h: h.to(x.device, x.dtype), FROM_HOST),
    (lambda x, h: x[[0, 2]], FROM_HOST),
    (lambda x, h: x.to(h.device), TO_HOST),
    (lambda x, h: x.to(torch.Tensor([1.0]).device), TO_HOST),
    (lambda x, h: torch.Tensor([1.0, 2.0]).to(x.device), FROM_HOST),
], ids=["torch.equal", "item", "bool", "tolist", "nonzero", "boolean mask", ".cpu()", ".to('cpu')",
        "torch.tensor(data, device)", "host tensor to the device", "list as an index", "to a host tensor's device",
        "to a legacy host tensor's device", "legacy host tensor to the device"])
def test_what_makes_the_host_wait_is_counted_by_kind(call, kind):
    x, h = torch.randn(3, 2), torch.ones(2)
    with HostWaits(host=[h]) as waits:
        call(x, h)
    assert dict(waits.counts) == {kind: 1}, waits.calls


def test_device_work_and_host_work_are_not_counted():
    x, h = torch.randn(3, 2), torch.ones(2)
    with HostWaits(host=[h]) as waits:
        y = torch.where(x > 0, x, torch.zeros_like(x))[0:2].to(x.device) * 2
        torch.cat([y[0:1], x[2:3]]).to(torch.float64)
        z = torch.zeros(3, 2, device=x.device)
        z[1] = x[0]
        z[z > 0] = 0.0  # a number set through a mask: a masked fill, no read
        made = torch.tensor([1.0, 2.0])  # host data on the host: the host reads its own memory
        g = torch.Generator().manual_seed(0)
        drawn = torch.rand(2, generator=g, device=g.device)  # a CPU generator draws in host memory
        assert [float(v) for v in drawn] == drawn.tolist()
        assert float(made[0] + h[1]) == 2.0 and torch.equal(h, torch.ones(2)) and made.tolist() == [1.0, 2.0]
        x.cpu().tolist()  # one copy to the host (counted), then a host read of the copy (not)
    assert dict(waits.counts) == {TO_HOST: 1}, waits.calls


def test_a_legacy_constructors_tensor_is_host_memory_only_while_counted():
    """``torch.Tensor([...])`` is seen by no torch function mode: the mode watches the constructor while it counts
    (ComfyUI's SDXL builds its size embedding so, on the host), and leaves it as it was."""
    x = torch.randn(2)
    with HostWaits() as waits:
        flat = torch.Tensor([3.0, 4.0]) * 2
        torch.cat((x.to(flat.device), flat))  # a device tensor moved to where a host tensor is: copied to the host
        torch.cat((flat.to(flat.device), flat))  # host to host
        assert waits.on_host(flat)
    assert dict(waits.counts) == {TO_HOST: 1}, waits.calls
    assert "__new__" not in vars(torch.Tensor) and torch.Tensor([1.0]).tolist() == [1.0]
    with pytest.raises(RuntimeError, match="boom"), HostWaits():
        raise RuntimeError("boom")
    assert "__new__" not in vars(torch.Tensor)


def _accumulating_run(loss_fn) -> tuple[loop._Run, loop.Batches, FusedSteps, dict[str, torch.Tensor]]:
    """A run of four micro-steps per optimizer step over host batches, with the fused AdamW step a GPU takes."""
    g = torch.Generator().manual_seed(2)
    params = {"w": torch.zeros(8, requires_grad=True)}
    batches = [torch.randn(8, generator=g) for _ in range(12)]
    run = loop._Run(params, batches, lambda b, m: loss_fn(params["w"], b, m),
                    loop.TrainConfig(steps=3, grad_accumulation=4), loop.TrainHooks())
    steps = FusedSteps(run.optimizer, optim.Fallbacks(), scaled=False)
    return run, loop.Batches(batches), steps, params


def test_steps_of_four_micro_steps_wait_for_the_device_only_when_their_losses_are_read(monkeypatch):
    """The loss is summed on the device and kept there: steps queue with no wait, and the losses of several steps
    are read at once, when they are reported."""
    monkeypatch.setattr(optim, "_fused", lambda groups: True)
    run, batches, steps, _ = _accumulating_run(lambda w, b, m: (w - b).square().mean())
    run.hooks = loop.TrainHooks(report_seconds=float("inf"), on_step=lambda s, v: reported.append((s, v)))
    reported: list[tuple[int, float]] = []
    assert steps.fused and run.deferring()
    run.finished_step(run.backward(batches))
    run.apply(steps)  # the first step checks the fused step once (a wait of the run, not the step)
    with HostWaits() as waits:
        for _ in range(2):
            loss = run.backward(batches)
            run.apply(steps)
            run.finished_step(loss)
    assert waits.calls == [] and reported == [] and run.result.losses == []
    with HostWaits() as waits:
        run.report()
    assert dict(waits.counts) == {READ: 1}, waits.calls
    assert [s for s, _ in reported] == [1, 2, 3] and run.result.losses == [v for _, v in reported]
    assert all(v > 0 for v in run.result.losses)


def test_a_non_finite_loss_skips_its_step_on_the_device_and_stops_the_run_when_read(monkeypatch):
    monkeypatch.setattr(optim, "_fused", lambda groups: True)
    run, batches, steps, params = _accumulating_run(
        lambda w, b, m: (w - b).square().mean() * (float("nan") if m == 5 else 1.0))  # step 2's second micro-step
    reported: list[int] = []
    run.hooks = loop.TrainHooks(report_seconds=float("inf"), on_step=lambda s, v: reported.append(s))
    run.ema = loop.EMA(params, 0.9)

    def one_step() -> None:
        loss = run.backward(batches)
        run.apply(steps)
        run.finished_step(loss)

    one_step()
    after_one = params["w"].detach().clone()
    state = {k: v.clone() for k, v in run.optimizer.state[params["w"]].items()}
    averaged = run.ema.shadow["w"].clone()
    with HostWaits() as waits:
        one_step()  # queued with no wait: the step is skipped on the device
    assert waits.calls == []
    assert torch.equal(params["w"], after_one), "the skipped step changed a weight"
    assert all(torch.equal(run.optimizer.state[params["w"]][k], v) for k, v in state.items()), \
        "the skipped step changed the optimizer's state (its step count included)"
    assert torch.equal(run.ema.shadow["w"], averaged), "the skipped step moved the EMA"
    one_step()
    assert not torch.equal(params["w"], after_one) and params["w"].isfinite().all()
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2 \(that step changed no weight, and the "
                                                 r"run went on to step 3\)"):
        run.report()
    assert reported == [1], "the steps before the non-finite one are reported"
    assert len(run.result.losses) == 3 and math.isnan(run.result.losses[1]), "a checkpoint holds every step's loss"


def test_a_gradient_scaler_skips_a_step_whose_loss_alone_is_not_finite(monkeypatch):
    """A non-finite loss whose gradients are finite (a term without gradient): the scaler, which checks only the
    gradients, is told, so the step is skipped on the device and the scale lowered."""
    monkeypatch.setattr(optim, "_fused", lambda groups: True)
    run, batches, _, params = _accumulating_run(
        lambda w, b, m: (w - b).square().mean() + (torch.tensor(float("inf")) if m == 5 else 0.0))
    run = loop._Run(params, [], run.loss_fn, loop.TrainConfig(steps=3, grad_accumulation=4, grad_scaling=True),
                    loop.TrainHooks(report_seconds=float("inf")))
    steps = FusedSteps(run.optimizer, optim.Fallbacks(), scaled=True)
    assert run.deferring()
    for _ in range(2):
        before, scale = params["w"].detach().clone(), run.scaler.get_scale()
        loss = run.backward(batches)
        run.apply(steps)
        run.finished_step(loss)
    assert torch.equal(params["w"], before) and run.scaler.get_scale() < scale
    with pytest.raises(FloatingPointError, match="loss is inf at step 2"):
        run.report()
