"""LoRA training on a ComfyUI model: trainable adapters on every layer ComfyUI can patch, the diffusion loss of
one batch, and the hook that runs the training loop where ComfyUI runs a sampler.

Like ComfyUI's TrainLoraNode, the model runs inside a guider's ``sample`` call, so ComfyUI prepares the model
and conditioning for whatever architecture it is (SD1.x, SDXL, Flux-family, ...). Unlike it, batches come from
the streaming loader (prefetched on threads, pinned, copied on a CUDA side stream) and each sample keeps its
own caption within a batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

import comfy.sampler_helpers
import comfy.samplers

from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.loader import BatchLoader
from ..streaming_cache.train import captions, loop, timesteps
from . import compat
from .ui import log

LOSSES: dict[str, Callable[[], torch.nn.Module]] = {
    "MSE": torch.nn.MSELoss, "L1": torch.nn.L1Loss, "Huber": torch.nn.HuberLoss, "SmoothL1": torch.nn.SmoothL1Loss}


class Adapters(dict):
    """The LORA_MODEL dict of trainable tensors (keys ``diffusion_model.<module>.<param>``); ``bypass`` holds
    the adapters that run as forward hooks in bypass mode (None: all are weight wrappers)."""

    bypass: Any = None


def create_adapters(mp: Any, rank: int, algorithm: str, lora_dtype: torch.dtype,
                    existing: dict[str, torch.Tensor], *, bypass: bool = False) -> Adapters:
    """Trainable adapters on every weight ComfyUI can patch, as its TrainLoraNode creates them; returns the
    LORA_MODEL dict (keys ``diffusion_model.<module>.<param>``) whose tensors are the trainable parameters.

    ``bypass`` (newer ComfyUI): matrix adapters run as forward hooks beside the untouched base weight
    (:func:`compat.bypass_manager`), for quantized (fp8) base models, and cheaper per step on large ones;
    norms and biases keep their weight wrappers. The saved file is the same either way."""
    lora_sd = Adapters()
    manager = compat.bypass_manager() if bypass else None
    for n, m in mp.model.named_modules():
        if not hasattr(m, "weight_function"):
            continue
        if m.weight is not None:
            key = f"{n}.weight"
            if len(m.weight.shape) >= 2:
                alpha = float(existing.get(f"{key}.alpha", 1.0))
                found = None
                for adapter_cls in compat.WEIGHT_ADAPTERS:
                    found = adapter_cls.load(n, existing, alpha, existing.get(f"{key}.dora_scale"))
                    if found is not None:
                        break
                if found is not None:
                    adapter = found.to_train().to(lora_dtype)
                else:
                    adapter = compat.adapter_maps[algorithm].create_train(m.weight, rank=rank, alpha=1.0).to(lora_dtype)
                for name, parameter in adapter.named_parameters():
                    lora_sd[f"{n}.{name}"] = parameter
                if manager is not None:
                    if not compat.runs_in_bypass(adapter):
                        raise ValueError(f"bypass mode cannot train {type(adapter).__name__} adapters in this ComfyUI "
                                         f"({compat.comfyui_version()}): choose the LoRA, LoKr or OFT algorithm, or "
                                         "turn bypass mode off")
                    manager.add_adapter(key, adapter)
                else:
                    mp.add_weight_wrapper(key, adapter)
            else:
                diff = torch.nn.Parameter(torch.zeros(m.weight.shape, dtype=lora_dtype, requires_grad=True))
                mp.add_weight_wrapper(key, compat.BiasDiff(diff))
                lora_sd[f"{n}.diff"] = diff
        if getattr(m, "bias", None) is not None:
            bias = torch.nn.Parameter(torch.zeros(m.bias.shape, dtype=lora_dtype, requires_grad=True))
            mp.add_weight_wrapper(f"{n}.bias", compat.BiasDiff(bias))
            lora_sd[f"{n}.diff_b"] = bias
    lora_sd.bypass = manager
    return lora_sd


def flatten_batch(t: torch.Tensor) -> torch.Tensor:
    """Collated entries are stacked on a new first dim; ComfyUI values already carry a batch dim of 1."""
    return t.flatten(0, 1) if t.dim() >= 2 else t


def _batch_option(value: Any, batch: int) -> Any:
    """One option of a collated conditioning dict, as a single conditioning for ``batch`` samples holds it.

    The rule is ComfyUI's own for conditioning shared by a batch: a value every sample has alike is given once
    (with batch dimension 1; ComfyUI repeats it to the batch), a tensor that differs is stacked, one row per
    sample. Giving an equal value once matters: some models derive sizes from it (Lumina 2 counts its text
    tokens as the sum of ``attention_mask``, which stacking would double). A list of tensors (e.g.
    ``reference_latents``) follows the rule element by element; scalars (guidance, sizes) are equal within a
    batch, whose rows share their shapes."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and all(torch.equal(value[0], value[i]) for i in range(1, value.shape[0])):
            return value[0]
        return flatten_batch(value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [_batch_option(v, batch) for v in value]
    if isinstance(value, list) and len(value) == batch:
        return value[0]
    return value


def batch_conditioning(cond: Any) -> list:
    """A collated CONDITIONING (one list per entry, stacked) -> one CONDITIONING with batch = samples, so each
    sample keeps its own caption (ComfyUI's TrainLoraNode averages all captions of a batch instead)."""
    out = []
    for c, extra in cond:
        batch = c.shape[0]
        out.append([flatten_batch(c), {k: _batch_option(v, batch) for k, v in extra.items()}])
    return out


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (also inside lists such as ``reference_latents``) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _is_leaf_list(value: Any) -> bool:
    """A list :func:`collate` made of one scalar, string or None per sample (not a structure of tensors)."""
    return isinstance(value, list) and bool(value) and \
        not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in value)


