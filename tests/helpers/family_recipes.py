"""Every entry of ComfyUI's ``supported_models`` list as a recipe for the family sweep (``family_sweep.py``).

A recipe names the ``supported_models`` class, the kind of architecture, the settings that make its diffusion
model tiny (``shrink``: what detection reads from the weights, cut to one block and a narrow width where
detection allows it; ``tiny_models.build`` takes whatever detection fixes), and one dataset sample as the
family's own encoders and ComfyUI's conditioning nodes produce it: the text conditioning (real encoder widths
and, where the encoder pads, the real token count), the keys ComfyUI's nodes add, and the dataset columns an
edit pair, an image-to-video start frame or a sound track brings. A recipe that is not trained says why
(``skip``): not a diffusion model, or a model detection only recognises at a size too large to run here.

Pure data and torch: the test process reads it for the table and the choice of families; the ComfyUI child
process builds models and caches from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# ------------------------------------------------------------------------------------------------ conditioning


@dataclasses.dataclass(frozen=True)
class Text:
    """One caption through a family's text encoder: ``[1, tokens, width]`` hidden states (``real`` tokens that
    are not padding: an encoder that zeroes the rest, UMT5, or keeps a mask), the pooled vector (None: the
    encoder has none) and the keys the encoder or a conditioning node adds (values, or ``f(g, i)`` per sample)."""

    encoder: str
    tokens: int
    width: int
    pooled: int | None = None
    real: int | None = None
    zero_padding: bool = False
    mask: bool = False
    extra: dict = dataclasses.field(default_factory=dict)

    def __call__(self, g: torch.Generator, i: int) -> list:
        c = torch.randn(1, self.tokens, self.width, generator=g) * 0.5
        real = self.tokens if self.real is None else self.real
        if self.zero_padding:
            c[:, real:] = 0
        options: dict[str, Any] = {"pooled_output": None if self.pooled is None
                                   else torch.randn(1, self.pooled, generator=g)}
        if self.mask:
            m = torch.zeros(1, self.tokens, dtype=torch.long)
            m[:, :real] = 1
            options["attention_mask"] = m
        for k, v in self.extra.items():
            options[k] = v(g, i) if callable(v) else v
        return [[c, options]]

    def describe(self) -> str:
        parts = [f"{self.encoder} [1,{self.tokens},{self.width}]"]
        if self.pooled is not None:
            parts.append(f"pooled [1,{self.pooled}]")
        if self.mask:
            parts.append("attention mask")
        parts += [f"`{k}`" for k in self.extra]
        return ", ".join(parts)


def randn(*shape: int, scale: float = 1.0) -> Callable[[torch.Generator, int], torch.Tensor]:
    return lambda g, i: torch.randn(*shape, generator=g) * scale


def ids(*shape: int, high: int) -> Callable[[torch.Generator, int], torch.Tensor]:
    return lambda g, i: torch.randint(0, high, shape, generator=g)


def sizes(g: torch.Generator, i: int) -> dict:
    w, h = (1024, 1024) if i % 2 == 0 else (832, 1216)
    return {"width": w, "height": h, "crop_w": 0, "crop_h": 0, "target_width": w, "target_height": h}


def sdxl_sizes(text: Text) -> Callable[[torch.Generator, int], list]:
    """CLIPTextEncodeSDXL: the six size values of each sample's source image (two samples of a batch differ)."""
    def cond(g: torch.Generator, i: int) -> list:
        out = text(g, i)
        out[0][1].update(sizes(g, i))
        return out
    return cond


CLIP_L = Text("CLIP-L", 77, 768, pooled=768)
OPENCLIP_H = Text("OpenCLIP-H", 77, 1024, pooled=1024)
CLIP_LG = Text("CLIP-L + CLIP-G", 77, 2048, pooled=1280)
T5_FLUX = Text("T5-XXL", 256, 4096, pooled=768)
UMT5 = Text("UMT5-XXL", 512, 4096, real=9, zero_padding=True)
QWEN25VL = Text("Qwen2.5-VL 7B", 10, 3584)


# ------------------------------------------------------------------------------------------------ columns


@dataclasses.dataclass(frozen=True)
class Column:
    """A dataset column beside ``latent`` and ``cond``: a LATENT (``{"samples": ...}``, e.g. an edit pair's
    reference image), a plain tensor (a mask) or a dict of tensors (a CLIP vision output), one per sample."""

    kind: str  # "latent" | "tensor" | "mask" | "clip_vision"
    shape: tuple[int, ...] = ()
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    kept: int = 1  # a mask's first frames that are given (0), the rest generated (1)
    last: bool = False  # a mask's last frame is given too (first/last-frame video: its last pixel frame)

    def value(self, g: torch.Generator) -> Any:
        if self.kind == "latent":
            return {"samples": torch.randn(self.shape, generator=g)}
        if self.kind == "tensor":
            return torch.randn(self.shape, generator=g)
        if self.kind == "mask":
            m = torch.ones(self.shape)
            m[:, :, :self.kept] = 0
            if self.last:
                m[:, -1, -1] = 0
            return m
        return {name: torch.randn(shape, generator=g) for name, shape in self.parts}

    def describe(self) -> str:
        if self.kind == "clip_vision":
            return "CLIP vision output " + ", ".join(f"{n} [{','.join(map(str, s))}]" for n, s in self.parts)
        return f"[{','.join(map(str, self.shape))}]"


def latent(*shape: int) -> Column:
    return Column("latent", shape)


def first_frame_mask(frames: int, h: int, w: int, kept: int = 1) -> Column:
    """What ComfyUI's image-to-video nodes mark: zero on the start image's latent frames (given), one elsewhere
    (generated); WanImageToVideo's ``concat_mask``, LTXVImgToVideo's latent ``noise_mask``."""
    return Column("mask", (1, 1, frames, h, w), kept=kept)


