"""How a training step picks its noise level and weights its loss, for any diffusion or flow model.

**Noise level.** :func:`sample_t` draws ``t`` in (0, 1), the noise level of each sample (1 = pure noise). The
caller maps ``t`` to the model's sigma with the model's own schedule (``percent = 1 - t``), so with
``"uniform"`` a flow model keeps its family's default time shift. ``"shifted"`` draws already include an
explicit time shift: for a flow model ``t`` is then the sigma itself (do not pass it through the model's
schedule, which would shift it again); :func:`shift_sigma` is that shift.

**Loss weight.** The loss compares the model's prediction of the clean latent x0 with x0 (as ComfyUI's own
TrainLoraNode does). How that x0 error relates to each model's native objective, with ``x_t`` the noised latent
(k-diffusion sigma parametrisation for eps and v; ``sigma_data = 1``):

- eps: ``x_t = x0 + sigma * eps``, ``x0_pred = x_t - sigma * eps_pred``, so
  ``|x0_pred - x0|^2 = sigma^2 |eps_pred - eps|^2``; the eps loss is ``snr * x0 loss`` with ``snr = 1/sigma^2``.
- v: ``x0_pred = x_t / (sigma^2 + 1) - v_pred * sigma / sqrt(sigma^2 + 1)``, so
  ``|x0_pred - x0|^2 = sigma^2 / (sigma^2 + 1) |v_pred - v|^2``; the v loss is ``(snr + 1) * x0 loss``.
- flow: ``x_t = (1 - t) x0 + t noise``, velocity ``v = noise - x0``, ``x0_pred = x_t - t v_pred``, so the
  velocity loss is ``x0 loss / t^2``; ``sigma = t`` and ``snr = ((1 - t) / t)^2``.

Min-SNR-gamma (Hang et al. 2023) weights the eps loss by ``min(snr, gamma) / snr`` and the v loss by
``min(snr, gamma) / (snr + 1)``; by the relations above both are the x0 loss weighted by ``min(snr, gamma)``
(which is also the paper's weight for x0 prediction). The same x0-space weight is used for flow models with the
flow ``snr``.

Debiased estimation (Yu et al. 2024) weights the eps loss by ``1 / sqrt(snr)``, the ``snr`` clamped at 1000 as
sd-scripts' ``--debiased_estimation_loss`` does: since the eps loss is ``snr`` x the x0 loss in every
parametrisation above (flow too: ``x0 error = t / (1 - t) x eps error``), that is the x0 loss weighted by
``snr / sqrt(min(snr, 1000))``, which is ``sqrt(snr)`` at the noise levels training draws.
(sd-scripts weights a v-prediction model's v loss by ``1 / (snr + 1)`` instead, which is the plain x0 loss.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TIMESTEP_SAMPLING = ("uniform", "logit_normal", "sigmoid", "shifted")
# Kinds whose ``t`` already carries the time shift: a flow model uses it as its sigma directly.
SETS_SIGMA = frozenset({"shifted"})
PREDICTIONS = ("eps", "v", "flow")
LOSS_SPACES = ("x0", "native")
# Drawn noise levels stay this far from 0 and 1 (a sigma of exactly 0 or 1 has an infinite or zero SNR).
T_EPS = 1e-5


def check_sampling(kind: str) -> None:
    if kind not in TIMESTEP_SAMPLING:
        raise ValueError(f"unknown timestep sampling {kind!r}; choose one of {', '.join(TIMESTEP_SAMPLING)}")


def shift_sigma(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-model time shift ``shift * t / (1 + (shift - 1) * t)`` (SD3, Flux): ``shift > 1`` moves noise
    levels towards 1 (more noise), ``shift = 1`` is the identity. Maps (0, 1) onto (0, 1), monotonically."""
    if not shift > 0:
        raise ValueError(f"shift must be positive, got {shift}")
    return shift * t / (1 + (shift - 1) * t)


