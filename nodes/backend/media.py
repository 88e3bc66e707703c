"""ComfyUI's VAE, text encoder, image loading and sampler as the encoders and the previews use them: the weights a
fingerprint is made of, how files are opened, how a video VAE counts frames, one image sampled with a model; and
ComfyUI's own nodes run on one sample, for what they put into a conditioning or a latent (an image-to-video start
frame, a CLIP vision output, a sound track's latent), so a cached sample holds exactly what a workflow would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import comfy.sample
import node_helpers
import torch
from PIL import Image, ImageOps

SAMPLER, SCHEDULER = "euler", "simple"

# Weights ComfyUI may leave uninitialised because checkpoints lack them (SD1.x has no text projection; ComfyUI
# ignores both when it reports missing keys): their bytes differ from load to load, so they cannot be hashed.
_NOT_LOADED = ("text_projection.weight", "logit_scale")


def vae_weights(vae: Any) -> tuple[dict[str, torch.Tensor], tuple]:
    """The VAE's weights and what else decides its output (model class, dtype), for its fingerprint."""
    model = vae.first_stage_model
    return model.state_dict(), (type(model).__name__, str(vae.vae_dtype))


def _patch_tensors(patches: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for key, plist in sorted(patches.items()):
        for n, p in enumerate(plist):
            value = p[1] if len(p) > 1 else None
            weights = getattr(value, "weights", value)
            for m, t in enumerate(weights if isinstance(weights, (tuple, list)) else [weights]):
                if isinstance(t, torch.Tensor):
                    out.append((f"{key}#{n}.{m}", t))
    return out


def clip_weights(clip: Any) -> tuple[list[tuple[str, torch.Tensor]], tuple]:
    """The text encoder's weights with any LoRA patched onto it, and what else decides its output (model class,
    clip-skip layer, patch strengths), for its fingerprint."""
    patches = getattr(getattr(clip, "patcher", None), "patches", {}) or {}
    strengths = sorted((k, [(p[0], p[2]) for p in v]) for k, v in patches.items())
    extra = (type(clip.cond_stage_model).__name__, getattr(clip, "layer_idx", None), strengths)
    weights = [(k, v) for k, v in clip.cond_stage_model.state_dict().items() if not k.endswith(_NOT_LOADED)]
    return weights + _patch_tensors(patches), extra


def encode_text(clip: Any, text: str) -> list:
    """A prompt as CONDITIONING, as CLIPTextEncode makes it."""
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def is_video_vae(vae: Any) -> bool:
    """Whether the VAE's latents have a time axis (Wan, HunyuanVideo, LTXV, ...)."""
    return getattr(vae, "latent_dim", 2) == 3


def frame_reducer(vae: Any) -> Callable[[int], int] | None:
    """The function that maps a clip's frame count to its latent frame count, for a video VAE (else None)."""
    ratio = getattr(vae, "downscale_ratio", None)
    return ratio[0] if isinstance(ratio, tuple) and ratio and callable(ratio[0]) else None


def open_image(path: str) -> Image.Image:
    """An image file opened as ComfyUI opens images (its safeguards for large and odd files), EXIF-rotated."""
    img = node_helpers.pillow(Image.open, path)
    return node_helpers.pillow(ImageOps.exif_transpose, img)


def sample(model: Any, positive: list, negative: list, latent: torch.Tensor, *, steps: int, cfg: float,
           seed: int) -> torch.Tensor:
    """One latent sampled from ``latent``'s shape with seeded noise, by ComfyUI's sampler (euler, simple)."""
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, SAMPLER, SCHEDULER, positive, negative, latent, seed=seed,
                               disable_pbar=True)


START_FRAME_NODES = ("WanImageToVideo", "WanFirstLastFrameToVideo", "Wan22ImageToVideoLatent", "HunyuanImageToVideo",
                     "HunyuanVideo15ImageToVideo", "LTXVImgToVideo", "CosmosPredict2ImageToVideoLatent",
                     "Kandinsky5ImageToVideo")
"""ComfyUI's image-to-video nodes Encode Dataset can run per clip: each takes a start image (some also an end
image or a CLIP vision output) and the clip's size and length, and sets conditioning keys or a latent noise mask."""

