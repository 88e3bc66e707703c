"""Exact resume with every trainer option: N steps uninterrupted vs. cancelled at k and resumed from the saved
checkpoint give bit-identical losses, weights, EMA weights and validation history."""

from __future__ import annotations

import pytest
import torch

import streaming_cache as sc
from helpers.toy_backend import linear_pairs_cache
from streaming_cache.loader import BatchLoader
from streaming_cache.train import captions, checkpoint, loop, timesteps

pytestmark = pytest.mark.oldest_torch

STEPS, CANCEL_AT = 9, 4
UP, DOWN = "diffusion_model.m.lora_up.weight", "diffusion_model.m.lora_down.weight"
ALPHA, BIAS = "diffusion_model.m.alpha", "diffusion_model.m.diff_b"
PROBE = torch.linspace(-1, 1, 8).reshape(2, 4)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A cache of (x, y) pairs, y = A x + 1 for a fixed 4x4 A."""
    return sc.open_cache(linear_pairs_cache(str(tmp_path_factory.mktemp("toy") / "cache"), 20)).dataset()


def lora_params() -> dict[str, torch.Tensor]:
    """A LoRA-like layout as ComfyUI's adapters name it: up (zeros), down (seeded), a frozen alpha, a bias diff."""
    g = torch.Generator().manual_seed(5)
    return {UP: torch.zeros(4, 2, requires_grad=True),
            DOWN: (torch.randn(2, 4, generator=g) * 0.5).requires_grad_(),
            ALPHA: torch.tensor(1.0), BIAS: torch.zeros(4, requires_grad=True)}


def forward(params, x):
    return x @ (params[UP] @ params[DOWN]).T * params[ALPHA] / 2 + params[BIAS]


def probe_loss(params) -> float:
    """A fixed validation loss (what the node computes with fixed timesteps and noise)."""
    torch.rand(3)  # consumes the global RNG: the loop must give it back untouched
    return float((forward(params, PROBE) ** 2).sum())


def make_loss(params, *, sampling: str | None = None, dropout: float = 0.0, seed: int = 7, fp16: bool = False):
    """``fp16``: the forward pass in float16 (as autocast runs a model), the loss in float32,
    so the scaled gradients overflow fp16 at first and the gradient scaler skips steps until its scale fits."""
    def loss_fn(batch, micro):
        g = loop.step_generator(seed, micro)
        x, y = batch["x"], batch["y"]
        x = x + 1e-3 * torch.rand(x.shape)  # the global RNG, as dropout layers use it: restored on resume
        if sampling is not None:  # noise the input at a sampled level and weight the loss by min-SNR
            t = timesteps.sample_t(sampling, x.shape[0], g, scale=1.2, shift=3.0)
            x = x + t[:, None] * torch.randn(x.shape, generator=g)
            w = timesteps.loss_weight(t, "flow", min_snr_gamma=5.0)
        else:
            w = torch.ones(x.shape[0])
        keep = torch.tensor([0.0 if captions.dropout(seed, micro, dropout, i) else 1.0 for i in range(x.shape[0])])
        if fp16:
            out = forward({k: v.half() for k, v in params.items()}, x.half()).float()
            return ((out - y) ** 2).mean()
        err = ((forward(params, x) - y * keep[:, None]) ** 2).mean(dim=1)
        return (err * w).mean() / w.mean()
    return loss_fn


def run(handle, config: dict, *, resume=None, save=None, on_step=None, should_stop=None, loss: dict | None = None,
        validated: bool = False, params: dict | None = None):
    torch.manual_seed(11)  # each run starts alike; a resumed one gets the saved state back
    params = lora_params() if params is None else params
    loader = BatchLoader(handle, 4, seed=1, workers=0)
    cfg = loop.TrainConfig(**{"steps": STEPS, "learning_rate": 0.05, "warmup_steps": 2, "grad_accumulation": 2,
                              **config})
    validate = (lambda: probe_loss(params)) if validated else None
    hooks = loop.TrainHooks(save=save, on_step=on_step, should_stop=should_stop, validate=validate)
    result = loop.train(params, loader, make_loss(params, **(loss or {})), cfg, resume=resume, hooks=hooks)
    return params, result


