"""Peak device memory of one LoRA training step, estimated on the CPU: ComfyUI's own model class of a family at
its published full size, built on the ``meta`` device, trained one forward and backward pass with this pack's
adapters (``training.create_adapters``), fused layers (``fused.fused_layers``), gradient checkpointing
(``compat.gradient_checkpointing``, the blocks ``recompute.spread`` picks) and bypass hooks, the live tensor
storages counted by ``streaming_cache.train.memory_count`` with attention counted as the GPU's fused kernels keep
it.

What the count holds: the frozen weights, the adapters, the step's inputs (latent, noise, conditioning), every
activation, saved tensor, temporary and gradient of the step. What is added by arithmetic, because it does not
run on ``meta``: the optimizer's state (AdamW: two tensors of each trained parameter's size and dtype, made at the
first step and kept). What is not counted: the CUDA context and the allocator's reserve beyond its allocations
(``memory_plan.RESERVE`` is what the plan keeps free for them), kernels' workspaces, the loader's
prefetched batches, CUDA graphs' pool (whose allocations equal the eager step's; the graphs' extra is reserved
memory, measured beside it in ``docs/vram.md``). Autocast is not emulated: ComfyUI's layers already compute in the
weights' dtype (bf16), and the fp32 outputs of the norms CUDA's autocast makes are left out (a few percent of the
activations of a block being recomputed). Offloading is not estimated: what stays on the device is decided by
ComfyUI's partial loading from the free memory at load time, which a count on ``meta`` cannot reproduce.

:func:`estimate_step` builds a family by name at a resolution (the table of ``docs/vram.md``);
:func:`training_step` estimates a loaded model with a dataset's row and a run's settings (the memory plan);
:func:`estimate_comfyui_step` estimates a step of ComfyUI's own TrainLoraNode the same way, made by its functions
(:func:`count_comfyui_step` says what stands in for what does not run on ``meta``).

Every family of :data:`FAMILIES` runs on ``meta`` as ComfyUI wrote it, with nothing substituted or skipped: its
position ids are made with ``linspace`` and ``arange``, which ``meta`` runs; LTX-2's frequency table is made with
numpy on the CPU and moved to the inputs' device. LTX-2 is estimated as ComfyUI's LTXAV model takes it: audio and
video, the two streams packed into one latent. Its text connectors run in its ``extra_conds`` before the model
call and are not in the count. HunyuanVideo 1.5's model always takes the image-to-video condition's channels
beside the latent (the start frame's latent and its mask, zeros for text-to-video: ``concat_cond``), counted as
``Family.concat`` says at the latent's size; its ByT5 glyph features (only for quoted text in a caption) and an
image-to-video start image's SigLIP features (729 tokens) are not in its figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import comfy.ldm.modules.attention
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from ...streaming_cache.train import memory_count, recompute
from ...streaming_cache.train.inplace import is_inplace_update
from ...streaming_cache.train.layers import LayerChoice
from . import compat, fused
from .training import LORA_DTYPES, TRAINING_DTYPES, create_adapters

META = torch.device("meta")
GIB = 1024 ** 3
ADAM_STATES = 2
"""AdamW keeps two tensors per trained parameter (its moments), each of the parameter's dtype."""

SDXL = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
        "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
        "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
        "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
        "use_temporal_attention": False, "use_temporal_resblock": False}
"""SDXL's UNet (2.57 B parameters), as ComfyUI's detection reads it from the published checkpoint."""
FLUX_DEV = {"image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 768,
            "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
            "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
            "guidance_embed": True}
"""FLUX.1 dev (11.90 B parameters), as ComfyUI's detection reads it from the published checkpoint."""
QWEN_IMAGE = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60}
"""Qwen-Image (20.43 B parameters; published: 20 B), as ComfyUI's detection reads it from the published
checkpoint (the model class's defaults give the rest: 24 heads of 128, Qwen2.5-VL's 3584-wide features in)."""
WAN_BLOCK = {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "freq_dim": 256,
             "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
"""What ComfyUI's detection sets for every Wan 2.x text-to-video checkpoint."""
WAN21_1_3B = {**WAN_BLOCK, "dim": 1536, "out_dim": 16, "num_heads": 12, "ffn_dim": 8960, "num_layers": 30,
              "in_dim": 16}
"""Wan 2.1 T2V 1.3B (1.42 B parameters; published: 1.3 B), as ComfyUI's detection reads it from the published
checkpoint."""
WAN21_14B = {**WAN_BLOCK, "dim": 5120, "out_dim": 16, "num_heads": 40, "ffn_dim": 13824, "num_layers": 40,
             "in_dim": 16}
"""Wan 2.1 T2V 14B (14.29 B parameters; published: 14 B), as ComfyUI's detection reads it from the published
checkpoint (each of Wan 2.2 A14B's two experts is this model)."""
WAN22_5B = {**WAN_BLOCK, "dim": 3072, "out_dim": 48, "num_heads": 24, "ffn_dim": 14336, "num_layers": 30,
            "in_dim": 48}
"""Wan 2.2 TI2V 5B (5.00 B parameters; published: 5 B), as ComfyUI's detection reads it from the published
checkpoint."""

LTX2 = {"image_model": "ltxav", "num_layers": 48, "attention_head_dim": 128, "cross_attention_dim": 4096,
        "use_keyframes_abs_pos_embedding": False}
"""LTX-2 19B's audio-video transformer (19.59 B parameters, its two text connectors included; published: 19 B),
as ComfyUI's detection reads it from the published checkpoint's weights. What detection takes from the
checkpoint's embedded config (the audio stream's heads and context width, the connectors) is left to the model
class's defaults, which are LTX-2's published sizes: video 32 heads of 128, audio 32 heads of 64 with a
2048-wide context, connectors of two layers."""
FLUX2_DEV = {"image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": 48, "mlp_ratio": 3.0, "theta": 2000,
             "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False,
             "ops_bias": False, "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3],
             "in_channels": 128, "hidden_size": 6144, "context_in_dim": 15360, "patch_size": 1,
             "vec_in_dim": None, "depth": 8, "depth_single_blocks": 48, "guidance_embed": True, "yak_mlp": False}
"""FLUX.2 dev (32.22 B parameters; published: 32 B), as ComfyUI's detection reads it from the published
checkpoint."""
Z_IMAGE = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 2560,
           "n_layers": 30, "qk_norm": True, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48],
           "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
           "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32}
