"""Tiny random-weight models and small media files for the video and edit-pair tests, built at run time inside a
ComfyUI process with ComfyUI's own classes (so its detection recognises each family), never committed.

- :func:`tiny_diffusion_model`: a model of any family from ``comfy.supported_models`` at a tiny width.
- :func:`tiny_wan_vae`: a Wan 2.1 video VAE (8x spatial, 4x temporal, 16 channels). ComfyUI 0.33 reads its
  width from the weights, so it is tiny there; v0.3.64 fixes it at the real width (127 M parameters).
- :func:`tiny_vae16`: the 16-channel image VAE of the Flux family (fixed size, 84 M parameters).
- :func:`tiny_ltx2_checkpoint`: an LTX-2 checkpoint as Lightricks ships one (the audio-video model, its video and
  audio VAEs and the vocoder in one file, their configs in its metadata), each part tiny.
- :func:`write_clip` / :func:`write_gif`: short generated videos.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

_ONES = (".gamma", "norm.weight", "norm1.weight", "norm2.weight", "norm3.weight", "norm_out.weight", ".scale")


def random_weights(state_dict: dict, seed: int = 0) -> dict:
    """Random values for a module's state-dict: norms 1, biases 0, everything else N(0, 0.02) (ComfyUI's ops
    leave weights uninitialised, and real checkpoints are never all zero)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state_dict.items():
        if not v.dtype.is_floating_point:
            out[k] = v.clone()
        elif k.endswith(_ONES) or (v.dim() == 1 and "norm" in k and k.endswith(".weight")):
            out[k] = torch.ones(v.shape)
        elif k.endswith(".bias"):
            out[k] = torch.zeros(v.shape)
        else:
            out[k] = torch.randn(v.shape, generator=g) * 0.02
    return out


