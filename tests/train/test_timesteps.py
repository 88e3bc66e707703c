"""Noise-level sampling, loss weighting (checked against each model's native objective), offset noise and
masked losses."""

from __future__ import annotations

import math

import pytest
import torch

from streaming_cache.train import timesteps as ts


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kind", ts.TIMESTEP_SAMPLING)
def test_sample_t_is_in_range_and_a_function_of_the_generator(kind):
    t = ts.sample_t(kind, 20_000, gen(1), scale=1.0, shift=3.0)
    assert t.shape == (20_000,) and t.dtype == torch.float32
    assert float(t.min()) >= ts.T_EPS and float(t.max()) <= 1 - ts.T_EPS
    assert torch.equal(t, ts.sample_t(kind, 20_000, gen(1), scale=1.0, shift=3.0))
    assert not torch.equal(t, ts.sample_t(kind, 20_000, gen(2), scale=1.0, shift=3.0))


def test_sample_t_distributions():
    n = 50_000
    uniform = ts.sample_t("uniform", n, gen())
    assert abs(float(uniform.mean()) - 0.5) < 0.01 and abs(float((uniform < 0.1).float().mean()) - 0.1) < 0.01
    z = torch.randn(n, generator=gen())
    assert torch.allclose(ts.sample_t("logit_normal", n, gen(), mean=0.5, scale=2.0), torch.sigmoid(0.5 + 2.0 * z))
    assert torch.equal(ts.sample_t("sigmoid", n, gen(), scale=2.0), torch.sigmoid(2.0 * z))
    # logit-normal concentrates in the middle, more so with a smaller scale
    narrow, wide = ts.sample_t("logit_normal", n, gen(), scale=0.5), ts.sample_t("logit_normal", n, gen(), scale=2)
    assert float(narrow.std()) < float(wide.std()) and abs(float(narrow.median()) - 0.5) < 0.01
    # shifted: kohya/musubi's "shift" (sigmoid of a normal draw, then the time shift), or a shifted uniform draw
    base = ts.sample_t("sigmoid", n, gen(), scale=1.0)
    shifted = ts.sample_t("shifted", n, gen(), shift=3.0)
    assert torch.allclose(shifted, ts.shift_sigma(base, 3.0).clamp(ts.T_EPS, 1 - ts.T_EPS))
    assert float(shifted.mean()) > float(base.mean()) + 0.1, "shift > 1 means more noise"
    assert torch.allclose(ts.sample_t("shifted", n, gen(), shift=2.0, base="uniform"),
                          ts.shift_sigma(torch.rand(n, generator=gen()), 2.0).clamp(ts.T_EPS, 1 - ts.T_EPS))
    assert "shifted" in ts.SETS_SIGMA and "uniform" not in ts.SETS_SIGMA


def test_shift_sigma():
    t = torch.linspace(0, 1, 101)
    assert torch.equal(ts.shift_sigma(t, 1.0), t)
    assert ts.shift_sigma(torch.tensor(0.5), 3.0).item() == pytest.approx(0.75)
    s = ts.shift_sigma(t, 3.0)
    assert float(s[0]) == 0 and float(s[-1]) == pytest.approx(1.0) and bool((s[1:] > s[:-1]).all())
    with pytest.raises(ValueError, match="shift must be positive"):
        ts.shift_sigma(t, 0.0)


def _truncated(kind: str, lo: float, hi: float, n: int, **kw) -> torch.Tensor:
    """The reference: draws of the whole distribution, those in [lo, hi] kept (rejection sampling)."""
    t = ts.sample_t(kind, n, torch.Generator().manual_seed(99), **kw)
    return t[(t >= lo) & (t <= hi)]


@pytest.mark.parametrize("kind, kw", [("uniform", {}), ("logit_normal", {"mean": 0.5, "scale": 1.2}),
                                      ("sigmoid", {"scale": 2.0}), ("shifted", {"shift": 3.0}),
                                      ("shifted", {"shift": 3.0, "base": "uniform"})])