"""Z-Image (6.15 B parameters; published: 6 B), as ComfyUI's detection reads it from the published
checkpoint, but for ``allow_fp16``, which detection measures on the weights and which changes nothing in bf16."""
SD35_LARGE = {"in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 38, "input_size": None,
              "adm_in_channels": 2048, "num_patches": 36864, "pos_embed_max_size": 192, "qk_norm": "rms",
              "context_embedder_config": {"target": "torch.nn.Linear",
                                          "params": {"in_features": 4096, "out_features": 2432}},
              "pos_embed_scaling_factor": None, "x_block_self_attn_layers": []}
"""Stable Diffusion 3.5 Large (8.06 B parameters; published: 8.1 B), as ComfyUI's detection reads it from
the published checkpoint."""
HUNYUAN_VIDEO15 = {"image_model": "hunyuan_video", "in_channels": 65, "patch_size": [1, 1, 1], "out_channels": 32,
                   "vec_in_dim": None, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 3584,
                   "hidden_size": 2048, "mlp_ratio": 4.0, "num_heads": 16, "depth": 54, "depth_single_blocks": 0,
                   "theta": 256, "qkv_bias": True, "byt5": True, "guidance_embed": False,
                   "use_cond_type_embedding": True, "vision_in_dim": 1152, "meanflow_sum": True}
"""HunyuanVideo 1.5 480p T2V (8.33 B parameters; published: 8.3 B), as ComfyUI's detection reads it from the
published checkpoint (tencent/HunyuanVideo-1.5 transformer/480p_t2v/config.json: hidden_size 2048, heads_num 16,
mm_double_blocks_depth 54, mm_single_blocks_depth 0, in_channels 32 with concat_condition (the patch embedding
takes 32 + 32 + 1), text_states_dim 3584, glyph_byT5_v2, vision_states_dim 1152, use_cond_type_embedding,
guidance_embed and use_meanflow off)."""