def first_last_mask(frames: int, h: int, w: int) -> Column:
    """WanFirstLastFrameToVideo's ``concat_mask`` [1,4,F,h,w] (four pixel frames per latent frame): the start
    image's latent frame given, and the end image's pixel frame (the last channel of the last latent frame)."""
    return Column("mask", (1, 4, frames, h, w), kept=1, last=True)


def clip_vision(**parts: tuple[int, ...]) -> Column:
    return Column("clip_vision", parts=tuple(parts.items()))


# ------------------------------------------------------------------------------------------------ recipes

UNET = dict(image_size=32, use_spatial_transformer=True, legacy=False, use_checkpoint=False, in_channels=4,
            out_channels=4, num_res_blocks=[1], channel_mult=[1], transformer_depth=[1],
            transformer_depth_output=[1, 1], transformer_depth_middle=-2)


def unet_levels(depths: list[int], per_level: int, **settings: Any) -> dict:
    """A UNet with ``per_level`` res blocks per level, every level as wide as the first (multipliers 1: what
    detection matches is the transformer depth of each input block, not the width of deeper levels nor the
    output blocks' transformers, which are left out)."""
    levels = len(depths) // per_level
    return dict(UNET, num_res_blocks=[per_level] * levels, channel_mult=[1] * levels, transformer_depth=list(depths),
                transformer_depth_output=[0] * (levels * (per_level + 1)), **settings)


SDXL_UNET = dict(context_dim=2048, use_linear_in_transformer=True, num_classes="sequential")
SVD_UNET = dict(context_dim=1024, use_linear_in_transformer=True, num_classes="sequential", extra_ff_mix_layer=True,
                use_spatial_context=True, merge_strategy="learned_with_images", merge_factor=0.0,
                video_kernel_size=[3, 1, 1], disable_temporal_crossattention=False)
FLUX = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=128, mlp_ratio=4.0,
            num_heads=1, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
            qkv_bias=True, txt_ids_dims=[])
CHROMA = dict(FLUX, hidden_size=3072, num_heads=24, in_channels=64, out_channels=64, in_dim=64, out_dim=3072,
              hidden_dim=5120, n_layers=5, vec_in_dim=None, depth_single_blocks=0)
HUNYUAN = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=128, mlp_ratio=4.0,
               num_heads=1, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2],
               qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False,
               vision_in_dim=None, meanflow_sum=False)
HUNYUAN15 = dict(HUNYUAN, vec_in_dim=None, out_channels=32, context_in_dim=3584, patch_size=[1, 1, 1], byt5=True,
                 use_cond_type_embedding=True, vision_in_dim=1152, meanflow_sum=True, guidance_embed=False)
COSMOS1 = dict(max_img_h=240, max_img_w=240, max_frames=128, out_channels=16, patch_spatial=2, patch_temporal=1,
               model_channels=4096, num_blocks=28, num_heads=32, block_config="FA-CA-MLP", concat_padding_mask=True,
               pos_emb_cls="rope3d", pos_emb_learnable=False, pos_emb_interpolation="crop", block_x_format="THWBD",
               affline_emb_norm=True, use_adaln_lora=True, adaln_lora_dim=256, extra_per_block_abs_pos_emb=True,
               extra_per_block_abs_pos_emb_type="learnable")
PREDICT2 = dict(max_img_h=240, max_img_w=240, max_frames=128, out_channels=16, patch_spatial=2, patch_temporal=1,
                model_channels=256, num_blocks=1, concat_padding_mask=True, crossattn_emb_channels=1024,
                pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30,
                use_adaln_lora=True, adaln_lora_dim=256, rope_h_extrapolation_ratio=4.0,
                rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False)
WAN = dict(dim=128, ffn_dim=256, num_heads=1, num_layers=1)
LUMINA_ZIMAGE = dict(patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560, n_layers=1, qk_norm=True, n_heads=30,
                     n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
                     ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32)

# kinds: what the families table (docs/families.md) groups by and CI picks one of each from
UNET_KIND, IMAGE, VIDEO, AUDIO, EDIT, I2V, AV, THREE_D, OTHER = (
    "UNet", "image DiT", "video DiT", "audio", "edit / reference", "image-to-video", "audio-video", "3D", "other")
NOT_DIFFUSION = "not a diffusion model"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One row of the sweep: ``config`` is the ``supported_models`` class; ``name`` tells variants of one class
    apart (Flux dev and Kontext). ``latent`` is one sample's LATENT shape (None: from the class's latent format);
    ``columns`` are the dataset's other columns; ``skip`` is why the family is not trained (empty: it is);
    ``same_as`` names the class a file of these weights loads as, where ComfyUI tells them apart only by
    metadata it does not find in the weights."""

    config: str
    kind: str
    cond: Callable[[torch.Generator, int], list] | None = None
    shrink: dict = dataclasses.field(default_factory=dict)
    name: str = ""
    latent: tuple[int, ...] | None = None
    columns: dict[str, Column] = dataclasses.field(default_factory=dict)
    metadata: dict[str, str] | None = None
    extra_weights: Callable[[], dict[str, tuple[int, ...]]] | None = None
    skip: str = ""
    notes: str = ""
    batch: int = 2
    encoders: str = ""
    ci: bool = False  # trained by the default test run (the rest with STREAMING_CACHE_SWEEP=all)
    model_keys: tuple[str, ...] = ("c_crossattn",)  # what the diffusion model must be handed in training
    checkpointing: bool = True  # False: trained without gradient checkpointing (the node's other path)
    learning_rate: float = 5e-3
    training_dtype: str = "bf16"  # what Train LoRA computes in (the sweep runs on the CPU)
    refuses_other_columns: bool = False  # also check that a dataset with a column it does not read is refused

    @property
    def key(self) -> str:
        return self.name or self.config

    def text(self) -> str:
        """What the cache holds for the family's conditioning, for the families table (docs/families.md)."""
        text = self.encoders or (self.cond.describe() if isinstance(self.cond, Text) else "")
        columns = ", ".join(f"`{name}` {column.describe()}" for name, column in self.columns.items()
                            if not self.encoders)
        return f"{text}; {columns}" if columns else text


