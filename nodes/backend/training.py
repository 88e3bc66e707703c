"""ComfyUI's models as the trainer's backend (``streaming_cache.train.backend.TrainBackend``): trainable adapters
on every layer ComfyUI can patch, the diffusion loss of one batch, and the training pass run where ComfyUI runs
a sampler.

Like ComfyUI's TrainLoraNode, the model runs inside a guider's ``sample`` call, so ComfyUI prepares the model
and conditioning for whatever architecture it is (SD1.x, SDXL, Flux-family, video models, ...). Unlike it,
batches come from the streaming loader (prefetched on threads, pinned, copied on a CUDA side stream) and each
sample keeps its own caption within a batch. What a family needs beyond ComfyUI's own preparation (an edit
pair's reference latent, the guidance value of guidance-distilled models) is added to each batch's conditioning
here, as ComfyUI's nodes would add it.

No host read of device values inside a micro-step: the step decides from host data (the draws, the samples'
groups and, where the batch was marked on the host, which samples hold equal options), keeps the empty caption on
the device, picks a split batch's rows by slices, hands ComfyUI's conditioning code the host copy of an option it
reads on the host (SDXL's pooled output: ``families.HOST_OPTIONS``) and copies what that code makes on the host to
the device from pinned memory, so that the host prepares the next step while the device still runs this one
(``streaming_cache.train.conditioning``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import comfy.model_sampling
import comfy.sampler_helpers
import comfy.samplers
import torch

from ...streaming_cache import environment
from ...streaming_cache.dataset import DatasetHandle
from ...streaming_cache.errors import LoraFormatError
from ...streaming_cache.fallbacks import COMPILED_BLOCKS, Fallbacks, describe
from ...streaming_cache.mix import DatasetMix
from ...streaming_cache.torch_build import is_rocm
from ...streaming_cache.train import captions, compiled, dora, graphs, inference, lora_formats, recompute, timesteps
from ...streaming_cache.train.conditioning import (
    flatten_batch,
    host_rows_applied,
    keep_on_host,
    mark_equal_samples,
    option_groups,
    pick_rows,
    sample_rows,
    step_conditioning,
    take_rows,
    to_device,
    upload,
)
from ...streaming_cache.train.draws import Draws, noise_and_levels, perturbation
from ...streaming_cache.train.graph_devices import GraphDevice, graph_device
from ...streaming_cache.train.inplace import is_inplace_update
from ...streaming_cache.train.layers import LayerChoice
from ...streaming_cache.train.spec import NO_LORA, TrainSpec
from . import compat, families, fused

R = TypeVar("R")

LOSSES: dict[str, Callable[[], torch.nn.Module]] = {
    "MSE": torch.nn.MSELoss, "L1": torch.nn.L1Loss, "Huber": torch.nn.HuberLoss, "SmoothL1": torch.nn.SmoothL1Loss}
TRAINING_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LORA_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class DoraDiff(compat.LoraDiff):
    """ComfyUI's training LoRA layer with a trained magnitude, ``dora_scale`` (``streaming_cache.train.dora``): the
    weight it makes is the one ComfyUI's loader makes from the saved file (in float32, with the base weight dtype's
    epsilon). A weight wrapper only: it rescales the whole weight, so it has no bypass form and is never fused."""

    def __init__(self, weights: tuple, magnitude: torch.Tensor):
        super().__init__(weights)
        self.dora_scale = torch.nn.Parameter(magnitude.detach().to(torch.float32).clone())

    @classmethod
    def of(cls, lora_layer: Any, weight: torch.Tensor) -> DoraDiff:
        """A new DoRA layer from a new LoRA layer of ``weight``: its matrices and alpha, the weight's magnitude."""
        weights = (lora_layer.lora_up.weight.data, lora_layer.lora_down.weight.data, float(lora_layer.alpha), None,
                   None, None)
        return cls(weights, dora.initial_magnitude(weight))

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        diff = (self.lora_up.weight @ self.lora_down.weight).float().reshape(w.shape)
        updated = w.float() + (self.alpha.float() / self.rank) * diff
        return dora.decomposed(updated, self.dora_scale.float(), torch.finfo(w.dtype).eps).to(w.dtype)