@pytest.mark.parametrize("lo, hi", [(0.2, 0.6), (0.0, 0.3), (0.85, 1.0)])
def test_a_timestep_range_keeps_the_distribution_inside_it(kind, kw, lo, hi):
    """Levels drawn with ``t_range`` lie in it and follow the whole distribution cut to it: quantiles within 0.01 of
    rejection sampling's (100,000 draws each, a sampling error near 0.003), where the whole distribution's are
    further off; ``(0, 1)`` draws exactly as without a range."""
    n = 100_000
    got = ts.sample_t(kind, n, torch.Generator().manual_seed(5), t_range=(lo, hi), **kw)
    assert got.dtype == torch.float32 and float(got.min()) >= lo and float(got.max()) <= hi
    reference = _truncated(kind, lo, hi, 2 * n, **kw)
    assert len(reference) > 5000
    q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    assert torch.allclose(got.quantile(q), reference.quantile(q), atol=0.01)
    whole = ts.sample_t(kind, n, torch.Generator().manual_seed(5), **kw)
    assert torch.equal(whole, ts.sample_t(kind, n, torch.Generator().manual_seed(5), t_range=(0, 1), **kw))
    assert (whole.quantile(q) - reference.quantile(q)).abs().max() > 0.03


def test_sample_t_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown timestep sampling"):
        ts.sample_t("cosmic", 3, gen())
    with pytest.raises(ValueError, match="scale must be positive"):
        ts.sample_t("sigmoid", 3, gen(), scale=0)
    with pytest.raises(ValueError, match="base of shifted sampling"):
        ts.sample_t("shifted", 3, gen(), base="sigmoid")
    for bad in [(0.5, 0.5), (0.6, 0.2), (-0.1, 0.5), (0.2, 1.5)]:
        with pytest.raises(ValueError, match="t_range"):
            ts.sample_t("uniform", 3, torch.Generator(), t_range=bad)


def _batch(b=6, shape=(4, 8, 8)):
    g = gen(3)
    return torch.randn(b, *shape, generator=g, dtype=torch.float64), \
        torch.randn(b, *shape, generator=g, dtype=torch.float64), \
        0.1 * torch.randn(b, *shape, generator=g, dtype=torch.float64)


def _mean(x):
    return x.flatten(1).mean(1)


SIGMAS = torch.tensor([0.03, 0.2, 0.7, 1.5, 6.0, 14.6], dtype=torch.float64)  # k-diffusion sigmas (SD1.x range)
TS = torch.tensor([0.01, 0.1, 0.35, 0.5, 0.8, 0.99], dtype=torch.float64)  # flow noise levels


def _x0_and_native_losses(prediction):
    """(x0-space loss, the model's native loss) per sample, computed the way each model predicts x0."""
    x0, noise, delta = _batch()
    if prediction == "eps":
        s = SIGMAS.view(-1, 1, 1, 1)
        xt = x0 + s * noise
        eps_pred = noise + delta
        x0_pred = xt - s * eps_pred
        return SIGMAS, _mean((x0_pred - x0) ** 2), _mean((eps_pred - noise) ** 2)
    if prediction == "v":  # ComfyUI's V_PREDICTION.calculate_denoised with sigma_data = 1
        s = SIGMAS.view(-1, 1, 1, 1)
        xt = x0 + s * noise
        v = (xt / (s ** 2 + 1) - x0) * torch.sqrt(s ** 2 + 1) / s
        v_pred = v + delta
        x0_pred = xt / (s ** 2 + 1) - v_pred * s / torch.sqrt(s ** 2 + 1)
        return SIGMAS, _mean((x0_pred - x0) ** 2), _mean((v_pred - v) ** 2)
    t = TS.view(-1, 1, 1, 1)  # flow: x_t = (1 - t) x0 + t noise, velocity = noise - x0
    xt = (1 - t) * x0 + t * noise
    v_pred = noise - x0 + delta
    x0_pred = xt - t * v_pred
    return TS, _mean((x0_pred - x0) ** 2), _mean(delta ** 2)


