"""ComfyUI's internals the nodes use, and what differs between the supported ComfyUI versions.

Supported: v0.3.64 (2025-10) to the newest master (0.33). Public ``comfy_api`` surfaces (the V3 node schema,
``io`` types) are used directly by the nodes; everything else (folders, the server's messages, progress and
interruption, LoRA loading, the weight-adapter classes, ComfyUI's training helpers, the ``in_training``
switch) is reached through this package (``nodes/backend``), so a ComfyUI change lands here. What differs
between versions:

* ``comfy.model_management.in_training`` (newer only): True while training, so layers pick differentiable
  kernels instead of fused inference-only ones (``comfy_kitchen``'s RoPE has no backward).
* ``comfy_extras.nodes_train.patch(m, offloading=...)`` and ``TrainGuider`` (newer only): gradient
  checkpointing that works with weights offloaded to the CPU, and a guider that loads the model partially.
* ``comfy.weight_adapter.bypass`` (newer only): adapters applied as forward hooks, for quantized base weights.
* ``ModelPatcher.clone(disable_dynamic=...)`` (newer only): dynamic-VRAM patchers load weights on demand,
  which training's weight wrappers cannot work with; training uses a plain patcher.
* ``folder_paths``' ``datasets`` folder (newer only): where ComfyUI keeps training data.

The LoRA key formats (``streaming_cache.train.lora_formats``) take their names from ComfyUI's own map of the LoRA
keys it loads for a model (``comfy.lora.model_lora_keys_unet`` / ``..._clip``), which both versions have; a
family a version does not know has no names there, and writing it in another format than ComfyUI's is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import logging
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import comfy.lora
import comfy.model_detection
import comfy.model_management
import comfy.ops
import comfy.sampler_helpers
import comfy.samplers
import comfy.sd
import comfy.utils
import folder_paths
import torch
from comfy.weight_adapter import adapter_maps, adapters, lora
from comfy_extras import nodes_train

from ...streaming_cache.train import inference
from ...streaming_cache.train.lora_formats import NameTable, Target
from ...streaming_cache.train.recompute import Replay, checkpoint_module, uncheckpoint_module

log = logging.getLogger("streaming_cache")

BiasDiff = nodes_train.BiasDiff
LoraDiff = lora.LoraDiff
"""The training adapter of plain LoRA (``lora_up`` / ``lora_down`` layers, ``alpha``, ``rank``)."""
ALGORITHMS: list[str] = list(adapter_maps)
"""Adapter types ComfyUI can train (LoRA, LoHa, LoKr, OFT, ...)."""
WEIGHT_ADAPTERS = adapters
"""Adapter classes, tried in order to load an existing LoRA's weights."""
LORA_PREFIX = "diffusion_model."
"""The modules ComfyUI's LoRA loaders patch (``comfy.lora.model_lora_keys_unet``): the diffusion model's."""

_PATCH_TAKES_OFFLOADING = "offloading" in inspect.signature(nodes_train.patch).parameters
HAS_OFFLOADING = _PATCH_TAKES_OFFLOADING and hasattr(nodes_train, "TrainGuider")
try:
    from comfy.weight_adapter.bypass import BypassInjectionManager
except ImportError:  # ComfyUI v0.3.x
    BypassInjectionManager = None  # type: ignore[assignment,misc]
HAS_BYPASS = BypassInjectionManager is not None


_STANDARD_OPS = tuple(getattr(comfy.ops.disable_weight_init, name) for name in
                      ("Linear", "Conv1d", "Conv2d", "LayerNorm", "GroupNorm"))


def standard_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes as ComfyUI's plain cast ops do: its class's ``forward`` and cast path are those of
    ``comfy.ops.disable_weight_init``'s class of its kind (``manual_cast`` and the classes ComfyUI derives for a
    model's dtypes inherit them). Scaled-fp8, fp8-matmul and mixed-precision ops override them, and so may a
    family's own layers: those are left to their own code."""
    for base in _STANDARD_OPS:
        if isinstance(module, base):
            cls = type(module)
            return cls.forward is base.forward and \
                getattr(cls, "forward_comfy_cast_weights", None) is getattr(base, "forward_comfy_cast_weights", None)
    return False


def comfyui_version() -> str:
    try:
        import comfyui_version as v

        return str(v.__version__)
    except ImportError:
        return "unknown"


@contextlib.contextmanager
def training_mode() -> Iterator[None]:
    """Autograd on (nodes run under ``inference_mode``) and ComfyUI told that it is training, as its own
    TrainLoraNode does; restored afterwards, also on errors and cancel."""
    mm = comfy.model_management
    had = hasattr(mm, "in_training")
    previous = getattr(mm, "in_training", False)
    mm.in_training = True
    try:
        with torch.inference_mode(False):
            yield
    finally:
        if had:
            mm.in_training = previous
        else:
            del mm.in_training


