"""EncodeDataset: images + captions -> VAE latents and text conditionings in a streaming cache."""

from __future__ import annotations

import os

import torch

import comfy.model_management
import comfy.utils
from comfy_api.latest import io

from ..streaming_cache.builder import Item, Part, build
from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.layout import INDEX_NAME
from ..streaming_cache.train.captions import caption_variants
from ..streaming_cache.train.folder import folder_items, folder_stamp
from .encoders import FolderParts, image_encoder, mask_encoder, tensor_items, text_encoder
from .folders import EMPTY_CAPTION, MANIFEST, cache_path, dataset_path
from .ui import StreamingDataset, node_schema, log, show_text



DESCRIPTION = ("Encodes a folder of images or video clips with kohya-style captions (name.txt beside name.png; "
               "N_name folders repeat N times; each caption line is a variant) into an on-disk cache of VAE "
               "latents and text conditionings. Edit pairs: name_ref.png (or ref/name.png) beside each target. "
               "Loss masks: name_mask.png (white counts). Only new or changed files are encoded; cancel keeps "
               "everything finished and the next run resumes.")


def _inputs() -> list:
    return [
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
        io.Int.Input("frames", default=33, min=1, max=1025,
                     tooltip="Video clips: frames per clip (rounded down to what the video VAE encodes whole, "
                             "e.g. 1+4k for Wan/HunyuanVideo). Images are not affected."),
        io.Float.Input("fps", default=0.0, min=0.0, max=240.0, step=0.5,
                       tooltip="Video clips: frames sampled per second (0: every frame, at the clip's own rate). "
                               "Lower it to cover more time with the same frame count."),
        io.Float.Input("start", default=0.0, min=0.0, max=86400.0, step=0.1,
                       tooltip="Video clips: seconds skipped at the start of every clip (temporal crop)."),
        io.Int.Input("caption_shuffles", default=0, min=0, max=16,
                     tooltip="Extra caption variants per caption with its comma-separated tags shuffled (kohya's "
                             "shuffle_caption, cached: each variant is encoded once). 0 = off."),
        io.Int.Input("keep_tokens", default=1, min=0, max=64,
                     tooltip="Leading tags that stay in place when tags are shuffled (e.g. the trigger word)."),
        io.Boolean.Input("alpha_as_mask", default=False,
                         tooltip="Use each image's transparency as its loss mask (transparent areas do not count) "
                                 "when it has no name_mask file. Off: only name_mask files make masks."),
        io.Image.Input("images", optional=True,
                       tooltip="Optional images from other nodes, used instead of the folder."),
        io.String.Input("captions", optional=True, multiline=True, default="",
                        tooltip="With connected images: one caption per line, matched to images in order "
                                "(the last line repeats)."),
    ]


def _outputs() -> list:
    return [
        StreamingDataset.Output("dataset", display_name="dataset",
                                tooltip="The cached dataset (a lazy handle: holds no tensors)."),
        io.String.Output("report", display_name="report",
                         tooltip="Encoded / reused / failed counts and any failures."),
    ]


def shuffled_variants(captions: tuple[str, ...], shuffles: int, keep_tokens: int) -> tuple[str, ...]:
    """Each caption followed by ``shuffles`` tag-shuffled variants of it (seeded by the caption, so a re-run
    asks for the same variants and encodes nothing new)."""
    if shuffles <= 0:
        return captions
    out: list[str] = []
    for caption in captions:
        out += [v for v in caption_variants(caption, shuffles=shuffles, keep_tokens=keep_tokens, seed=0)
                if v not in out]
    return tuple(out)


class EncodeDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema("StreamingCacheEncodeDataset", "Encode Dataset (streaming cache)", DESCRIPTION,
                           _inputs(), _outputs(), output_node=True)

    @classmethod
    def fingerprint_inputs(cls, vae, clip, folder, cache_name, resolution, batch_size, frames, fps, start,
                           caption_shuffles, keep_tokens, alpha_as_mask, images=None, captions=""):
        try:
            stamp = "" if images is not None else folder_stamp(dataset_path(folder))
            index = os.path.join(cache_path(cache_name), INDEX_NAME)
            st = os.stat(index) if os.path.exists(index) else None
            return (stamp, None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size))
        except Exception as exc:  # the node itself reports bad inputs
            return repr(exc)

    @classmethod
    def execute(cls, vae, clip, folder, cache_name, resolution, batch_size, frames, fps, start, caption_shuffles,
                keep_tokens, alpha_as_mask, images=None, captions="") -> io.NodeOutput:
        if vae is None or clip is None:
            raise ValueError("EncodeDataset needs both a VAE and a CLIP; the checkpoint loader gave none for one "
                             "of them. Load them with a VAE Loader / CLIP Loader node.")
        path = cache_path(cache_name)
        if images is not None:
            items, problems = tensor_items(images, captions or ""), []
        else:
            parts = FolderParts(resolution, frames=frames, fps=fps, start=start, alpha_masks=alpha_as_mask)
            items, problems = folder_items(dataset_path(folder), media_part=parts.media,
                                           reference_part=parts.reference, mask_part=parts.mask,
                                           masks=True if alpha_as_mask else None,
                                           captions=lambda s: shuffled_variants(s.captions, caption_shuffles,
                                                                                keep_tokens))
        if not items:
            raise ValueError(f"no images found in dataset folder {folder!r} (looked for .png, .jpg, .jpeg, .webp, "
                             f".bmp images and .mp4, .webm, .mov, .gif, .mkv, .avi, .m4v clips)"
                             f"{'; problems: ' + '; '.join(problems[:3]) if problems else ''}")
        node_id = cls.hidden.unique_id
        pbar = comfy.utils.ProgressBar(1, node_id=node_id)
        images_vae = image_encoder(vae, resolution, batch_size)
        encoders = {"latent": images_vae, "cond": text_encoder(clip, batch_size)}
        columns = set().union(*(item.parts for item in items))
        if "ref" in columns:
            encoders["ref"] = images_vae
        if "mask" in columns:
            encoders["mask"] = mask_encoder(batch_size)
        with torch.inference_mode():
            report = build(path, items, encoders, manifest=MANIFEST,
                           should_stop=comfy.model_management.processing_interrupted,
                           progress=lambda done, total: pbar.update_absolute(done, max(total, 1)),
                           commit_seconds=30.0)
            if not report.stopped and report.rows:
                build(path, [Item("empty caption", {"cond": Part(data=b"")})], {"cond": encoders["cond"]},
                      manifest=EMPTY_CAPTION, commit_seconds=30.0)
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