def _continued(found: Any, name: str, weight: torch.Tensor, magnitude: torch.Tensor | None) -> Any:
    """The training layer of an adapter loaded from an existing file: a DoRA layer where the file holds a LoRA
    with a ``magnitude`` (ComfyUI's own ``to_train`` drops it), else ComfyUI's."""
    if magnitude is None:
        return found.to_train()
    weights = getattr(found, "weights", None)
    if getattr(found, "name", None) != "lora" or weights is None:
        raise ValueError(f"the LoRA to continue has a DoRA magnitude on a {type(found).__name__} layer at {name}, "
                         "which Train LoRA cannot train (DoRA is for LoRA layers); train a new adapter instead")
    if weights[3] is not None:
        raise ValueError(f"the LoRA to continue has a DoRA layer with a mid matrix (Tucker) at {name}, which Train "
                         "LoRA cannot train; train a new LoRA instead")
    dora.check_magnitude(weights[4], weight.shape, name)
    return DoraDiff(weights, weights[4])


def _saved_alpha(existing: dict[str, torch.Tensor], module: str) -> float:
    """The alpha of ``module``'s layer in an existing LoRA: its ``.alpha``, or where the file has none (diffusers'
    and PEFT's files) the rank, since ComfyUI's loader then applies the matrices at scale 1."""
    alpha = existing.get(f"{module}.alpha")
    if alpha is not None:
        return float(alpha)
    down = existing.get(f"{module}.lora_down.weight")
    return float(down.shape[0]) if down is not None else 1.0


def create_adapters(mp: Any, rank: int, algorithm: str, lora_dtype: torch.dtype,
                    existing: dict[str, torch.Tensor], manager: Any = None,
                    alpha: float = 1.0, choice: LayerChoice | None = None,
                    decompose: bool = False) -> dict[str, torch.Tensor]:
    """Trainable adapters on the weights ComfyUI can patch that ``choice`` picks (default: every one, as its
    TrainLoraNode creates them); returns the LORA_MODEL dict (keys ``diffusion_model.<module>.<param>``) whose
    tensors are the trainable parameters. ``alpha``: a new adapter's alpha (its scale is ``alpha / rank``, saved in
    its file as ``.alpha``); ``choice`` gives a layer's rank where it names one; ``decompose``: new LoRA layers are
    DoRA layers (:class:`DoraDiff`). An adapter continued from ``existing`` keeps the layout, alpha and magnitudes
    of its file, whatever ``choice`` says.

    With a bypass ``manager`` (:func:`compat.bypass_manager`, newer ComfyUI) matrix adapters run as forward hooks
    beside the untouched base weight, for quantized (fp8) base models, and cheaper per step on large ones; norms
    and biases keep their weight wrappers. The saved file is the same either way.

    Only the diffusion model's layers get adapters: ComfyUI's LoRA loaders apply nothing else (a model's own
    embedders outside it, such as Stable Audio's seconds conditioners, would be trained and never loaded)."""
    choice = choice or LayerChoice()
    lora_sd: dict[str, torch.Tensor] = {}
    seen: list[str] = []
    for n, m in mp.model.named_modules():
        if not hasattr(m, "weight_function") or not n.startswith(compat.LORA_PREFIX):
            continue
        short = n[len(compat.LORA_PREFIX):]
        seen.append(short)
        if m.weight is not None:
            key = f"{n}.weight"
            if len(m.weight.shape) >= 2:
                saved_alpha = _saved_alpha(existing, n)
                found = None
                for adapter_cls in compat.WEIGHT_ADAPTERS:
                    found = adapter_cls.load(n, existing, saved_alpha, existing.get(f"{n}.dora_scale"))
                    if found is not None:
                        break
                if found is not None:
                    adapter = _continued(found, short, m.weight, existing.get(f"{n}.dora_scale")).to(lora_dtype)
                elif choice.trains(short, matrix=True):
                    layer_rank = choice.rank(short, rank)
                    new = compat.adapter_maps[algorithm].create_train(m.weight, rank=layer_rank, alpha=alpha)
                    adapter = (DoraDiff.of(new, m.weight) if decompose else new).to(lora_dtype)
                else:
                    adapter = None
                if adapter is not None:
                    for name, parameter in adapter.named_parameters():
                        lora_sd[f"{n}.{name}"] = parameter
                    if manager is not None:
                        if isinstance(adapter, DoraDiff):
                            raise ValueError("bypass mode cannot train DoRA (it rescales the whole weight, which a "
                                             "branch beside the layer cannot do): turn bypass mode or dora off")
                        if not compat.runs_in_bypass(adapter):
                            raise ValueError(f"bypass mode cannot train {type(adapter).__name__} adapters in this "
                                             f"ComfyUI ({compat.comfyui_version()}): choose the LoRA, LoKr or OFT "
                                             "algorithm, or turn bypass mode off")
                        manager.add_adapter(key, adapter)
                    else:
                        mp.add_weight_wrapper(key, adapter)
            elif choice.trains(short, matrix=False):
                diff = torch.nn.Parameter(torch.zeros(m.weight.shape, dtype=lora_dtype, requires_grad=True))
                mp.add_weight_wrapper(key, compat.BiasDiff(diff))
                lora_sd[f"{n}.diff"] = diff
        if getattr(m, "bias", None) is not None and choice.trains(short, matrix=False):
            bias = torch.nn.Parameter(torch.zeros(m.bias.shape, dtype=lora_dtype, requires_grad=True))
            mp.add_weight_wrapper(f"{n}.bias", compat.BiasDiff(bias))
            lora_sd[f"{n}.diff_b"] = bias
    if seen and not lora_sd and choice.narrows:
        raise ValueError(choice.nothing_chosen(seen))
    return lora_sd