def take_rows(value: Any, rows: list[int]) -> Any:
    """The samples ``rows`` of a collated batch: tensors indexed on their first (sample) dimension, per-sample
    scalar lists picked, structures kept."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, dict):
        return type(value)((k, take_rows(v, rows)) for k, v in value.items())
    if _is_leaf_list(value):
        return [value[i] for i in rows]
    if isinstance(value, (list, tuple)):
        return type(value)(take_rows(v, rows) for v in value)
    return value


def option_groups(cond: Any, batch: int) -> list[list[int]]:
    """Samples of a collated CONDITIONING grouped by their scalar options (SDXL's size conditioning, Flux
    guidance, ...). ComfyUI gives a conditioning one value of such an option for the whole batch, so samples
    that differ in one must run as separate model calls; usually there is one group, the whole batch."""
    keys: list[tuple] = [() for _ in range(batch)]
    for _, extra in cond:
        for name in sorted(extra):
            value = extra[name]
            if _is_leaf_list(value) and len(value) == batch and any(v != value[0] for v in value[1:]):
                keys = [k + ((name, repr(value[i])),) for i, k in enumerate(keys)]
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())


def append_reference(cond: list, latent: torch.Tensor) -> list:
    """What ComfyUI's ReferenceLatent node does to a conditioning: ``latent`` appended to the list under
    ``reference_latents`` of every entry (a new list; the input is not changed). With one reference latent
    per sample (batch dimension = samples), each sample is conditioned on its own reference."""
    out = []
    for c, extra in cond:
        extra = dict(extra)
        extra["reference_latents"] = list(extra.get("reference_latents") or []) + [latent]
        out.append([c, extra])
    return out


def set_default(cond: list, name: str, value: Any) -> list:
    """``cond`` with option ``name`` set to ``value`` in entries that do not have it."""
    return [[c, extra if name in extra else dict(extra, **{name: value})] for c, extra in cond]


@dataclass(frozen=True)
class LossOptions:
    """How a step draws its noise level and weighs its loss (``streaming_cache.train.timesteps``), and what it
    does with captions and masks. The defaults are ComfyUI's own trainer's behaviour."""

    timestep_sampling: str = "uniform"
    timestep_shift: float = 3.0
    timestep_scale: float = 1.0
    space: str = "x0"
    min_snr_gamma: float = 0.0
    noise_offset: float = 0.0
    masked: bool = True
    caption_dropout: float = 0.0
    empty_caption: Any = None  # the empty caption's CONDITIONING, for caption dropout


def prediction_type(model_sampling: Any) -> str:
    """What the model predicts, in the terms of ``timesteps.loss_weight``: flow (rectified-flow models: SD3,
    Flux, Wan, ...), v, or eps."""
    import comfy.model_sampling as ms

    if isinstance(model_sampling, ms.CONST):
        return "flow"
    if isinstance(model_sampling, ms.V_PREDICTION):
        return "v"
    return "eps"


def drop_captions(cond: Any, empty: Any, drop: list[bool]) -> Any:
    """A collated CONDITIONING with the samples marked in ``drop`` given the empty caption's conditioning
    ``empty`` (one entry, as cached). Samples are replaced row by row where the shapes agree (CLIP's fixed 77
    tokens); otherwise the whole batch takes the empty caption if its first sample is dropped."""
    if not any(drop):
        return cond
    (e_cond, e_extra), = empty
    out = []
    for c, extra in cond:
        if tuple(c.shape[2:]) == tuple(e_cond.shape[1:]):
            rows = torch.tensor(drop)
            c = torch.where(rows.view(-1, *([1] * (c.dim() - 1))), e_cond.to(c.dtype)[None], c)
            extra = dict(extra)
            for k, v in e_extra.items():
                if isinstance(v, torch.Tensor) and isinstance(extra.get(k), torch.Tensor) and \
                        tuple(extra[k].shape[2:]) == tuple(v.shape[1:]):
                    extra[k] = torch.where(rows.view(-1, *([1] * (extra[k].dim() - 1))), v.to(extra[k].dtype)[None],
                                           extra[k])
            out.append([c, extra])
        elif drop[0]:
            n = c.shape[0]
            out.append([e_cond[None].expand(n, *e_cond.shape).contiguous(),
                        {k: (v[None].expand(n, *v.shape).contiguous() if isinstance(v, torch.Tensor) else v)
                         for k, v in e_extra.items()}])
        else:
            out.append([c, extra])
    return out


class DiffusionLoss:
    """The loss of one batch for any model ComfyUI can sample: the clean latent is noised at a random
    timestep by the model's own sampling object (eps, v-prediction or flow, with the shift of the model or of
    a ModelSampling* node applied to it), the model predicts, and its prediction of the clean latent is
    compared with the clean latent. Noise and timesteps are drawn from a generator seeded by (seed,
    micro-step), so a resumed run draws exactly what the uninterrupted one would.

    What a family needs beyond that is added to each batch's conditioning as ComfyUI's own nodes would:
    an edit pair's reference latent (a ``ref`` column) as ReferenceLatent adds it, and for guidance-distilled
    models (Flux dev, HunyuanVideo) the ``guidance`` value FluxGuidance would set, where the cached
    conditioning has none. Its default 1.0 is what kohya's and ai-toolkit's Flux trainers use: ComfyUI's own
    default (3.5) is a sampling setting, and a LoRA trained at it learns to depend on it."""

    def __init__(self, criterion: torch.nn.Module, dtype: torch.dtype, seed: int, *, guidance: float | None = 1.0,
                 options: LossOptions | None = None):
        self.criterion, self.dtype, self.seed, self.guidance = criterion, dtype, seed, guidance
        self.criterion.reduction = "none"  # per element: samples are weighted and masked before averaging
        self.options = options or LossOptions()
        timesteps.check_sampling(self.options.timestep_sampling)
        if self.options.caption_dropout > 0 and self.options.empty_caption is None:
            raise ValueError("caption dropout needs the empty caption's conditioning")

    def bind(self, model_wrap: Any, extra_args: dict, device: torch.device) -> None:
        """Called when sampling starts: the wrapped model, its sampling arguments and device."""
        self.model_wrap, self.extra_args, self.device = model_wrap, extra_args, device
        self.inner = model_wrap.inner_model

    def conditioning(self, batch: Any, model: Any, micro: int | None = None) -> list:
        """The CONDITIONING of a collated batch (whose scalar options are equal) for ``model`` (a BaseModel);
        with ``micro`` (the micro-step), captions dropped as the options ask, decided per sample by the step."""
        raw = batch["cond"]
        p = self.options.caption_dropout
        if micro is not None and p > 0:
            n = batch["latent"]["samples"].shape[0]
            raw = drop_captions(raw, self.options.empty_caption,
                                [captions.dropout(self.seed, micro, p, i) for i in range(n)])
        cond = batch_conditioning(raw)
        if "ref" in batch:
            cond = append_reference(cond, flatten_batch(batch["ref"]["samples"]))
        if self.guidance is not None and compat.guidance_distilled(model):
            cond = set_default(cond, "guidance", float(self.guidance))
        return cond

    def __call__(self, batch: Any, micro: int) -> torch.Tensor:
        return self.loss(batch, loop.step_generator(self.seed, micro), micro=micro)

    def sigmas(self, t: torch.Tensor) -> torch.Tensor:
        """Noise levels ``t`` (1 = pure noise) as the model's sigmas: through its own schedule (with its shift),
        except a ``shifted`` draw on a flow model, whose ``t`` is the sigma (the shift given overrides the
        model's)."""
        ms = self.inner.model_sampling
        if self.options.timestep_sampling in timesteps.SETS_SIGMA and prediction_type(ms) == "flow":
            return t.to(self.device, torch.float32)
        return torch.tensor([float(ms.percent_to_sigma(1.0 - float(v))) for v in t], device=self.device)

    def loss(self, batch: Any, g: torch.Generator, *, micro: int | None = None,
             t: float | None = None) -> torch.Tensor:
        """The loss of a collated batch with noise drawn from ``g``: at noise levels drawn as the options say,
        or at the fixed level ``t`` (validation). ``micro`` decides caption dropout (none without it)."""
        inner, device, o = self.inner, self.device, self.options
        latent = inner.process_latent_in(flatten_batch(batch["latent"]["samples"]).to(device))
        n = latent.shape[0]
        noise = torch.randn(latent.shape, generator=g)
        if t is None:
            draw = timesteps.sample_t(o.timestep_sampling, n, g, scale=o.timestep_scale, shift=o.timestep_shift)
        else:
            draw = torch.full((n,), float(t))
        noise = timesteps.offset_noise(noise, o.noise_offset, g).to(device, latent.dtype)
        sigmas = self.sigmas(draw)
        weight = timesteps.loss_weight(sigmas.float().cpu(), prediction_type(inner.model_sampling), space=o.space,
                                       min_snr_gamma=o.min_snr_gamma)
        mask = flatten_batch(batch["mask"]["mask"]).to(device) if o.masked and "mask" in batch else None
        xt = inner.model_sampling.noise_scaling(sigmas, noise, latent, False)
        x0 = inner.model_sampling.noise_scaling(torch.zeros_like(sigmas), torch.zeros_like(noise), latent, False)
        groups = option_groups(batch["cond"], n)
        total = None
        for group in groups:
            part, rows = (batch, slice(None)) if len(groups) == 1 else (take_rows(batch, group), group)
            cond = self.conditioning(part, inner, None if micro is None else micro)
            positive = {"positive": comfy.sampler_helpers.convert_cond(_to(cond, device))}
            self.model_wrap.conds = comfy.samplers.process_conds(inner, noise[rows], positive, device, latent[rows],
                                                                 None, self.seed)
            with torch.autocast(device.type, dtype=self.dtype):
                pred = self.model_wrap(xt[rows], sigmas[rows], **self.extra_args)
            err = self.criterion(pred.float(), x0[rows].float())
            count = n if isinstance(rows, slice) else len(rows)
            loss = timesteps.masked_loss(err, None if mask is None else mask[rows], weight[rows]) * (count / n)
            total = loss if total is None else total + loss
        assert total is not None
        return total


class Validation:
    """The validation loss: up to ``rows`` held-out samples, each scored at fixed noise levels with noise fixed
    per (sample, level), so values compare across steps and across runs on the same data. The loop calls it
    without gradients and restores the random state afterwards."""

    LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9)

    def __init__(self, loss: DiffusionLoss, dataset: DatasetHandle, rows: int = 16):
        self.loss, self.dataset = loss, dataset
        self.rows = list(range(min(rows, len(dataset))))

    def __call__(self) -> float:
        values = []
        for i in self.rows:
            batch = self.dataset.collate([i])
            for k, level in enumerate(self.LEVELS):
                g = torch.Generator().manual_seed(1_000_003 * i + k)
                values.append(float(self.loss.loss(batch, g, t=level)))
        return sum(values) / max(1, len(values))


