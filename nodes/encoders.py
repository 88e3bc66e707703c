"""The encoders EncodeDataset caches with: ComfyUI's VAE for images, its CLIP for captions, each with a
fingerprint of its weights (part of every cache key), and image loading into aspect buckets."""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np
import torch
import xxhash
from PIL import Image

from ..streaming_cache.builder import Encoder, Item, Part
from ..streaming_cache.train.buckets import DEFAULT_BUCKETS, BucketRule, crop_box
from ..streaming_cache.train.fingerprint import fingerprint_tensors
from ..streaming_cache.train.folder import Sample
from . import video
from .backend import media


def vae_fingerprint(vae: Any) -> str:
    weights, extra = media.vae_weights(vae)
    return "vae:" + fingerprint_tensors(weights, extra=extra)


def clip_fingerprint(clip: Any) -> str:
    """Weights, clip-skip layer and any LoRA patches applied to the text encoder."""
    weights, extra = media.clip_weights(clip)
    return "clip:" + fingerprint_tensors(weights, extra=extra)


def load_image(path: str) -> Image.Image:
    img = media.open_image(path)
    if img.mode == "I":
        img = img.point(lambda i: i * (1 / 255))
    return img.convert("RGB")


def fit(img: Image.Image, bucket: tuple[int, int]) -> torch.Tensor:
    """Cover-resize and centre-crop to ``bucket`` (width, height); [H, W, 3] floats in 0..1."""
    scale, left, top, right, bottom = crop_box(img.width, img.height, bucket)
    size = (max(bucket[0], round(img.width * scale)), max(bucket[1], round(img.height * scale)))
    if size != img.size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    img = img.crop((left, top, right, bottom))
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)


def to_bucket(img: Image.Image, resolution: int, rule: BucketRule = DEFAULT_BUCKETS) -> torch.Tensor:
    """Cover-resize and centre-crop to the image's aspect bucket; [H, W, 3] floats in 0..1."""
    return fit(img, rule.size(img.width, img.height, resolution))


def media_size(part: Part) -> tuple[int, int]:
    """(width, height) of a part's image or clip, read from its header."""
    if part.params.get("frames"):
        return video.clip_size(part.path)  # type: ignore[arg-type]
    img = media.open_image(part.path)  # type: ignore[arg-type]
    try:
        return img.width, img.height
    finally:
        img.close()