def training_clone(model: Any) -> Any:
    """A patcher of ``model`` that training may add weight wrappers to. Dynamic-VRAM patchers (newer ComfyUI
    on CUDA) are cloned as plain ones."""
    is_dynamic = getattr(model, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        return model.clone(disable_dynamic=True)
    return model.clone()


def modules_at_depth(root: torch.nn.Module, depth: int) -> list[torch.nn.Module]:
    """Modules to checkpoint: the ``depth``-th level of modules with a forward of their own below ``root``
    (containers such as ModuleList do not count as a level). Depth 1 is the model's top-level blocks; deeper
    levels checkpoint smaller pieces (less recomputation, more memory)."""
    if depth < 1:
        raise ValueError(f"checkpoint depth must be at least 1, got {depth}")
    found: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module, level: int) -> None:
        for child in module.children():
            container = isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict))
            if container:
                walk(child, level)
            elif level + 1 == depth or not any(True for _ in child.children()):
                found.append(child)
            else:
                walk(child, level + 1)

    walk(root, 0)
    return found


@contextlib.contextmanager
def gradient_checkpointing(modules: list[torch.nn.Module], offloading: bool = False,
                           preserve_rng_state: bool = True, fallbacks: Any = None) -> Iterator[None]:
    """Recompute ``modules``' activations in the backward pass, undone on exit. The recomputation is given the
    free-memory readings of the forward pass (``streaming_cache.train.recompute.Replay``), so ComfyUI's attention
    chunks the same way both times whatever memory does in between (ComfyUI's own checkpoint wrapper reads it
    again, and fails with "Recomputed values ... have different metadata" when it changed). With ``offloading``,
    linear and conv layers use ComfyUI's offload-aware variant (newer versions). ``preserve_rng_state`` off where
    the step is recorded as a CUDA graph (``streaming_cache.train.graphs``). ``fallbacks``: where blocks that
    cannot be recomputed correctly on this PyTorch are noted (``Replay``)."""
    replay = Replay([(comfy.model_management, "get_free_memory")], preserve_rng_state, fallbacks)
    try:
        with replay.installed():
            for m in modules:
                if offloading and _PATCH_TAKES_OFFLOADING and isinstance(m, _OFFLOAD_CHECKPOINTED):
                    nodes_train.patch(m, offloading=True)
                    _offload_safely(m)
                else:
                    checkpoint_module(m, replay)
            yield
    finally:
        for m in modules:
            uncheckpoint_module(m)