def _save(state_dict: dict, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def tiny_diffusion_model(path: str, config_class: str, unet_config: dict[str, Any], params_class: Any = None) -> None:
    """``comfy.supported_models.<config_class>(unet_config)``'s diffusion model with random weights, saved as a
    diffusion_models file (keys without prefix). Keys of ``unet_config`` that this ComfyUI's ``params_class``
    (a dataclass of model parameters) does not know are dropped, so one config serves both snapshots."""
    import comfy.supported_models

    if params_class is not None:
        known = {f.name for f in dataclasses.fields(params_class)}
        unet_config = {k: v for k, v in unet_config.items() if k == "image_model" or k in known}
    model = getattr(comfy.supported_models, config_class)(dict(unet_config)).get_model({})
    _save(random_weights(model.diffusion_model.state_dict()), path)


def tiny_hunyuan_video(path: str, context_dim: int = 768) -> None:
    """A one-block HunyuanVideo (128 wide, 1 head; 16-channel 5-D latents) whose text input is ``context_dim``
    wide, so a CLIP-L encoder (768, with a 768 pooled output) conditions it."""
    import comfy.ldm.hunyuan_video.model as hv

    tiny_diffusion_model(path, "HunyuanVideo", {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
        "context_in_dim": context_dim, "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 1, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [16, 56, 56], "theta": 256, "patch_size": [1, 2, 2],
        "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False,
        "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}, hv.HunyuanVideoParams)


def tiny_flux(path: str, context_dim: int = 768) -> None:
    """A one-block Flux dev (guidance; 128 wide, 1 head) with a ``context_dim``-wide text input and a 768 pooled
    vector, which on ComfyUI 0.33 also takes reference latents (the Kontext way of editing)."""
    import comfy.ldm.flux.model as flux

    tiny_diffusion_model(path, "Flux", {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": context_dim,
        "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1,
        "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
        "txt_ids_dims": []}, flux.FluxParams)


def tiny_wan_vae(path: str) -> None:
    """A Wan 2.1 VAE, as narrow as this ComfyUI accepts."""
    import inspect

    import comfy.ldm.wan.vae as wan
    import comfy.sd
    import torch

    dim = 8 if 'sd["decoder.head.0.gamma"].shape[0]' in inspect.getsource(comfy.sd.VAE.__init__) else 96
    with torch.device("meta"):
        module = wan.WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                            temperal_downsample=[False, True, True], dropout=0.0)
    _save(random_weights({k: torch.empty(v.shape) for k, v in module.state_dict().items()}), path)


def tiny_vae16(path: str) -> None:
    """The 16-channel AutoencoderKL of Flux and SD3 (ComfyUI detects it by its 16 latent channels)."""
    import comfy.ldm.models.autoencoder
    import torch

    ddconfig = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        module = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=16)
    _save(random_weights({k: torch.empty(v.shape) for k, v in module.state_dict().items()}), path)


def _frames(n: int, width: int, height: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    return [np.roll(base, 4 * i, axis=1) for i in range(n)]  # a moving pattern


def write_clip(path: str, frames: int = 12, width: int = 96, height: int = 64, fps: int = 8, seed: int = 0) -> None:
    """An MPEG-4 clip (PyAV's built-in encoder) of a pattern moving right."""
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for arr in _frames(frames, width, height, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_gif(path: str, frames: int = 9, width: int = 64, height: int = 64, seed: int = 1) -> None:
    from PIL import Image

    images = [Image.fromarray(a) for a in _frames(frames, width, height, seed)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=100, loop=0)


def write_image(path: str, width: int = 64, height: int = 64, seed: int = 2, mode: str = "RGB") -> None:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (height, width, len(mode)), dtype=np.uint8)
    Image.fromarray(arr if len(mode) > 1 else arr[..., 0], mode).save(path)


def write_wav(path: str, seconds: float = 0.5, rate: int = 22050, channels: int = 2, freq: float = 440.0) -> None:
    """A 16-bit PCM WAV of a sine tone (the stdlib's wave module), left and right a quarter period apart."""
    import wave

    t = np.arange(int(seconds * rate)) / rate
    tone = np.stack([np.sin(2 * np.pi * freq * t + c * np.pi / 2) for c in range(channels)], axis=1) * 0.5
    with wave.open(path, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((tone * 32767).astype("<i2").tobytes())


def write_clip_with_sound(path: str, frames: int = 12, width: int = 64, height: int = 64, fps: int = 8,
                          rate: int = 16000, seed: int = 0) -> None:
    """An MPEG-4 clip of a moving pattern with an AAC sound track (a rising tone) as long as its frames."""
    import av

    seconds = frames / fps
    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        sound = container.add_stream("aac", rate=rate, layout="stereo")
        for arr in _frames(frames, width, height, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        t = np.arange(int(seconds * rate)) / rate
        tone = (np.sin(2 * np.pi * (220 + 220 * t) * t) * 0.5).astype(np.float32)
        for i in range(0, len(tone), 1024):
            chunk = np.ascontiguousarray(np.stack([tone[i:i + 1024]] * 2))
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate = rate
            for packet in sound.encode(frame):
                container.mux(packet)
        for packet in sound.encode():
            container.mux(packet)


LTX_AUDIO_CONFIG = {
    "audio_vae": {"model": {"params": {"sampling_rate": 16000, "ddconfig": {
        "double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
        "in_channels": 2, "out_ch": 2, "ch": 8, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
        "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}}},
        "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}},
    "vocoder": {"upsample_initial_channel": 16, "upsample_rates": [5, 4, 2, 2, 2],
                "upsample_kernel_sizes": [10, 8, 4, 4, 4], "resblock_kernel_sizes": [3],
                "resblock_dilation_sizes": [[1, 3, 5]]},
}
"""LTX-2's audio VAE at a tiny width: 8 latent channels and 64 mel bins (16 latent frequency bins), the sound stream
LTX-2's model takes; 16 kHz, 160 samples per mel frame, 4 mel frames per latent frame (25 latent frames a second)."""


def tiny_ltx_audio_vae() -> Any:
    """LTX-2's audio VAE (``comfy.sd.VAE`` with ComfyUI's own class, :data:`LTX_AUDIO_CONFIG`) with random weights,
    the per-channel statistics set to mean 0 and std 1."""
    import json

    import comfy.ldm.lightricks.vae.audio_vae as audio_vae
    import comfy.sd
    import torch

    metadata = {"config": json.dumps(LTX_AUDIO_CONFIG)}
    sd = random_weights(audio_vae.AudioVAE(metadata).state_dict(), seed=21)
    for k in sd:
        if k.endswith("std-of-means"):
            sd[k] = torch.ones_like(sd[k])
        elif k.endswith("mean-of-means"):
            sd[k] = torch.zeros_like(sd[k])
    return comfy.sd.VAE(sd=sd, metadata=metadata)


def stable_audio_vae() -> Any:
    """Stable Audio's VAE (ComfyUI's AudioOobleckVAE; its size is fixed: 157 M parameters) with random weights,
    snake activations' alpha and beta at 1, as ``comfy.sd.VAE``."""
    import comfy.sd
    import torch
    from comfy.ldm.audio.autoencoder import AudioOobleckVAE

    sd = random_weights(AudioOobleckVAE().state_dict(), seed=22)
    for k in sd:
        if k.endswith((".alpha", ".beta")):
            sd[k] = torch.ones_like(sd[k])
    return comfy.sd.VAE(sd=sd)


LTX_VIDEO_VAE_CONFIG = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["compress_time_res", {"multiplier": 2}], ["compress_all_res", {"multiplier": 2}],
                       ["compress_all_res", {"multiplier": 2}]],
    "decoder_blocks": [["compress_all", {"residual": True, "multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}]],
    "encoder_base_channels": 8, "decoder_base_channels": 8, "scaling_factor": 1.0, "norm_layer": "pixel_norm",
    "patch_size": 4, "latent_log_var": "uniform", "use_quant_conv": False, "causal_decoder": False,
    "timestep_conditioning": True}
"""LTX-2's video VAE (ComfyUI's ``VideoVAE`` of LTX-2's layout: space-to-depth blocks) 8 channels wide instead of
128, one layer per residual block: 128 latent channels, 32x smaller per side, 8 frames to a latent frame."""


def _statistics_neutral(sd: dict) -> dict:
    """Per-channel latent statistics of mean 0 and std 1 (random ones would scale the latents arbitrarily)."""
    import torch

    for k in sd:
        if k.endswith("std-of-means"):
            sd[k] = torch.ones_like(sd[k])
        elif k.endswith("mean-of-means"):
            sd[k] = torch.zeros_like(sd[k])
    return sd


def tiny_ltx2_checkpoint(path: str, model_file: str) -> None:
    """An LTX-2 checkpoint of the tiny diffusion model in ``model_file`` (a diffusion_models file with its
    transformer config in the metadata): ``model.diffusion_model.*`` with ``vae.*`` (:data:`LTX_VIDEO_VAE_CONFIG`),
    ``audio_vae.*`` and ``vocoder.*`` (:data:`LTX_AUDIO_CONFIG`), random weights, every config in the metadata as
    Lightricks' files carry them. Load Checkpoint gives the model and video VAE; Load LTXV Audio VAE reads the
    audio VAE from the same file."""
    import json

    import comfy.ldm.lightricks.vae.audio_vae as audio_vae
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as video_vae
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(model_file, "pt") as f:
        config = json.loads((f.metadata() or {}).get("config", "{}"))
    sd = {f"model.diffusion_model.{k}": v for k, v in load_file(model_file).items()}
    config.update(LTX_AUDIO_CONFIG, vae=LTX_VIDEO_VAE_CONFIG)
    with torch.device("meta"):
        video = video_vae.VideoVAE(config=LTX_VIDEO_VAE_CONFIG)
    vae = _statistics_neutral(random_weights({k: torch.empty(v.shape) for k, v in video.state_dict().items()}, 22))
    sd.update({f"vae.{k}": v for k, v in vae.items()})
    sound = _statistics_neutral(random_weights(audio_vae.AudioVAE({"config": json.dumps(config)}).state_dict(), 21))
    for k, v in sound.items():  # AudioVAE's autoencoder.* is the file's audio_vae.* (Load LTXV Audio VAE maps it)
        sd["audio_vae." + k[len("autoencoder."):] if k.startswith("autoencoder.") else k] = v
    os.makedirs(os.path.dirname(path), exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, path + ".tmp", metadata={"config": json.dumps(config)})
    os.replace(path + ".tmp", path)
