"""EncodeDataset: images + captions -> VAE latents and text conditionings in a streaming cache."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

import comfy.model_management
import comfy.utils
import node_helpers
from comfy_api.latest import io

from ..streaming_cache.buckets import bucket_size, crop_box
from ..streaming_cache.builder import Encoder, Item, Part, build
from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.fingerprint import fingerprint_tensors
from ..streaming_cache.folder import folder_items, folder_stamp
from ..streaming_cache.format import INDEX_NAME
from .common import StreamingDataset, cache_path, dataset_path, log, show_text

MANIFEST = "default"


def vae_fingerprint(vae: Any) -> str:
    return "vae:" + fingerprint_tensors(vae.first_stage_model.state_dict(),
                                        extra=(type(vae.first_stage_model).__name__, str(vae.vae_dtype)))


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


# Weights ComfyUI may leave uninitialised because checkpoints lack them (SD1.x has no text projection; ComfyUI
# ignores both when it reports missing keys): their bytes differ from load to load, so they cannot be hashed.
_NOT_LOADED = ("text_projection.weight", "logit_scale")


def clip_fingerprint(clip: Any) -> str:
    """Weights, clip-skip layer and any LoRA patches applied to the text encoder."""
    patches = getattr(getattr(clip, "patcher", None), "patches", {}) or {}
    strengths = sorted((k, [(p[0], p[2]) for p in v]) for k, v in patches.items())
    extra = (type(clip.cond_stage_model).__name__, getattr(clip, "layer_idx", None), strengths)
    weights = [(k, v) for k, v in clip.cond_stage_model.state_dict().items() if not k.endswith(_NOT_LOADED)]
    return "clip:" + fingerprint_tensors(weights + _patch_tensors(patches), extra=extra)


def load_image(path: str) -> Image.Image:
    img = node_helpers.pillow(Image.open, path)
    img = node_helpers.pillow(ImageOps.exif_transpose, img)
    if img.mode == "I":
        img = img.point(lambda i: i * (1 / 255))
    return img.convert("RGB")


def to_bucket(img: Image.Image, resolution: int) -> torch.Tensor:
    """Cover-resize and centre-crop to the image's aspect bucket; [H, W, 3] floats in 0..1."""
    bucket = bucket_size(img.width, img.height, resolution)
    scale, left, top, right, bottom = crop_box(img.width, img.height, bucket)
    size = (max(bucket[0], round(img.width * scale)), max(bucket[1], round(img.height * scale)))
    if size != img.size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    img = img.crop((left, top, right, bottom))
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)