def latent_projection(channels: int, video: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The linear latent-to-RGB projection ComfyUI's sampler previews use, for a cached latent ``[C, H, W]`` or
    ``[C, T, H, W]`` of ``channels`` channels (the first of ComfyUI's latent formats with that many channels and
    factors; the cache does not record the model, and formats of one channel count look alike in a thumbnail),
    or None where ComfyUI has none. The projection applies the format's own scaling first, as the model sees it."""
    import comfy.latent_formats as formats

    for cls in vars(formats).values():
        if not (isinstance(cls, type) and issubclass(cls, formats.LatentFormat)) or cls is formats.LatentFormat:
            continue
        try:
            fmt = cls()
        except Exception:  # a format whose constructor needs arguments
            continue
        factors = getattr(fmt, "latent_rgb_factors", None)
        if factors is None or getattr(fmt, "latent_rgb_factors_reshape", None) is not None or \
                getattr(fmt, "latent_channels", 0) != channels or \
                (getattr(fmt, "latent_dimensions", 2) == 3) != video:
            continue
        weight = torch.tensor(factors, dtype=torch.float32)
        bias_values = getattr(fmt, "latent_rgb_factors_bias", None)
        bias = torch.tensor(bias_values if bias_values is not None else [0.0, 0.0, 0.0], dtype=torch.float32)
        if weight.shape != (channels, 3) or bias.shape != (3,):
            continue

        def project(latent: torch.Tensor, fmt: Any = fmt, weight: torch.Tensor = weight,
                    bias: torch.Tensor = bias) -> torch.Tensor:
            x = fmt.process_in(latent.float()[None])[0]
            x = x[:, x.shape[1] // 2] if x.dim() == 4 else x
            return ((torch.einsum("chw,cr->hwr", x, weight) + bias + 1.0) / 2.0).clamp(0.0, 1.0)

        return project
    return None


def check_memory_options(*, offloading: bool, bypass: bool) -> None:
    """A clear error, before anything is done, for an option this ComfyUI cannot do."""
    if offloading and not HAS_OFFLOADING:
        raise ValueError(f"offloading needs a newer ComfyUI than {comfyui_version()} (its training guider with "
                         "partial loading); update ComfyUI or turn offloading off")
    if bypass and not HAS_BYPASS:
        raise ValueError(f"bypass mode needs a newer ComfyUI than {comfyui_version()} (its weight-adapter bypass "
                         "hooks); update ComfyUI or turn bypass mode off")


_OFFLOAD_CHECKPOINTED = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _offload_safely(module: torch.nn.Module) -> None:
    """Guard a linear or conv layer that ``nodes_train.patch`` gave ComfyUI's offload-aware checkpoint function.

    That function's output only takes part in autograd when its input requires grad, and it reaches the layer's
    adapter only through the recomputation in its backward pass: on a layer fed with data (Flux's ``img_in``
    takes the noisy latent) the adapter would never get a gradient. Such a layer runs its plain forward, which
    keeps only its input, as the checkpoint would. The function's output is also made under ``no_grad`` inside
    a custom autograd function, so models that add to it in place (Flux: ``img += ...``) fail in autograd
    ("a view was created in no_grad mode and is being modified inplace"): it is copied (one activation of the
    layer). ``uncheckpoint_module`` (or ComfyUI's ``unpatch``) restores the original forward as before."""
    patched, plain = module.forward, module.org_forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not x.requires_grad:
            return plain(x, *args, **kwargs)
        return patched(x, *args, **kwargs).clone()

    module.forward = forward


def training_guider(model: Any, offloading: bool = False) -> Any:
    """The guider whose ``sample`` runs the training loop with the model loaded: fully, or (``offloading``,
    newer ComfyUI) partially with the rest on the CPU."""
    if offloading:
        check_memory_options(offloading=True, bypass=False)
        return nodes_train.TrainGuider(model, offloading=True)
    import comfy_extras.nodes_custom_sampler

    return comfy_extras.nodes_custom_sampler.Guider_Basic(model)


def bypass_manager() -> Any:
    """A registry of adapters applied as forward hooks (``y = W x + adapter(x)``) instead of weight wrappers
    (``W' = W + delta``): the base weight is never rebuilt, so it may be quantized (fp8 and other formats
    ComfyUI keeps packed), and neither a merged weight nor its full-size gradient is made at each step."""
    check_memory_options(offloading=False, bypass=True)
    return BypassInjectionManager()


def runs_in_bypass(adapter: Any) -> bool:
    """Whether a training adapter can run as a bypass hook: it computes its own branch output (``h``); in
    ComfyUI 0.33 LoRA, LoKr and OFT do, LoHa does not."""
    from comfy.weight_adapter.base import WeightAdapterTrainBase

    return getattr(type(adapter), "h", WeightAdapterTrainBase.h) is not WeightAdapterTrainBase.h


@contextlib.contextmanager
def bypass_hooks(manager: Any, model: Any) -> Iterator[None]:
    """The hooks of ``manager`` (from :func:`bypass_manager`; None: nothing to do) in ``model``'s modules while
    the block runs, as ComfyUI's own trainer injects them: after loading, removed afterwards."""
    injections = manager.create_injections(model.model) if manager is not None else []
    for injection in injections:
        injection.inject(model)
    try:
        yield
    finally:
        for injection in injections:
            injection.eject(model)


def _trained(f: Any) -> bool:
    """Whether a weight or bias function is a trained adapter: a module with trainable parameters."""
    return isinstance(f, torch.nn.Module) and any(p.requires_grad for p in f.parameters())


class AdaptersOff:
    """``model`` (a ModelPatcher) computing as its base model while the block of a call runs: every trained weight
    wrapper (LoRA, DoRA, norm and bias differences: a module with trainable parameters; the pack's fused layers then
    take ComfyUI's own path) taken off its layer, what ComfyUI itself wraps a weight with kept (a LoRA loaded before
    training, applied to an offloaded layer at each call), and the adapters of a bypass ``manager`` at strength 0
    (LoRA's and LoKr's branch scaled to nothing, OFT's rotation the identity). Restored afterwards, also on errors.

    A preserved dataset's every batch calls it (``ComfyBackend._base_prediction``), so the trained wrappers and the
    layers holding them are found once: asking every wrapper for its parameters takes a fifth of a second for SDXL.
    Each call then takes the layers' lists as they are (ComfyUI gives a layer new lists, or adds its own wrappers to
    them, when it loads the model again) without the trained wrappers."""

    def __init__(self, model: Any, manager: Any = None) -> None:
        self.model, self.manager = model, manager
        self._layers: list[Any] | None = None
        self._trained: dict[int, Any] = {}  # id -> a trained wrapper (kept, so that its id stays its own)
        self.searches = 0  # how often the modules were walked (for tests)

    def _search(self) -> list[Any]:
        """The layers with trained wrappers, from the patcher's wrappers by weight name (which ComfyUI puts on the
        layers when it loads the model: loaded or not, the same)."""
        if self._layers is None:
            self.searches += 1
            layers: dict[int, Any] = {}
            for key, functions in self.model.weight_wrapper_patches.items():
                found = [f for f in functions if _trained(f)]
                if found:
                    m = self.model.model.get_submodule(key.rsplit(".", 1)[0])
                    layers[id(m)] = m
                    self._trained.update((id(f), f) for f in found)
            self._layers = list(layers.values())
        return self._layers

    def _untrained(self, functions: list) -> list:
        return [f for f in functions if id(f) not in self._trained]

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        wrapped = [(m, m.weight_function, m.bias_function) for m in self._search()]
        bypassed = [(adapter, getattr(adapter, "multiplier", strength))
                    for adapter, strength in (self.manager.adapters.values() if self.manager is not None else ())]
        try:
            for m, weight_function, bias_function in wrapped:  # plain attributes: nn.Module's checks are not needed
                object.__setattr__(m, "weight_function", self._untrained(weight_function))
                object.__setattr__(m, "bias_function", self._untrained(bias_function))
            for adapter, _ in bypassed:
                adapter.multiplier = 0.0
            yield
        finally:
            for m, weight_function, bias_function in wrapped:
                object.__setattr__(m, "weight_function", weight_function)
                object.__setattr__(m, "bias_function", bias_function)
            for adapter, multiplier in bypassed:
                adapter.multiplier = multiplier


_KITCHEN_KERNELS = ("apply_rope", "apply_rope1", "apply_rope_split_half", "apply_rope_split_half1", "rms_rope",
                    "rms_rope1", "rms_rope_split_half", "rms_rope_split_half1")


@contextlib.contextmanager
def differentiable_kernels() -> Iterator[None]:
    """comfy_kitchen's fused RoPE kernels (newer ComfyUI) replaced by its own eager PyTorch versions while the
    block runs. The fused ones have no backward ("no autograd formula was registered"); most models switch to
    a differentiable path when ``in_training`` is set, but Cosmos Predict 2, Anima and JoyImage call them
    unconditionally, so neither they nor ComfyUI's own TrainLoraNode could train. The eager versions compute
    the same values with ordinary tensor operations."""
    try:
        import comfy_kitchen
        from comfy_kitchen.backends.eager import rope
    except ImportError:  # ComfyUI v0.3.x: no kitchen
        yield
        return
    saved = {name: getattr(comfy_kitchen, name) for name in _KITCHEN_KERNELS
             if hasattr(comfy_kitchen, name) and hasattr(rope, name)}
    for name in saved:
        setattr(comfy_kitchen, name, getattr(rope, name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(comfy_kitchen, name, fn)


def memory_for_training(device: torch.device) -> int:
    """Bytes a training on ``device`` may use: what is free there now, plus what ComfyUI's loaded models hold on it
    (:func:`load_models_for_training` unloads every other model)."""
    return int(comfy.model_management.get_free_memory(device)) + models_loaded_on(device)


def models_loaded_on(device: torch.device) -> int:
    """Bytes ComfyUI's loaded models hold on ``device``."""
    return sum(int(m.model_loaded_memory()) for m in list(comfy.model_management.current_loaded_models)
               if m.model is not None and _same_device(torch.device(m.device), device))


def load_models_for_training(model: Any, offloading: bool = False) -> None:
    comfy.model_management.load_models_gpu([model], memory_required=1e20, force_full_load=not offloading)


def thaw_inference_tensors(model: torch.nn.Module, device: torch.device | None = None) -> int:
    """The model's parameters and buffers that autograd cannot use replaced by ordinary copies
    (``streaming_cache.train.inference.thaw``); returns how many. With ``device``, only those on it: the ones
    layers compute with directly.

    Nodes load models under ``torch.inference_mode``: on the CPU, where loading moves nothing, every weight stays
    an inference tensor; on a GPU, loading moves them outside inference mode, which leaves parameters that claim
    to be ordinary tensors but have no version counter ("Inference tensors do not track version counter" as
    soon as autograd keeps one). ComfyUI's weight wrappers read a fresh copy of each weight at every call, but
    the pack's fused layers and parameters that models use directly (the RMSNorm ``scale`` of Flux, Chroma and
    HunyuanVideo in ComfyUI v0.3.x, MiniMax H3's q/k norm weights read past their wrapper into its fused RoPE)
    do not.

    Weights an offloading model keeps on the CPU while it trains on a GPU are left alone: layers copy them to
    the GPU before use (a new, ordinary tensor), and ComfyUI has page-locked them where they are
    (``cudaHostRegister``): freeing such a tensor while it is still registered leaves the driver with a stale
    registration, and the next asynchronous copy fails with "CUDA error: invalid argument"."""

    def keep(tensor: torch.Tensor) -> bool:
        return (device is not None and not _same_device(tensor.device, device)) or \
            (tensor.device.type == "cpu" and tensor.is_pinned())

    return inference.thaw(model, keep)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` (the current device) are one device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def latent_mask(noise_mask: torch.Tensor, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A LATENT's ``noise_mask`` at the latents' ``shape``, as ComfyUI's sampler prepares it for the model."""
    return comfy.sampler_helpers.prepare_mask(noise_mask, shape, device)


def given_region(model: Any, sigmas: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor,
                 denoise_mask: torch.Tensor) -> torch.Tensor:
    """What ComfyUI's sampler puts where a mask says the latent is given (``KSamplerX0Inpaint``): the model's own
    ``scale_latent_inpaint`` (the clean latent for models that condition on clean frames, LTXV and Wan 2.2; the
    latent noised to ``sigmas`` for the rest; every version's method takes further keywords)."""
    return model.scale_latent_inpaint(x=noise, sigma=sigmas, noise=noise, latent_image=latent,
                                      denoise_mask=denoise_mask)


def pack_streams(model: Any, streams: list[torch.Tensor], shaped: bool = False) -> tuple[torch.Tensor, list | None]:
    """Latent streams (video, then audio) as the one flat latent ComfyUI's sampler runs joint audio-video models
    on, with the streams' shapes that the model unpacks it by (set on the model, as the sampler does). One stream
    is returned as it is, with None; for a model that reads its latent by the shapes (``shaped``: LTX-2 trained on
    video alone) with its shape, which ComfyUI's LTXAV model reads as a video stream beside an empty sound stream
    (a plain latent it takes for a list of streams)."""
    if len(streams) == 1 and not shaped:
        return streams[0], None
    if len(streams) == 1:
        shapes = [streams[0].shape]
        model.latent_shapes = shapes
        return streams[0], shapes
    packed, shapes = comfy.utils.pack_latents(streams)
    model.latent_shapes = shapes
    return packed, shapes


def process_conds(model: Any, noise: torch.Tensor, conds: dict, device: torch.device, latent: torch.Tensor,
                  denoise_mask: torch.Tensor | None, seed: int, latent_shapes: list | None = None) -> dict:
    """ComfyUI's ``process_conds`` (the model's own ``extra_conds`` for every conditioning); the streams' shapes
    of a packed audio-video latent are passed where there are some (versions with joint audio-video models)."""
    if latent_shapes is None:
        return comfy.samplers.process_conds(model, noise, conds, device, latent, denoise_mask, seed)
    return comfy.samplers.process_conds(model, noise, conds, device, latent, denoise_mask, seed,
                                        latent_shapes=latent_shapes)


def host_conds_uploaded(conds: dict, upload: Callable[[torch.Tensor], torch.Tensor],
                        on_host: Callable[[torch.Tensor], bool]) -> dict:
    """``conds`` (what :func:`process_conds` returns) with each model condition whose tensor ``on_host`` says is in
    host memory copied to the device by ``upload`` (new entries; the input is not changed). ComfyUI's model would
    copy it at the call (``convert_tensor``), from pageable memory; ``upload`` copies from pinned memory, so that
    the host does not wait for the device (SDXL's ``y``, joined on the host from the pooled output and the size
    embedding)."""
    out: dict = {}
    for kind, entries in conds.items():
        moved = []
        for entry in entries:
            model_conds = entry.get("model_conds", {}) if isinstance(entry, dict) else {}
            up = {name: mc._copy_with(upload(mc.cond)) for name, mc in model_conds.items()
                  if isinstance(getattr(mc, "cond", None), torch.Tensor) and hasattr(mc, "_copy_with")
                  and on_host(mc.cond)}
            moved.append({**entry, "model_conds": {**model_conds, **up}} if up else entry)
        out[kind] = moved
    return out


def tokenizer_name(clip: Any) -> str:
    """The class name of a CLIP's tokenizer (``SD1Tokenizer``, ``SDXLTokenizer``, ``FluxTokenizer``, ...), which
    says whose text encoders it holds."""
    return type(getattr(clip, "tokenizer", None)).__name__


def model_config_name(model: Any) -> str:
    """ComfyUI's name of a MODEL's family: its model config class (``SDXL``, ``Flux``, ``WAN21_T2V``, ...)."""
    return type(model.model.model_config).__name__


def guidance_distilled(model: Any) -> bool:
    """True for models with a guidance embedding (Flux dev and Kontext, HunyuanVideo), which read the
    ``guidance`` value of the conditioning (ComfyUI's FluxGuidance node sets it)."""
    params = getattr(getattr(model, "diffusion_model", None), "params", None)
    return bool(getattr(params, "guidance_embed", False))


def apply_lora(model: Any, lora: dict[str, torch.Tensor], strength: float = 1.0, *, bypass: bool = False) -> Any:
    """``model`` with a LORA_MODEL applied the way ComfyUI's own Load LoRA Model node applies it, or with
    ``bypass`` as its bypass LoRA loader does (forward hooks; the base weights, which may be quantized, are
    never rebuilt)."""
    if bypass:
        check_memory_options(offloading=False, bypass=True)
        patched, _ = comfy.sd.load_bypass_lora_for_models(model, None, lora, strength, 0)
    else:
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora, strength, 0)
    return patched


def datasets_folders() -> list[str]:
    """ComfyUI's folders for training data (``datasets``, with any extra paths the user configured); empty on
    versions that have none."""
    if "datasets" not in folder_paths.folder_names_and_paths:
        return []
    return list(folder_paths.get_folder_paths("datasets"))


def output_folder() -> str:
    return folder_paths.get_output_directory()


def input_folder() -> str:
    return folder_paths.get_input_directory()


def temp_folder() -> str:
    return folder_paths.get_temp_directory()


def loras_folder() -> str:
    return folder_paths.get_folder_paths("loras")[0]


def load_lora_file(name: str) -> dict[str, torch.Tensor]:
    """The tensors of the LoRA ``name`` in ComfyUI's loras folder."""
    return comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", name))


def lora_names() -> list[str]:
    return folder_paths.get_filename_list("loras")


# ---- LoRA key formats

def lora_name_table(model: Any, text_encoders: Any = None) -> NameTable:
    """The names of ``model``'s weights (a ModelPatcher or its model) in every LoRA format, from ComfyUI's own map
    of the LoRA keys it loads for it; with ``text_encoders`` (a CLIP, or anything whose ``state_dict()`` has a
    CLIP's keys) those of the text encoders too."""
    base = getattr(model, "model", model)
    key_map = comfy.lora.model_lora_keys_unet(base, {})
    shapes = {k: tuple(v.shape) for k, v in base.state_dict().items()}
    if text_encoders is not None:
        encoders = getattr(text_encoders, "cond_stage_model", text_encoders)
        key_map = comfy.lora.model_lora_keys_clip(encoders, key_map)
        shapes.update({k: tuple(v.shape) for k, v in encoders.state_dict().items()})
    targets = {name: t for name, t in ((n, _lora_target(to)) for n, to in key_map.items()) if t is not None}
    return NameTable(targets, shapes, type(base.model_config).__name__)


def _lora_target(to: Any) -> Target | None:
    """A target of ComfyUI's LoRA key map (a weight's key, ``(key, (dim, offset, size))`` for part of a fused
    weight, ``(key, None, function)`` for a weight stored in another order) as the engine's Target; None for what
    it cannot express (a slice along another dimension, a function other than the halves' swap)."""
    if isinstance(to, str):
        return Target(to) if to.endswith(".weight") else None
    key, offset = to[0], to[1]
    function = to[2] if len(to) > 2 else None
    if function is not None and (function is not comfy.utils.swap_scale_shift or offset is not None):
        return None
    if offset is not None and offset[0] != 0:
        return None
    return Target(key, None if offset is None else (int(offset[1]), int(offset[2])), function is not None)


class _Keys:
    """What ComfyUI's LoRA key map reads of a text-encoder model: its ``state_dict()`` (meta tensors)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors


def lora_name_table_of_file(path: str) -> NameTable:
    """:func:`lora_name_table` of the model in a checkpoint or diffusion-model file (safetensors), read from its
    header alone (no weights are loaded: the model is built on the meta device); with the text encoders a
    checkpoint has. ValueError, saying what to give instead, when ComfyUI does not recognise the file."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            sd = {k: torch.empty(f.get_slice(k).get_shape(), device="meta",
                                 dtype=_DTYPES.get(f.get_slice(k).get_dtype(), torch.float32)) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own types for a missing or damaged file
        raise ValueError(f"{path}: not a readable .safetensors model file ({exc}); give the checkpoint or diffusion "
                         "model the LoRA was made for, as .safetensors") from exc
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    unet = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)} or sd
    config = comfy.model_detection.model_config_from_unet(unet, "")
    if config is None:
        raise ValueError(f"{path}: ComfyUI {comfyui_version()} does not recognise this model (a diffusers-format "
                         "folder or an unknown family?); give the checkpoint or diffusion model file Load Checkpoint "
                         "or Load Diffusion Model loads")
    with torch.device("meta"):
        model = config.get_model(unet, "")
    encoders = {k: v for k, v in config.process_clip_state_dict(dict(sd)).items() if k not in sd}
    return lora_name_table(model, _Keys(encoders) if encoders else None)


_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}



def input_subfolders() -> list[str]:
    """The folders under ComfyUI's input folder (relative, ``/``-separated), as its own dataset nodes list them."""
    return list(folder_paths.get_input_subfolders())


# ---- a model another process can load (Train LoRA's devices)

def portable_model(model: Any) -> dict[str, Any]:
    """What another process needs to load ``model`` (a ModelPatcher) as this process has it: the loader call
    that made it (``cached_patcher_init``: its file and options, ComfyUI 0.4+ core loaders) and its patches (LoRAs
    applied with a LoRA loader, model-sampling shifts, options), as one picklable value for :func:`restore_model`.
    ValueError, naming what is missing, when the model cannot be loaded elsewhere."""
    init = getattr(model, "cached_patcher_init", None)
    if init is None:
        raise ValueError(f"devices > 1: the other GPUs load the model from its file, but this "
                         f"{type(model.model).__name__} model came from a loader that does not record its file "
                         f"(ComfyUI {comfyui_version()}: Load Checkpoint and Load Diffusion Model of ComfyUI 0.4 "
                         "and newer do). Train on one device, or launch several processes with torchrun "
                         "(docs/multi-gpu.md)")
    value = {"init": init, "patches": dict(model.patches),
             "object_patches": {k: _portable(v) for k, v in model.object_patches.items()},
             "model_options": model.model_options}
    try:
        pickle.dump(value, io.BytesIO())
    except Exception as exc:
        raise ValueError(f"devices > 1: this model carries patches the other processes cannot receive ({exc}); "
                         "apply them after training, or train on one device") from exc
    return value


def restore_model(value: dict[str, Any]) -> Any:
    """The ModelPatcher :func:`portable_model` described, loaded in this process on its device."""
    init = value["init"]
    model = init[0](*init[1])
    if len(init) > 2:
        model = model[init[2]]
    model.patches = {k: list(v) for k, v in value["patches"].items()}
    if hasattr(model, "patches_uuid"):
        model.patches_uuid = uuid.uuid4()
    for name, obj in value["object_patches"].items():
        model.add_object_patch(name, _restored(obj))
    model.model_options = value["model_options"]
    return model


def _portable(obj: Any) -> Any:
    """``obj``, or for an instance of a class made at run time (ComfyUI's ModelSampling* nodes subclass two
    sampling classes inside a function) its class's bases and its state, which :func:`_restored` rebuilds."""
    cls = type(obj)
    module = sys.modules.get(cls.__module__)
    if module is not None and getattr(module, cls.__qualname__, None) is cls:
        return obj
    return ("streaming-cache:dynamic", cls.__name__, cls.__bases__, dict(obj.__dict__))


def _restored(obj: Any) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "streaming-cache:dynamic":
        cls = type(obj[1], obj[2], {})
        out = cls.__new__(cls)
        out.__dict__.update(obj[3])
        return out
    return obj


def pin_budget() -> Any:
    """ComfyUI's check that pinning ``nbytes`` more host memory stays within its budget (it frees its own pins
    first if it must), where the version has one; None otherwise. ComfyUI started with ``--disable-pinned-memory``
    (newer versions have the flag) pins nothing, and neither does the pack: the budget then refuses every pin."""
    import comfy.cli_args

    if getattr(comfy.cli_args.args, "disable_pinned_memory", False):
        return lambda nbytes: False
    ensure = getattr(comfy.model_management, "ensure_pin_budget", None)
    return None if ensure is None else (lambda nbytes: bool(ensure(nbytes)))


def comfyui_dir() -> str:
    """The folder of the running ComfyUI's code (where its main.py is)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_management.__file__)))


def device_index() -> int | None:
    """The index of the GPU ComfyUI runs on, or None on the CPU."""
    device = comfy.model_management.get_torch_device()
    return device.index if device.type == "cuda" else None


def unload_models() -> None:
    """Free what ComfyUI holds on its GPU (other processes are about to load models)."""
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()


# ---- progress, interruption and messages to the browser

InterruptProcessingException = comfy.model_management.InterruptProcessingException


def progress_bar(total: int, node_id: str | None) -> Any:
    """ComfyUI's progress bar of a node: ``update_absolute(value, total, preview)`` shows progress (and a
    preview image) on the node and checks the Cancel button."""
    return comfy.utils.ProgressBar(total, node_id=node_id)


def send_to_browser(event: str, data: dict) -> None:
    """A message to the browser that queued the prompt (the pack's frontend extension listens for ``event``);
    nothing where no server runs (headless runs, tests)."""
    try:
        from server import PromptServer

        server = PromptServer.instance
        send = server.send_sync
    except (ImportError, AttributeError):
        return
    send(event, data, getattr(server, "client_id", None))


def serve_json(path: str, answer: Callable[[Mapping[str, str]], tuple[int, dict]]) -> bool:
    """Serve ``GET path`` on ComfyUI's server: ``answer(query)`` returns the status and the JSON body, run on a
    worker thread (it may read files). False where no server runs (headless runs, tests)."""
    try:
        from aiohttp import web
        from server import PromptServer

        routes = PromptServer.instance.routes
    except (ImportError, AttributeError):
        return False

    async def handle(request: Any) -> Any:
        status, body = await asyncio.get_running_loop().run_in_executor(None, answer, dict(request.rel_url.query))
        return web.json_response(body, status=status)

    routes.get(path)(handle)
    return True


def terminal_progress_enabled() -> bool:
    return bool(comfy.utils.PROGRESS_BAR_ENABLED)


def check_interrupt() -> None:
    """Raise :data:`InterruptProcessingException` if Cancel was pressed (this clears the request)."""
    comfy.model_management.throw_exception_if_processing_interrupted()


def interrupt_requested() -> bool:
    return bool(comfy.model_management.processing_interrupted())


def clear_interrupt() -> None:
    """Forget a Cancel request the node has answered (it stops the rest of the prompt itself: :func:`interrupt`)."""
    comfy.model_management.interrupt_current_processing(False)


def interrupt() -> None:
    """Ask the executor to stop the rest of the prompt, as the Cancel button does."""
    comfy.model_management.interrupt_current_processing(True)


def send_text(node_id: str | None, text: str) -> None:
    """Progress text under the node while it runs (when a server is running; the frontend clears it when the
    job ends, so what must stay is also returned as the node's ``ui`` text)."""
    try:
        from server import PromptServer

        if PromptServer.instance is not None and node_id is not None:
            PromptServer.instance.send_progress_text(text, node_id)
    except Exception:  # headless runs without a server: the log is enough
        pass


# ---- running prompts without the web UI (scripts/headless.py)

def prompt_executor(server: Any) -> Any:
    """A ``PromptExecutor`` for ``server`` (what the executor needs of one) built the way the running ComfyUI's own
    ``main.py`` builds it, with the same cache settings from the command line, for the headless runner. Its
    constructor changed: v0.3.x takes ``cache_size``; newer versions take ``cache_args`` and fail at the first
    run without it (RAM-pressure caching is their default)."""
    import execution
    from comfy.cli_args import args

    params = inspect.signature(execution.PromptExecutor.__init__).parameters
    lru = getattr(args, "cache_lru", 0) or 0
    if "cache_args" not in params:  # ComfyUI v0.3.x
        cache_type = execution.CacheType.CLASSIC
        if lru > 0:
            cache_type = execution.CacheType.LRU
        elif getattr(args, "cache_none", False):
            cache_type = execution.CacheType.DEPENDENCY_AWARE
        return execution.PromptExecutor(server, cache_type=cache_type, cache_size=lru)
    classic, none = getattr(args, "cache_classic", False), getattr(args, "cache_none", False)
    ram, ram_inactive = 0.0, 0.0
    types = execution.CacheType.__members__
    if not classic and not none and lru <= 0 and "RAM_PRESSURE" in types:
        total = comfy.model_management.total_ram  # MiB
        ram = min(10.0, max(2.0, total * 0.10 / 1024.0))
        ram_inactive = min(128.0, total / 1024.0)
        given = list(getattr(args, "cache_ram", None) or [])
        ram = float(given[0]) if given else ram
        ram_inactive = float(given[1]) if len(given) > 1 else ram_inactive
        cache_type = types["RAM_PRESSURE"]
    elif classic or "RAM_PRESSURE" not in types:
        cache_type = types["CLASSIC"]
    elif lru > 0:
        cache_type = types["LRU"]
    else:
        cache_type = types.get("NONE", types["CLASSIC"])
    return execution.PromptExecutor(server, cache_type=cache_type,
                                    cache_args={"lru": lru, "ram": ram, "ram_inactive": ram_inactive})