def fused_mode() -> str:
    """How trainable layers run (``fused.MODES``): ``auto`` unless ``STREAMING_CACHE_FUSED_LORA`` says otherwise
    (``0`` or ``off``: through ComfyUI's weight wrappers; ``lowrank`` or ``merged``: every LoRA layer in that form),
    to compare them (the benchmarks and tests do)."""
    value = os.environ.get("STREAMING_CACHE_FUSED_LORA", "auto").strip().lower()
    value = {"1": "auto", "on": "auto", "0": "off", "false": "off", "no": "off"}.get(value, value)
    if value not in fused.MODES:
        raise ValueError(f"STREAMING_CACHE_FUSED_LORA={value!r}: use auto, lowrank, merged or off (0)")
    return value


def prediction_type(model_sampling: Any) -> str:
    """What the model predicts, in the terms of ``timesteps.loss_weight``: flow (rectified-flow models: SD3,
    Flux, Wan, ...), v, or eps."""
    if isinstance(model_sampling, comfy.model_sampling.CONST):
        return "flow"
    if isinstance(model_sampling, comfy.model_sampling.V_PREDICTION):
        return "v"
    return "eps"


class _LoopSampler(comfy.samplers.Sampler):
    """Runs the training pass where ComfyUI runs a sampler: model loaded, options and patches in place."""

    def __init__(self, run: Callable[[Any, dict, torch.device], Any]):
        self.run = run
        self.result: Any = None

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        self.result = self.run(model_wrap, extra_args, noise.device)
        return torch.zeros_like(latent_image)