class _LoopSampler(comfy.samplers.Sampler):
    """Runs the training loop where ComfyUI runs a sampler: model loaded, options and patches in place."""

    def __init__(self, run: Callable[[Any, dict, torch.device], loop.TrainResult]):
        self.run = run
        self.result: loop.TrainResult | None = None

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        self.result = self.run(model_wrap, extra_args, noise.device)
        return torch.zeros_like(latent_image)


def train_lora(mp: Any, dataset: DatasetHandle, lora_sd: dict[str, torch.Tensor], loss: DiffusionLoss,
               config: loop.TrainConfig, *, batch_size: int, workers: int, prefetch: int,
               checkpoint_depth: int, resume: dict | None, on_step: Callable[[int, float], None],
               save: Callable[[dict, bool], None], validate: Callable[[], float] | None = None,
               should_stop: Callable[[], bool] | None = None, offloading: bool = False) -> loop.TrainResult:
    """Train ``lora_sd`` (adapters already added to ``mp``) on ``dataset`` for ``config.steps`` steps.

    The guider is started with the first sample, batched by the same collate the loader uses, as the shape of
    the latent and the conditioning ComfyUI prepares the model for; every step then sets its own.

    ``checkpoint_depth`` 0 trains without gradient checkpointing where the model allows it. Several of
    ComfyUI's models (Flux, LTXV, HunyuanVideo) update activations in place (``img += ...`` after a norm saved
    ``img`` for the backward pass), which autograd refuses ("modified by an inplace operation"); checkpointing
    is immune, as each block is recomputed in the backward pass. Such a model fails at its first backward pass,
    before any weight changed, so it is trained again from the start with checkpoint depth 1, exactly as if
    that had been asked for.

    ``offloading`` (newer ComfyUI) keeps only part of the frozen base model on the GPU and streams the rest
    in from the CPU for each layer, with ComfyUI's offload-aware checkpointing, so a model larger than the
    GPU trains; adapters created with ``bypass`` run as forward hooks (:func:`create_adapters`)."""
    try:
        return _train(mp, dataset, lora_sd, loss, config, batch_size=batch_size, workers=workers,
                      prefetch=prefetch, checkpoint_depth=checkpoint_depth, resume=resume, on_step=on_step,
                      save=save, validate=validate, should_stop=should_stop, offloading=offloading)
    except RuntimeError as e:
        if checkpoint_depth or "modified by an inplace operation" not in str(e):
            raise
        log.warning("%s updates tensors in place during its forward pass, which only trains with gradient "
                    "checkpointing; training with gradient checkpointing on", type(mp.model).__name__)
        for p in lora_sd.values():
            p.grad = None
        return _train(mp, dataset, lora_sd, loss, config, batch_size=batch_size, workers=workers,
                      prefetch=prefetch, checkpoint_depth=1, resume=resume, on_step=on_step, save=save,
                      validate=validate, should_stop=should_stop, offloading=offloading)