@pytest.mark.parametrize("prediction", ts.PREDICTIONS)
def test_native_weight_turns_the_x0_loss_into_the_models_own_objective(prediction):
    sigma, x0_loss, native = _x0_and_native_losses(prediction)
    w = ts.loss_weight(sigma, prediction, space="native", max_weight=1e9).double()
    assert torch.allclose(w * x0_loss, native, rtol=1e-5)
    assert torch.equal(ts.loss_weight(sigma, prediction), torch.ones(len(sigma))), "x0 space: plain loss"
    assert float(ts.loss_weight(sigma, prediction, space="native").max()) <= 1e4, "clamped at tiny sigma"


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_min_snr_weight_in_x0_space_equals_min_snr_on_the_native_loss(prediction):
    gamma = 5.0
    sigma, x0_loss, native = _x0_and_native_losses(prediction)
    snr = 1 / sigma ** 2
    # Hang et al. 2023: eps loss x min(snr, gamma) / snr, v loss x min(snr, gamma) / (snr + 1)
    paper = native * torch.clamp(snr, max=gamma) / (snr if prediction == "eps" else snr + 1)
    for space in ts.LOSS_SPACES:
        w = ts.loss_weight(sigma, prediction, space=space, min_snr_gamma=gamma).double()
        assert torch.allclose(w * x0_loss, paper, rtol=1e-5)
    assert torch.allclose(ts.snr(sigma, prediction).double(), snr, rtol=1e-6)


def test_debiased_weight_in_x0_space_is_sd_scripts_debiased_estimation_of_the_noise_loss():
    """sd-scripts' ``apply_debiased_estimation`` weights an eps model's loss by 1 / sqrt(min(snr, 1000)); the
    x0-space weight gives that loss (the smallest sigma, 0.03, has an SNR of 1111: the clamp counts), and for a
    flow model the same of the noise its velocity implies (t = 0.01 has an SNR of 9801)."""
    sigma, x0_loss, native = _x0_and_native_losses("eps")
    snr = 1 / sigma ** 2
    sd_scripts = native / torch.sqrt(torch.clamp(snr, max=1000.0))
    w = ts.loss_weight(sigma, "eps", debiased=True).double()
    assert torch.allclose(w * x0_loss, sd_scripts, rtol=1e-5)
    assert not torch.allclose(w * x0_loss, native / torch.sqrt(snr), rtol=1e-3), "the clamp at 1000 applies"
    x0, noise, delta = _batch()  # a flow model: the noise its velocity implies, debiased as for eps
    t = TS.view(-1, 1, 1, 1)
    xt = (1 - t) * x0 + t * noise
    x0_pred = xt - t * (noise - x0 + delta)
    eps_pred = (xt - (1 - t) * x0_pred) / t
    eps_loss = _mean((eps_pred - noise) ** 2)
    flow_snr = ((1 - TS) / TS) ** 2
    w = ts.loss_weight(TS, "flow", debiased=True).double()
    assert torch.allclose(w * _mean((x0_pred - x0) ** 2), eps_loss / torch.sqrt(torch.clamp(flow_snr, max=1000.0)),
                          rtol=1e-5)


def test_flow_snr_and_min_snr():
    t = torch.tensor([0.25, 0.5, 0.9])
    assert torch.allclose(ts.snr(t, "flow"), torch.tensor([9.0, 1.0, 1 / 81]))
    assert torch.allclose(ts.loss_weight(t, "flow", min_snr_gamma=2.0), torch.tensor([2.0, 1.0, 1 / 81]))
    with pytest.raises(ValueError, match="unknown prediction"):
        ts.loss_weight(t, "x0")
    with pytest.raises(ValueError, match="unknown loss space"):
        ts.loss_weight(t, "flow", space="velocity")