CONV3D_BF16 = ("trained in fp32 here: on the CPU, PyTorch 2.13's bf16 conv3d backward returns non-finite gradients "
               "for the temporal (3, 1, 1) convolutions of its video blocks from finite inputs")


def _metadata(**transformer: Any) -> dict[str, str]:
    import json

    return {"config": json.dumps({"transformer": transformer})}


def _number_conditioners(*names: str) -> Callable[[], dict[str, tuple[int, ...]]]:
    """Stable Audio's seconds embedders: weights outside the diffusion model that ``get_model`` loads."""
    def shapes() -> dict[str, tuple[int, ...]]:
        from comfy.ldm.audio.embedders import NumberConditioner

        sd = NumberConditioner(768).state_dict()
        return {f"conditioner.conditioners.{n}.{k}": tuple(v.shape) for n in names for k, v in sd.items()}
    return shapes


def _zero123_projection() -> dict[str, tuple[int, ...]]:
    return {"cc_projection.weight": (768, 772), "cc_projection.bias": (768,)}


LTX2_METADATA = dict(audio_num_attention_heads=2, audio_attention_head_dim=64, audio_cross_attention_dim=128,
                     connector_num_layers=1)
"""What an LTX-2 checkpoint's embedded config sets and detection takes from it (the weights do not tell)."""