def _pixels(part: Part, resolution: int, multiple: int, rule: BucketRule = DEFAULT_BUCKETS) -> torch.Tensor:
    """A part as [frames, H, W, 3] pixels in its bucket: one frame for an image, ``1 + k * multiple`` for a
    clip (the most its length and its ``frames`` setting allow). ``multiple`` is 0 for an image VAE."""
    if part.params.get("kind") == AUDIO_KIND:
        raise ValueError("audio files need an audio VAE (Stable Audio, ACE-Step, ...) on Encode Dataset; this VAE "
                         "encodes images")
    bucket = tuple(part.params["bucket"]) if "bucket" in part.params else None
    resolution = int(part.params.get("resolution", resolution))  # a part of one of Encode Options' resolutions
    if part.params.get("frames"):
        if multiple == 0 and part.params["frames"] > 1:
            raise ValueError("video clips need a video model's VAE (Wan, HunyuanVideo, LTXV, ...); this VAE "
                             "encodes still images")
        width, height = video.clip_size(part.path)  # type: ignore[arg-type]
        bucket = bucket or rule.size(width, height, resolution)
        frames = video.read_frames(part.path, frames=int(part.params["frames"]),  # type: ignore[arg-type]
                                   fps=float(part.params.get("fps", 0)), start=float(part.params.get("start", 0)),
                                   convert=lambda img: fit(img, bucket))  # type: ignore[arg-type]
        stacked = torch.stack(frames[:video.usable_frames(len(frames), len(frames), max(1, multiple))])
        return _mirrored(stacked, part)
    if part.path is not None:
        img = load_image(part.path)
    else:  # an IMAGE from another node, carried as float32 bytes
        h, w, c = part.params["shape"]
        arr = torch.frombuffer(bytearray(part.data or b""), dtype=torch.float32).reshape(h, w, c)[..., :3]
        img = Image.fromarray((arr.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
    return _mirrored((fit(img, bucket) if bucket else to_bucket(img, resolution, rule))[None], part)


def _mirrored(pixels: torch.Tensor, part: Part) -> torch.Tensor:
    """``pixels`` ([..., H, W, C]) mirrored left to right where the part is a flipped copy (``folder_items``'
    ``flip_columns``), else as they are."""
    return pixels.flip(-2).contiguous() if part.params.get("flip") else pixels


def image_encoder(vae: Any, resolution: int, batch_size: int, rule: BucketRule = DEFAULT_BUCKETS) -> Encoder:
    """Images and clips to latents. Files are read, decoded and fitted to their bucket ahead of the VAE, on
    threads (the encoder's ``prepare``). An image VAE encodes a batch of same-sized images at once; a video VAE
    (latents with a time axis) would read a stack of images as the frames of one clip, so it gets each image or
    clip on its own."""
    is_video = media.is_video_vae(vae)
    multiple = video.frame_multiple(media.frame_reducer(vae)) if is_video else 0

    def prepare(part: Part) -> torch.Tensor:
        return _pixels(part, resolution, multiple, rule)

    def encode(pixels: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        out: list[Any] = [None] * len(pixels)
        if is_video:
            for i, px in enumerate(pixels):
                out[i] = {"samples": vae.encode(px).to("cpu").contiguous()}
            return out
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixels):
            by_shape.setdefault(tuple(px.shape), []).append(i)
        for idx in by_shape.values():
            latents = vae.encode(torch.cat([pixels[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i] = {"samples": latents[j:j + 1].to("cpu").contiguous()}
        return out

    return Encoder(vae_fingerprint(vae), encode, {"resolution": resolution, **rule.settings()}, batch_size,
                   prepare=prepare)


class StartFrames:
    """What a start-frame node needs of one clip: its first (and last) frame in the clip's bucket, [1, H, W, 3],
    and the clip's size and frame count as its latent will have them."""

    def __init__(self, start: torch.Tensor, end: torch.Tensor, length: int):
        self.start, self.end, self.length = start, end, length


def _start_frames(part: Part, resolution: int, multiple: int, rule: BucketRule = DEFAULT_BUCKETS) -> StartFrames:
    bucket = tuple(part.params["bucket"])
    if not part.params.get("frames"):
        px = _pixels(part, resolution, multiple, rule)
        return StartFrames(px[:1], px[-1:], 1)
    recent: collections.deque = collections.deque(maxlen=max(1, multiple) + 1)
    first: list[Image.Image] = []

    def keep(img: Image.Image) -> int:
        if not first:
            first.append(img)
        recent.append(img)
        return 0

    count = len(video.read_frames(part.path, frames=int(part.params["frames"]),  # type: ignore[arg-type]
                                  fps=float(part.params.get("fps", 0)), start=float(part.params.get("start", 0)),
                                  convert=keep))
    length = video.usable_frames(count, count, max(1, multiple))
    last = recent[len(recent) - 1 - (count - length)]  # the last frame the clip's latent keeps
    return StartFrames(_mirrored(fit(first[0], bucket)[None], part),  # type: ignore[arg-type]
                       _mirrored(fit(last, bucket)[None], part), length)  # type: ignore[arg-type]


def start_frame_encoder(vae: Any, clip_vision: Any, node: str, resolution: int, batch_size: int,
                        rule: BucketRule = DEFAULT_BUCKETS) -> Encoder:
    """A clip's first frame (and last) through ComfyUI's image-to-video node ``node``, as a workflow would run it
    before sampling: what the node sets in the conditioning (concat latent and mask, CLIP vision output) and in
    the latent (a noise mask), cached per clip for training image-to-video models."""
    multiple = video.frame_multiple(media.frame_reducer(vae)) if media.is_video_vae(vae) else 0

    def prepare(part: Part) -> StartFrames:
        return _start_frames(part, resolution, multiple, rule)

    def encode(clips: list[StartFrames]) -> list[dict[str, Any]]:
        return [media.start_frame_values(node, vae=vae, clip_vision=clip_vision, start=c.start, end=c.end,
                                         width=c.start.shape[2], height=c.start.shape[1], length=c.length)
                for c in clips]

    fingerprint = f"start:{node}:{vae_fingerprint(vae)}"
    if clip_vision is not None:
        weights, extra = media.clip_vision_weights(clip_vision)
        fingerprint += ":clipvision:" + fingerprint_tensors(weights, extra=extra)
    return Encoder(fingerprint, encode, {"resolution": resolution, **rule.settings(), "node": node}, batch_size,
                   prepare=prepare)


def text_encoder(clip: Any, batch_size: int) -> Encoder:
    def encode(parts: list[Part]) -> list[Any]:
        out = []
        for p in parts:
            text = (p.data or b"").decode("utf-8")
            cond = media.encode_text(clip, text)
            out.append([[c.to("cpu").contiguous(), {k: (v.to("cpu").contiguous() if isinstance(v, torch.Tensor) else v)
                                                     for k, v in extra.items()}] for c, extra in cond])
        return out

    return Encoder(clip_fingerprint(clip), encode, {}, batch_size)


AUDIO_KIND = "audio"
AUDIO_COLUMN = "audio"
"""The column of each clip's sound track latent, for joint audio-video models (see :func:`sound_track_encoder`)."""


def audio_seed(audio: dict[str, Any]) -> int:
    """The seed a sampling audio VAE draws a sound's latent with: a hash of its samples (one per sound, and the
    same on every run)."""
    return xxhash.xxh3_64_intdigest(audio["waveform"].numpy().tobytes()) & 0x7FFFFFFF


def _audio(part: Part) -> dict[str, Any]:
    """An audio file's sound from ``start`` on, ``duration`` seconds of it (0: to the end), as AUDIO."""
    if part.params.get("kind") != AUDIO_KIND:
        raise ValueError("this is an audio VAE: it encodes audio files (.wav .flac .mp3 ...), not images or clips; "
                         "encode them with an image or video VAE in another cache")
    audio = media.load_audio(part.path)  # type: ignore[arg-type]
    return media.trim_audio(audio, float(part.params.get("start", 0)), float(part.params.get("duration", 0)),
                            part.path)  # type: ignore[arg-type]


def audio_node(vae: Any) -> str:
    """ComfyUI's node that encodes sound with ``vae``: LTX-2's own for its audio VAE where ComfyUI has it (it
    does what VAEEncodeAudio does), else VAEEncodeAudio."""
    ltx = type(getattr(vae, "first_stage_model", None)).__name__ == "AudioVAE"
    return "LTXVAudioVAEEncode" if ltx and media.available_nodes(("LTXVAudioVAEEncode",)) else "VAEEncodeAudio"


def audio_encoder(vae: Any, batch_size: int) -> Encoder:
    """Audio files to latents with an audio VAE, as ComfyUI's LoadAudio and VAEEncodeAudio give them: decoded
    and cut to ``start``/``duration`` on threads (the encoder's ``prepare``), then resampled to the VAE's rate
    and encoded one file at a time (lengths differ)."""
    node = audio_node(vae)

    def encode(sounds: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        return [media.encode_audio(node, vae, a, audio_seed(a)) for a in sounds]

    return Encoder(f"audio:{node}:{vae_fingerprint(vae)}", encode,
                   {"sample_rate": media.audio_sample_rate(vae), "node": node}, batch_size, prepare=_audio)


def _sound_track(part: Part, multiple: int) -> dict[str, Any]:
    """A clip's sound over the span its latent's frames cover: from ``start``, as many seconds as the frames
    kept (at ``fps``, or the clip's own rate)."""
    path: str = part.path  # type: ignore[assignment]
    fps = float(part.params.get("fps", 0)) or video.frame_rate(path)
    start = float(part.params.get("start", 0))
    count = len(video.read_frames(path, frames=int(part.params["frames"]), fps=fps, start=start,
                                  convert=lambda img: 0))
    length = video.usable_frames(count, count, max(1, multiple))
    try:
        audio = media.load_audio(path)
    except ValueError as exc:
        raise ValueError(f"{exc}. The clip needs a sound track for audio-video training: add one (silence "
                         "counts), or leave audio_vae on Encode Options unconnected") from exc
    return media.trim_audio(audio, start, length / fps, path)


def sound_track_encoder(audio_vae: Any, vae: Any, batch_size: int) -> Encoder:
    """Each clip's sound track over the same time span as its frames (``start``, the frames its latent keeps at
    ``fps``) through ComfyUI's audio encode node (LTXVAudioVAEEncode for LTX-2), for joint audio-video models."""
    multiple = video.frame_multiple(media.frame_reducer(vae)) if media.is_video_vae(vae) else 0
    node = audio_node(audio_vae)

    def prepare(part: Part) -> dict[str, Any]:
        return _sound_track(part, multiple)

    def encode(sounds: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        return [media.encode_audio(node, audio_vae, a, audio_seed(a)) for a in sounds]

    return Encoder(f"track:{node}:{vae_fingerprint(audio_vae)}", encode,
                   {"sample_rate": media.audio_sample_rate(audio_vae), "node": node, "frame_multiple": multiple},
                   batch_size, prepare=prepare)


MASK_DOWNSCALE = 8
START_COLUMN = "start"
"""The column of what a start-frame node set for each clip (see :func:`start_frame_encoder`)."""


class FolderParts:
    """How a dataset folder's samples become parts. A clip carries its frame settings (so changing them changes
    its cache key); a reference image and a loss mask carry the bucket of their target, so they are resized
    and cropped exactly as the target is and line up with it pixel for pixel."""

    def __init__(self, resolution: int, *, frames: int, fps: float, start: float, alpha_masks: bool,
                 audio_duration: float = 0.0, own_resolution: bool = False, rule: BucketRule = DEFAULT_BUCKETS):
        self.resolution, self.alpha_masks, self.rule = resolution, alpha_masks, rule
        # another resolution than Encode Dataset's own: its images and clips say so in their params (and keys)
        self.sized = {"resolution": resolution} if own_resolution else {}
        self.clip = {"frames": frames, "fps": fps, "start": start}
        self.audio = {"kind": AUDIO_KIND, "start": start, "duration": audio_duration}
        self._buckets: dict[str, list[int]] = {}

    def media(self, s: Sample) -> Part:
        if s.kind == AUDIO_KIND:
            return Part(path=s.image, params=dict(self.audio))
        if s.kind == "video":
            return Part(path=s.image, params={**self.clip, **self.sized})
        return Part(path=s.image, params=dict(self.sized))

    def sound_track(self, s: Sample) -> Part:
        """The part of a clip's sound track (with the clip's settings); an image or audio file has none."""
        if s.kind != "video":
            raise ValueError("not a video clip: with audio_vae connected (audio-video training) every sample needs "
                             "a sound track; move images and audio files to another dataset")
        return Part(path=s.image, params=dict(self.clip))

    def bucket(self, s: Sample) -> list[int]:
        if s.image not in self._buckets:
            width, height = media_size(self.media(s))
            self._buckets[s.image] = list(self.rule.size(width, height, self.resolution))
        return self._buckets[s.image]

    def reference(self, s: Sample) -> Part:
        return Part(path=s.reference, params={"bucket": self.bucket(s)})

    def start(self, s: Sample) -> Part:
        """The part a start-frame node encodes: the clip (or image) in its bucket, with the clip's settings."""
        return Part(path=s.image, params={**(self.clip if s.kind == "video" else {}), "bucket": self.bucket(s)})

    def mask(self, s: Sample) -> Part | None:
        """The loss mask's part; None for an audio file, which has no pixels to weight (a ``name_mask`` file beside
        one is refused, so the file fails alone with that reason instead of being trained without its mask)."""
        if s.kind == AUDIO_KIND:
            if s.mask:
                raise ValueError(f"{os.path.basename(s.mask)} is a loss mask, which only images and clips can have; "
                                 "an audio file trains on all of its sound: remove the mask file")
            return None
        if s.mask:
            return Part(path=s.mask, params={"bucket": self.bucket(s), "mask": "file"})
        if self.alpha_masks and s.kind == "image":
            return Part(path=s.image, params={"bucket": self.bucket(s), "mask": "alpha"})
        return Part(data=b"", params={"bucket": self.bucket(s), "mask": "full"})


def _mask(part: Part) -> torch.Tensor:
    """A loss mask as [1, 1, H/8, W/8] float16 in 0..1 (area-averaged: a latent pixel is weighted by the share
    of its pixels that count). White counts, black does not; for ``alpha`` the image's opacity."""
    width, height = part.params["bucket"]
    if part.params["mask"] == "full" or part.path is None:
        m = torch.ones(height, width)
    else:
        img = media.open_image(part.path)
        if part.params["mask"] == "alpha":
            has_alpha = "A" in img.getbands() or "transparency" in img.info
            img = img.convert("RGBA").getchannel("A") if has_alpha else None
        gray = (img if img is not None else Image.new("L", (width, height), 255)).convert("L")
        m = fit(gray, (width, height))
        m = m.flip(-1) if part.params.get("flip") else m
    m = torch.nn.functional.avg_pool2d(m.reshape(1, 1, height, width), MASK_DOWNSCALE)
    return m.to(torch.float16).contiguous()


def mask_encoder(batch_size: int) -> Encoder:
    """Loss masks, cached beside the latents: no model involved, so the fingerprint is the format's own."""
    return Encoder("mask:v1", lambda masks: [{"mask": m} for m in masks], {"downscale": MASK_DOWNSCALE}, batch_size,
                   prepare=_mask)


def tensor_items(images: torch.Tensor, captions: str) -> list[Item]:
    lines = captions.splitlines() if captions else []
    items = []
    for i in range(images.shape[0]):
        img = images[i].detach().to("cpu", torch.float32).contiguous()
        caption = lines[min(i, len(lines) - 1)].strip() if lines else ""
        items.append(Item(f"image{i:05d}", {
            "latent": Part(data=img.numpy().tobytes(), params={"shape": list(img.shape)}),
            "cond": Part(data=caption.encode("utf-8"))}))
    return items
