"""Tiny diffusers models with the architecture of the LoRA-format tests' tiny ComfyUI models, and what diffusers'
own LoRA loading does to them (tests/comfy/test_lora_files_in_comfyui.py; runs in the test process, which has diffusers).

The models mirror ``demo_assets.tiny_checkpoint`` (SD1.x: one 320-wide level, a middle block of one resnet),
``families.sdxl_unet(1)`` (KOALA-700M's SDXL layout: three 320-wide levels with 0, 2 and 5 transformer layers, no
middle block, transformers of depth 1 in the output blocks of the two deeper levels, as SDXL has) and ``families.flux`` (one double and one single block; ``hidden`` as ComfyUI detected it). They are
built on the meta device and given zero weights: after ``fuse_lora`` a weight *is* the delta diffusers applied.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def _zero(model: Any) -> Any:
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    return model


def _zeroed(build: Any) -> Any:
    with torch.device("meta"):
        model = build()
    return _zero(model.to_empty(device="cpu"))


@functools.cache
def pipeline(family: str, hidden: int | None = None) -> Any:
    """A diffusers pipeline of ``family`` (``sd15``, ``sdxl``, ``flux_dev``) holding only its zeroed diffusion model:
    what ``load_lora_weights`` needs. Built once and zeroed again after each use."""
    import diffusers as d

    if family == "sd15":
        unet = _zeroed(lambda: d.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(320,),
            down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
            mid_block_type="UNetMidBlock2D", cross_attention_dim=768, attention_head_dim=8))
        return d.StableDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet,
                                         scheduler=d.DDPMScheduler(), safety_checker=None, feature_extractor=None,
                                         requires_safety_checker=False)
    if family == "sdxl":
        unet = _zeroed(lambda: d.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(320, 320, 320),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), mid_block_type=None,
            transformer_layers_per_block=(1, 2, 5), reverse_transformer_layers_per_block=(1, 1, 1),
            cross_attention_dim=2048, attention_head_dim=64,
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816))
        return d.StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                           tokenizer_2=None, unet=unet, scheduler=d.DDPMScheduler())
    if family == "flux_dev":
        assert hidden is not None
        transformer = _zeroed(lambda: d.FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
            num_attention_heads=hidden // 128, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56)))
        return d.FluxPipeline(scheduler=d.FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                              tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    raise ValueError(f"no tiny diffusers model for {family}")


def deltas_applied(family: str, lora_file: str, hidden: int | None = None) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The weights diffusers changes when it loads ``lora_file`` with ``load_lora_weights`` and fuses it, by
    parameter name, each one the delta it applied (the weights were zero); and the names of all the model's
    parameters."""
    pipe = pipeline(family, hidden)
    model = pipe.transformer if family == "flux_dev" else pipe.unet
    try:
        pipe.load_lora_weights(lora_file)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        params = dict(model.named_parameters())
        return {name: p.detach().clone() for name, p in params.items() if bool(p.any())}, set(params)
    finally:
        pipe.unload_lora_weights()
        with torch.no_grad():
            for p in model.parameters():
                if p.any():
                    p.zero_()
