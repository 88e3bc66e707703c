"""LoRA training on a ComfyUI model: trainable adapters on every layer ComfyUI can patch, the diffusion loss of
one batch, and the hook that runs the training loop where ComfyUI runs a sampler.

Like ComfyUI's TrainLoraNode, the model runs inside a guider's ``sample`` call, so ComfyUI prepares the model
and conditioning for whatever architecture it is (SD1.x, SDXL, Flux-family, ...). Unlike it, batches come from
the streaming loader (prefetched on threads, pinned, copied on a CUDA side stream) and each sample keeps its
own caption within a batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

import comfy.sampler_helpers
import comfy.samplers

from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.loader import BatchLoader
from ..streaming_cache.train import loop
from . import compat

LOSSES: dict[str, Callable[[], torch.nn.Module]] = {
    "MSE": torch.nn.MSELoss, "L1": torch.nn.L1Loss, "Huber": torch.nn.HuberLoss, "SmoothL1": torch.nn.SmoothL1Loss}


def create_adapters(mp: Any, rank: int, algorithm: str, lora_dtype: torch.dtype,
                    existing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainable adapters on every weight ComfyUI can patch, as its TrainLoraNode creates them; returns the
    LORA_MODEL dict (keys ``diffusion_model.<module>.<param>``) whose tensors are the trainable parameters."""
    lora_sd: dict[str, torch.Tensor] = {}
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
                mp.add_weight_wrapper(key, adapter)
            else:
                diff = torch.nn.Parameter(torch.zeros(m.weight.shape, dtype=lora_dtype, requires_grad=True))
                mp.add_weight_wrapper(key, compat.BiasDiff(diff))
                lora_sd[f"{n}.diff"] = diff
        if getattr(m, "bias", None) is not None:
            bias = torch.nn.Parameter(torch.zeros(m.bias.shape, dtype=lora_dtype, requires_grad=True))
            mp.add_weight_wrapper(f"{n}.bias", compat.BiasDiff(bias))
            lora_sd[f"{n}.diff_b"] = bias
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


def _to(cond: list, device: torch.device) -> list:
    return [[c.to(device), {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in o.items()}]
            for c, o in cond]


class DiffusionLoss:
    """The loss of one batch for any model ComfyUI can sample: the clean latent is noised at a random
    timestep by the model's own sampling object (eps, v-prediction or flow), the model predicts, and its
    prediction of the clean latent is compared with the clean latent. Noise and timesteps are drawn from a
    generator seeded by (seed, micro-step), so a resumed run draws exactly what the uninterrupted one would."""

    def __init__(self, criterion: torch.nn.Module, dtype: torch.dtype, seed: int):
        self.criterion, self.dtype, self.seed = criterion, dtype, seed

    def bind(self, model_wrap: Any, extra_args: dict, device: torch.device) -> None:
        """Called when sampling starts: the wrapped model, its sampling arguments and device."""
        self.model_wrap, self.extra_args, self.device = model_wrap, extra_args, device
        self.inner = model_wrap.inner_model

    def __call__(self, batch: Any, micro: int) -> torch.Tensor:
        inner, device = self.inner, self.device
        g = loop.step_generator(self.seed, micro)
        latent = inner.process_latent_in(flatten_batch(batch["latent"]["samples"]).to(device))
        noise = torch.randn(latent.shape, generator=g).to(device, latent.dtype)
        sigmas = torch.tensor([inner.model_sampling.percent_to_sigma(float(p))
                               for p in torch.rand(latent.shape[0], generator=g)], device=device)
        xt = inner.model_sampling.noise_scaling(sigmas, noise, latent, False)
        x0 = inner.model_sampling.noise_scaling(torch.zeros_like(sigmas), torch.zeros_like(noise), latent, False)
        positive = {"positive": comfy.sampler_helpers.convert_cond(_to(batch_conditioning(batch["cond"]), device))}
        self.model_wrap.conds = comfy.samplers.process_conds(inner, noise, positive, device, latent, None, self.seed)
        with torch.autocast(device.type, dtype=self.dtype):
            pred = self.model_wrap(xt, sigmas, **self.extra_args)
            return self.criterion(pred.float(), x0.float())


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
               save: Callable[[dict, bool], None]) -> loop.TrainResult:
    """Train ``lora_sd`` (adapters already added to ``mp``) on ``dataset`` for ``config.steps`` steps.

    The guider is started with the first sample, batched by the same collate the loader uses, as the shape of
    the latent and the conditioning ComfyUI prepares the model for; every step then sets its own."""

    def run(model_wrap: Any, extra_args: dict, device: torch.device) -> loop.TrainResult:
        loss.bind(model_wrap, extra_args, device)
        loader = BatchLoader(dataset, batch_size, seed=config.seed, workers=workers, prefetch=prefetch,
                             device=device if device.type == "cuda" else None)
        with contextlib.closing(loader):
            return loop.train(lora_sd, loader, loss, config, resume=resume, on_step=on_step, save=save)

    first = dataset.collate([0])
    latent = flatten_batch(first["latent"]["samples"])
    modules = compat.modules_at_depth(mp.model.diffusion_model, checkpoint_depth) if checkpoint_depth else []
    mp.model.requires_grad_(False)
    sampler = _LoopSampler(run)
    guider = compat.training_guider(mp)
    guider.set_conds(batch_conditioning(first["cond"]))
    dummy = torch.zeros((batch_size, *latent.shape[1:]))
    with compat.gradient_checkpointing(modules):
        compat.load_models_for_training(mp)
        guider.sample(dummy, dummy, sampler, torch.ones(2), seed=config.seed)
    assert sampler.result is not None
    return sampler.result