def unshift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of :func:`shift_sigma`: the ``t`` that ``shift`` moves to ``sigma``."""
    return sigma / (shift - (shift - 1) * sigma)


def _in_range(kind: str, n: int, generator: torch.Generator, lo: float, hi: float, *, scale: float, mean: float
              ) -> torch.Tensor:
    """``n`` draws of ``kind`` (``uniform`` or ``logit_normal`` with ``mean`` and ``scale``) that lie in ``[lo, hi]``,
    distributed as the whole distribution is inside that range (its inverse CDF at a uniform draw between the
    CDF's values at ``lo`` and ``hi``): one uniform draw each, never a rejected one."""
    device = generator.device
    u = torch.rand(n, generator=generator, device=device, dtype=torch.float64)
    if kind == "uniform":
        return (lo + (hi - lo) * u).float()
    bounds = torch.tensor([lo, hi], dtype=torch.float64)  # on the host: reading them back waits for nothing
    a, b = torch.special.ndtr((torch.logit(bounds) - mean) / scale).tolist()
    return torch.sigmoid(mean + scale * torch.special.ndtri(a + (b - a) * u)).float()


def sample_t(kind: str, n: int, generator: torch.Generator, *, scale: float = 1.0, shift: float = 1.0,
             mean: float = 0.0, base: str = "logit_normal", t_range: tuple[float, float] = (0.0, 1.0)
             ) -> torch.Tensor:
    """``n`` noise levels ``t`` in (0, 1) (float32, on the generator's device), drawn with ``generator`` only.

    - ``uniform``: ``t ~ U(0, 1)``.
    - ``logit_normal``: ``t = sigmoid(mean + scale * N(0, 1))``, SD3's logit-normal sampling with location
      ``mean`` and scale (standard deviation) ``scale`` (SD3: 0 and 1).
    - ``sigmoid``: ``t = sigmoid(scale * N(0, 1))``, kohya/musubi's "sigmoid" (``scale`` = their
      ``sigmoid_scale``): logit-normal centred at 0.
    - ``shifted``: a ``base`` draw (``"logit_normal"`` with ``mean``/``scale``, as kohya/musubi's "shift", or
      ``"uniform"``), then :func:`shift_sigma` with ``shift``. See the module docstring: this ``t`` is a flow
      model's sigma.

    Values are clamped to ``[T_EPS, 1 - T_EPS]``. ``shift`` is used by ``shifted`` only. ``t_range``: ``(lo, hi)``
    within ``[0, 1]``, the levels drawn (after the shift) lie in it, distributed as the whole distribution is inside
    it (sd-scripts' ``--min_timestep`` / ``--max_timestep``, as fractions of 1000); ``(0, 1)`` draws as before."""
    check_sampling(kind)
    if n < 0:
        raise ValueError(f"n must not be negative, got {n}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    lo, hi = (float(v) for v in t_range)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"t_range must be (lo, hi) with 0 <= lo < hi <= 1, got {t_range}")
    if kind == "shifted" and base not in ("uniform", "logit_normal"):
        raise ValueError(f"the base of shifted sampling must be 'uniform' or 'logit_normal', got {base!r}")
    device = generator.device
    if (lo, hi) != (0.0, 1.0):
        if kind == "shifted":
            t = _in_range(base, n, generator, float(unshift_sigma(torch.tensor(lo, dtype=torch.float64), shift)),
                          float(unshift_sigma(torch.tensor(hi, dtype=torch.float64), shift)), scale=scale, mean=mean)
            t = shift_sigma(t, shift)
        else:
            t = _in_range("uniform" if kind == "uniform" else "logit_normal", n, generator, lo, hi, scale=scale,
                          mean=0.0 if kind == "sigmoid" else mean)
        return t.clamp(max(T_EPS, lo), min(1 - T_EPS, hi))
    if kind == "uniform" or (kind == "shifted" and base == "uniform"):
        t = torch.rand(n, generator=generator, device=device)
    elif kind in ("logit_normal", "shifted"):
        t = torch.sigmoid(mean + scale * torch.randn(n, generator=generator, device=device))
    else:  # sigmoid
        t = torch.sigmoid(scale * torch.randn(n, generator=generator, device=device))
    if kind == "shifted":
        t = shift_sigma(t, shift)
    return t.clamp(T_EPS, 1 - T_EPS)


def snr(sigma: torch.Tensor, prediction: str) -> torch.Tensor:
    """Signal-to-noise ratio of noise level ``sigma``: ``1 / sigma^2`` (eps, v) or ``((1 - t) / t)^2`` (flow,
    ``sigma = t``)."""
    if prediction not in PREDICTIONS:
        raise ValueError(f"unknown prediction type {prediction!r}; choose one of {', '.join(PREDICTIONS)}")
    s = sigma.to(torch.float32)
    if prediction == "flow":
        return ((1 - s) / s) ** 2
    return 1 / s ** 2


DEBIASED_MAX_SNR = 1000.0


def loss_weight(sigma: torch.Tensor, prediction: str, *, space: str = "x0", min_snr_gamma: float = 0.0,
                max_weight: float = 1e4, debiased: bool = False) -> torch.Tensor:
    """Per-sample weights ``[B]`` (float32) for an x0-space loss at noise levels ``sigma`` ``[B]``.

    ``space="x0"``: all ones (the plain x0 loss). ``space="native"``: the weight that makes the x0 loss equal
    the model's own objective (eps: ``snr``; v: ``snr + 1``; flow velocity: ``1 / t^2``), clamped to
    ``max_weight`` (those grow without bound as sigma goes to 0). ``min_snr_gamma > 0``: min-SNR-gamma, weight
    ``min(snr, gamma)`` whatever ``space`` (it is one objective in every parametrisation; module docstring).
    ``debiased``: debiased estimation, weight ``snr / sqrt(min(snr, 1000))`` (``sqrt(snr)`` below an SNR of 1000;
    module docstring), clamped to ``max_weight``."""
    if space not in LOSS_SPACES:
        raise ValueError(f"unknown loss space {space!r}; choose one of {', '.join(LOSS_SPACES)}")
    if min_snr_gamma < 0:
        raise ValueError(f"min_snr_gamma must be 0 (off) or positive, got {min_snr_gamma}")
    ratio = snr(sigma, prediction)
    if debiased:
        return torch.clamp(ratio / torch.sqrt(torch.clamp(ratio, max=DEBIASED_MAX_SNR)), max=max_weight)
    if min_snr_gamma > 0:
        return torch.clamp(ratio, max=min_snr_gamma)
    if space == "x0":
        return torch.ones_like(ratio)
    if prediction == "eps":
        weight = ratio
    elif prediction == "v":
        weight = ratio + 1
    else:
        weight = 1 / sigma.to(torch.float32) ** 2
    return torch.clamp(weight, max=max_weight)


def perturbed_input(noise_scaling: Callable[..., torch.Tensor], calculate_denoised: Callable[..., torch.Tensor],
                    sigmas: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor,
                    extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Input perturbation (Ning et al. 2023): the model's input noised with ``noise + extra``, and how far that
    input moves the model's prediction of x0 by itself (its part that does not depend on the model's output),
    which the caller subtracts from the prediction so that the target stays what ``noise`` alone makes (sd-scripts'
    ``--ip_noise_gamma``: the noised latent takes the perturbed noise, the target the plain one). Comparing the
    prediction with x0 without that correction would train the model to remove the perturbed noise: plain
    training at a higher noise level. ``noise_scaling`` and ``calculate_denoised`` are the model sampling's
    (ComfyUI's ``model_sampling``: linear in the noise and in the input, for eps, v and flow models alike)."""
    plain = noise_scaling(sigmas, noise, latent, False)
    moved = noise_scaling(sigmas, noise + extra, latent, False) - plain
    return plain + moved, calculate_denoised(sigmas, torch.zeros_like(moved), moved)


def offset_noise(noise: torch.Tensor, strength: float, generator: torch.Generator) -> torch.Tensor:
    """Noise offset (Guttenberg 2023): ``noise + strength * N(0, 1)`` drawn once per sample and channel and
    broadcast over the spatial (and temporal) dimensions, for latents ``[B, C, H, W]`` or ``[B, C, T, H, W]``.
    The offset is drawn with ``generator`` (on its device) and moved to ``noise``'s device and dtype.
    ``strength == 0`` returns ``noise`` unchanged and draws nothing."""
    if strength == 0:
        return noise
    if noise.dim() < 3:
        raise ValueError(f"offset noise needs latents [B, C, ...spatial], got shape {tuple(noise.shape)}")
    shape = (noise.shape[0], noise.shape[1]) + (1,) * (noise.dim() - 2)
    offset = torch.randn(shape, generator=generator, device=generator.device)
    return noise + strength * offset.to(noise.device, noise.dtype)


def resize_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A pixel mask ``[B, H, W]``, ``[B, 1, H, W]`` or ``[B, 1, T, H, W]`` (batch 1 is broadcast) resized by area
    averaging to the spatial (and temporal) size of latents ``like`` (``[B, C, h, w]`` or ``[B, C, t, h, w]``):
    ``[B, 1, h, w]`` or ``[B, 1, t, h, w]`` (a 2-D mask on video latents is the same for every frame), float32,
    negative values clamped to 0."""
    m = mask.to(device=like.device, dtype=torch.float32)
    if m.dim() == 3:
        m = m[:, None]
    if m.dim() not in (4, 5) or m.shape[1] != 1:
        raise ValueError(f"a mask must be [B, H, W], [B, 1, H, W] or [B, 1, T, H, W], got {tuple(mask.shape)}")
    if like.dim() not in (4, 5):
        raise ValueError(f"masked losses need latents [B, C, H, W] or [B, C, T, H, W], got {tuple(like.shape)}")
    if m.dim() == 5 and like.dim() == 4:
        raise ValueError(f"a video mask {tuple(mask.shape)} does not fit image latents {tuple(like.shape)}")
    if m.shape[0] not in (1, like.shape[0]):
        raise ValueError(f"the mask has batch {m.shape[0]}, the latents {like.shape[0]}")
    if m.dim() == 4:
        m = F.adaptive_avg_pool2d(m, (like.shape[-2], like.shape[-1]))
        if like.dim() == 5:
            m = m[:, :, None]
    else:
        m = F.adaptive_avg_pool3d(m, (like.shape[-3], like.shape[-2], like.shape[-1]))
    return m.clamp(min=0).expand(like.shape[0], *m.shape[1:])


def per_sample_loss(err: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of each sample ``[B]`` from per-element errors ``err`` (``[B, C, H, W]`` or ``[B, C, T, H, W]``):
    the mean over its elements, or with a pixel ``mask`` (see :func:`resize_mask`) the mask-weighted mean
    ``sum(err * m) / sum(m)`` over its elements. A sample whose mask is all zero gets its plain mean (a mask
    that selects nothing would otherwise divide by zero)."""
    dims = tuple(range(1, err.dim()))
    if mask is None:
        return err.mean(dim=dims)
    m = resize_mask(mask, err).to(err.dtype)
    weight = m.expand_as(err)
    total = weight.sum(dim=dims)
    masked = (err * weight).sum(dim=dims) / total.clamp(min=torch.finfo(err.dtype).tiny)
    return torch.where(total > 0, masked, err.mean(dim=dims))


def masked_loss(err: torch.Tensor, mask: torch.Tensor | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """The batch loss from per-element errors: the mean over samples of :func:`per_sample_loss` (each sample
    counts once, however much of it the mask selects), each multiplied by ``weight`` ``[B]`` if given (e.g.
    :func:`loss_weight`)."""
    per = per_sample_loss(err, mask)
    if weight is not None:
        per = per * weight.to(per.device, per.dtype)
    return per.mean()


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`masked_loss` of the squared error ``(pred - target)^2``."""
    return masked_loss((pred - target) ** 2, mask, weight)