def _train(mp: Any, dataset: DatasetHandle, lora_sd: dict[str, torch.Tensor], loss: DiffusionLoss,
           config: loop.TrainConfig, *, batch_size: int, workers: int, prefetch: int, checkpoint_depth: int,
           resume: dict | None, on_step: Callable[[int, float], None],
           save: Callable[[dict, bool], None], validate: Callable[[], float] | None = None,
           should_stop: Callable[[], bool] | None = None, offloading: bool = False) -> loop.TrainResult:
    def run(model_wrap: Any, extra_args: dict, device: torch.device) -> loop.TrainResult:
        loss.bind(model_wrap, extra_args, device)
        loader = BatchLoader(dataset, batch_size, seed=config.seed, workers=workers, prefetch=prefetch,
                             device=device if device.type == "cuda" else None)
        with contextlib.closing(loader):
            return loop.train(lora_sd, loader, loss, config, resume=resume, on_step=on_step, save=save,
                              validate=validate, should_stop=should_stop)

    first = dataset.collate([0])
    latent = flatten_batch(first["latent"]["samples"])
    modules = compat.modules_at_depth(mp.model.diffusion_model, checkpoint_depth) if checkpoint_depth else []
    mp.model.requires_grad_(False)
    sampler = _LoopSampler(run)
    guider = compat.training_guider(mp, offloading)
    guider.set_conds(loss.conditioning(first, mp.model))
    dummy = torch.zeros((batch_size, *latent.shape[1:]))
    with compat.gradient_checkpointing(modules, offloading):
        compat.load_models_for_training(mp, offloading)
        compat.thaw_inference_tensors(mp.model)
        with compat.bypass_hooks(getattr(lora_sd, "bypass", None), mp):
            guider.sample(dummy, dummy, sampler, torch.ones(2), seed=config.seed)
    assert sampler.result is not None
    return sampler.result