R = Recipe
RECIPES: list[Recipe] = [
    # ---- UNets
    R("SD15", UNET_KIND, CLIP_L, dict(UNET, context_dim=768), ci=True),
    R("SD20", UNET_KIND, OPENCLIP_H, dict(UNET, context_dim=1024, use_linear_in_transformer=True)),
    R("SD21UnclipL", UNET_KIND, OPENCLIP_H, dict(UNET, context_dim=1024, use_linear_in_transformer=True,
                                                 num_classes="sequential")),
    R("SD21UnclipH", UNET_KIND, OPENCLIP_H, dict(UNET, context_dim=1024, use_linear_in_transformer=True,
                                                 num_classes="sequential")),
    R("SDXL", UNET_KIND, sdxl_sizes(CLIP_LG), unet_levels([0, 0, 2, 2, 10, 10], 2, **SDXL_UNET),
      encoders="CLIP-L + CLIP-G [1,77,2048], pooled [1,1280], six sizes"),
    R("SSD1B", UNET_KIND, sdxl_sizes(CLIP_LG), unet_levels([0, 0, 2, 2, 4, 4], 2, **SDXL_UNET),
      encoders="as SDXL"),
    R("Segmind_Vega", UNET_KIND, sdxl_sizes(CLIP_LG), unet_levels([0, 0, 1, 1, 2, 2], 2, **SDXL_UNET),
      encoders="as SDXL"),
    R("KOALA_700M", UNET_KIND, sdxl_sizes(CLIP_LG), unet_levels([0, 2, 5], 1, **SDXL_UNET), encoders="as SDXL",
      ci=True, model_keys=("c_crossattn", "y")),
    R("KOALA_1B", UNET_KIND, sdxl_sizes(CLIP_LG), unet_levels([0, 2, 6], 1, **SDXL_UNET), encoders="as SDXL"),
    R("SDXLRefiner", UNET_KIND, Text("CLIP-G", 77, 1280, pooled=1280, extra={"aesthetic_score": 6.0, "width": 1024,
                                                                            "height": 1024}),
      unet_levels([0, 0, 4, 4, 4, 4, 0, 0], 2, context_dim=1280, use_linear_in_transformer=True,
                  num_classes="sequential"), encoders="CLIP-G [1,77,1280], pooled [1,1280], aesthetic score"),
    R("SDXL_instructpix2pix", EDIT, sdxl_sizes(CLIP_LG), unet_levels([0, 0, 2, 2, 10, 10], 2, **SDXL_UNET),
      columns={"concat_latent_image": latent(1, 4, 8, 8)}, encoders="as SDXL; the input image's latent",
      model_keys=("c_crossattn", "c_concat", "y")),
    R("SD15_instructpix2pix", EDIT, CLIP_L, dict(UNET, context_dim=768),
      columns={"concat_latent_image": latent(1, 4, 8, 8)}, encoders="CLIP-L [1,77,768]; the input image's latent",
      ci=True, model_keys=("c_crossattn", "c_concat")),
    R("SD_X4Upscaler", UNET_KIND, OPENCLIP_H,
      dict(UNET, context_dim=1024, use_linear_in_transformer=True, num_res_blocks=[1] * 4, channel_mult=[1] * 4,
           transformer_depth=[1] * 4, transformer_depth_output=[1] * 8),
      columns={"concat_image": Column("tensor", (1, 3, 8, 8))}, latent=(1, 4, 8, 8),
      encoders="OpenCLIP-H [1,77,1024]; the low-resolution image"),
    R("LotusD", UNET_KIND, OPENCLIP_H, dict(UNET, context_dim=1024, use_linear_in_transformer=True,
                                            num_classes="sequential")),
    R("Stable_Zero123", I2V, Text("CLIP vision + pose", 1, 772), dict(UNET, context_dim=768),
      columns={"concat_latent_image": latent(1, 4, 8, 8)}, extra_weights=_zero123_projection,
      encoders="CLIP vision embeds + elevation/azimuth [1,1,772]; the view's latent"),
    R("SVD_img2vid", I2V, Text("CLIP-H vision", 1, 1024, extra={"fps": 6, "motion_bucket_id": 127,
                                                                "augmentation_level": 0.0}),
      unet_levels([1, 1, 1, 1, 1, 1, 0, 0], 2, **SVD_UNET), latent=(2, 4, 8, 8), batch=1,
      columns={"concat_latent_image": latent(1, 4, 8, 8)},
      encoders="CLIP-H image embeds [1,1,1024], fps, motion bucket, augmentation; the start image's latent",
      notes="a clip's frames are its batch: one clip per step; " + CONV3D_BF16,
      training_dtype="fp32"),
    R("SV3D_u", I2V, Text("CLIP-H vision", 1, 1024, extra={"augmentation_level": 0.0}),
      unet_levels([1, 1, 1, 1, 1, 1, 0, 0], 2, **SVD_UNET), latent=(2, 4, 8, 8), batch=1,
      columns={"concat_latent_image": latent(1, 4, 8, 8)}, encoders="as SVD",
      notes="one orbit per step; " + CONV3D_BF16, training_dtype="fp32"),
    R("SV3D_p", I2V, Text("CLIP-H vision", 1, 1024, extra={"augmentation_level": 0.0, "elevation": [10.0, 10.0],
                                                           "azimuth": [0.0, 180.0]}),
      unet_levels([1, 1, 1, 1, 1, 1, 0, 0], 2, **SVD_UNET), latent=(2, 4, 8, 8), batch=1,
      columns={"concat_latent_image": latent(1, 4, 8, 8)}, encoders="as SVD, with elevation and azimuth per frame",
      notes="one orbit per step; " + CONV3D_BF16, training_dtype="fp32"),
    R("Stable_Cascade_C", IMAGE, Text("CLIP-G", 77, 1280, extra={"pooled_output": randn(1, 1, 1280)}),
      dict(c_cond=1536, c_hidden=[1536, 1536], nhead=[24, 24], blocks=[[4, 12], [12, 4]]), latent=(1, 16, 4, 4),
      encoders="CLIP-G [1,77,1280], pooled [1,1,1280]"),
    R("Stable_Cascade_B", IMAGE, Text("CLIP-G", 77, 1280, extra={"pooled_output": randn(1, 1, 1280),
                                                                 "stable_cascade_prior": randn(1, 16, 4, 4)}),
      dict(c_hidden=[320, 576, 1152, 1152], nhead=[-1, 9, 18, 18], blocks=[[2, 4, 14, 4], [4, 14, 4, 2]],
           block_repeat=[[1, 1, 1, 1], [2, 2, 2, 2]]), latent=(1, 4, 16, 16),
      encoders="CLIP-G pooled [1,1,1280], the stage C prior [1,16,h,w]"),
    # ---- image DiTs
    R("SD3", IMAGE, Text("CLIP-L + CLIP-G + T5-XXL", 154, 4096, pooled=2048),
      dict(in_channels=16, out_channels=16, patch_size=2, depth=2, input_size=None, adm_in_channels=2048,
           num_patches=64 * 64, pos_embed_max_size=64, qk_norm="rms", x_block_self_attn_layers=[0],
           context_embedder_config={"target": "torch.nn.Linear",
                                    "params": {"in_features": 4096, "out_features": 128}}),
      notes="SD3.5 layout: RMS q/k norm, an extra self-attention in block 0", ci=True, model_keys=("c_crossattn", "y")),
    # a double layer that is the model's last has a short modulation its forward cannot run: one single layer
    R("AuraFlow", IMAGE, Text("Pile-T5-XL", 256, 2048), dict(n_layers=2, n_double_layers=1, max_seq=256)),
    R("PixArtAlpha", IMAGE, Text("T5-XXL", 12, 4096, extra={"width": 1024, "height": 1024}),
      dict(depth=1, micro_condition=True, input_size=64, model_max_length=120, pe_interpolation=1),
      latent=(1, 4, 48, 48), notes="its position embedding divides by the latent size / 64, rounded: 48 at least"),
    R("PixArtSigma", IMAGE, Text("T5-XXL", 12, 4096), dict(depth=1, micro_condition=False, input_size=64,
                                                          model_max_length=300, pe_interpolation=1),
      latent=(1, 4, 48, 48), notes="as PixArt Alpha"),
    R("HunyuanDiT", IMAGE, Text("BERT + mT5-XL", 77, 1024, mask=True, real=9,
                                extra={"conditioning_mt5xl": randn(1, 256, 2048),
                                       "attention_mask_mt5xl": torch.ones(1, 256, dtype=torch.long)}),
      dict(depth=1, hidden_size=256), encoders="BERT [1,77,1024] + mask, mT5-XL [1,256,2048] + mask"),
    R("HunyuanDiT1", IMAGE, Text("BERT + mT5-XL", 77, 1024, mask=True, real=9,
                                 extra={"conditioning_mt5xl": randn(1, 256, 2048),
                                        "attention_mask_mt5xl": torch.ones(1, 256, dtype=torch.long)}),
      dict(depth=1, hidden_size=1408, size_cond=True, use_style_cond=True), encoders="as HunyuanDiT"),
    R("Flux", IMAGE, T5_FLUX, dict(FLUX), name="Flux dev", encoders="T5-XXL [1,256,4096], CLIP-L pooled [1,768]",
      ci=True, model_keys=("c_crossattn", "y", "guidance")),
    R("Flux", EDIT, Text("T5-XXL", 256, 4096, pooled=768, extra={"guidance": 2.5}), dict(FLUX), name="Flux Kontext",
      columns={"ref": latent(1, 16, 4, 6)}, encoders="as Flux dev, guidance 2.5; the reference image's latent",
      ci=True, model_keys=("c_crossattn", "y", "guidance", "ref_latents")),
    R("FluxSchnell", IMAGE, T5_FLUX, dict(FLUX), encoders="as Flux dev", model_keys=("c_crossattn", "y")),
    R("FluxInpaint", IMAGE, T5_FLUX, dict(FLUX),
      columns={"concat_latent_image": latent(1, 16, 4, 4), "concat_mask": Column("mask", (1, 1, 32, 32), kept=0)},
      encoders="as Flux dev; the masked image's latent and the mask (InpaintModelConditioning)"),
    R("LongCatImage", IMAGE, QWEN25VL, dict(FLUX, vec_in_dim=None, context_in_dim=3584, txt_ids_dims=[1, 2])),
    R("Flux2", IMAGE, Text("Mistral Small 3 (3 layers)", 12, 15360),
      dict(FLUX, in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360,
           axes_dim=[32, 32, 32, 32], mlp_ratio=3.0, theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True,
           global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
           ref_index_scale=10.0, txt_ids_dims=[3]), name="Flux 2"),
    R("Flux2", EDIT, Text("Mistral Small 3 (3 layers)", 12, 15360),
      dict(FLUX, in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360,
           axes_dim=[32, 32, 32, 32], mlp_ratio=3.0, theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True,
           global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
           ref_index_scale=10.0, txt_ids_dims=[3]), name="Flux 2 edit", columns={"ref": latent(1, 128, 4, 4)},
      model_keys=("c_crossattn", "ref_latents")),
    R("Chroma", IMAGE, Text("T5-XXL", 9, 4096), dict(CHROMA), batch=1,
      notes="the approximator (5 layers of 5120) runs on 344 rows per sample: one sample per step"),
    R("ChromaRadiance", IMAGE, Text("T5-XXL", 9, 4096),
      dict(CHROMA, in_channels=3, out_channels=3, patch_size=16, nerf_hidden_size=64, nerf_mlp_ratio=4, nerf_depth=4,
           nerf_max_freqs=8, nerf_tile_size=512, nerf_final_head_type="conv", nerf_embedder_dtype=torch.float32,
           use_x0=False, use_sequential_txt_ids=False), latent=(1, 3, 32, 32), batch=1),
    R("HunyuanImage21", IMAGE, Text("Qwen2.5-VL 7B + ByT5", 10, 3584,
                                    extra={"conditioning_byt5small": randn(1, 6, 1472)}),
      dict(HUNYUAN, vec_in_dim=None, patch_size=[1, 1], axes_dim=[64, 64], in_channels=64, out_channels=64,
           context_in_dim=3584, byt5=True, guidance_embed=False), latent=(1, 64, 4, 4),
      encoders="Qwen2.5-VL [1,T,3584], ByT5 glyphs [1,T,1472]"),
    R("HunyuanImage21Refiner", IMAGE, skip="its latent format pairs frames (doubling the channels) on every latent "
      "but an empty one, and HunyuanRefinerLatent samples from an empty 32-channel latent: a trained latent and a "
      "sampled one cannot reach the model in the same layout"),
    R("Lumina2", IMAGE, Text("Gemma-2 2B", 12, 2304, mask=True),
      dict(patch_size=2, in_channels=16, dim=2304, cap_feat_dim=2304, n_layers=1, qk_norm=True, n_heads=24,
           n_kv_heads=8, axes_dims=[32, 32, 32], axes_lens=[300, 512, 512], rope_theta=10000.0,
           ffn_dim_multiplier=4.0), batch=2, model_keys=("c_crossattn", "num_tokens")),
    R("ZImage", IMAGE, Text("Qwen3 4B", 12, 2560, mask=True), dict(LUMINA_ZIMAGE)),
    R("ZImagePixelSpace", IMAGE, Text("Qwen3 4B", 12, 2560, mask=True),
      dict(LUMINA_ZIMAGE, patch_size=16, in_channels=3, decoder_hidden_size=64, decoder_num_res_blocks=1,
           decoder_max_freqs=8, decoder_in_channels=768), latent=(1, 3, 32, 32), batch=1),
    R("CosmosT2IPredict2", IMAGE, Text("T5-XXL (Cosmos)", 512, 1024), dict(PREDICT2), latent=(1, 16, 1, 4, 4),
      notes="ComfyUI's code calls comfy_kitchen's fused RoPE, which has no backward, even in training"),
    R("Anima", IMAGE, Text("Qwen3 0.6B + T5 ids", 10, 1024, extra={"t5xxl_ids": ids(12, high=32128),
                                                                    "t5xxl_weights": lambda g, i: torch.ones(12)}),
      dict(PREDICT2, in_channels=16), latent=(1, 16, 1, 4, 4),
      encoders="Qwen3 0.6B [1,T,1024], T5 token ids and weights [T']"),
    R("QwenImage", IMAGE, QWEN25VL, dict(num_layers=1), latent=(1, 16, 1, 4, 4), name="Qwen-Image"),
    R("QwenImage", EDIT, QWEN25VL, dict(num_layers=1), latent=(1, 16, 1, 4, 4), name="Qwen-Image-Edit",
      columns={"ref": latent(1, 16, 1, 4, 4)}, model_keys=("c_crossattn", "ref_latents")),
    R("MageFlow", IMAGE, Text("Qwen3 4B", 10, 2560), dict(num_layers=1)),
    R("JoyImage", IMAGE, Text("Qwen3-VL 8B", 10, 4096), dict(num_layers=1, hidden_size=128, num_attention_heads=1),
      ci=True, notes="ComfyUI's code calls comfy_kitchen's fused RoPE, which has no backward, even in training"),
    R("Ideogram4", IMAGE, Text("Qwen3-VL 8B (13 layers)", 10, 53248), dict(num_layers=1)),
    R("Krea2", IMAGE, Text("Qwen3-VL 4B (12 layers)", 10, 30720), dict(layers=1, features=256, heads=2, kvheads=1),
      latent=(1, 16, 1, 4, 4), notes="an image model on Wan 2.1's VAE: one latent frame per image"),
    R("Lens", IMAGE, Text("GPT-OSS 20B (4 layers)", 10, 11520, mask=True), dict(num_layers=1, num_attention_heads=1)),
    R("Boogu", IMAGE, Text("Qwen3 8B", 10, 4096, mask=True),
      dict(hidden_size=3360, num_layers=1, num_double_stream_layers=1, num_refiner_layers=1),
      notes="detection keeps 28 heads of 120 (the RoPE axes): 3360 wide"),
    R("Kandinsky5Image", IMAGE, Text("Qwen2.5-VL 7B + CLIP-L", 10, 3584, pooled=768),
      dict(num_text_blocks=1, num_visual_blocks=1)),
    # ---- video DiTs
    R("WAN21_T2V", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4), name="Wan 2.1 / 2.2 A14B T2V", ci=True,
      checkpointing=False),
    R("WAN22_T2V", VIDEO, UMT5, dict(WAN, out_dim=48, in_dim=48), latent=(1, 48, 2, 4, 4), name="Wan 2.2 TI2V 5B"),
    R("WAN21_CausalAR_T2V", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4), metadata=_metadata(causal_ar=True)),
    R("WAN21_FlowRVS", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4), metadata=_metadata(model_type="flow_rvs")),
    R("LTXV", VIDEO, Text("T5-XXL", 128, 4096, mask=True, real=9, extra={"frame_rate": 25.0}),
      dict(num_layers=1, attention_head_dim=4, cross_attention_dim=128), latent=(1, 128, 2, 2, 2), ci=True,
      checkpointing=False, model_keys=("c_crossattn", "attention_mask", "frame_rate")),
    R("HunyuanVideo", VIDEO, Text("Llama 3 8B", 11, 4096, pooled=768), dict(HUNYUAN), latent=(1, 16, 2, 4, 4),
      encoders="Llama [1,T,4096], CLIP-L pooled [1,768]", ci=True, checkpointing=False,
      model_keys=("c_crossattn", "y", "guidance")),
    R("HunyuanVideo15", VIDEO, Text("Qwen2.5-VL 7B + ByT5", 10, 3584,
                                    extra={"conditioning_byt5small": randn(1, 6, 1472)}),
      dict(HUNYUAN15, in_channels=65), latent=(1, 32, 2, 4, 4),
      encoders="Qwen2.5-VL [1,T,3584], ByT5 [1,T,1472]"),
    R("CosmosT2V", VIDEO, Text("T5-XXL (Cosmos)", 512, 1024), dict(COSMOS1)),
    R("Kandinsky5", VIDEO, Text("Qwen2.5-VL 7B + CLIP-L", 10, 3584, pooled=768),
      dict(num_text_blocks=1, num_visual_blocks=1), latent=(1, 16, 2, 4, 4)),
    R("CogVideoX_T2V", VIDEO, Text("T5-XXL", 226, 4096),
      dict(num_layers=1, num_attention_heads=2, time_embed_dim=128, use_rotary_positional_embeddings=True,
           use_learned_positional_embeddings=False), latent=(1, 16, 2, 4, 4)),
    R("GenmoMochi", VIDEO, Text("T5-XXL", 256, 4096, mask=True, real=9),
      dict(depth=48, patch_size=2, num_heads=24, hidden_size_x=3072, hidden_size_y=1536, mlp_ratio_x=4.0,
           mlp_ratio_y=4.0, learn_sigma=False, in_channels=12, qk_norm=True, qkv_bias=False, out_bias=True,
           attn_drop=0.0, patch_embed_bias=True, posenc_preserve_area=True, timestep_mlp_bias=True,
           attend_to_padding=False, timestep_scale=1000.0, use_t5=True, t5_feat_dim=4096, t5_token_length=256,
           rope_theta=10000.0)),
    # ---- image-to-video and first/last frame
    R("WAN21_I2V", I2V, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4), name="Wan 2.1 / 2.2 A14B I2V",
      columns={"concat_latent_image": latent(1, 16, 2, 4, 4), "concat_mask": first_frame_mask(2, 4, 4),
               "clip_vision_output": clip_vision(penultimate_hidden_states=(1, 257, 1280))},
      encoders="UMT5 [1,512,4096]; WanImageToVideo: the start image + gray frames' latent, the mask (start frame "
               "0), CLIP-H vision penultimate states [1,257,1280]", ci=True,
      refuses_other_columns=True, model_keys=("c_crossattn", "c_concat", "clip_fea")),
    R("WAN21_I2V", I2V, UMT5, dict(WAN, flf_pos_embed_token_number=514), latent=(1, 16, 3, 4, 4),
      name="Wan 2.1 first/last frame",
      columns={"concat_latent_image": latent(1, 16, 3, 4, 4), "concat_mask": first_last_mask(3, 4, 4),
               "clip_vision_output": clip_vision(penultimate_hidden_states=(1, 514, 1280))},
      encoders="UMT5 [1,512,4096]; WanFirstLastFrameToVideo: the start and end images with gray frames between, "
               "the mask (start and end given), both images' CLIP-H states [1,514,1280]",
      model_keys=("c_crossattn", "c_concat", "clip_fea")),
    R("WAN21_FunControl2V", I2V, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4),
      columns={"concat_latent_image": latent(1, 32, 2, 4, 4)},
      encoders="UMT5; WanFunControlToVideo: the control video's and the start image's latents [1,32,F,h,w]"),
    R("HunyuanVideoI2V", I2V, Text("Llama 3 8B (LLaVA)", 11, 4096, pooled=768), dict(HUNYUAN, in_channels=33),
      latent=(1, 16, 2, 4, 4),
      columns={"concat_latent_image": latent(1, 16, 1, 4, 4), "concat_mask": first_frame_mask(2, 4, 4)},
      encoders="Llama [1,T,4096], CLIP-L pooled; HunyuanImageToVideo (v1 concat): start latent and mask",
      model_keys=("c_crossattn", "c_concat", "guidance")),
    R("HunyuanVideoSkyreelsI2V", I2V, Text("Llama 3 8B", 11, 4096, pooled=768), dict(HUNYUAN, in_channels=32),
      latent=(1, 16, 2, 4, 4), columns={"concat_latent_image": latent(1, 16, 1, 4, 4)}),
    R("HunyuanVideo15", I2V, Text("Qwen2.5-VL 7B + ByT5", 10, 3584,
                                  extra={"conditioning_byt5small": randn(1, 6, 1472)}),
      dict(HUNYUAN15, in_channels=65), latent=(1, 32, 2, 4, 4), name="HunyuanVideo 1.5 I2V",
      columns={"concat_latent_image": latent(1, 32, 2, 4, 4), "concat_mask": first_frame_mask(2, 4, 4),
               "clip_vision_output": clip_vision(last_hidden_state=(1, 729, 1152))},
      encoders="as HunyuanVideo 1.5; HunyuanVideo15ImageToVideo: start latent, mask, SigLIP states [1,729,1152]",
      model_keys=("c_crossattn", "c_concat", "clip_fea")),
    R("LTXV", I2V, Text("T5-XXL", 128, 4096, mask=True, real=9, extra={"frame_rate": 25.0}),
      dict(num_layers=1, attention_head_dim=4, cross_attention_dim=128), latent=(1, 128, 2, 2, 2),
      name="LTXV image-to-video", columns={"noise_mask": first_frame_mask(2, 1, 1)},
      encoders="as LTXV; LTXVImgToVideo: the start frame in the latent, noise mask 0 on it", ci=True,
      model_keys=("c_crossattn", "frame_rate", "denoise_mask")),
    R("WAN22_T2V", I2V, UMT5, dict(WAN, out_dim=48, in_dim=48), latent=(1, 48, 2, 4, 4),
      name="Wan 2.2 TI2V 5B image-to-video", columns={"noise_mask": first_frame_mask(2, 4, 4)},
      encoders="UMT5; Wan22ImageToVideoLatent: the start frame in the latent, noise mask 0 on it",
      model_keys=("c_crossattn", "denoise_mask")),
    R("CosmosI2VPredict2", I2V, Text("T5-XXL (Cosmos)", 512, 1024), dict(PREDICT2), latent=(1, 16, 2, 4, 4),
      columns={"noise_mask": first_frame_mask(2, 4, 4)}),
    R("CogVideoX_I2V", I2V, Text("T5-XXL", 226, 4096),
      dict(num_layers=1, num_attention_heads=2, time_embed_dim=128, in_channels=32,
           use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False), latent=(1, 16, 2, 4, 4),
      columns={"concat_latent_image": latent(1, 16, 2, 4, 4)}),
    R("CogVideoX_Inpaint", I2V, Text("T5-XXL", 226, 4096),
      dict(num_layers=1, num_attention_heads=2, time_embed_dim=128, in_channels=48,
           use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False), latent=(1, 16, 2, 4, 4),
      columns={"concat_latent_image": latent(1, 16, 2, 4, 4)}),
    R("CosmosI2V", I2V, Text("T5-XXL (Cosmos)", 512, 1024), dict(COSMOS1)),
    # ---- Wan variants driven by more than text
    R("WAN21_Vace", VIDEO, UMT5, dict(WAN, vace_layers=1, vace_in_dim=96), latent=(1, 16, 2, 4, 4)),
    R("WAN21_Camera", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4)),
    R("WAN22_Camera", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4)),
    R("WAN22_S2V", VIDEO, UMT5, dict(WAN, audio_inject_layers=[0]), latent=(1, 16, 2, 4, 4)),
    R("WAN21_HuMo", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4)),
    R("WAN22_Animate", VIDEO, UMT5, dict(WAN, num_layers=5), latent=(1, 16, 2, 4, 4)),
    R("WAN_Animate2", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4), metadata=_metadata(model_type="animate2")),
    R("WAN21_SCAIL", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4)),
    R("WAN21_SCAIL2", VIDEO, UMT5, dict(WAN), latent=(1, 16, 2, 4, 4)),
    R("WAN22_WanDancer", VIDEO, UMT5, dict(WAN, audio_inject_layers=[0]), latent=(1, 16, 2, 4, 4)),
    R("HunyuanVideo15_SR_Distilled", VIDEO, Text("Qwen2.5-VL 7B + ByT5", 10, 3584,
                                                 extra={"conditioning_byt5small": randn(1, 6, 1472)}),
      dict(HUNYUAN15, in_channels=98), latent=(1, 32, 2, 4, 4),
      columns={"concat_latent_image": latent(1, 66, 2, 4, 4)},
      encoders="as HunyuanVideo 1.5; the low-resolution video's latent with its masks [1,66,F,h,w]"),
    # ---- audio and audio-video
    R("StableAudio", AUDIO, Text("T5-base", 128, 768, mask=True, real=9,
                                 extra={"seconds_start": 0.0, "seconds_total": 1.0}),
      dict(depth=1, embed_dim=768, io_channels=64, cond_token_dim=768, global_cond_dim=1536,
           project_cond_tokens=False, timestep_features_type="learned"), latent=(1, 64, 16),
      notes="detection keeps 24 heads, and the rotary embedding needs 32 per head: 768 wide",
      extra_weights=_number_conditioners("seconds_start", "seconds_total"), ci=True,
      model_keys=("c_crossattn", "global_embed")),
    R("StableAudio3", AUDIO, Text("T5Gemma", 16, 768, extra={"seconds_total": 1.0}),
      dict(depth=1, embed_dim=768, num_heads=12, io_channels=256, global_cond_type="adaLN", global_cond_dim=768,
           global_cond_shared_embed=True, local_add_cond_dim=257, norm_type="rms_norm",
           attn_kwargs={"qk_norm": "rms", "differential": False}, timestep_features_type="learned"),
      latent=(1, 256, 16),
      extra_weights=_number_conditioners("seconds_total")),
    R("ACEStep15", AUDIO, Text("Qwen3 0.6B", 10, 1024, extra={"conditioning_lyrics": randn(1, 12, 1024)}),
      dict(num_dit_layers=1, hidden_size=2048, num_heads=16, intermediate_size=256, encoder_hidden_size=2048,
           encoder_num_heads=16, encoder_intermediate_size=256, num_lyric_layers=1, num_timbre_layers=1,
           num_tokenizer_layers=1), notes="detection keeps the 2048-wide quantizer and 8 key/value heads of 128",
      latent=(1, 64, 16), encoders="Qwen3 0.6B caption [1,T,1024], lyrics [1,L,1024]"),
    R("ACEStep", AUDIO, Text("UMT5-base", 16, 768, extra={"conditioning_lyrics": ids(1, 12, high=6693)}),
      dict(num_layers=1), latent=(1, 8, 16, 16)),
    R("LTXAV", AV, Text("Gemma 3 12B", 12, 3840, extra={"unprocessed_ltxav_embeds": True, "frame_rate": 25.0}),
      dict(num_layers=1, attention_head_dim=4, cross_attention_dim=128, **LTX2_METADATA), latent=(1, 128, 2, 2, 2),
      name="LTX-2", metadata=_metadata(**LTX2_METADATA),
      notes="the text connectors stay 3840 wide (Gemma's width): one layer each, set by the checkpoint's config",
      columns={"audio": latent(1, 8, 4, 16)},
      encoders="Gemma 3 12B [1,T,3840] (projected); the sound track's latent [1,8,T,16] (LTXVConcatAVLatent)",
      model_keys=("c_crossattn", "latent_shapes")),
    R("MiniMaxH3", AV, Text("Qwen3-VL 32B", 10, 5120),
      dict(hidden_size=128, num_layers=1, token_refiner_num_layers=1, num_attention_heads=1, attention_head_dim=128,
           ffn_hidden_size=256, time_embed_hidden_size=128, time_embed_dim=64), latent=(1, 24, 2, 4, 4),
      columns={"audio": latent(1, 32, 2, 8)}, encoders="Qwen3-VL 32B [1,T,5120]; the sound track's latent",
      batch=1, notes="ComfyUI's MiniMax H3 runs one sample per call", ci=True,
      model_keys=("c_crossattn", "latent_shapes")),
    R("MiniMaxMusic3", AUDIO),
    # ---- 3D
    R("Hunyuan3Dv2", THREE_D, Text("DINOv2 image features", 16, 1536),
      dict(depth=1, depth_single_blocks=1, hidden_size=64, num_heads=16), latent=(1, 64, 16), ci=True),
    R("Hunyuan3Dv2mini", THREE_D, Text("DINOv2 image features", 16, 1536),
      dict(depth_single_blocks=1, hidden_size=64, num_heads=16), latent=(1, 64, 16)),
    R("Hunyuan3Dv2_1", THREE_D, Text("DINOv2 image features", 16, 1024),
      dict(depth=1, hidden_size=64, num_heads=16, num_moe_layers=1), latent=(1, 64, 16)),
    R("TripoSplat", THREE_D, Text("DINOv3 image features", 16, 1280), dict(num_blocks=1, model_channels=64),
      skip="3D gaussian splats: its latent is a shape-code sequence with a camera token (a nested latent) that "
           "the cache has no encoder for"),
    R("Trellis2", THREE_D, skip="3D structured latents (sparse voxel coordinates) that the cache has no encoder "
                                "for", shrink=dict(resolution=64, num_blocks=1)),
    # ---- sizes detection fixes
    R("HiDream", IMAGE, shrink=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                                    attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096],
                                    text_emb_dim=2048, num_routed_experts=4, num_activated_experts=2,
                                    axes_dims_rope=[64, 32, 32], max_resolution=[128, 128],
                                    llama_layers=list(range(32)) + [31] * 16)),
    R("HiDreamO1", IMAGE),
    R("Omnigen2", EDIT, shrink=dict(num_layers=1)),
    R("ErnieImage", IMAGE, shrink=dict(num_layers=1)),
    R("SeedVR2", OTHER, shrink=dict(vid_dim=2560, heads=20, num_layers=32, norm_eps=1e-5, mlp_type="swiglu",
                                    vid_out_norm=True)),
    R("PiD", OTHER),
    R("PixelDiTT2I", IMAGE),
    # ---- not diffusion models
    R("RT_DETR_v4", NOT_DIFFUSION, skip="an object detector (RT-DETR), not a diffusion model"),
    R("SAM3", NOT_DIFFUSION, skip="a segmenter (Segment Anything 3), not a diffusion model"),
    R("SAM31", NOT_DIFFUSION, skip="a segmenter (Segment Anything 3.1), not a diffusion model"),
    R("DepthAnything3", NOT_DIFFUSION, skip="a depth estimator (Depth Anything 3), not a diffusion model"),
]

BY_KEY = {r.key: r for r in RECIPES}
CI_FAMILIES = [r.key for r in RECIPES if r.ci]
_PRECISION_PICKS = {"edit / reference": "Flux Kontext", "image-to-video": "LTXV image-to-video"}
"""Kinds whose first CI family is slow on a CPU (an SD1.x-sized pix2pix UNet, 26 s for the twelve runs; Wan's
image-to-video, 26 s): a CI family of the same kind that takes a second or two stands for them."""
PRECISION_FAMILIES = [_PRECISION_PICKS.get(r.kind, r.key) for r in RECIPES
                      if r.ci and r is next(c for c in RECIPES if c.ci and c.kind == r.kind)]
"""One CI family of each kind (the first, or the pick above), which the default run also trains in every training
precision and LoRA dtype through the current and the first release's Train LoRA
(``family_sweep.precision_combinations``)."""
CI_MAX_PARAMS = 150_000_000
"""A CI family whose model detection makes larger on some version (Flux on v0.3.64: 3072 wide) is run there only
with STREAMING_CACHE_SWEEP=all."""