def interrupted_then_resumed(handle, tmp_path, config, **kw):
    path = str(tmp_path / "state.pt")

    def cancel(step, loss):
        if step == CANCEL_AT:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(handle, config, save=lambda s, final: checkpoint.save_checkpoint(path, s), on_step=cancel, **kw)
    state = checkpoint.load_checkpoint(path)
    assert state["step"] == CANCEL_AT
    return run(handle, config, resume=state, **kw)


def assert_identical(a, b):
    (pa, ra), (pb, rb) = a, b
    assert ra.step == rb.step == STEPS
    assert ra.losses == rb.losses, "losses differ"
    assert ra.validation == rb.validation
    assert ra.overflow_steps == rb.overflow_steps
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
        assert torch.equal(ra.weights[k], rb.weights[k]), k
    if ra.ema_weights is not None or rb.ema_weights is not None:
        for k in pa:
            assert torch.equal(ra.ema_weights[k], rb.ema_weights[k]), k


def needs(package: str) -> None:
    pytest.importorskip(package, reason=f"the optimizer's package {package} is not installed "
                                        f"(python -m pip install {package})")


OPTIONS = {
    "lora_plus": ({"lora_plus_ratio": 4.0}, {}),
    "cosine_with_restarts": ({"schedule": "cosine_with_restarts", "cycles": 3}, {}),
    "ema": ({"ema_decay": 0.9}, {}),
    "validation": ({"validate_every": 3}, {}),
    "caption_dropout": ({}, {"dropout": 0.4}),
    "max_grad_norm": ({"max_grad_norm": 0.05}, {}),
    **{f"timesteps_{k}": ({}, {"sampling": k}) for k in timesteps.TIMESTEP_SAMPLING},
    "fp16_grad_scaling": ({"grad_scaling": True, "max_grad_norm": 1.0}, {"fp16": True}),
    "everything": ({"lora_plus_ratio": 2.0, "schedule": "cosine_with_restarts", "cycles": 2, "ema_decay": 0.8,
                    "validate_every": 2}, {"sampling": "shifted", "dropout": 0.3}),
}
OPTIMIZER_OPTIONS = {
    "schedule_free": ("schedulefree", {"optimizer": "AdamWScheduleFree", "validate_every": 3, "ema_decay": 0.9,
                                       "lora_plus_ratio": 2.0}),
    "prodigy": ("prodigyopt", {"optimizer": "Prodigy", "learning_rate": 1.0, "schedule": "cosine", "ema_decay": 0.9}),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_resume_is_exact_with_option(toy, tmp_path, option):
    config, loss = OPTIONS[option]
    validated = "validate_every" in config
    reference = run(toy, config, loss=loss, validated=validated)
    assert_identical(interrupted_then_resumed(toy, tmp_path, config, loss=loss, validated=validated), reference)
    if validated:
        every = config["validate_every"]
        assert [s for s, _ in reference[1].validation] == list(range(every, STEPS + 1, every)) + \
            ([STEPS] if STEPS % every else [])


@pytest.mark.parametrize("option", list(OPTIMIZER_OPTIONS))
def test_resume_is_exact_with_optimizer(toy, tmp_path, option):
    package, config = OPTIMIZER_OPTIONS[option]
    needs(package)
    validated = "validate_every" in config
    reference = run(toy, config, validated=validated)
    assert reference[1].losses[-1] < reference[1].losses[0], "it trains"
    assert_identical(interrupted_then_resumed(toy, tmp_path, config, validated=validated), reference)


def test_schedule_free_saving_and_validation_do_not_change_training(toy):
    """Saving and validating switch a schedule-free optimizer to eval mode and back; the training weights are
    put back bit for bit, so a run that saves and validates every step trains exactly like one that does not."""
    needs("schedulefree")
    states = []
    plain = run(toy, {"optimizer": "AdamWScheduleFree"})
    busy = run(toy, {"optimizer": "AdamWScheduleFree", "save_every": 1, "validate_every": 1}, validated=True,
               save=lambda s, final: states.append(s))
    assert plain[1].losses == busy[1].losses
    for k in plain[0]:
        assert torch.equal(plain[0][k], busy[0][k])
    # A larger layout, where switching modes back and forth is not exact in floating point (about 1.5% of
    # the values of a 1000-element tensor change): the training weights are still put back bit for bit.
    def train_large(every: int) -> torch.Tensor:
        torch.manual_seed(3)
        w = torch.randn(1000, requires_grad=True)
        target = torch.randn(1000)
        cfg = loop.TrainConfig(steps=6, learning_rate=0.05, optimizer="AdamWScheduleFree", save_every=every,
                               validate_every=every)
        loop.train({"w": w}, BatchLoader(toy, 4, seed=1, workers=0),
                   lambda batch, micro: ((w - target) ** 2 * (1 + batch["x"].mean())).mean(), cfg,
                   hooks=loop.TrainHooks(save=lambda s, f: None, validate=lambda: float(w.sum())))
        return w.detach()

    assert torch.equal(train_large(0), train_large(1))
    # The saved LoRA is the eval-mode (averaged) weights, not the training weights of the checkpoint.
    last = states[-1]
    assert not torch.equal(last["weights"][UP], last["params"][UP])
    assert torch.equal(last["weights"][UP], busy[1].weights[UP]), "the run ends with the eval-mode weights in place"


def test_validation_does_not_change_training(toy):
    plain = run(toy, {"ema_decay": 0.9})
    validated = run(toy, {"ema_decay": 0.9, "validate_every": 1}, validated=True)
    assert plain[1].losses == validated[1].losses and len(validated[1].validation) == STEPS
    for k in plain[0]:
        assert torch.equal(plain[0][k], validated[0][k])


def test_stopped_run_resumes_exactly_and_finished_run_continues_when_steps_are_raised(toy, tmp_path):
    config = {"ema_decay": 0.9, "validate_every": 2}
    reference = run(toy, config, validated=True)
    states = []
    stop_after = iter([False] * 5 + [True] * 100)
    first = run(toy, config, validated=True, should_stop=lambda: next(stop_after), save=lambda s, f: states.append(s))
    assert first[1].stopped and first[1].step == 5 and states[-1]["step"] == 5
    path = str(tmp_path / "s.pt")
    checkpoint.save_checkpoint(path, states[-1])
    assert_identical(run(toy, config, validated=True, resume=checkpoint.load_checkpoint(path)), reference)


def test_interrupt_during_validation_is_validated_on_resume(toy, tmp_path):
    """A cancel inside validate() at a validation step saves the finished step; the resumed run validates that
    step first, so the history matches the uninterrupted run's."""
    config = {"validate_every": 2}
    reference = run(toy, config, validated=True)
    path = str(tmp_path / "s.pt")
    params = lora_params()
    calls = []

    def validate():
        calls.append(1)
        if len(calls) == 2:  # the validation of step 4
            raise KeyboardInterrupt
        return probe_loss(params)

    cfg = loop.TrainConfig(steps=STEPS, learning_rate=0.05, warmup_steps=2, grad_accumulation=2, **config)
    torch.manual_seed(11)
    with pytest.raises(KeyboardInterrupt):
        loop.train(params, BatchLoader(toy, 4, seed=1, workers=0), make_loss(params), cfg,
                   hooks=loop.TrainHooks(validate=validate, save=lambda s, f: checkpoint.save_checkpoint(path, s)))
    state = checkpoint.load_checkpoint(path)
    assert state["step"] == 4 and [s for s, _ in state["validation"]] == [2]
    assert_identical(run(toy, config, validated=True, resume=state), reference)


def test_checkpoint_carries_ema_validation_and_derived_weights(toy, tmp_path):
    states = []
    run(toy, {"ema_decay": 0.9, "validate_every": 4}, validated=True, save=lambda s, f: states.append((s, f)))
    state, final = states[-1]
    assert final and state["ema"]["updates"] == STEPS
    assert [s for s, _ in state["validation"]] == [4, 8, 9]
    assert set(state["ema_weights"]) == set(state["params"])
    assert state["ema_weights"][UP].dtype == state["params"][UP].dtype
    path = str(tmp_path / "s.pt")
    checkpoint.save_checkpoint(path, state)
    loaded = checkpoint.load_checkpoint(path)
    assert "weights" not in loaded and "ema_weights" not in loaded, "derived keys are not written"
    assert loaded["validation"] == state["validation"]


def test_resume_without_saved_ema_starts_the_average_from_the_restored_weights(toy, tmp_path):
    states = []
    run(toy, {"steps": 3}, save=lambda s, f: states.append(s))
    params, result = run(toy, {"steps": 4, "ema_decay": 0.5}, resume=states[-1])
    assert result.step == 4 and result.ema_weights is not None
    # One update with warmed-up decay min(0.5, 1/10) from the weights at step 3.
    expected = states[-1]["params"][UP] * 0.1 + params[UP].detach() * 0.9
    assert torch.allclose(result.ema_weights[UP], expected)


def test_lora_plus_checkpoint_refuses_a_different_ratio_layout(toy):
    states = []
    run(toy, {"steps": 2, "lora_plus_ratio": 4.0}, save=lambda s, f: states.append(s))
    with pytest.raises(sc.CacheError, match="optimizer state does not fit"):
        run(toy, {"steps": 3}, resume=states[-1])


def test_grad_scaling_skips_overflowing_steps_and_resumes_with_its_scale(toy, tmp_path):
    """The fp16 run of ``fp16_grad_scaling`` above: a step whose scaled gradients overflow is skipped (weights
    untouched, the scale halved) and counted; the checkpoint carries the scale, so the resumed run skips
    exactly the same steps."""
    ups, params = [torch.zeros(4, 2)], lora_params()
    _, result = run(toy, {"grad_scaling": True}, loss={"fp16": True}, params=params,
                    on_step=lambda step, loss: ups.append(params[UP].detach().clone()))
    skipped = [i for i in range(1, STEPS + 1) if torch.equal(ups[i], ups[i - 1])]
    assert skipped and len(skipped) == result.overflow_steps < STEPS, (skipped, result.overflow_steps)
    assert result.losses[-1] < result.losses[0], "the other steps train"
    state_path = str(tmp_path / "s.pt")
    run(toy, {"grad_scaling": True, "steps": CANCEL_AT}, loss={"fp16": True},
        save=lambda s, final: checkpoint.save_checkpoint(state_path, s))
    state = checkpoint.load_checkpoint(str(state_path))
    before = sum(1 for i in skipped if i <= CANCEL_AT)
    assert state["overflow_steps"] == before >= 1
    assert state["scaler"]["scale"] == 2.0 ** 16 / 2 ** before


def test_grad_scaling_keeps_gradients_that_fp16_flushes_to_zero(toy):
    """Gradients of about 1e-8 pass through float16 (smallest step 6e-8): without scaling they become zero and
    nothing trains; with the scaler they arrive, unscaled, at their true size."""
    def fit(scaling: bool) -> torch.Tensor:
        w = torch.ones(1, requires_grad=True)

        def loss_fn(batch, micro):
            a = torch.tensor(1e-4, dtype=torch.float16)
            return ((w.half() * a).float() * 1e-4).sum()

        loop.train({"w": w}, BatchLoader(toy, 4, workers=0), loss_fn,
                   loop.TrainConfig(steps=1, optimizer="SGD", learning_rate=1e6, grad_scaling=scaling))
        return w.detach()

    assert fit(False).item() == 1.0, "fp16 flushed the gradient to zero"
    assert fit(True).item() == pytest.approx(1.0 - 1e6 * 1e-8, rel=1e-2)