@pytest.mark.parametrize("shape", [(2, 4, 8, 8), (2, 16, 3, 8, 8)])
def test_offset_noise_is_constant_per_sample_and_channel(shape):
    noise = torch.randn(shape, generator=gen(1))
    out = ts.offset_noise(noise, 0.1, gen(2))
    offset = out - noise
    flat = offset.flatten(2)
    assert torch.allclose(flat, flat[:, :, :1].expand_as(flat), atol=1e-6), "broadcast over space and time"
    assert torch.allclose(flat[:, :, 0], 0.1 * torch.randn(shape[:2], generator=gen(2)), atol=1e-6)
    assert ts.offset_noise(noise, 0.0, gen(2)) is noise
    half = ts.offset_noise(noise.half(), 0.1, gen(2))
    assert half.dtype == torch.float16 and torch.allclose(half.float(), out, atol=2e-3)


def test_resize_mask_averages_areas():
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., :4] = 1
    latent = torch.zeros(1, 4, 4, 4)
    m = ts.resize_mask(mask, latent)
    assert m.shape == (1, 1, 4, 4) and torch.equal(m[..., :2], torch.ones(1, 1, 4, 2)) and not m[..., 2:].any()
    odd = ts.resize_mask(mask, torch.zeros(1, 4, 3, 3))  # 8 pixels onto 3 latents: the middle is half covered
    assert torch.allclose(odd[0, 0, 0], torch.tensor([1.0, 0.5, 0.0]))
    assert ts.resize_mask(mask[:, 0], latent).shape == (1, 1, 4, 4), "[B, H, W] masks too"
    video = ts.resize_mask(mask, torch.zeros(1, 16, 3, 4, 4))
    assert video.shape == (1, 1, 1, 4, 4) and torch.equal(video[:, :, 0], m)
    frames = torch.zeros(1, 1, 9, 8, 8)
    frames[:, :, :3] = 1  # the first third of the clip
    resized = ts.resize_mask(frames, torch.zeros(1, 16, 3, 4, 4))
    assert torch.allclose(resized[0, 0, :, 0, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert ts.resize_mask(mask, torch.zeros(3, 4, 4, 4)).shape == (3, 1, 4, 4), "batch 1 broadcast"
    for bad, like in ((torch.zeros(1, 2, 8, 8), latent), (torch.zeros(8, 8), latent), (frames, latent),
                      (torch.zeros(2, 1, 8, 8), torch.zeros(3, 4, 4, 4))):
        with pytest.raises(ValueError):
            ts.resize_mask(bad, like)


def test_masked_loss():
    err = torch.zeros(2, 4, 4, 4)
    err[..., :2] = 1.0  # error only in the left half
    left = torch.zeros(2, 1, 8, 8)
    left[..., :4] = 1
    assert ts.masked_loss(err).item() == pytest.approx(0.5)
    assert ts.masked_loss(err, left).item() == pytest.approx(1.0), "mean over the masked area"
    assert ts.masked_loss(err, 1 - left).item() == pytest.approx(0.0)
    assert ts.masked_loss(err, torch.zeros(2, 1, 8, 8)).item() == pytest.approx(0.5), "all-zero mask: plain mean"
    half = torch.stack([left[0], torch.zeros_like(left[0])])  # sample 2 has an empty mask: its plain mean
    assert torch.allclose(ts.per_sample_loss(err, half), torch.tensor([1.0, 0.5]))
    small = torch.zeros(2, 1, 8, 8)
    small[0, :, :2, :2] = 1  # a tiny mask counts as much as a large one: each sample weighs the same
    small[1, :, :, :4] = 1
    assert torch.allclose(ts.per_sample_loss(err, small), torch.tensor([1.0, 1.0]))
    assert ts.masked_loss(err, left, torch.tensor([2.0, 0.0])).item() == pytest.approx(1.0)
    pred, target = torch.ones(2, 4, 4, 4), torch.zeros(2, 4, 4, 4)
    assert ts.masked_mse(pred, target, left).item() == pytest.approx(1.0)
    video = torch.zeros(1, 16, 2, 4, 4)
    video[:, :, 1] = 2.0
    assert ts.masked_loss(video, left[:1]).item() == pytest.approx(1.0), "a 2-D mask applies to every frame"
    assert math.isfinite(ts.masked_loss(err.requires_grad_(), left).item())


def test_a_samples_latent_rows_share_its_noise_level_and_draw_their_own_noise_and_offset():
    """``noise_and_levels`` with one sample's latent rows ``[rows, C, H, W]``: a clip whose frames are the model's
    batch (SVD) gets one noise level for all its frames, noise per frame and an offset per frame and channel;
    with one row per sample it draws exactly what a sample of shape ``[C, H, W]`` drew."""
    from streaming_cache.train.draws import Draws, noise_and_levels

    draws = Draws(seed=5, micro=3)
    noise, levels = noise_and_levels(draws, (4, 2, 3, 3), 2, sampling="uniform", offset=0.1)
    assert noise.shape == (2, 4, 2, 3, 3) and levels.shape == (2,)
    assert not torch.equal(noise[0, 0], noise[0, 1]), "each frame its own noise"
    one, one_levels = noise_and_levels(draws, (1, 2, 3, 3), 2, sampling="uniform")
    g = draws.generator(1)
    plain = torch.randn((2, 3, 3), generator=g)
    assert torch.equal(one[1, 0], plain), "one row: the same stream as a sample without a rows dimension"
    assert one_levels[1] == ts.sample_t("uniform", 1, g)[0]
    _, ranged = noise_and_levels(draws, (1, 2, 3, 3), 64, sampling="logit_normal", t_range=(0.2, 0.3))
    assert float(ranged.min()) >= 0.2 and float(ranged.max()) <= 0.3


class _Sampling:
    """The noise scaling and x0 prediction of ComfyUI's eps, v (sigma_data 1) and flow (CONST) model samplings."""

    def __init__(self, prediction):
        self.prediction = prediction

    def noise_scaling(self, sigma, noise, latent, max_denoise=False):
        s = sigma.view(-1, *[1] * (noise.dim() - 1))
        return s * noise + (1 - s) * latent if self.prediction == "flow" else latent + s * noise

    def calculate_denoised(self, sigma, output, model_input):
        s = sigma.view(-1, *[1] * (output.dim() - 1))
        if self.prediction == "v":
            return model_input / (s ** 2 + 1) - output * s / torch.sqrt(s ** 2 + 1)
        return model_input - output * s

    def oracle(self, sigma, noise, latent):
        """What a perfect model outputs for the noised latent of ``noise`` (its own target)."""
        s = sigma.view(-1, *[1] * (noise.dim() - 1))
        if self.prediction == "eps":
            return noise
        if self.prediction == "flow":
            return noise - latent
        xt = latent + s * noise
        return (xt / (s ** 2 + 1) - latent) * torch.sqrt(s ** 2 + 1) / s


@pytest.mark.parametrize("prediction", ts.PREDICTIONS)
def test_input_perturbation_moves_the_input_and_keeps_the_target_of_the_plain_noise(prediction):
    """The model sees the latent noised with noise + extra; a model that outputs the plain noise's own target from
    it, corrected by the returned shift, predicts x0 exactly (sd-scripts' ip_noise_gamma: input perturbed, target
    not). Uncorrected, that perfect model would be wrong by the shift: it would be trained to remove the extra."""
    x0, noise, _ = _batch()
    extra = 0.1 * torch.randn(noise.shape, generator=gen(9), dtype=torch.float64)
    sampling = _Sampling(prediction)
    sigma = TS if prediction == "flow" else SIGMAS
    xt, shift = ts.perturbed_input(sampling.noise_scaling, sampling.calculate_denoised, sigma, noise, x0, extra)
    assert torch.allclose(xt, sampling.noise_scaling(sigma, noise + extra, x0))
    pred = sampling.calculate_denoised(sigma, sampling.oracle(sigma, noise, x0), xt)
    assert torch.allclose(pred - shift, x0, atol=1e-9)
    assert _mean((pred - x0) ** 2).min() > 1e-8, "every sample's uncorrected prediction is off"