def image_encoder(vae: Any, resolution: int, batch_size: int) -> Encoder:
    def encode(parts: list[Part]) -> list[dict[str, torch.Tensor]]:
        pixels = []
        for p in parts:
            if p.path is not None:
                pixels.append(to_bucket(load_image(p.path), resolution))
            else:  # an IMAGE from another node, carried as float32 bytes
                h, w, c = p.params["shape"]
                arr = torch.frombuffer(bytearray(p.data or b""), dtype=torch.float32).reshape(h, w, c)[..., :3]
                img = Image.fromarray((arr.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
                pixels.append(to_bucket(img, resolution))
        out: list[Any] = [None] * len(parts)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixels):
            by_shape.setdefault(tuple(px.shape), []).append(i)
        for idx in by_shape.values():
            latents = vae.encode(torch.stack([pixels[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i] = {"samples": latents[j:j + 1].to("cpu").contiguous()}
        return out

    return Encoder(vae_fingerprint(vae), encode, {"resolution": resolution, "bucket_step": 64}, batch_size)


def text_encoder(clip: Any, batch_size: int) -> Encoder:
    def encode(parts: list[Part]) -> list[Any]:
        out = []
        for p in parts:
            text = (p.data or b"").decode("utf-8")
            cond = clip.encode_from_tokens_scheduled(clip.tokenize(text))
            out.append([[c.to("cpu").contiguous(), {k: (v.to("cpu").contiguous() if isinstance(v, torch.Tensor) else v)
                                                     for k, v in extra.items()}] for c, extra in cond])
        return out

    return Encoder(clip_fingerprint(clip), encode, {}, batch_size)


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


class EncodeDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamingCacheEncodeDataset",
            display_name="Encode Dataset (streaming cache)",
            category="training/streaming cache",
            description="Encodes a folder of images with kohya-style captions (name.txt beside name.png; N_name "
                        "folders repeat N times; each caption line is a variant) into an on-disk cache of VAE "
                        "latents and text conditionings. Only new or changed images and captions are encoded; "
                        "cancel keeps everything finished and the next run resumes.",
            is_output_node=True,
            inputs=[
                io.Vae.Input("vae", tooltip="The VAE that encodes the images into latents."),
                io.Clip.Input("clip", tooltip="The text encoder that encodes the captions."),
                io.String.Input("folder", default="dataset",
                                tooltip="Dataset folder, relative to ComfyUI's input folder (or an absolute path "
                                        "inside the input or output folder). Ignored when images are connected."),
                io.String.Input("cache_name", default="my_dataset",
                                tooltip="Name of the cache, created in ComfyUI's datasets folder (output/streaming_caches "
                                        "on ComfyUI versions without one). Reusing a name adds to that cache: "
                                        "unchanged items are not encoded again."),
                io.Int.Input("resolution", default=512, min=0, max=4096, step=64,
                             tooltip="Training resolution: each image is resized and centre-cropped to the aspect "
                                     "bucket with about resolution x resolution pixels. 0 keeps each image's own "
                                     "size (rounded down to 64)."),
                io.Int.Input("batch_size", default=4, min=1, max=64,
                             tooltip="Images per VAE call. A failing batch is retried image by image, so one "
                                     "bad file fails only itself."),
                io.Image.Input("images", optional=True,
                               tooltip="Optional images from other nodes, used instead of the folder."),
                io.String.Input("captions", optional=True, multiline=True, default="",
                                tooltip="With connected images: one caption per line, matched to images in order "
                                        "(the last line repeats)."),
            ],
            outputs=[
                StreamingDataset.Output("dataset", display_name="dataset",
                                        tooltip="The cached dataset (a lazy handle: holds no tensors)."),
                io.String.Output("report", display_name="report",
                                 tooltip="Encoded / reused / failed counts and any failures."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, vae, clip, folder, cache_name, resolution, batch_size, images=None, captions=""):
        try:
            stamp = "" if images is not None else folder_stamp(dataset_path(folder))
            index = os.path.join(cache_path(cache_name), INDEX_NAME)
            st = os.stat(index) if os.path.exists(index) else None
            return (stamp, None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size))
        except Exception as exc:  # the node itself reports bad inputs
            return repr(exc)

    @classmethod
    def execute(cls, vae, clip, folder, cache_name, resolution, batch_size, images=None, captions="") -> io.NodeOutput:
        if vae is None or clip is None:
            raise ValueError("EncodeDataset needs both a VAE and a CLIP; the checkpoint loader gave none for one "
                             "of them. Load them with a VAE Loader / CLIP Loader node.")
        path = cache_path(cache_name)
        if images is not None:
            items, problems = tensor_items(images, captions or ""), []
        else:
            items, problems = folder_items(dataset_path(folder))
        if not items:
            raise ValueError(f"no images found in dataset folder {folder!r} (looked for .png, .jpg, .jpeg, .webp, "
                             f".bmp files){'; problems: ' + '; '.join(problems[:3]) if problems else ''}")
        node_id = cls.hidden.unique_id
        pbar = comfy.utils.ProgressBar(1, node_id=node_id)
        encoders = {"latent": image_encoder(vae, resolution, batch_size), "cond": text_encoder(clip, batch_size)}
        with torch.inference_mode():
            report = build(path, items, encoders, manifest=MANIFEST,
                           should_stop=comfy.model_management.processing_interrupted,
                           progress=lambda done, total: pbar.update_absolute(done, max(total, 1)),
                           commit_seconds=30.0)
        lines = [f"encoded {report.encoded}, reused {report.reused}, failed {report.failed + len(problems)} "
                 f"({report.rows} samples, {report.deduplicated} duplicate captions shared) in {report.seconds:.1f}s"]
        lines += [f"failed: {f.item}: {f.error}" for f in report.failures[:10]]
        lines += [f"failed: {p}" for p in problems[:10]]
        text = "\n".join(lines)
        show_text(node_id, text)
        if report.stopped:
            log.info("encoding cancelled; finished items are kept and the next run resumes")
            raise comfy.model_management.InterruptProcessingException()
        if report.rows == 0:
            raise ValueError(f"every item failed to encode, nothing to train on:\n{text}")
        handle = DatasetHandle.from_cache(path, MANIFEST)
        return io.NodeOutput(handle, text, ui={"text": [text]})