class ComfyBackend:
    """A ComfyUI model (a ModelPatcher) as the trainer's backend, with adapters for ``spec`` on every layer
    ComfyUI can patch (``create_adapters``; seeded by the spec's seed, from an existing LoRA if one is named).

    The loss of a batch: the clean latent is noised at a random timestep by the model's own sampling object (eps,
    v-prediction or flow, with the shift of the model or of a ModelSampling* node applied to it), the model
    predicts, and its prediction is compared with the target of the spec's loss space, weighted and masked as
    the spec says (``streaming_cache.train.timesteps``). Captions are dropped per sample as the spec asks,
    deciding by (seed, micro-step, sample) alone, so resumes are exact. An edit pair's reference latent (a
    ``ref`` column) is appended to the conditioning's ``reference_latents`` as ReferenceLatent does, and
    guidance-distilled models (Flux dev, HunyuanVideo) get the spec's ``guidance`` where the cached
    conditioning has none; its default 1.0 is what kohya's and ai-toolkit's Flux trainers use (ComfyUI's own
    3.5 is a sampling setting, and a LoRA trained at it learns to depend on it).

    The LoRA keeps ComfyUI's keys everywhere in the graph; only its file is written in the spec's ``lora_format``
    (:meth:`lora_file`), with names from ComfyUI's own key map of this model. A format that cannot hold this LoRA
    is refused before training starts. An existing LoRA to continue may be in any of the formats."""

    def __init__(self, model: Any, spec: TrainSpec, dataset: DatasetHandle | DatasetMix, *,
                 empty_caption: Any = None):
        if spec.data.caption_dropout > 0 and empty_caption is None:
            raise ValueError("caption dropout needs the empty caption's conditioning")
        if spec.adapter.algorithm not in compat.adapter_maps:
            raise ValueError(f"unknown adapter algorithm {spec.adapter.algorithm!r}; this ComfyUI trains "
                             f"{', '.join(compat.adapter_maps)}")
        compat.check_memory_options(offloading=spec.memory.offloading, bypass=spec.memory.bypass_mode)
        self.spec, self.empty_caption = spec, empty_caption
        self.dtype = TRAINING_DTYPES[spec.memory.training_dtype]
        self.lora_dtype = LORA_DTYPES[spec.memory.lora_dtype]
        self.criterion = LOSSES[spec.objective.loss_function]()
        self.criterion.reduction = "none"  # per element: samples are weighted and masked before averaging
        self.first = dataset.collate([0])
        self.patcher = compat.training_clone(model)
        self.patcher.set_model_compute_dtype(self.dtype)
        self.bypass = compat.bypass_manager() if spec.memory.bypass_mode else None
        self.fused_count = 0  # layers the last training pass ran fused (``fused.fused_layers``)
        self.graphed: graphs.GraphedForward | None = None  # the model's recorded steps during a pass, if any
        self.graph_report: str | None = None  # what CUDA graphs did in the last pass, for the summary
        self.fallbacks = Fallbacks()  # the device optimizations this node's run turned off, and why
        self.pin_budget = compat.pin_budget()  # ComfyUI's budget of pinned host memory (none pinned if disabled)
        self._trained_versions: tuple[int, ...] | None = None  # the trained tensors' versions at a pass's first loss
        self._names: lora_formats.NameTable | None = None
        self._host_sampling: tuple[Any, Any] | None = None  # (model sampling, its CPU copy): see _sigmas
        self._empty_on: tuple[torch.device, Any] | None = None  # (device, the empty caption there): see _empty_caption
        with compat.training_mode():
            named = spec.adapter.existing_lora
            existing = {} if named == NO_LORA else self._in_comfy_keys(compat.load_lora_file(named))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                self.adapters = create_adapters(self.patcher, spec.rank, spec.adapter.algorithm, self.lora_dtype,
                                                existing, self.bypass, spec.adapter.alpha, spec.adapter.layers,
                                                spec.adapter.dora)
        if not self.adapters:
            raise ValueError("this model has no layers ComfyUI can train a LoRA on")
        self._adapters_off = compat.AdaptersOff(self.patcher, self.bypass)  # a preserved batch's base model
        if spec.adapter.lora_format != lora_formats.DEFAULT_FORMAT:
            self.lora_file(self.lora(self.adapters))  # a format that cannot hold this LoRA is refused now

    # ---- what the node asks

    @property
    def model_config(self) -> str:
        """ComfyUI's name of the model's family (its model config class: ``SDXL``, ``Flux``, ``WAN21``, ...)."""
        return type(self.patcher.model.model_config).__name__

    @property
    def v_prediction(self) -> bool:
        return prediction_type(self.patcher.model.model_sampling) == "v"

    def layout_digest(self) -> str:
        """The model class and the trained tensors' names and shapes: another base model is another run."""
        text = json.dumps([type(self.patcher.model).__name__,
                           sorted((k, list(v.shape)) for k, v in self.adapters.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one sample's latent, batch dimension first (what previews sample at)."""
        return tuple(flatten_batch(self.first["latent"]["samples"]).shape)

    def lora(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights`` as the LORA_MODEL to save and pass on: detached, in the LoRA dtype."""
        return {k: v.detach().to(self.lora_dtype) for k, v in weights.items()}

    def names(self) -> lora_formats.NameTable:
        """The names of the model's weights in every LoRA format (built on first use)."""
        if self._names is None:
            self._names = compat.lora_name_table(self.patcher)
        return self._names

    def lora_file(self, lora: dict[str, torch.Tensor]) -> lora_formats.Converted:
        """``lora`` (ComfyUI's keys) as its file holds it: in the spec's ``lora_format``, with what that format
        left out."""
        fmt = self.spec.adapter.lora_format
        if fmt == lora_formats.DEFAULT_FORMAT:
            return lora_formats.Converted(dict(lora))
        try:
            return lora_formats.convert(lora, self.names(), fmt)
        except LoraFormatError as exc:
            raise ValueError(f"lora_format {fmt}: {exc}") from exc

    def _in_comfy_keys(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An existing LoRA in ComfyUI's keys: converted when it is in kohya's or diffusers' format, as it is
        otherwise (the adapters take what they recognise)."""
        if lora_formats.detect_format(tensors, self.names()) in ("kohya", "diffusers"):
            return lora_formats.convert(tensors, self.names(), "comfyui").tensors
        return tensors

    def model_with_lora(self, model: Any, lora: dict[str, torch.Tensor]) -> Any:
        """``model`` with ``lora`` applied as ComfyUI's LoRA loaders apply it (bypass mode: as forward hooks)."""
        return compat.apply_lora(model, lora, bypass=self.spec.memory.bypass_mode)

    def adapters_in_place(self) -> Any:
        """A context in which the patcher runs with the adapters as trained (bypass hooks injected): for
        sampling previews with the LoRA as it is."""
        return compat.bypass_hooks(self.bypass, self.patcher)

    # ---- TrainBackend

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.adapters

    def _bind(self, model_wrap: Any, extra_args: dict, device: torch.device) -> None:
        self.model_wrap, self.extra_args, self.device = model_wrap, extra_args, device
        self.inner = model_wrap.inner_model

    def prepare(self, batch: Any) -> Any:
        """A collated batch on the host, before its copy to the device, with its conditioning marked for the step
        (``conditioning.mark_equal_samples``: which samples hold equal options, and which equal the empty
        caption): the step then decides what a comparison on the device would, and the host does not wait for
        it."""
        if not isinstance(batch, dict) or "cond" not in batch:
            return batch
        cond = mark_equal_samples(batch["cond"], self.empty_caption)
        return dict(batch, cond=keep_on_host(cond, families.host_options(self.patcher.model)))

    def conditioning(self, batch: Any, draws: Draws | None = None, rows: Sequence[int] | None = None) -> list:
        """The CONDITIONING of a collated batch (whose scalar options are equal); with the ``draws`` of a training
        step, captions dropped as the spec asks, decided per sample (its global index: ``rows`` are the batch's
        samples among the draws' local samples)."""
        raw = batch["cond"]
        p, seed = self.spec.data.caption_dropout, self.spec.seed
        if draws is not None and draws.caption_dropout is not None:  # the batch's dataset has a rate of its own
            p = draws.caption_dropout
        drop = None
        if draws is not None and draws.micro is not None and p > 0:
            n = batch["latent"]["samples"].shape[0]
            local = list(rows) if rows is not None else list(range(n))
            drop = [captions.dropout(seed, draws.micro, p, draws.index(i)) for i in local]
        empty = self._empty_caption(raw[0][0].device) if drop is not None and any(drop) else None
        return families.conditioning(step_conditioning(raw, empty, drop), batch, self.patcher.model,
                                     guidance=float(self.spec.objective.guidance))

    def _empty_caption(self, device: torch.device) -> Any:
        """The empty caption's conditioning on ``device``, copied there once: a copy from the host in every step
        that drops a caption would make the host wait for the device."""
        if self._empty_on is None or self._empty_on[0] != device:
            kept = keep_on_host(self.empty_caption, families.host_options(self.patcher.model))
            self._empty_on = (device, to_device(kept, device))
        return self._empty_on[1]

    def _sigmas(self, t: torch.Tensor) -> torch.Tensor:
        """Noise levels ``t`` (1 = pure noise) as the model's sigmas (float32, on the CPU): through its own schedule
        (with its shift), except a ``shifted`` draw on a flow model, whose ``t`` is the sigma (the shift given
        overrides the model's). A discrete schedule's ``percent_to_sigma`` reads its value back from the tables
        (``.item()``), which on a GPU waits for every step still queued: the tables are read from a CPU copy."""
        ms = self.inner.model_sampling
        if self.spec.objective.timestep_sampling in timesteps.SETS_SIGMA and prediction_type(ms) == "flow":
            return t.to(torch.float32)
        on_host = self._on_host(ms)
        return torch.tensor([float(on_host.percent_to_sigma(1.0 - float(v))) for v in t], dtype=torch.float32)

    def _on_host(self, ms: Any) -> Any:
        """``ms`` where its tables are on the CPU, else its CPU copy (made once per model sampling object)."""
        if self._host_sampling is not None and self._host_sampling[0] is ms:
            return self._host_sampling[1]
        tables = list(ms.buffers()) if isinstance(ms, torch.nn.Module) else []
        if all(b.device.type == "cpu" for b in tables):
            return ms
        self._host_sampling = (ms, copy.deepcopy(ms).to("cpu"))
        return self._host_sampling[1]

    def host_tensor(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in host memory while the model trains on another device: a model condition ComfyUI's
        conditioning code made on the host (SDXL's ``y``), which the step copies up (:meth:`_upload`). Tests on the
        CPU, where both are the CPU, stand in for it with what they know."""
        return t.device.type == "cpu" and self.device.type != "cpu"

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the step made on the host, on the training device (``conditioning.upload``)."""
        return upload(tensor, self.device, self.fallbacks, pin_budget=self.pin_budget)

    def _autocast(self, device: torch.device) -> Any:
        """The training dtype's autocast on ``device`` (none for fp32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def _generated(self, batch: Any, latent: torch.Tensor) -> torch.Tensor | None:
        """Where the model generates (1) and where a node gave the latent (0): the latent's ``noise_mask``
        (LTXVImgToVideo and Wan22ImageToVideoLatent set 0 on the start frames) at the latent's shape, or None."""
        noise_mask = families.noise_mask(batch)
        if noise_mask is None:
            return None
        return compat.latent_mask(flatten_batch(noise_mask), latent.shape, self.device).to(latent.dtype)

    preserves_outputs = True  # ``loss(..., preserve=True)``: ``streaming_cache.train.backend.PreservingBackend``

    def loss(self, batch: Any, draws: Draws, *, t: float | None = None, preserve: bool = False) -> torch.Tensor:
        if self._trained_versions is None:
            self._trained_versions = self._versions()
        if self.graphed is not None:
            self.graphed.begin_step()
        inner, device, o = self.inner, self.device, self.spec.objective
        streams = families.latent_streams(batch, inner)
        packed, shapes = compat.pack_streams(inner, [s.to(device) for s in streams],
                                             shaped=families.needs(inner).shaped)
        latent = inner.process_latent_in(packed)
        n, samples = latent.shape[0], batch["latent"]["samples"].shape[0]
        per = n // samples  # latent rows of one sample: 1, or a clip's frames where they are the model's batch (SVD)
        noise, draw = noise_and_levels(draws, (per, *latent.shape[1:]), samples, sampling=o.timestep_sampling,
                                       scale=o.timestep_scale, shift=o.timestep_shift, offset=o.noise_offset, t=t,
                                       t_range=o.t_range)
        noise = self._upload(noise.flatten(0, 1).to(latent.dtype))
        levels = self._sigmas(draw).repeat_interleave(per)
        weight = self._upload(timesteps.loss_weight(levels, prediction_type(inner.model_sampling), space=o.space,
                                                    min_snr_gamma=o.snr_gamma, debiased=o.debiased))
        sigmas = self._upload(levels)
        mask = flatten_batch(batch["mask"]["mask"]).to(device) if o.masked_loss and "mask" in batch else None
        if shapes is not None and (mask is not None or families.noise_mask(batch) is not None):
            raise ValueError("masks on joint audio-video latents are not supported yet: train without masked_loss "
                             "and without image-to-video masks")
        xt = inner.model_sampling.noise_scaling(sigmas, noise, latent, False)
        x0 = inner.model_sampling.noise_scaling(torch.zeros_like(sigmas), torch.zeros_like(noise), latent, False)
        shift = None  # input perturbation: how far the perturbed input moves the prediction of x0 by itself
        if o.input_perturbation > 0 and t is None:
            extra = perturbation(draws, (per, *latent.shape[1:]), samples)
            extra = self._upload(extra.flatten(0, 1).to(latent.dtype)) * o.input_perturbation
            ms = inner.model_sampling
            xt, shift = timesteps.perturbed_input(ms.noise_scaling, ms.calculate_denoised, sigmas, noise, latent, extra)
        generated = self._generated(batch, latent)
        if generated is not None:  # given frames: as ComfyUI's sampler holds them, and not learned
            given = compat.given_region(inner, sigmas, noise, latent, generated)
            xt = xt * generated + given * (1.0 - generated)
            shift = None if shift is None else shift * generated
            mask = generated[:, :1] if mask is None else timesteps.resize_mask(mask, latent) * generated[:, :1]
        groups = option_groups(batch["cond"], samples)
        if per > 1:  # one clip per model call: the model takes its batch for one clip's frames
            groups = [[i] for group in groups for i in group]
        total = None
        for group in groups:
            whole = len(groups) == 1
            part, rows = (batch if whole else take_rows(batch, group)), sample_rows(group, per)
            pick = _picker(rows, whole)
            cond = self.conditioning(part, draws, None if whole else group)
            # the cached conditioning reaches layers unchanged where no dtype cast copies it (fp32)
            positive = {"positive": comfy.sampler_helpers.convert_cond(
                inference.ordinary(host_rows_applied(to_device(cond, device))))}
            conds = compat.process_conds(inner, pick(noise), positive, device, pick(latent),
                                         None if generated is None else pick(generated), self.spec.seed, shapes)
            self.model_wrap.conds = compat.host_conds_uploaded(conds, self._upload, self.host_tensor)
            # the base model's prediction first: its pass's memory is freed before the trained pass keeps its own
            target = self._base_prediction(pick(xt), pick(sigmas)) if preserve else pick(x0)
            with self._autocast(device):
                pred = self.model_wrap(pick(xt), pick(sigmas), **self.extra_args)
            if shift is not None and not preserve:  # the target stays the unperturbed noise's (Ning et al. 2023)
                pred = pred - pick(shift)
            err = self.criterion(pred.float(), target.float())
            loss = timesteps.masked_loss(err, None if mask is None else pick(mask), pick(weight)) * (len(rows) / n)
            total = loss if total is None else total + loss
        assert total is not None
        return total

    def _base_prediction(self, xt: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """What the model predicts for ``xt`` at ``sigmas`` with its adapters off (the conditioning bound for the
        step's call): a preserved dataset's target. Without gradients, so CUDA graphs run it eagerly and
        checkpointed blocks keep nothing."""
        with torch.no_grad(), self._adapters_off(), self._autocast(xt.device):
            return self.model_wrap(xt, sigmas, **self.extra_args)

    def run(self, work: Callable[[torch.device], R]) -> R:
        """``work(device)`` inside one pass of ComfyUI's guider, the model loaded for training.

        Before the first optimizer step, a pass that fails in a way another pass avoids is run again that way, from
        the start (the trained tensors checked unchanged since the pass's first loss, so the retry is the same
        run; after a step, the error is raised):

        * Several of ComfyUI's models (Flux, LTXV, HunyuanVideo) update activations in place inside their blocks
          (``img += ...`` after a norm saved ``img`` for the backward pass). A recomputed block handles that itself
          (``recompute.checkpoint_module``); in a block that is not recomputed (no gradient checkpointing, or one
          ``checkpoint_share`` leaves out) autograd refuses it at the first backward pass. The pass then runs with
          those blocks keeping copies of their inputs where autograd saves them (``recompute.inputs_kept``), and if
          in-place updates outside the blocks still fail, with every block recomputed (depth 1 where none was asked
          for): the same training either way, as if it had been asked for.
        * A compiled block's backward pass is compiled at the first backward pass; if that fails, the pass runs
          without compiled blocks (noted in :attr:`fallbacks`)."""
        memory = self.spec.memory
        depth = memory.depth
        plan = _Pass(depth=depth, share=memory.checkpoint_share if depth else 0.0, keep_inputs=False,
                     compiling=compiled.compile_mode())
        while True:
            self._trained_versions = None
            try:
                return self._run(work, plan)
            except RuntimeError as e:
                retry = self._retry(plan, e)
                if retry is None:
                    raise
            plan = retry
            self._forget_gradients()

    def _retry(self, plan: _Pass, exc: RuntimeError) -> _Pass | None:
        """How to run a pass that failed with ``exc`` again, or None to raise it (also once an optimizer step changed
        the trained tensors: a retry from the start would not be the same run)."""
        if self._trained_versions is not None and self._versions() != self._trained_versions:
            return None
        name = type(self.patcher.model).__name__
        if plan.compiling != "off" and compiled.is_compile_error(exc):
            self.fallbacks.note(COMPILED_BLOCKS, f"compiling a block's backward pass failed ({describe(exc)})")
            return dataclasses.replace(plan, compiling="off")
        if not is_inplace_update(exc):
            return None
        if not plan.keep_inputs and not (plan.depth and plan.share >= 1.0):
            compat.log.warning("%s updates tensors in place in its blocks, which autograd refuses in a block that is "
                               "not recomputed: those blocks keep copies of their inputs", name)
            return dataclasses.replace(plan, keep_inputs=True)
        if plan.keep_inputs:
            compat.log.warning("%s updates tensors in place outside its blocks too: training with every block "
                               "checkpointed", name)
            return dataclasses.replace(plan, depth=plan.depth or 1, share=1.0, keep_inputs=False)
        return None

    def _forget_gradients(self) -> None:
        for p in self.adapters.values():
            p.grad = None

    def _versions(self) -> tuple[int, ...]:
        """The trained tensors' versions: an optimizer step (or anything else that updates them) changes them."""
        return tuple(p._version for p in self.adapters.values())

    def _run(self, work: Callable[[torch.device], R], plan: _Pass) -> R:
        mp, offloading = self.patcher, self.spec.memory.offloading
        depth, share, keep_inputs, compiling = plan.depth, plan.share, plan.keep_inputs, plan.compiling

        def inside(model_wrap: Any, extra_args: dict, device: torch.device) -> R:
            self._bind(model_wrap, extra_args, device)
            return work(device)

        latent = flatten_batch(self.first["latent"]["samples"])
        at_depth = compat.modules_at_depth(mp.model.diffusion_model, depth or 1)
        modules = recompute.spread(at_depth, share) if depth else []
        kept = [m for m in at_depth if all(m is not c for c in modules)] if keep_inputs else []
        mp.model.requires_grad_(False)
        sampler = _LoopSampler(inside)
        guider = compat.training_guider(mp, offloading)
        guider.set_conds(inference.ordinary(self.conditioning(self.first)))  # its sampling runs extra_conds
        dummy = torch.zeros((self.spec.batch_size, *latent.shape[1:]))
        compat.load_models_for_training(mp, offloading)
        compat.thaw_inference_tensors(mp.model, mp.load_device)
        recompute.settle_attention_dispatch(torch.device(mp.load_device))
        blocks = at_depth if compiling != "off" else []
        recorder = self._graph_device(torch.device(mp.load_device), offloading, compiling)
        with fused.fused_layers(mp.model.diffusion_model, fused_mode()) as self.fused_count, \
                compiled.compiled_blocks(blocks, compiling, fallbacks=self.fallbacks), \
                compat.gradient_checkpointing(modules, offloading, preserve_rng_state=recorder is None,
                                              fallbacks=self.fallbacks), \
                recompute.inputs_kept(kept), \
                compat.bypass_hooks(self.bypass, mp), compat.differentiable_kernels(), \
                graphs.graphed_forward(mp.model.diffusion_model, list(self.adapters.values()), recorder is not None,
                                       device=recorder, fallbacks=self.fallbacks,
                                       memory_budget=None if recorder is None else recorder.budget()) as self.graphed:
            try:
                guider.sample(dummy, dummy, sampler, torch.ones(2), seed=self.spec.seed)
            finally:
                if self.graphed is not None:
                    self.graph_report = self.graphed.report()
                self.graphed = None
        return sampler.result

    def _graph_device(self, device: torch.device, offloading: bool, compiling: str) -> GraphDevice | None:
        """Where this pass records its steps as graphs (``streaming_cache.train.graphs``), or None: asked for (the
        ``cuda_graphs`` setting), on a CUDA device (or the CPU with the device emulated, for tests), with the whole
        model on it (no offloading), no bypass hooks, no compiled blocks, one process, not on ROCm (not checked on
        AMD GPUs). Where asked for on CUDA and not possible, the summary says why."""
        recorder = graph_device(device, emulate=environment.emulated_device())
        if not graphs.requested(self.spec.memory.cuda_graphs) or recorder is None:
            return None
        why = "with offloading" if offloading else "in bypass mode" if self.bypass else \
            "with compiled blocks" if compiling != "off" else \
            "with several processes" if torch.distributed.is_available() and torch.distributed.is_initialized() \
            else "on ROCm (AMD GPUs: not checked there yet)" if device.type == "cuda" and is_rocm() \
            else None
        if why is not None:
            self.graph_report = f"CUDA graphs are not used {why}"
            return None
        return recorder


def _picker(rows: list[int], whole: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a model call takes its ``rows`` of the step's tensors: all of them for the whole batch, else by slices
    (``conditioning.pick_rows``: a list as an index would be copied to the device, and the host would wait for it)."""
    return (lambda t: t[:]) if whole else (lambda t: pick_rows(t, rows))


@dataclasses.dataclass(frozen=True)
class _Pass:
    """How one training pass runs the model: gradient checkpointing's ``depth`` and ``share``, whether blocks that
    are not recomputed keep copies of their inputs, and the compile mode (``compiled.MODES``)."""

    depth: int
    share: float
    keep_inputs: bool
    compiling: str