_START_INPUTS = ("start_image", "image")
_END_INPUTS = ("end_image",)


def _node_class(class_type: str) -> Any:
    import nodes as comfy_nodes  # ComfyUI's top-level module (this pack imports its own ``nodes`` relatively)

    cls = comfy_nodes.NODE_CLASS_MAPPINGS.get(class_type)
    if cls is None:
        raise ValueError(f"this ComfyUI has no {class_type} node; update ComfyUI or choose another node")
    return cls


def available_nodes(names: tuple[str, ...]) -> list[str]:
    """The nodes of ``names`` this ComfyUI has, in that order."""
    import nodes as comfy_nodes

    return [n for n in names if n in comfy_nodes.NODE_CLASS_MAPPINGS]


def node_input_names(class_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A node's required and optional inputs: name -> default (None where the input has no default)."""
    types = _node_class(class_type).INPUT_TYPES()

    def defaults(group: dict) -> dict[str, Any]:
        out = {}
        for name, spec in (group or {}).items():
            options = spec[1] if isinstance(spec, (tuple, list)) and len(spec) > 1 else {}
            kind = spec[0] if isinstance(spec, (tuple, list)) and spec else None
            default = options.get("default") if isinstance(options, dict) else None
            choices = kind if isinstance(kind, (list, tuple)) else \
                (options.get("options") if isinstance(options, dict) else None)
            if default is None and choices:
                default = choices[0]  # a drop-down's first choice, as the frontend gives
            out[name] = default
        return out

    return defaults(types.get("required")), defaults(types.get("optional"))


def run_node(class_type: str, **inputs: Any) -> tuple:
    """Run one of ComfyUI's nodes on ``inputs`` (its outputs as a tuple), whichever node API it is written in."""
    cls = _node_class(class_type)
    if hasattr(cls, "define_schema"):
        out = cls.execute(**inputs)
    else:
        out = getattr(cls(), cls.FUNCTION)(**inputs)
    if isinstance(out, dict) and "result" in out:
        out = out["result"]
    return tuple(getattr(out, "args", out))


def clip_vision_tensors(output: Any) -> dict[str, torch.Tensor]:
    """A CLIP vision output as a plain dict of its tensors (what a cache can hold)."""
    items = output.items() if isinstance(output, dict) else vars(output).items()
    return {k: v.to("cpu").contiguous() for k, v in items if isinstance(v, torch.Tensor)}


def clip_vision_weights(clip_vision: Any) -> tuple[dict[str, torch.Tensor], tuple]:
    model = clip_vision.model
    return model.state_dict(), (type(model).__name__, str(getattr(clip_vision, "dtype", "")))


def encode_clip_vision(clip_vision: Any, image: torch.Tensor) -> Any:
    """``image`` ([1, H, W, 3]) through CLIP Vision Encode, centre-cropped as that node does by default."""
    return run_node("CLIPVisionEncode", clip_vision=clip_vision, image=image, crop="center")[0]


def start_frame_values(class_type: str, *, vae: Any, clip_vision: Any, start: torch.Tensor,
                       end: torch.Tensor | None, width: int, height: int, length: int) -> dict[str, Any]:
    """What image-to-video node ``class_type`` sets for a clip of ``length`` frames of ``width`` x ``height`` whose
    first frame is ``start`` (and last ``end``), each [1, H, W, 3]: ``{"conditioning": {key: value}}`` with the
    keys it adds to the positive conditioning, and ``"noise_mask"`` when its latent has one (the frames given,
    not generated). CLIP vision outputs are dicts of tensors. Other inputs take the node's defaults."""
    required, optional = node_input_names(class_type)
    names = {**required, **optional}
    placeholder = [[torch.zeros(1, 1, 1), {}]]
    given: dict[str, Any] = {"positive": placeholder, "negative": placeholder, "vae": vae, "width": width,
                             "height": height, "length": length, "batch_size": 1}
    given.update({n: start for n in _START_INPUTS})
    if end is not None:
        given.update({n: end for n in _END_INPUTS})
    if clip_vision is not None:
        for name, image in (("clip_vision_output", start), ("clip_vision_start_image", start),
                            ("clip_vision_end_image", end)):
            if name in names and image is not None:
                given[name] = encode_clip_vision(clip_vision, image)
    inputs = {n: given.get(n, default) for n, default in names.items() if n in given or default is not None}
    missing = [n for n in required if n not in inputs]
    if missing:
        raise ValueError(f"{class_type} needs {', '.join(missing)}, which Encode Dataset cannot give it; choose "
                         "another start-frame node")
    conditioning: dict[str, Any] = {}
    noise_mask = None
    for value in run_node(class_type, **inputs):
        if isinstance(value, list) and value and isinstance(value[0], (list, tuple)) and not conditioning:
            for key, v in value[0][1].items():
                conditioning[key] = clip_vision_tensors(v) if key.startswith("clip_vision") else \
                    (v.to("cpu").contiguous() if isinstance(v, torch.Tensor) else v)
        elif isinstance(value, dict) and isinstance(value.get("noise_mask"), torch.Tensor):
            noise_mask = value["noise_mask"].to("cpu").contiguous()
    out: dict[str, Any] = {"conditioning": conditioning}
    if noise_mask is not None:
        out["noise_mask"] = noise_mask
    return out


def is_audio_vae(vae: Any) -> bool:
    """Whether the VAE encodes sound (Stable Audio, ACE-Step, LTX-2's and MiniMax's audio VAEs, ...)."""
    name = type(getattr(vae, "first_stage_model", None)).__name__.lower()
    return "audio" in name or "music" in name


def audio_sample_rate(vae: Any) -> int:
    """The rate ComfyUI's VAEEncodeAudio resamples to for this VAE."""
    return int(getattr(vae, "audio_sample_rate", 44100))


def load_audio(path: str) -> dict[str, Any]:
    """An audio file (or a video's sound track) as AUDIO, decoded as ComfyUI's LoadAudio decodes it:
    ``{"waveform": [1, channels, samples] float32, "sample_rate": rate}``. Raises ValueError naming the file when
    it has no sound or cannot be decoded."""
    import sys

    module = sys.modules.get(_node_class("LoadAudio").__module__)
    load = getattr(module, "load", None)
    if load is None:  # the loader function is not reachable through the node's module
        from comfy_extras.nodes_audio import load
    try:
        waveform, rate = load(path)
    except Exception as exc:
        if "no audio stream" in str(exc).lower():
            raise ValueError(f"{path}: no sound track (audio stream) in this file") from exc
        raise ValueError(f"{path}: cannot decode its audio ({exc}); re-save it (e.g. as WAV or FLAC) or remove "
                         "it") from exc
    return {"waveform": waveform.unsqueeze(0), "sample_rate": int(rate)}


def trim_audio(audio: dict[str, Any], start: float, duration: float, name: str) -> dict[str, Any]:
    """``duration`` seconds (0: to the end) of ``audio`` from ``start`` on, cut by ComfyUI's TrimAudioDuration."""
    rate, length = audio["sample_rate"], audio["waveform"].shape[-1]
    if int(round(start * rate)) >= length:
        raise ValueError(f"{name}: the audio is {length / rate:.2f} s long, shorter than start ({start:g} s); "
                         "lower start on Encode Options")
    if start <= 0 and duration <= 0:
        return audio
    seconds = duration if duration > 0 else length / rate
    return run_node("TrimAudioDuration", audio=audio, start_index=float(start), duration=float(seconds))[0]


def encode_audio(class_type: str, vae: Any, audio: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """AUDIO through ComfyUI's audio encode node ``class_type`` (VAEEncodeAudio, or LTXVAudioVAEEncode for LTX-2's
    audio VAE), which resamples it to the VAE's rate. VAEs that sample their latent (Stable Audio's) draw it with
    ``seed``, so the same sound always gives the same latent."""
    inputs = {"audio": audio, "audio_vae" if class_type == "LTXVAudioVAEEncode" else "vae": vae}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        latent = run_node(class_type, **inputs)[0]
    return {"samples": latent["samples"].to("cpu").contiguous()}
