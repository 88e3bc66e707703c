"""The fused optimizer step falls back to PyTorch's plain step instead of ending the run, and trains what the plain
step trains (``optim.FusedSteps`` in ``loop.train``).

PyTorch runs the fused Adam step on the CPU too, so the fused path really runs here: the weights' device (the
CPU) is made one that takes the fused step (``optim.FUSED_DEVICES``), and the fused kernels
(``torch._fused_adam_`` / ``torch._fused_adamw_``, which ``torch.optim.adam._fused_adam`` calls) are made to fail
as a missing kernel does, or to compute something else."""

from __future__ import annotations

import pytest
import torch

import streaming_cache as sc
from helpers.toy_backend import linear_pairs_cache
from streaming_cache.fallbacks import FUSED_OPTIMIZER, Fallbacks
from streaming_cache.loader import BatchLoader
from streaming_cache.train import checkpoint, loop, optim

pytestmark = pytest.mark.oldest_torch

STEPS, CANCEL_AT = 8, 3
UP, DOWN, BIAS = "diffusion_model.m.lora_up.weight", "diffusion_model.m.lora_down.weight", "diffusion_model.m.diff_b"
MISSING = "CUDA error: no kernel image is available for execution on the device"
KERNELS = ("_fused_adam_", "_fused_adamw_")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A cache of (x, y) pairs, y = A x + 1 for a fixed 4x4 A."""
    return sc.open_cache(linear_pairs_cache(str(tmp_path_factory.mktemp("toy") / "cache"), 16)).dataset()


class Kernels:
    """PyTorch's fused Adam kernels, counted; from call ``fail_from`` on (1 = the first) they raise as a kernel
    missing on the GPU does, or with ``wrong`` they compute something else (one more added to every weight);
    ``fail_scaled``: they raise when given a gradient scaler's overflow flag."""

    def __init__(self, monkeypatch, fail_from: int | None = None, wrong: bool = False,
                 fail_scaled: bool = False) -> None:
        self.calls = 0
        for name in KERNELS:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), fail_from, wrong, fail_scaled))

    def _wrap(self, kernel, fail_from, wrong, fail_scaled):
        def run(params, *args, **kwargs):
            self.calls += 1
            if (fail_from is not None and self.calls >= fail_from) or \
                    (fail_scaled and kwargs.get("found_inf") is not None):
                raise RuntimeError(f"{MISSING}\nCUDA kernel errors might be asynchronously reported")
            kernel(params, *args, **kwargs)
            if wrong:
                torch._foreach_add_(params, 1.0)
        return run


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Adam's fused step for CPU weights, as for CUDA ones."""
    monkeypatch.setattr(optim, "FUSED_DEVICES", frozenset({"cuda", "cpu"}))


def params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {UP: torch.zeros(4, 2, requires_grad=True), DOWN: (torch.randn(2, 4, generator=g) * 0.5).requires_grad_(),
            BIAS: torch.zeros(4, requires_grad=True)}


def run(handle, config: dict, *, fp16: bool = False, resume=None, cancel_at: int | None = None,
        fallbacks: Fallbacks | None = None):
    """A training of the toy; returns (weights, result, the last checkpoint). ``cancel_at``: interrupted after that
    step (the checkpoint is the one saved then)."""
    torch.manual_seed(11)
    p = params()
    saved: list[dict] = []

    def loss_fn(batch, micro):
        x = batch["x"] + 1e-3 * torch.rand(batch["x"].shape)
        if fp16:  # the forward pass in fp16: the scaled gradients overflow at first and steps are skipped
            out = (x.half() @ (p[UP].half() @ p[DOWN].half()).T + p[BIAS].half()).float()
        else:
            out = x @ (p[UP] @ p[DOWN]).T + p[BIAS]
        return ((out - batch["y"]) ** 2).mean()

    def on_step(step, loss):
        if step == cancel_at:
            raise KeyboardInterrupt

    cfg = loop.TrainConfig(**{"steps": STEPS, "learning_rate": 0.05, **config})
    hooks = loop.TrainHooks(on_step=on_step, save=lambda state, final: saved.append(state), fallbacks=fallbacks,
                            report_seconds=0.0 if cancel_at is not None else 0.5)  # read each step to stop at one
    loader = BatchLoader(handle, 4, seed=1, workers=0)
    if cancel_at is not None:
        with pytest.raises(KeyboardInterrupt):
            loop.train(p, loader, loss_fn, cfg, resume=resume, hooks=hooks)
        return p, None, saved[-1]
    result = loop.train(p, loader, loss_fn, cfg, resume=resume, hooks=hooks)
    return p, result, saved[-1]


def plain_run(handle, config: dict, *, fp16: bool = False):
    """The reference: a run whose optimizer takes the plain step from the start."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(optim, "FUSED_DEVICES", frozenset())
        return run(handle, config, fp16=fp16)


def assert_same_state(a, b) -> None:
    """Two optimizer states alike: the same settings and bit-identical tensors, of one dtype and device."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key, state in a["state"].items():
        other = b["state"][key]
        assert state.keys() == other.keys()
        for name, value in state.items():
            assert value.dtype == other[name].dtype and value.device == other[name].device, (key, name)
            assert torch.equal(value, other[name]), (key, name)


