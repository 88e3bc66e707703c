"""One small spec per major model family: the state-dict shapes of a tiny random-weight diffusion model that
ComfyUI's own detection recognises as that family, and one dataset sample as ComfyUI's encoders for that
family produce it (latent shape, conditioning keys and shapes, an edit pair's reference latent).

Only shapes live here; ComfyUI's loader (UNETLoader / ``comfy.sd.load_diffusion_model``) detects the family
from them and builds its own classes. Detection pins most widths, so "tiny" means as small as each family's
detection allows: what it reads from the weights (block counts, mostly) is cut to one block, what it
hard-codes stays. Conditioning keeps the real text-encoder widths (T5-XXL 4096, Qwen2.5-VL 3584, Gemma-2
2304, CLIP-G 2048 / pooled 1280) and, where the encoder pads to a fixed length, the real token count (CLIP 77,
Flux's T5 256, Wan's UMT5 512, LTXV's T5 128); encoders without padding get a short prompt's length.

Used inside the ComfyUI child process (``comfy_scenario.py families``); needs torch only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

Shapes = dict[str, tuple[int, ...]]


class _Weights:
    """Collects ``{key: shape}`` in the layouts of the real checkpoints."""

    def __init__(self) -> None:
        self.shapes: Shapes = {}

    def lin(self, name: str, out: int, inp: int, bias: bool = True) -> None:
        self.shapes[f"{name}.weight"] = (out, inp)
        if bias:
            self.shapes[f"{name}.bias"] = (out,)

    def conv(self, name: str, out: int, inp: int, kernel: tuple[int, ...]) -> None:
        self.shapes[f"{name}.weight"] = (out, inp, *kernel)
        self.shapes[f"{name}.bias"] = (out,)

    def norm(self, name: str, dim: int, bias: bool = True, param: str = "weight") -> None:
        self.shapes[f"{name}.{param}"] = (dim,)
        if bias:
            self.shapes[f"{name}.bias"] = (dim,)

    def raw(self, name: str, *shape: int) -> None:
        self.shapes[name] = shape


def random_weights(shapes: Shapes, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Norm scales (1-D ``.weight`` / ``.scale``) one, biases zero, everything else N(0, 0.02): a model whose
    activations stay finite through every block."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in shapes.items():
        if len(shape) == 1:
            value = torch.ones(shape) if key.endswith((".weight", ".scale")) else torch.zeros(shape)
        else:
            value = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=g)
        out[key] = value.to(dtype)
    return out


def parameter_count(shapes: Shapes) -> int:
    return sum(math.prod(s) for s in shapes.values())


# ---------------------------------------------------------------------------------------------- architectures

def sdxl_unet(output_depth: int = 0) -> Shapes:
    """KOALA-700M layout, the smallest SDXL UNet detection accepts (``supported_models.KOALA_700M``, a
    ``model_base.SDXL``): model channels 320, context 2048 and ADM 2816 (pooled 1280 + six size embeddings)
    are matched exactly, as is transformer depth (0, 2, 5); channel multipliers, output depths and the
    middle block are read, so every level stays 320 wide and the middle block is left out. ``output_depth``:
    the output blocks of the two deeper levels get a transformer of that depth before their upsampler, as in
    SDXL (whose LoRA key conventions assume it)."""
    w, mc, ctx, ted = _Weights(), 320, 2048, 1280

    def res(p: str, ci: int, co: int) -> None:
        w.norm(f"{p}.in_layers.0", ci)
        w.conv(f"{p}.in_layers.2", co, ci, (3, 3))
        w.lin(f"{p}.emb_layers.1", co, ted)
        w.norm(f"{p}.out_layers.0", co)
        w.conv(f"{p}.out_layers.3", co, co, (3, 3))
        if ci != co:
            w.conv(f"{p}.skip_connection", co, ci, (1, 1))

    def transformer(p: str, c: int, depth: int) -> None:
        w.norm(f"{p}.norm", c)
        w.lin(f"{p}.proj_in", c, c)
        for j in range(depth):
            b = f"{p}.transformer_blocks.{j}"
            for attn, kv in (("attn1", c), ("attn2", ctx)):
                w.lin(f"{b}.{attn}.to_q", c, c, bias=False)
                w.lin(f"{b}.{attn}.to_k", c, kv, bias=False)
                w.lin(f"{b}.{attn}.to_v", c, kv, bias=False)
                w.lin(f"{b}.{attn}.to_out.0", c, c)
            w.lin(f"{b}.ff.net.0.proj", c * 8, c)
            w.lin(f"{b}.ff.net.2", c, c * 4)
            for n in ("norm1", "norm2", "norm3"):
                w.norm(f"{b}.{n}", c)
        w.lin(f"{p}.proj_out", c, c)

    w.lin("time_embed.0", ted, mc)
    w.lin("time_embed.2", ted, ted)
    w.lin("label_emb.0.0", ted, 2816)
    w.lin("label_emb.0.2", ted, ted)
    w.conv("input_blocks.0.0", mc, 4, (3, 3))
    depths, index = [0, 2, 5], 1  # one res block per level, a downsampler between levels
    for level in range(3):
        res(f"input_blocks.{index}.0", mc, mc)
        if depths[level]:
            transformer(f"input_blocks.{index}.1", mc, depths[level])
        index += 1
        if level < 2:
            w.conv(f"input_blocks.{index}.0.op", mc, mc, (3, 3))
            index += 1
    for index in range(6):  # two per level, each taking a skip connection
        res(f"output_blocks.{index}.0", 2 * mc, mc)
        attention = output_depth > 0 and index < 4
        if attention:
            transformer(f"output_blocks.{index}.1", mc, output_depth)
        if index in (1, 3):
            w.conv(f"output_blocks.{index}.{2 if attention else 1}.conv", mc, mc, (3, 3))
    w.norm("out.0", mc)
    w.conv("out.2", 4, mc, (3, 3))
    return w.shapes


def flux(hidden: int, guidance: bool, single_blocks: int, chroma: bool = False) -> Shapes:
    """Flux.1 (BFL layout, RMSNorm ``.scale``): head dim 128, 16 latent channels patchified 2x2, T5-XXL
    context 4096, CLIP-L pooled 768. ``guidance_in`` makes it dev (``supported_models.Flux``), without it
    schnell. Chroma is Flux without per-block modulation and with the ``distilled_guidance_layer``
    approximator, all of whose sizes detection hard-codes (5 layers of 5120, output 3072)."""
    w, mlp = _Weights(), 4 * hidden
    w.lin("img_in", hidden, 64)
    w.lin("txt_in", hidden, 4096)
    if chroma:
        p = "distilled_guidance_layer"
        w.lin(f"{p}.in_proj", 5120, 64)
        for i in range(5):
            w.lin(f"{p}.layers.{i}.in_layer", 5120, 5120)
            w.lin(f"{p}.layers.{i}.out_layer", 5120, 5120)
            w.norm(f"{p}.norms.{i}", 5120, bias=False, param="scale")
        w.lin(f"{p}.out_proj", hidden, 5120)
    else:
        for emb, inp in (("time_in", 256), ("vector_in", 768)) + ((("guidance_in", 256),) if guidance else ()):
            w.lin(f"{emb}.in_layer", hidden, inp)
            w.lin(f"{emb}.out_layer", hidden, hidden)
    for stream in ("img", "txt"):
        p = f"double_blocks.0.{stream}_"
        if not chroma:
            w.lin(f"{p}mod.lin", 6 * hidden, hidden)
        w.lin(f"{p}attn.qkv", 3 * hidden, hidden)
        w.norm(f"{p}attn.norm.query_norm", 128, bias=False, param="scale")
        w.norm(f"{p}attn.norm.key_norm", 128, bias=False, param="scale")
        w.lin(f"{p}attn.proj", hidden, hidden)
        w.lin(f"{p}mlp.0", mlp, hidden)
        w.lin(f"{p}mlp.2", hidden, mlp)
    for i in range(single_blocks):
        p = f"single_blocks.{i}."
        w.lin(f"{p}linear1", 3 * hidden + mlp, hidden)
        w.lin(f"{p}linear2", hidden, hidden + mlp)
        w.norm(f"{p}norm.query_norm", 128, bias=False, param="scale")
        w.norm(f"{p}norm.key_norm", 128, bias=False, param="scale")
        if not chroma:
            w.lin(f"{p}modulation.lin", 3 * hidden, hidden)
    if not chroma:
        w.lin("final_layer.adaLN_modulation.1", 2 * hidden, hidden)
    w.lin("final_layer.linear", 64, hidden)
    return w.shapes


def qwen_image() -> Shapes:
    """Qwen-Image (and -Edit: same weights): detected by ``txt_norm``; only the block count is read, the
    width (24 heads x 128 = 3072) and the Qwen2.5-VL context (3584) are constructor defaults."""
    w, d = _Weights(), 3072
    w.lin("time_text_embed.timestep_embedder.linear_1", d, 256)
    w.lin("time_text_embed.timestep_embedder.linear_2", d, d)
    w.norm("txt_norm", 3584, bias=False)
    w.lin("img_in", d, 64)
    w.lin("txt_in", d, 3584)
    p = "transformer_blocks.0."
    for stream in ("img", "txt"):
        w.lin(f"{p}{stream}_mod.1", 6 * d, d)
        w.lin(f"{p}{stream}_mlp.net.0.proj", 4 * d, d)
        w.lin(f"{p}{stream}_mlp.net.2", d, 4 * d)
    for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        w.norm(f"{p}attn.{n}", 128, bias=False)
    for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
        w.lin(f"{p}attn.{n}", d, d)
    w.lin("norm_out.linear", 2 * d, d)
    w.lin("proj_out", 64, d)
    return w.shapes


def wan(channels: int) -> Shapes:
    """Wan 2.1 / 2.2 (``head.modulation``): dim 128 = one head of 128 (heads = dim // 128 is hard-coded), UMT5
    context 4096. Output channels pick the version: 16 is Wan 2.1 T2V (and each Wan 2.2 A14B expert), 48 is
    Wan 2.2 TI2V-5B with its own 48-channel VAE."""
    w, d, ffn = _Weights(), 128, 256
    w.conv("patch_embedding", d, channels, (1, 2, 2))
    w.lin("text_embedding.0", d, 4096)
    w.lin("text_embedding.2", d, d)
    w.lin("time_embedding.0", d, 256)
    w.lin("time_embedding.2", d, d)
    w.lin("time_projection.1", 6 * d, d)
    w.raw("blocks.0.modulation", 1, 6, d)
    for attn in ("self_attn", "cross_attn"):
        for n in ("q", "k", "v", "o"):
            w.lin(f"blocks.0.{attn}.{n}", d, d)
        w.norm(f"blocks.0.{attn}.norm_q", d, bias=False)
        w.norm(f"blocks.0.{attn}.norm_k", d, bias=False)
    w.norm("blocks.0.norm3", d)
    w.lin("blocks.0.ffn.0", ffn, d)
    w.lin("blocks.0.ffn.2", d, ffn)
    w.raw("head.modulation", 1, 2, d)
    w.lin("head.head", channels * 4, d)
    return w.shapes


def ltxv() -> Shapes:
    """LTX-Video 0.9 (``adaln_single``): 32 heads are hard-coded, the head dim is read (4, so 128 wide),
    128 latent channels, T5-XXL captions 4096."""
    w, d = _Weights(), 128
    w.raw("scale_shift_table", 2, d)
    w.lin("patchify_proj", d, 128)
    w.lin("adaln_single.emb.timestep_embedder.linear_1", d, 256)
    w.lin("adaln_single.emb.timestep_embedder.linear_2", d, d)
    w.lin("adaln_single.linear", 6 * d, d)
    w.lin("caption_projection.linear_1", d, 4096)
    w.lin("caption_projection.linear_2", d, d)
    w.raw("transformer_blocks.0.scale_shift_table", 6, d)
    for attn in ("attn1", "attn2"):
        p = f"transformer_blocks.0.{attn}"
        w.norm(f"{p}.q_norm", d, bias=False)
        w.norm(f"{p}.k_norm", d, bias=False)
        for n in ("to_q", "to_k", "to_v", "to_out.0"):
            w.lin(f"{p}.{n}", d, d)
    w.lin("transformer_blocks.0.ff.net.0.proj", 4 * d, d)
    w.lin("transformer_blocks.0.ff.net.2", d, 4 * d)
    w.lin("proj_out", 128, d)
    return w.shapes


def hunyuan_video() -> Shapes:
    """HunyuanVideo 1.0 T2V in its original key names (ComfyUI renames them on load): hidden 128 = one head of
    128, Llama context 4096, CLIP-L pooled 768 (``vector_in``; without it the file is HunyuanImage 2.1),
    guidance embedding, the two token-refiner blocks the model always has."""
    w, h = _Weights(), 128
    m = 4 * h
    w.conv("img_in.proj", h, 16, (1, 2, 2))
    for emb, inp in (("time_in", 256), ("guidance_in", 256)):
        w.lin(f"{emb}.mlp.0", h, inp)
        w.lin(f"{emb}.mlp.2", h, h)
    w.lin("vector_in.in_layer", h, 768)
    w.lin("vector_in.out_layer", h, h)
    w.lin("txt_in.input_embedder", h, 4096)
    w.lin("txt_in.t_embedder.mlp.0", h, 256)
    w.lin("txt_in.t_embedder.mlp.2", h, h)
    w.lin("txt_in.c_embedder.linear_1", h, 4096)
    w.lin("txt_in.c_embedder.linear_2", h, h)
    for i in range(2):
        p = f"txt_in.individual_token_refiner.blocks.{i}."
        w.norm(f"{p}norm1", h)
        w.lin(f"{p}self_attn_qkv", 3 * h, h)
        w.lin(f"{p}self_attn_proj", h, h)
        w.norm(f"{p}norm2", h)
        w.lin(f"{p}mlp.fc1", m, h)
        w.lin(f"{p}mlp.fc2", h, m)
        w.lin(f"{p}adaLN_modulation.1", 2 * h, h)
    for stream in ("img", "txt"):
        p = f"double_blocks.0.{stream}_"
        w.lin(f"{p}mod.linear", 6 * h, h)
        w.lin(f"{p}attn_qkv", 3 * h, h)
        w.norm(f"{p}attn_q_norm", 128, bias=False)
        w.norm(f"{p}attn_k_norm", 128, bias=False)
        w.lin(f"{p}attn_proj", h, h)
        w.lin(f"{p}mlp.fc1", m, h)
        w.lin(f"{p}mlp.fc2", h, m)
    p = "single_blocks.0."
    w.lin(f"{p}linear1", 3 * h + m, h)
    w.lin(f"{p}linear2", h, h + m)
    w.norm(f"{p}q_norm", 128, bias=False)
    w.norm(f"{p}k_norm", 128, bias=False)
    w.lin(f"{p}modulation.linear", 3 * h, h)
    w.lin("final_layer.linear", 16 * 4, h)
    w.lin("final_layer.adaLN_modulation.1", 2 * h, h)
    return w.shapes


def lumina2() -> Shapes:
    """Lumina Image 2.0 (NextDiT, ``cap_embedder`` + ``noise_refiner``): width 2304 selects its config (v0.3.x
    hard-codes it), 24 heads / 8 KV heads of 96, Gemma-2 context 2304; the two noise and two context
    refiner blocks are always built, so the smallest model is those plus one main layer."""
    w, d, t = _Weights(), 2304, 1024

    def block(p: str, modulation: bool) -> None:
        w.raw(f"{p}attention.qkv.weight", (24 + 2 * 8) * 96, d)
        w.raw(f"{p}attention.out.weight", d, d)
        w.norm(f"{p}attention.q_norm", 96, bias=False)
        w.norm(f"{p}attention.k_norm", 96, bias=False)
        for n, (o, i) in (("w1", (4 * d, d)), ("w2", (d, 4 * d)), ("w3", (4 * d, d))):
            w.lin(f"{p}feed_forward.{n}", o, i, bias=False)
        for n in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"):
            w.norm(f"{p}{n}", d, bias=False)
        if modulation:
            w.lin(f"{p}adaLN_modulation.1", 4 * d, t)

    w.lin("x_embedder", d, 64)
    for i in range(2):
        block(f"noise_refiner.{i}.", True)
        block(f"context_refiner.{i}.", False)
    w.lin("t_embedder.mlp.0", t, 256)
    w.lin("t_embedder.mlp.2", t, t)
    w.norm("cap_embedder.0", 2304, bias=False)
    w.lin("cap_embedder.1", d, 2304)
    block("layers.0.", True)
    w.lin("final_layer.linear", 64, d)
    w.lin("final_layer.adaLN_modulation.1", d, t)
    return w.shapes


# ---------------------------------------------------------------------------------------------- conditioning

def _text(g: torch.Generator, tokens: int, dim: int, real: int | None = None) -> torch.Tensor:
    c = torch.randn(1, tokens, dim, generator=g) * 0.5
    if real is not None:  # UMT5 (Wan) zeroes the padding rows
        c[:, real:] = 0
    return c


def _mask(tokens: int, real: int) -> torch.Tensor:
    m = torch.zeros(1, tokens, dtype=torch.long)
    m[:, :real] = 1
    return m


def sdxl_cond(g: torch.Generator, i: int) -> list:
    """CLIPTextEncodeSDXL: CLIP-L and CLIP-G hidden states side by side, CLIP-G's pooled output and the six
    size values of the sample's source image (so two samples of one batch can differ in them)."""
    w, h = (1024, 1024) if i % 2 == 0 else (832, 1216)
    return [[_text(g, 77, 2048), {"pooled_output": torch.randn(1, 1280, generator=g), "width": w, "height": h,
                                  "crop_w": 0, "crop_h": 0, "target_width": w, "target_height": h}]]


def flux_cond(g: torch.Generator, i: int, guidance: float | None = None) -> list:
    """CLIPTextEncode with Flux's clip: T5-XXL padded to 256 tokens, CLIP-L pooled; FluxGuidance adds
    ``guidance``."""
    extra: dict = {"pooled_output": torch.randn(1, 768, generator=g)}
    if guidance is not None:
        extra["guidance"] = guidance
    return [[_text(g, 256, 4096), extra]]


def pooled_none_cond(tokens: int, dim: int, real: int | None = None) -> Callable[[torch.Generator, int], list]:
    """Encoders without a pooled output (Chroma's T5, Qwen2.5-VL, UMT5): ``pooled_output`` None."""
    return lambda g, i: [[_text(g, tokens, dim, real), {"pooled_output": None}]]


def ltxv_cond(g: torch.Generator, i: int) -> list:
    """LTXV's T5-XXL: padded to 128 tokens with the mask kept; LTXVConditioning adds ``frame_rate``."""
    return [[_text(g, 128, 4096), {"pooled_output": None, "attention_mask": _mask(128, 9), "frame_rate": 25.0}]]


def hunyuan_cond(g: torch.Generator, i: int) -> list:
    """HunyuanVideo's Llama (template cropped, no padding, mask dropped) and CLIP-L's pooled output."""
    return [[_text(g, 11, 4096), {"pooled_output": torch.randn(1, 768, generator=g)}]]


def lumina2_cond(g: torch.Generator, i: int) -> list:
    """Lumina 2's Gemma-2: its attention mask is kept, batch 1 (the model counts text tokens from it)."""
    return [[_text(g, 12, 2304), {"pooled_output": None, "attention_mask": _mask(12, 12)}]]


# ---------------------------------------------------------------------------------------------- the families

@dataclasses.dataclass(frozen=True)
class Family:
    """One family's tiny model and dataset sample. ``latent`` and ``ref`` are one sample's LATENT shapes
    (batch 1); ``ref`` marks an edit-pair dataset (the reference image's latent, a ``ref`` column)."""

    name: str
    model_class: str  # type(model.model).__name__ after loading
    config_class: str  # type(model.model.model_config).__name__
    weights: Callable[[bool], Shapes]  # argument: this ComfyUI reads Flux's width from the weights
    latent: tuple[int, ...]
    cond: Callable[[torch.Generator, int], list]
    ref: tuple[int, ...] | None = None
    file: str = ""  # model file, shared by families with the same weights
    guidance_distilled: bool = False  # the trainer supplies ``guidance`` where the conditioning has none
    model_keys: tuple[str, ...] = ("c_crossattn",)  # what ComfyUI must hand the diffusion model in training
    batch: int = 2  # two samples per batch: each keeps its own caption (and reference)
    split: bool = False  # the samples differ in a scalar option (SDXL's sizes): one model call per sample
    checkpointing: bool = True  # False: trained without gradient checkpointing (the node's other path)

    @property
    def model_file(self) -> str:
        return f"tiny_{self.file or self.name}.safetensors"


def _flux_width(tiny: bool) -> int:
    return 128 if tiny else 3072


FAMILIES: list[Family] = [
    Family("sdxl", "SDXL", "KOALA_700M", lambda tiny: sdxl_unet(), (1, 4, 8, 8), sdxl_cond,
           model_keys=("c_crossattn", "y"), split=True),
    Family("flux_dev", "Flux", "Flux", lambda tiny: flux(_flux_width(tiny), True, 1 if tiny else 0), (1, 16, 4, 4),
           flux_cond, guidance_distilled=True, model_keys=("c_crossattn", "y", "guidance")),
    Family("flux_schnell", "Flux", "FluxSchnell", lambda tiny: flux(_flux_width(tiny), False, 1 if tiny else 0),
           (1, 16, 4, 4), flux_cond, model_keys=("c_crossattn", "y")),
    Family("flux_kontext", "Flux", "Flux", lambda tiny: flux(_flux_width(tiny), True, 1 if tiny else 0),
           (1, 16, 4, 4), lambda g, i: flux_cond(g, i, guidance=2.5), ref=(1, 16, 4, 6), file="flux_dev",
           guidance_distilled=True, model_keys=("c_crossattn", "y", "guidance", "ref_latents")),
    # Chroma's approximator (hard-coded 5 x 5120 wide) runs on 344 rows per sample: one sample per batch
    Family("chroma", "Chroma", "Chroma", lambda tiny: flux(3072, False, 0, chroma=True), (1, 16, 4, 4),
           pooled_none_cond(9, 4096), batch=1),
    Family("qwen_image", "QwenImage", "QwenImage", lambda tiny: qwen_image(), (1, 16, 1, 4, 4),
           pooled_none_cond(10, 3584)),
    Family("qwen_image_edit", "QwenImage", "QwenImage", lambda tiny: qwen_image(), (1, 16, 1, 4, 4),
           pooled_none_cond(10, 3584), ref=(1, 16, 1, 4, 4), file="qwen_image",
           model_keys=("c_crossattn", "ref_latents")),
    Family("wan21_t2v", "WAN21", "WAN21_T2V", lambda tiny: wan(16), (1, 16, 2, 4, 4), pooled_none_cond(512, 4096, 9),
           checkpointing=False),
    Family("wan22_ti2v", "WAN22", "WAN22_T2V", lambda tiny: wan(48), (1, 48, 2, 4, 4), pooled_none_cond(512, 4096, 9)),
    Family("ltxv", "LTXV", "LTXV", lambda tiny: ltxv(), (1, 128, 2, 2, 2), ltxv_cond,
           model_keys=("c_crossattn", "attention_mask", "frame_rate"), checkpointing=False),
    Family("hunyuan_video", "HunyuanVideo", "HunyuanVideo", lambda tiny: hunyuan_video(), (1, 16, 2, 4, 4),
           hunyuan_cond, guidance_distilled=True, model_keys=("c_crossattn", "y", "guidance"), checkpointing=False),
    Family("lumina2", "Lumina2", "Lumina2", lambda tiny: lumina2(), (1, 16, 4, 4), lumina2_cond,
           model_keys=("c_crossattn", "num_tokens")),
]
BY_NAME = {f.name: f for f in FAMILIES}


def describe(value: object) -> object:
    """Shapes instead of tensors, for reports."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    return value