Shape = tuple[int, ...]
Streams = Shape | list[Shape]
"""A latent's shape, or the shapes of the streams a joint model takes packed into one latent (video and sound:
ComfyUI's ``pack_latents``, the model told their shapes by ``latent_shapes``)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """A family to estimate: ComfyUI's model config class, the config that builds it at its published size, and
    the model call's inputs: ``latent(batch, width, height, frames)`` gives the latent's shape (``frames``: None
    for an image family), ``conditioning(batch)`` the conditioning tensors' shapes by name (the model's keyword
    arguments). A video family's ``clips`` are the (width, height, frames) the table estimates it at. ``concat``:
    the channels the model's ``concat_cond`` puts beside the latent at every call (0: none), at the latent's size.
    """

    name: str
    config_class: Callable[[], Any]
    config: Callable[[], dict]
    latent: Callable[[int, int, int, int | None], Streams]
    conditioning: Callable[[int], dict[str, Any]]
    clips: tuple[tuple[int, int, int], ...] = ()
    concat: int = 0

    @property
    def video(self) -> bool:
        return bool(self.clips)

    def inputs(self, batch: int, x_shape: Streams) -> dict[str, Any]:
        """The conditioning of a step of ``batch`` samples on a latent of ``x_shape``: :attr:`conditioning`'s,
        with the ``concat`` channels (``c_concat``, which ``apply_model`` joins to the noisy latent)."""
        shapes = self.conditioning(batch)
        if self.concat:
            shapes["c_concat"] = (x_shape[0], self.concat, *x_shape[2:])
        return shapes


def _flux_config() -> dict:
    import comfy.ldm.flux.model

    config = dict(FLUX_DEV)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:
        config["txt_ids_dims"] = []  # what detection gives Flux.1 on versions that have the field
    return config


def _square(channels: int, factor: int) -> Callable[[int, int, int, int | None], tuple[int, ...]]:
    """An image family's latent: ``channels`` at ``factor`` times fewer pixels."""
    return lambda b, w, h, f: (b, channels, h // factor, w // factor)


def _frames(channels: int, factor: int, frames_per_latent: int = 4, image: bool = False
            ) -> Callable[[int, int, int, int | None], tuple[int, ...]]:
    """A video VAE's latent: the first frame alone, then ``frames_per_latent`` frames per latent frame
    (``image``: an image family on a video VAE, one latent frame)."""
    def shape(b: int, w: int, h: int, f: int | None) -> tuple[int, ...]:
        t = 1 if image or not f else 1 + (f - 1) // frames_per_latent
        return b, channels, t, h // factor, w // factor
    return shape


QWEN_TOKENS = 256
"""Qwen-Image's caption length: its encoder does not pad, so the features are as long as the caption (after the
template's prefix ComfyUI drops); 256 tokens stand for a long caption."""
UMT5_TOKENS = 512
"""Wan's UMT5-XXL features: padded to 512 tokens (zeros past the caption), as ComfyUI's Wan text encoder gives
them."""
WAN_CLIPS = ((832, 480, 33), (832, 480, 81))
"""The clips the table estimates Wan at (width, height, frames): 480p, as LoRAs are commonly trained."""


def _ltx2_streams(b: int, w: int, h: int, f: int | None) -> list[Shape]:
    """LTX-2's packed latent: the video's (128 channels, 32 times fewer pixels, 8 frames per latent frame after
    the first) and the sound track's (8 channels x 16 mel bins, 25 latents a second: one per frame at 25 fps),
    as LTXVConcatAVLatent joins them."""
    frames = f or 1
    return [(b, 128, 1 + (frames - 1) // 8, h // 32, w // 32), (b, 8, round(frames / LTX2_FPS * 25), 16)]


FLUX2_TOKENS = 512
"""FLUX.2's Mistral Small 3 features (three layers' hidden states, 15360 wide), padded to 512 tokens by its
``extra_conds``."""
QWEN3_TOKENS = 256
"""Z-Image's Qwen3 4B features: not padded (the caption's length); 256 tokens stand for a long caption."""
SD3_TOKENS = 154
"""SD3's conditioning: 77 tokens of CLIP-L + CLIP-G (padded to 4096 wide) then 77 of T5-XXL."""

LTX2_FPS = 25.0
LTX2_TOKENS = 1024
"""LTX-2's text features: Gemma 3 12B's, padded to 1024 tokens, through the model's two connectors (run by its
``extra_conds`` before the model call, not counted here) into one 3840-wide half per stream."""
LTX2_CLIPS = ((768, 512, 49), (768, 512, 121))
"""The clips the table estimates LTX-2 at (width, height, frames), at 25 fps."""
HUNYUAN15_CONCAT = 33
"""HunyuanVideo 1.5's ``concat_cond``: the patch embedding's 65 input channels less the latent's 32: a start
frame's latent (32) and its mask (1), zeros for text-to-video."""

FAMILIES: dict[str, Family] = {
    "sdxl": Family("SDXL", lambda: comfy.supported_models.SDXL, lambda: dict(SDXL), _square(4, 8),
                   lambda b: {"c_crossattn": (b, 77, 2048), "y": (b, 2816)}),  # CLIP-L + CLIP-G, pooled + sizes
    "flux-dev": Family("Flux dev", lambda: comfy.supported_models.Flux, _flux_config, _square(16, 8),
                       lambda b: {"c_crossattn": (b, 256, 4096), "y": (b, 768), "guidance": (b,)}),  # T5-XXL 256
    "sd35-large": Family("SD3.5 Large", lambda: comfy.supported_models.SD3, lambda: dict(SD35_LARGE),
                         _square(16, 8), lambda b: {"c_crossattn": (b, SD3_TOKENS, 4096), "y": (b, 2048)}),
    "z-image": Family("Z-Image", lambda: comfy.supported_models.ZImage, lambda: dict(Z_IMAGE), _square(16, 8),
                      lambda b: {"c_crossattn": (b, QWEN3_TOKENS, 2560), "num_tokens": QWEN3_TOKENS}),
    "qwen-image": Family("Qwen-Image", lambda: comfy.supported_models.QwenImage, lambda: dict(QWEN_IMAGE),
                         _frames(16, 8, image=True), lambda b: {"c_crossattn": (b, QWEN_TOKENS, 3584)}),
    "flux2-dev": Family("Flux.2 dev", lambda: comfy.supported_models.Flux2, lambda: dict(FLUX2_DEV),
                        _square(128, 16), lambda b: {"c_crossattn": (b, FLUX2_TOKENS, 15360), "guidance": (b,)}),
    "wan21-1.3b": Family("Wan 2.1 1.3B", lambda: comfy.supported_models.WAN21_T2V, lambda: dict(WAN21_1_3B),
                         _frames(16, 8), lambda b: {"c_crossattn": (b, UMT5_TOKENS, 4096)}, WAN_CLIPS),
    "wan22-5b": Family("Wan 2.2 5B", lambda: comfy.supported_models.WAN22_T2V, lambda: dict(WAN22_5B),
                       _frames(48, 16), lambda b: {"c_crossattn": (b, UMT5_TOKENS, 4096)}, WAN_CLIPS),
    "wan21-14b": Family("Wan 2.1 14B", lambda: comfy.supported_models.WAN21_T2V, lambda: dict(WAN21_14B),
                        _frames(16, 8), lambda b: {"c_crossattn": (b, UMT5_TOKENS, 4096)}, WAN_CLIPS),
    "ltx2": Family("LTX-2", lambda: comfy.supported_models.LTXAV, lambda: dict(LTX2), _ltx2_streams,
                   lambda b: {"c_crossattn": (b, LTX2_TOKENS, 2 * 3840), "frame_rate": LTX2_FPS}, LTX2_CLIPS),
    "hunyuan-video-1.5": Family("HunyuanVideo 1.5", lambda: comfy.supported_models.HunyuanVideo15,
                                lambda: dict(HUNYUAN_VIDEO15), _frames(32, 16),
                                lambda b: {"c_crossattn": (b, QWEN_TOKENS, 3584)}, WAN_CLIPS, HUNYUAN15_CONCAT),
}
"""The families :func:`estimate_step` builds, by name."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One step's device memory, in GiB: ``weights`` (the frozen model), ``adapters`` (the trained tensors),
    ``optimizer`` (AdamW's state, by arithmetic), ``inputs`` (latent, noise, target and conditioning),
    ``activations`` (the peak of the step above what was live at its start: saved activations, temporaries and
    the gradients), ``peak`` (the count's peak plus the optimizer's state: compare with
    ``torch.cuda.max_memory_allocated``). ``attention``: the calls counted per kernel (``memory_count``);
    ``settings``: what was estimated; ``omitted``: what the figure leaves out. ``resolution`` is the height in
    pixels, ``width`` the width where it differs (None: square)."""

    family: str
    resolution: int
    frames: int | None
    settings: dict[str, Any]
    parameters: int
    trained_parameters: int
    weights_gib: float
    adapters_gib: float
    optimizer_gib: float
    inputs_gib: float
    activations_gib: float
    peak_gib: float
    attention: dict[str, int]
    checkpointed_blocks: int
    seconds: float
    omitted: tuple[str, ...] = ()
    width: int | None = None
    launches: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


OMITTED = ("the CUDA context and the allocator's reserve", "kernels' workspaces", "autocast's fp32 norm outputs")


def _bytes_of(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def build(family: Family, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> Any:
    """ComfyUI's model of ``family`` on ``meta`` with weights in ``weight_dtype`` (default ``dtype``) computing
    in ``dtype`` (ComfyUI's manual cast where they differ, as Load Diffusion Model's fp8 weight dtypes do)."""
    config = family.config_class()(family.config())
    weights = weight_dtype or dtype
    config.set_inference_dtype(weights, None if weights == dtype else dtype)
    model = config.get_model({}, device=META)
    model.model_sampling.to(META)  # its tables, made on the CPU, where the loaded model has them: on the device
    return model


def _wrap(mp: Any) -> None:
    """The patcher's weight wrappers on its modules, as ``ModelPatcher.load`` attaches them (without loading)."""
    wrappers = mp.weight_wrapper_patches
    for n, m in mp.model.named_modules():
        if hasattr(m, "weight_function"):
            m.weight_function = list(wrappers.get(f"{n}.weight", []))
            m.bias_function = list(wrappers.get(f"{n}.bias", []))


def _unwrap(mp: Any) -> None:
    for m in mp.model.modules():
        if hasattr(m, "weight_function"):
            m.weight_function, m.bias_function = [], []


class _MetaFactories(TorchFunctionMode):
    """Tensors made without a device made on ``meta``, except ``torch.tensor``'s: the adapters' matrices and
    offsets on ``meta`` like the model, their alpha (a number read at every call) a real one."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.tensor and func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = META
        return func(*args, **kwargs)


@contextlib.contextmanager
def _hooks_on_meta(manager: Any, mp: Any) -> Iterator[None]:
    """``compat.bypass_hooks``, the hooks' adapters moved to ``meta`` where ComfyUI moves them to its compute
    device (read from ``get_torch_device`` while they are injected)."""
    mm = comfy.model_management
    original = mm.get_torch_device
    mm.get_torch_device = lambda: META
    try:
        hooks = compat.bypass_hooks(manager, mp)
        hooks.__enter__()
    finally:
        mm.get_torch_device = original
    try:
        yield
    finally:
        hooks.__exit__(None, None, None)


def _pytorch_attention(func: Any, *args: Any, **kwargs: Any) -> Any:
    """ComfyUI's attention override: PyTorch's ``scaled_dot_product_attention``, what ComfyUI runs on NVIDIA
    GPUs, whatever this process chose (ComfyUI on a CPU may choose sub-quadratic attention)."""
    return comfy.ldm.modules.attention.attention_pytorch(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The settings of a counted step (those of ``MemoryOptions`` that change memory, and the adapters')."""

    rank: int = 16
    dtype: str = "bf16"
    lora_dtype: str = "bf16"
    depth: int = 1  # 0: no gradient checkpointing
    share: float = 1.0
    bypass: bool = False
    fp8: bool = False
    attention: str = "flash"
    algorithm: str = "LoRA"
    choice: LayerChoice = dataclasses.field(default_factory=LayerChoice)


def packed(streams: Streams) -> tuple[Shape, dict[str, Any]]:
    """The latent's shape the model is called on and the constants that say how it unpacks: one stream as it is,
    several flattened into one ``[batch, 1, n]`` latent as ``comfy.utils.pack_latents`` lays them out."""
    if isinstance(streams, tuple):
        return streams, {}
    size = sum(math.prod(s[1:]) for s in streams)
    return (streams[0][0], 1, size), {"latent_shapes": [torch.Size(s) for s in streams]}


def count_step(model: Any, x_shape: Streams, conditioning: dict[str, Any], settings: StepSettings
               ) -> tuple[memory_count.Count, dict[str, Any]]:
    """One training step of ``model`` (a ComfyUI ``BaseModel`` on ``meta``) counted: the adapters made, wrapped
    or hooked, the layers fused, the blocks checkpointed as Train LoRA's pass does, then the model called
    through ``apply_model`` on a noisy latent of ``x_shape`` (or of streams packed, :func:`packed`) with
    ``conditioning`` (shapes, or tensors whose shape and dtype are taken; any other value, a frame rate, is
    handed over as it is, as ComfyUI's constant conditions are), the flow-matching loss's backward pass run.
    Returns the count and what else was found (parameters, trained parameters and their bytes, inputs' bytes,
    attention calls, blocks checkpointed)."""
    dtype = TRAINING_DTYPES[settings.dtype]
    mp = comfy.model_patcher.ModelPatcher(model, load_device=META, offload_device=META)
    manager = compat.bypass_manager() if settings.bypass else None
    with _MetaFactories():
        adapters = create_adapters(mp, settings.rank, settings.algorithm, LORA_DTYPES[settings.lora_dtype], {},
                                   manager, choice=settings.choice)
    trained = list(adapters.values())
    dm = model.diffusion_model
    model.requires_grad_(False)
    x_shape, constants = packed(x_shape)
    constants.update({k: v for k, v in conditioning.items() if not isinstance(v, (tuple, torch.Tensor))})
    inputs = {k: torch.empty(v if isinstance(v, tuple) else v.shape, device=META,
                             dtype=torch.float32 if isinstance(v, tuple) else v.dtype)
              for k, v in conditioning.items() if k not in constants}
    latent, noise = torch.empty(x_shape, device=META), torch.empty(x_shape, device=META)
    sigma = torch.empty(x_shape[0], device=META)
    existing = [*memory_count.module_tensors(model), *trained, latent, noise, sigma, *inputs.values()]
    depth, share, keep_inputs = settings.depth, settings.share if settings.depth else 0.0, False
    while True:  # as ``ComfyBackend.run`` retries a model that updates tensors in place (``_retry``)
        at_depth = compat.modules_at_depth(dm, depth or 1)
        blocks = recompute.spread(at_depth, share) if depth else []
        kept = [m for m in at_depth if all(m is not b for b in blocks)] if keep_inputs else []
        try:
            c, fused_count = _counted_pass(model, mp, manager, blocks, kept, existing, settings.attention,
                                           latent, noise, sigma, {**inputs, **constants})
            break
        except RuntimeError as e:
            if not is_inplace_update(e) or (depth and share >= 1.0):
                raise
            if keep_inputs:
                depth, share, keep_inputs = depth or 1, 1.0, False
            else:
                keep_inputs = True
            for p in trained:
                p.grad = None
    found = {"parameters": sum(p.numel() for p in model.parameters()),
             "trained_parameters": sum(p.numel() for p in trained), "trained_bytes": _bytes_of(trained),
             "weights_bytes": _bytes_of(memory_count.module_tensors(model)),
             "inputs_bytes": _bytes_of([latent, noise, sigma, *inputs.values()]),
             "attention": c.attention_calls(), "checkpointed": len(blocks), "kept_inputs": len(kept),
             "fused": fused_count, "launches": c.launches.summary(),
             "marks": dict(c.storages.marks), "dtype": str(dtype)}
    return c.storages.count(), found


def _counted_pass(model: Any, mp: Any, manager: Any, blocks: list[torch.nn.Module], kept: list[torch.nn.Module],
                  existing: list[torch.Tensor], attention: str, latent: torch.Tensor, noise: torch.Tensor,
                  sigma: torch.Tensor, inputs: dict[str, Any]) -> tuple[memory_count.Counting, int]:
    """One forward and backward pass counted, in the contexts of Train LoRA's pass (``ComfyBackend._run``)."""
    dm = model.diffusion_model
    options = {"optimized_attention_override": _pytorch_attention}
    _wrap(mp)
    try:
        with compat.training_mode(), fused.fused_layers(dm, "auto") as fused_count, \
                compat.gradient_checkpointing(blocks, False, preserve_rng_state=False), \
                recompute.inputs_kept(kept), _hooks_on_meta(manager, mp), compat.differentiable_kernels(), \
                memory_count.counting(*existing, attention=attention) as c:
            xt = model.model_sampling.noise_scaling(sigma, noise, latent, False)
            pred = model.apply_model(xt, sigma, transformer_options=options, **inputs)
            loss = F.mse_loss(pred.float(), latent.float())
            del pred, xt
            c.storages.mark("forward")
            loss.backward()
            del loss
            c.storages.mark("backward")
    finally:
        _unwrap(mp)
    return c, fused_count


def _trainable(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run outside inference mode, with gradients on: a node runs under ``torch.inference_mode``
    (ComfyUI's executor), where the counted step's tensors could not be saved for its backward pass."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False), torch.enable_grad():
            return function(*args, **kwargs)

    return run


@_trainable
def estimate_step(family: str, resolution: int, frames: int | None = None, *, width: int | None = None,
                  rank: int = 16, batch: int = 1,
                  dtype: str = "bf16", gradient_checkpointing: bool = True, checkpoint_share: float = 1.0,
                  bypass_fp8: bool = False, attention: str = "flash") -> Estimate:
    """The estimate of one training step of ``family`` (a key of :data:`FAMILIES`) at ``resolution`` pixels
    high and ``width`` wide (default: square), ``frames`` for video, ``batch`` samples, LoRA ``rank`` on every
    layer ComfyUI patches (Train LoRA's default), the model and the adapters in ``dtype``, AdamW.
    ``bypass_fp8``: the base weights in fp8 (e4m3fn), the adapters in bypass mode."""
    import time

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; estimated: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    began = time.perf_counter()
    weights = torch.float8_e4m3fn if bypass_fp8 else TRAINING_DTYPES[dtype]
    model = build(spec, TRAINING_DTYPES[dtype], weights)
    settings = StepSettings(rank=rank, dtype=dtype, lora_dtype=dtype, depth=1 if gradient_checkpointing else 0,
                            share=checkpoint_share, bypass=bypass_fp8, fp8=bypass_fp8, attention=attention)
    x_shape = spec.latent(batch, width or resolution, resolution, frames)
    count, found = count_step(model, x_shape, spec.inputs(batch, x_shape), settings)
    optimizer = ADAM_STATES * found["trained_bytes"]
    return Estimate(
        family=spec.name, resolution=resolution, frames=frames,
        settings={"rank": rank, "batch": batch, "dtype": dtype, "gradient_checkpointing": gradient_checkpointing,
                  "checkpoint_share": checkpoint_share if gradient_checkpointing else 0.0,
                  "bypass_fp8": bypass_fp8, "attention": attention},
        parameters=found["parameters"], trained_parameters=found["trained_parameters"],
        weights_gib=found["weights_bytes"] / GIB, adapters_gib=found["trained_bytes"] / GIB,
        optimizer_gib=optimizer / GIB, inputs_gib=found["inputs_bytes"] / GIB,
        activations_gib=count.transient / GIB, peak_gib=(count.peak + optimizer) / GIB,
        attention=found["attention"], checkpointed_blocks=found["checkpointed"],
        seconds=time.perf_counter() - began, omitted=OMITTED, width=width, launches=found["launches"])


def _config_class(family: Family) -> Any:
    """The family's model config class in this ComfyUI, or None where it has none (v0.3.64 has no Z-Image,
    Flux.2, LTX-2 or HunyuanVideo 1.5)."""
    try:
        return family.config_class()
    except AttributeError:
        return None


def _family_of(model: Any) -> tuple[str, Family]:
    """The :data:`FAMILIES` entry of a loaded model (a ModelPatcher), by its config class and its config."""
    config = model.model.model_config
    known = {key: family for key, family in FAMILIES.items() if _config_class(family) is not None}
    for key, family in known.items():
        if type(config) is _config_class(family):
            wanted = family.config()
            if all(config.unet_config.get(k) == v for k, v in wanted.items() if k not in ("dtype", "txt_ids_dims")):
                return key, family
    raise ValueError(f"no estimate for {type(config).__name__} at this size yet (estimated: "
                     f"{', '.join(f.name for f in known.values())})")


def _feature_tokens(value: Any, width: int) -> int | None:
    """The token count of the first text features ``[..., tokens, width]`` in a collated conditioning value."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[-2]) if value.dim() >= 3 and value.shape[-1] == width else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        tokens = _feature_tokens(item, width)
        if tokens is not None:
            return tokens
    return None


def row_latent(row: Any, batch: int) -> Streams:
    """The latent of a step of ``batch`` samples shaped as ``row`` (a collated dataset row): its ``latent``
    column's, and with a sound track (the ``audio`` column of a joint audio-video model's dataset) both streams,
    which training packs into one latent (``compat.pack_streams``)."""
    from ...streaming_cache.train.conditioning import flatten_batch

    columns = ["latent", *(["audio"] if isinstance(row.get("audio"), dict) else [])]
    shapes = [(batch, *flatten_batch(row[c]["samples"]).shape[1:]) for c in columns]
    return shapes[0] if len(shapes) == 1 else shapes


def row_conditioning(family: Family, row: Any, batch: int, x_shape: Streams) -> dict[str, Any]:
    """``family``'s conditioning shapes for ``batch`` samples on a latent of ``x_shape`` (:meth:`Family.inputs`),
    its text features as long as those of ``row`` (a collated dataset row) where the row holds features of the
    family's width: an encoder that does not pad (Qwen2.5-VL) gives each caption its own length, which the
    family's figure only stands for."""
    shapes = family.inputs(batch, x_shape)
    text = shapes.get("c_crossattn")
    tokens = _feature_tokens(row.get("cond"), text[-1]) if text and isinstance(row, dict) else None
    if tokens is not None:
        shapes["c_crossattn"] = (text[0], tokens, text[-1])
    return shapes


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """What :func:`training_step` counted: the step's peak device bytes (the optimizer's state included) and the
    frozen weights' bytes in it."""

    peak: int
    weights: int


_COUNTED: dict[tuple, StepBytes] = {}
"""Counts made in this process, by what they depend on: a run queued again is planned without counting again
(the last :data:`KEPT_COUNTS`)."""
KEPT_COUNTS = 64


def _weight_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype most of ``module``'s parameters are stored in: the one it was loaded with (a few layers keep
    their own, Wan's fp32 patch embedding first of all)."""
    sizes: dict[torch.dtype, int] = {}
    for p in module.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.__getitem__)


@_trainable
def training_step(model: Any, row: Any, spec: Any, depth: int) -> StepBytes:
    """One step of ``spec``'s run (a ``TrainSpec``) on ``model`` (a loaded ModelPatcher of a family of
    :data:`FAMILIES`; others raise ValueError) counted with gradient checkpointing at ``depth`` of every block
    (0: none), a batch of ``spec.batch_size`` samples shaped as ``row`` (a collated row of the dataset: its
    latent's shape is used, :func:`row_latent`; the conditioning is the family's text encoders' at their padded
    lengths, or as long as the row's, :func:`row_conditioning`). The weights are counted in the dtype the model
    is loaded with."""
    key, family = _family_of(model)
    memory = spec.memory
    weight_dtype = _weight_dtype(model.model.diffusion_model)
    x_shape = row_latent(row, spec.batch_size)
    settings = StepSettings(rank=spec.rank, dtype=memory.training_dtype, lora_dtype=memory.lora_dtype,
                            depth=depth, share=1.0, bypass=memory.bypass_mode, fp8=weight_dtype.itemsize == 1,
                            algorithm=spec.adapter.algorithm, choice=spec.adapter.layers)
    conditioning = row_conditioning(family, row, spec.batch_size, x_shape)
    known = (key, str(weight_dtype), str(x_shape), str(sorted(conditioning.items())), settings)
    if known not in _COUNTED:
        meta_model = build(family, TRAINING_DTYPES[memory.training_dtype], weight_dtype)
        count, found = count_step(meta_model, x_shape, conditioning, settings)
        while len(_COUNTED) >= KEPT_COUNTS:
            del _COUNTED[next(iter(_COUNTED))]
        _COUNTED[known] = StepBytes(count.peak + ADAM_STATES * found["trained_bytes"], found["weights_bytes"])
    return _COUNTED[known]


def comfyui_trainer() -> Any | None:
    """ComfyUI's ``comfy_extras.nodes_train`` where its TrainLoraNode is built of the functions
    :func:`count_comfyui_step` calls (its adapters' setup, ``find_modules_at_depth``, ``patch``: ComfyUI 0.3.7x
    and later), else None (v0.3.64 inlines them in the node)."""
    try:
        import comfy_extras.nodes_train as trainer
    except ImportError:
        return None
    needed = ("_setup_lora_adapters", "find_modules_at_depth", "patch", "unpatch", "adapter_maps")
    return trainer if all(hasattr(trainer, n) for n in needed) else None


def count_comfyui_step(model: Any, x_shape: Shape, conditioning: dict[str, Any], rank: int = 16,
                       lora_dtype: torch.dtype = torch.bfloat16, checkpoint_depth: int | None = 1,
                       attention: str = "flash") -> tuple[memory_count.Count, dict[str, Any]]:
    """One step of ComfyUI's own TrainLoraNode on ``model`` (a ``BaseModel`` on ``meta``) counted, on a latent of
    ``x_shape`` (one tensor: the node takes no packed streams) with ``conditioning`` (shapes; any other value, a
    token count, is handed over as it is, as ComfyUI's constant conditions are), made by its own functions as its
    ``execute`` makes it: ``_setup_lora_adapters`` (its default algorithm, new adapters of ``rank`` in
    ``lora_dtype``: a LoRA on every matrix weight, a full-size ``BiasDiff`` on every bias and 1-D weight, all as
    weight wrappers), its checkpointing (``find_modules_at_depth`` at ``checkpoint_depth``, each
    module ``patch``-ed; None: off), ``in_training`` set; then its ``fwd_bwd``: the noisy latent and the sigma
    made to require gradients, the target ``noise_scaling`` of zeros, the model called, the loss's backward pass.

    Stand-ins, because they do not run on ``meta`` or change no tensor's size: the model is called through
    ``apply_model``, as the guider's ``calc_cond_batch`` calls it with one condition (its batching of conditions
    is left out: latent-sized tensors); autocast is not entered (the model computes in bf16 already, as
    ``set_model_compute_dtype`` asks); the weight wrappers are attached and moved to the device (``meta``) as
    ``ModelPatcher.load`` attaches and moves them.
    Returns the count and what was found (parameters, trained parameters and their bytes, inputs' bytes,
    attention calls, modules checkpointed)."""
    trainer = comfyui_trainer()
    if trainer is None:
        raise RuntimeError("this ComfyUI's TrainLoraNode is not built of the functions the estimate calls")
    mp = comfy.model_patcher.ModelPatcher(model, load_device=META, offload_device=META)
    model.requires_grad_(False).train()
    algorithm = next(iter(trainer.adapter_maps))  # the node's default
    with _MetaFactories():
        lora_sd, _ = trainer._setup_lora_adapters(mp, {}, algorithm, lora_dtype, rank)
    trained = list(lora_sd.values())
    dm = model.diffusion_model
    _wrap(mp)
    for m in model.modules():  # the adapters moved to the device as ModelPatcher.load moves them (alpha too)
        comfy.model_patcher.move_weight_functions(m, META)
    constants = {k: v for k, v in conditioning.items() if not isinstance(v, tuple)}
    inputs = {k: torch.empty(v, device=META) for k, v in conditioning.items() if k not in constants}
    latent, noise = torch.empty(x_shape, device=META), torch.empty(x_shape, device=META)
    sigma = torch.empty(x_shape[0], device=META)
    existing = [*memory_count.module_tensors(model), *trained, latent, noise, sigma, *inputs.values()]
    patched = trainer.find_modules_at_depth(dm, depth=checkpoint_depth) if checkpoint_depth else []
    options = {"optimized_attention_override": _pytorch_attention}
    try:
        for m in patched:
            trainer.patch(m)
        with compat.training_mode(), memory_count.counting(*existing, attention=attention) as c:
            ms = model.model_sampling
            xt = ms.noise_scaling(sigma, noise, latent, False)
            x0 = ms.noise_scaling(torch.zeros_like(sigma), torch.zeros_like(noise), latent, False)
            pred = model.apply_model(xt.requires_grad_(True), sigma.requires_grad_(True),
                                     transformer_options=options, **inputs, **constants)
            loss = F.mse_loss(pred.float(), x0.float())
            del pred, xt, x0
            c.storages.mark("forward")
            loss.backward()
            del loss
            c.storages.mark("backward")
    finally:
        for m in patched:
            trainer.unpatch(m)
        _unwrap(mp)
    found = {"parameters": sum(p.numel() for p in model.parameters()),
             "trained_parameters": sum(p.numel() for p in trained), "trained_bytes": _bytes_of(trained),
             "weights_bytes": _bytes_of(memory_count.module_tensors(model)),
             "inputs_bytes": _bytes_of([latent, noise, sigma, *inputs.values()]),
             "attention": c.attention_calls(), "checkpointed": len(patched),
             "patched": [type(m).__name__ for m in patched], "launches": c.launches.summary()}
    return c.storages.count(), found


@_trainable
def estimate_comfyui_step(family: str, resolution: int, frames: int | None = None, *, width: int | None = None,
                          rank: int = 16, batch: int = 1, gradient_checkpointing: bool = True,
                          checkpoint_depth: int = 1, attention: str = "flash") -> Estimate:
    """The estimate of one step of ComfyUI's TrainLoraNode (:func:`count_comfyui_step`) on ``family`` (a key of
    :data:`FAMILIES` whose latent is one tensor: not LTX-2's packed streams, which the node does not take) at
    ``resolution`` pixels high and ``width`` wide (default: square), ``frames`` for video: the model built as
    :func:`estimate_step` builds it, the same inputs, its defaults otherwise (bf16 training and LoRA, AdamW,
    whose two moments per trained parameter are added by arithmetic as :func:`estimate_step` adds them)."""
    import time

    spec = FAMILIES[family]
    began = time.perf_counter()
    x_shape = spec.latent(batch, width or resolution, resolution, frames)
    if not isinstance(x_shape, tuple):
        raise ValueError(f"{spec.name}'s latent is several streams, which TrainLoraNode does not take")
    model = build(spec, torch.bfloat16)
    count, found = count_comfyui_step(model, x_shape, spec.inputs(batch, x_shape), rank,
                                      checkpoint_depth=checkpoint_depth if gradient_checkpointing else None,
                                      attention=attention)
    optimizer = ADAM_STATES * found["trained_bytes"]
    return Estimate(
        family=spec.name, resolution=resolution, frames=frames,
        settings={"trainer": "TrainLoraNode", "rank": rank, "batch": batch, "dtype": "bf16",
                  "gradient_checkpointing": gradient_checkpointing,
                  "checkpoint_depth": checkpoint_depth if gradient_checkpointing else 0,
                  "checkpointed": found["patched"], "attention": attention},
        parameters=found["parameters"], trained_parameters=found["trained_parameters"],
        weights_gib=found["weights_bytes"] / GIB, adapters_gib=found["trained_bytes"] / GIB,
        optimizer_gib=optimizer / GIB, inputs_gib=found["inputs_bytes"] / GIB,
        activations_gib=count.transient / GIB, peak_gib=(count.peak + optimizer) / GIB,
        attention=found["attention"], checkpointed_blocks=found["checkpointed"],
        seconds=time.perf_counter() - began, omitted=OMITTED, width=width, launches=found["launches"])


def iter_settings() -> Iterator[tuple[str, dict[str, Any]]]:
    """The memory settings of the table, by name: checkpointing (Train LoRA's default), half of the blocks
    recomputed, none, and fp8 weights in bypass mode (with checkpointing)."""
    yield "checkpointing", {"gradient_checkpointing": True}
    yield "half recomputed", {"gradient_checkpointing": True, "checkpoint_share": 0.5}
    yield "no checkpointing", {"gradient_checkpointing": False}
    yield "fp8 + bypass", {"gradient_checkpointing": True, "bypass_fp8": True}


COMFYUI_FAMILIES = ("sdxl", "flux-dev", "sd35-large", "z-image", "qwen-image", "flux2-dev", "wan21-1.3b",
                    "wan22-5b", "wan21-14b", "hunyuan-video-1.5")
"""The families the table also estimates ComfyUI's TrainLoraNode on (:func:`estimate_comfyui_step`): every family
of :data:`FAMILIES` the node can train on the inputs the table counts. Its step takes one latent tensor, image or
video, and the conditioning its guider makes (HunyuanVideo 1.5's image-to-video channels included), so all but
LTX-2: the table counts LTX-2 with its sound track, a latent of two streams (LTXVConcatAVLatent's nested latent),
which the node does not take (it counts no samples in it and stops before its first step, the conditioning not
matching the latents' count); on video alone it would run, a step the LTX-2 rows do not count."""


def iter_comfyui_settings() -> Iterator[tuple[str, dict[str, Any]]]:
    """TrainLoraNode's rows of the table, by name: its default (gradient checkpointing at depth 1) and without
    checkpointing."""
    yield "TrainLoraNode, checkpointing", {"gradient_checkpointing": True}
    yield "TrainLoraNode, no checkpointing", {"gradient_checkpointing": False}


def round_gib(value: float) -> float:
    return math.floor(value * 100 + 0.5) / 100