def assert_same_run(a, b) -> None:
    (pa, ra, ca), (pb, rb, cb) = a, b
    assert ra.losses == rb.losses and ra.step == rb.step == STEPS
    assert ra.overflow_steps == rb.overflow_steps
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert_same_state(ca["optimizer"], cb["optimizer"])


OPTIONS = {
    "adamw": ({}, False),
    "adam": ({"optimizer": "Adam"}, False),
    "lora_plus": ({"lora_plus_ratio": 4.0}, False),  # two parameter groups
    "fp16_grad_scaling": ({"grad_scaling": True, "max_grad_norm": 1.0}, True),  # the scaler hands over found_inf
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_the_fused_step_runs_where_the_weights_take_it(toy, monkeypatch, fused_on_cpu, option):
    """What the other tests rely on: with CPU weights taken as fused ones, every step runs the fused kernel."""
    config, fp16 = OPTIONS[option]
    kernels = Kernels(monkeypatch)
    fallbacks = Fallbacks()
    _, result, last = run(toy, config, fp16=fp16, fallbacks=fallbacks)
    assert not fallbacks and result.losses[-1] < result.losses[0]
    assert kernels.calls >= STEPS - result.overflow_steps
    assert all(g["fused"] for g in last["optimizer"]["param_groups"])


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_fused_kernel_that_cannot_run_falls_back_before_the_first_step_and_trains_as_plain(toy, monkeypatch,
                                                                                             fused_on_cpu, option):
    config, fp16 = OPTIONS[option]
    plain = plain_run(toy, config, fp16=fp16)
    assert all(g["fused"] is None for g in plain[2]["optimizer"]["param_groups"])
    kernels = Kernels(monkeypatch, fail_from=1)
    fallbacks = Fallbacks()
    fell_back = run(toy, config, fp16=fp16, fallbacks=fallbacks)
    assert kernels.calls == 1, "tried once, on a tiny weight, and never again"
    reason = fallbacks.reason(FUSED_OPTIMIZER)
    assert reason == f"RuntimeError: {MISSING} (a trial step on cpu float32 before the first step)"
    assert fallbacks.lines() == [f"fused optimizer fell back to the plain path: {reason}"]
    assert_same_run(fell_back, plain)


def test_a_fused_step_that_computes_something_else_is_not_used(toy, monkeypatch, fused_on_cpu):
    plain = plain_run(toy, {"lora_plus_ratio": 2.0})
    Kernels(monkeypatch, wrong=True)
    fallbacks = Fallbacks()
    assert_same_run(run(toy, {"lora_plus_ratio": 2.0}, fallbacks=fallbacks), plain)
    reason = fallbacks.reason(FUSED_OPTIMIZER)
    assert reason.startswith("the fused step computed [-0.4") and " where the plain step computes [-1.4" in reason
    assert reason.endswith("] (a trial step on cpu float32 before the first step)")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_first_step_that_fails_after_the_trial_passed_leaves_no_state_behind(toy, monkeypatch, fused_on_cpu,
                                                                               option):
    """The kernel runs on the trial's tiny weight and fails on the real ones: the state the failed step created
    (step counters already counted, moments) is dropped, and the run is the plain one."""
    config, fp16 = OPTIONS[option]
    plain = plain_run(toy, config, fp16=fp16)
    kernels = Kernels(monkeypatch, fail_from=2)
    fallbacks = Fallbacks()
    assert_same_run(run(toy, config, fp16=fp16, fallbacks=fallbacks), plain)
    assert kernels.calls == 2 and "a fused step; it was done again" in fallbacks.reason(FUSED_OPTIMIZER)


def test_the_trial_hands_the_fused_step_the_overflow_flag_a_gradient_scaler_does(toy, monkeypatch, fused_on_cpu):
    config, fp16 = OPTIONS["fp16_grad_scaling"]
    plain = plain_run(toy, config, fp16=fp16)
    kernels = Kernels(monkeypatch, fail_scaled=True)
    fallbacks = Fallbacks()
    assert_same_run(run(toy, config, fp16=fp16, fallbacks=fallbacks), plain)
    assert kernels.calls == 1 and "a trial step" in fallbacks.reason(FUSED_OPTIMIZER)


def test_the_loop_keeps_its_own_record_when_the_caller_gives_none(toy, monkeypatch, fused_on_cpu, caplog):
    plain = plain_run(toy, {})
    Kernels(monkeypatch, fail_from=1)
    assert_same_run(run(toy, {}), plain)
    assert f"fused optimizer: off for the rest of the run, training goes on without it (RuntimeError: {MISSING}" \
        in caplog.text


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_fused_step_failing_mid_run_is_done_again_on_the_plain_path(toy, monkeypatch, fused_on_cpu, option):
    """The kernel fails from the 4th real step on (after the trial and three fused steps): that step is done
    again on the plain path with the step counters as they were before it, and the rest of the run is plain;
    the same run as three fused steps, saved, and resumed where the fused step cannot run."""
    config, fp16 = OPTIONS[option]
    groups = 2 if "lora_plus_ratio" in config else 1
    fail_from = 1 + groups * 3 + 1  # the trial, three steps of each parameter group's kernel call
    with monkeypatch.context() as m:
        kernels = Kernels(m, fail_from=fail_from)
        fallbacks = Fallbacks()
        once = run(toy, config, fp16=fp16, fallbacks=fallbacks)
        assert kernels.calls == fail_from
    assert fallbacks.reason(FUSED_OPTIMIZER) == \
        f"RuntimeError: {MISSING} (a fused step; it was done again on the plain path)"
    _, _, after_three = run(toy, config, fp16=fp16, cancel_at=3)
    assert all(g["fused"] for g in after_three["optimizer"]["param_groups"])
    Kernels(monkeypatch, fail_from=1)
    resumed = run(toy, config, fp16=fp16, resume=checkpoint_copy(after_three))
    assert_same_run(once, resumed)
    steps = {float(s["step"]) for s in once[2]["optimizer"]["state"].values()}
    assert steps == {float(STEPS - once[1].overflow_steps)}, "every weight counted each applied step once"


def checkpoint_copy(state: dict) -> dict:
    """The checkpoint as a resume reads it from its file."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_run_that_fell_back_resumes_plain_and_exactly(toy, monkeypatch, fused_on_cpu, option, tmp_path):
    """Its checkpoints are plain ones: resumed where the fused step works, the run goes on plain and ends as the
    uninterrupted plain run (with the gradient scaler too, which hands a fused optimizer its overflow flag)."""
    config, fp16 = OPTIONS[option]
    with monkeypatch.context() as m:
        Kernels(m, fail_from=1)
        _, _, state = run(toy, config, fp16=fp16, cancel_at=CANCEL_AT)
    path = str(tmp_path / "state.pt")
    checkpoint.save_checkpoint(path, state)
    assert all(g["fused"] is None for g in state["optimizer"]["param_groups"])
    kernels = Kernels(monkeypatch)
    fallbacks = Fallbacks()
    resumed = run(toy, config, fp16=fp16, resume=checkpoint.load_checkpoint(path), fallbacks=fallbacks)
    assert kernels.calls == 0 and not fallbacks
    assert_same_run(resumed, plain_run(toy, config, fp16=fp16))


def test_the_plain_state_of_a_fallback_is_the_plain_optimizers(fused_on_cpu):
    """``use_plain_step`` on a fused optimizer after steps: the state a plain optimizer has after the same steps
    (step counters on the CPU in PyTorch's dtype, groups not fused), and the gradient scaler told to skip
    overflowing steps itself."""
    torch.manual_seed(0)
    grads = [torch.randn(3) for _ in range(3)]
    states = []
    for fused in (True, None):
        w = torch.ones(3, requires_grad=True)
        opt = torch.optim.AdamW([w], lr=0.1, fused=fused)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        opt.grad_scale, opt.found_inf = None, torch.zeros(())  # left by a scaler whose fused step raised
        if fused:
            assert opt._step_supports_amp_scaling
            optim.use_plain_step(opt)
            assert not opt._step_supports_amp_scaling
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        states.append(opt.state_dict())
    fused_state, plain_state = states
    assert fused_state["param_groups"] == plain_state["param_groups"]
    assert fused_state["state"][0]["step"].device == plain_state["state"][0]["step"].device
    assert fused_state["state"][0]["step"].dtype == plain_state["state"][0]["step"].dtype
    assert float(fused_state["state"][0]["step"]) == 3.0


def test_step_counters_move_to_the_plain_steps_dtype(toy, monkeypatch, fused_on_cpu):
    """With float64 as the default dtype, PyTorch's plain step counts in float64 and the fused one in float32: a
    fallback mid-run leaves the counters as the plain step keeps them, and the run resumes plain and exactly."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        kernels = Kernels(monkeypatch, fail_from=4)
        _, _, state = run(toy, {}, cancel_at=5)
        assert kernels.calls == 4
        steps = [s["step"] for s in state["optimizer"]["state"].values()]
        assert steps and all(s.dtype == torch.float64 and s.device.type == "cpu" and float(s) == 5 for s in steps)
    finally:
        torch.set_default_dtype(previous)


def test_optimizers_without_a_fused_step_are_left_alone():
    w = torch.zeros(2, requires_grad=True)
    sgd = torch.optim.SGD([w], lr=0.1)
    before = dict(sgd.param_groups[0])
    optim.use_plain_step(sgd)
    steps = optim.FusedSteps(sgd, Fallbacks())
    w.grad = torch.ones(2)
    steps.step(sgd.step)
    assert not steps.fused and sgd.param_groups[0] == before and torch.equal(w, torch.full((2,), -0.1))
