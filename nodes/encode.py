"""Encode Dataset: a folder of images or clips (or images from other nodes) + captions -> VAE latents and text
conditionings in a streaming cache; and its option node (video clips, caption variants, masks).

A first dataset needs only the VAE, the text encoder, a folder and a name; clips, tag shuffling and alpha masks
are set on Encode Options. Only new or changed items are encoded (the cache is content-addressed); Cancel keeps
everything finished, says so on the node, and the next run resumes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from comfy_api.latest import io

from ..streaming_cache.builder import Item, Part, build
from ..streaming_cache.dataset import DatasetHandle, shared_reader
from ..streaming_cache.group import Group
from ..streaming_cache.layout import INDEX_NAME
from ..streaming_cache.train import presets
from ..streaming_cache.train.buckets import BucketRule, parse_resolutions
from ..streaming_cache.train.captions import caption_variants
from ..streaming_cache.train.folder import (
    AUDIO_EXTENSIONS,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    folder_items,
    folder_stamp,
)
from . import dataset_preview
from .backend import compat, media
from .encoders import (
    AUDIO_COLUMN,
    START_COLUMN,
    FolderParts,
    audio_encoder,
    image_encoder,
    mask_encoder,
    sound_track_encoder,
    start_frame_encoder,
    tensor_items,
    text_encoder,
)
from .folders import EMPTY_CAPTION, MANIFEST, NO_FOLDERS, cache_path, dataset_folders, dataset_path
from .ui import EncodeOptionsType, StreamingDataset, cancels, log, new_run, node_schema, note_cancel, show_text

DESCRIPTION = ("Encodes a folder of images, video clips or audio files (with an audio VAE) with kohya-style "
               "captions (name.txt beside name.png or song.wav; N_name folders repeat N times; each caption line "
               "is a variant) into an on-disk cache of VAE "
               "latents and text conditionings, which Train LoRA streams from disk. Edit pairs: name_ref.png (or "
               "ref/name.png) beside each target. Loss masks: name_mask.png (white counts). Only new or changed "
               "files are encoded; cancel keeps everything finished and the next run resumes. Video, tag shuffling, "
               "alpha masks, image-to-video start frames and clips' sound tracks: Encode Options.")
OPTIONS_DESCRIPTION = ("Settings of Encode Dataset beyond a folder of images: video clips (frames, frame rate, "
                       "start), tag-shuffled caption variants, transparency as loss mask, start frames for "
                       "image-to-video models, audio length, and clips' sound tracks for audio-video models.")


@dataclass(frozen=True)
class EncodeOptions:
    """Encode Dataset's settings beyond images and captions (each is part of the cache key where it changes
    what is encoded, so changing one re-encodes only what it affects)."""

    frames: int = 33
    fps: float = 0.0
    start: float = 0.0
    caption_shuffles: int = 0
    keep_tokens: int = 1
    alpha_as_mask: bool = False
    start_frames: str = "off"
    clip_vision: Any = None
    audio_duration: float = 0.0
    audio_vae: Any = None
    preview_page: int = 1
    tag_dropout: float = 0.0
    flip_augmentation: bool = False
    resolutions: str = ""
    bucket_step: int = 64
    min_bucket_side: int = 0
    max_bucket_side: int = 0

    @property
    def buckets(self) -> BucketRule:
        """The bucket step and side limits (``streaming_cache.train.buckets.BucketRule``)."""
        return BucketRule(self.bucket_step, self.min_bucket_side, self.max_bucket_side)


def option_inputs(**kw: Any) -> list:
    """The inputs of :class:`EncodeOptions` (``kw``: e.g. ``optional=True`` for the legacy node)."""
    d = EncodeOptions()
    return [
        io.Int.Input("frames", default=d.frames, min=1, max=1025,
                     tooltip="Video clips: frames per clip (rounded down to what the video VAE encodes whole, "
                             "e.g. 1+4k for Wan/HunyuanVideo). Images are not affected.", **kw),
        io.Float.Input("fps", default=d.fps, min=0.0, max=240.0, step=0.5,
                       tooltip="Video clips: frames sampled per second (0: every frame, at the clip's own rate). "
                               "Lower it to cover more time with the same frame count.", **kw),
        io.Float.Input("start", default=d.start, min=0.0, max=86400.0, step=0.1,
                       tooltip="Video clips and audio files: seconds skipped at the start of every clip or sound "
                               "(temporal crop).", **kw),
        io.Int.Input("caption_shuffles", default=d.caption_shuffles, min=0, max=16,
                     tooltip="Extra caption variants per caption with its comma-separated tags shuffled (kohya's "
                             "shuffle_caption, cached: each variant is encoded once). 0 = off.", **kw),
        io.Int.Input("keep_tokens", default=d.keep_tokens, min=0, max=64,
                     tooltip="Leading tags that stay in place when tags are shuffled (e.g. the trigger word).", **kw),
        io.Boolean.Input("alpha_as_mask", default=d.alpha_as_mask,
                         tooltip="Use each image's transparency as its loss mask (transparent areas do not count) "
                                 "when it has no name_mask file. Off: only name_mask files make masks.", **kw),
    ]


START_FRAMES_OFF = "off"
FLIPPED_COLUMNS = frozenset({"latent", "ref", "mask", START_COLUMN})
"""The columns a flipped copy mirrors (its caption and a clip's sound track stay as they are)."""


def added_option_inputs() -> list:
    """Encode Options' inputs added after release 0.4.0 (appended, so saved workflows keep their values)."""
    return [
        io.Combo.Input("start_frames", options=[START_FRAMES_OFF, *media.available_nodes(media.START_FRAME_NODES)],
                       default=START_FRAMES_OFF, optional=True,
                       tooltip="Image-to-video training: each clip's first frame (and last, for first/last-frame "
                               "nodes) goes through this ComfyUI node as your generation workflow runs it, and what "
                               "the node adds to the conditioning (concat latent and mask, CLIP vision output) or "
                               "the latent (noise mask) is cached with the clip. Pick the node of your model's I2V "
                               "workflow; off: text-to-video."),
        io.ClipVision.Input("clip_vision", optional=True,
                            tooltip="For start-frame nodes that take a CLIP vision output (Wan 2.1 image-to-video, "
                                    "first/last frame): the CLIP vision model that encodes the frames."),
        io.Float.Input("audio_duration", default=0.0, min=0.0, max=86400.0, step=0.1, optional=True,
                       tooltip="Audio files (with an audio VAE on Encode Dataset, e.g. Stable Audio or ACE-Step): "
                               "seconds of each file encoded, from start on. 0: the whole file. Changing it "
                               "re-encodes only the audio files."),
        io.Vae.Input("audio_vae", optional=True,
                     tooltip="Audio-video training (LTX-2, MiniMax H3): the audio VAE that encodes each clip's sound "
                             "track over the clip's frames (same start, frames and fps) into the audio column, as "
                             "LTXV Audio VAE Encode does. A clip without a sound track fails on its own. Leave "
                             "unconnected for video without sound."),
        dataset_preview.page_input(),
        io.Float.Input("tag_dropout", default=0.0, min=0.0, max=1.0, step=0.05, optional=True,
                       tooltip="Caption variants (caption_shuffles) also leave each tag after the first keep_tokens "
                               "out with this probability, as kohya's caption_tag_dropout_rate (cached: each variant "
                               "is encoded once). Needs caption_shuffles of 1 or more. 0 = off."),
        io.Boolean.Input("flip_augmentation", default=False, optional=True,
                         tooltip="Also encode every image and clip mirrored left to right (with its edit reference, "
                                 "loss mask and start frames), as kohya's flip_aug: an epoch holds each sample "
                                 "twice, once each way. Off for subjects whose sides differ (text, asymmetric "
                                 "faces, logos)."),
        io.String.Input("resolutions", default="", optional=True,
                        tooltip="More training resolutions from the same folder, in one cache: '512, 768' encodes "
                                "every image and clip at these too, beside Encode Dataset's resolution (ai-toolkit's "
                                "resolution: [512, 768, 1024]); each size trains in buckets of its own. Empty: only "
                                "Encode Dataset's resolution."),
        io.Int.Input("bucket_step", default=64, min=16, max=128, step=16, optional=True,
                     tooltip="Bucket sides are multiples of this (kohya's bucket_reso_steps): 16, 32, 64 or 128. 64 "
                             "suits every model; 16 or 32 fit aspect ratios more closely on Flux, SD3, Qwen-Image "
                             "and other DiTs with 2x2 patches, not on SD1.x or SDXL."),
        io.Int.Input("min_bucket_side", default=0, min=0, max=4096, step=64, optional=True,
                     tooltip="No bucket side shorter than this (kohya's min_bucket_reso); 0: no limit. Very wide or "
                             "tall images then get a larger bucket instead of a thin one."),
        io.Int.Input("max_bucket_side", default=0, min=0, max=8192, step=64, optional=True,
                     tooltip="No bucket side longer than this (kohya's max_bucket_reso); 0: no limit."),
    ]


DEFAULT_RESOLUTION = 512


def size_inputs() -> list:
    return [
        io.Int.Input("resolution", default=DEFAULT_RESOLUTION, min=0, max=4096, step=64,
                     tooltip="Training resolution: each image is resized and centre-cropped to the aspect "
                             "bucket with about resolution x resolution pixels (1024 for SDXL, Flux and newer; 512 "
                             "for SD1.5). 0 keeps each image's own size (rounded down to 64)."),
        io.Int.Input("batch_size", default=4, min=1, max=64,
                     tooltip="Images per VAE call. A failing batch is retried image by image, so one "
                             "bad file fails only itself."),
    ]


def cache_name_input() -> io.Input:
    return io.String.Input("cache_name", default="my_dataset",
                           tooltip="Name of the cache, created in ComfyUI's datasets folder (output/streaming_caches "
                                   "on ComfyUI versions without one). Reusing a name adds to that cache: unchanged "
                                   "items are not encoded again.")


def encoders_inputs() -> list:
    return [io.Vae.Input("vae", tooltip="The VAE that encodes the images into latents."),
            io.Clip.Input("clip", tooltip="The text encoder that encodes the captions.")]


def images_inputs(**kw: Any) -> list:
    return [io.Image.Input("images", optional=True,
                           tooltip="Optional images from other nodes, used instead of the folder."),
            io.String.Input("captions", optional=True, multiline=True, default="",
                            tooltip="With connected images: one caption per line, matched to images in order (the "
                                    "last line repeats).", **kw)]


def outputs() -> list:
    return [
        StreamingDataset.Output("dataset", display_name="dataset",
                                tooltip="The cached dataset (a lazy handle: holds no tensors)."),
        io.String.Output("report", display_name="report", tooltip="Encoded / reused / failed counts and any failures."),
        dataset_preview.output(),
    ]


def shuffled_variants(captions: tuple[str, ...], shuffles: int, keep_tokens: int,
                      tag_dropout: float = 0.0) -> tuple[str, ...]:
    """Each caption followed by ``shuffles`` tag-shuffled variants of it, with ``tag_dropout`` of their tags left
    out (seeded by the caption, so a re-run asks for the same variants and encodes nothing new)."""
    if shuffles <= 0:
        return captions
    out: list[str] = []
    for caption in captions:
        out += [v for v in caption_variants(caption, shuffles=shuffles, keep_tokens=keep_tokens, seed=0,
                                            tag_dropout=tag_dropout) if v not in out]
    return tuple(out)


def _folder_at(folder: str, resolution: int, o: EncodeOptions, *, own: bool) -> tuple[list[Item], list[str]]:
    """The folder's items at ``resolution``; ``own``: one of Encode Options' ``resolutions`` beside Encode Dataset's
    own, whose items are named ``name @resolution`` and whose images and clips carry it in their keys (audio
    files, which have no resolution, come once, with Encode Dataset's own)."""
    parts = FolderParts(resolution, frames=o.frames, fps=o.fps, start=o.start, alpha_masks=o.alpha_as_mask,
                        audio_duration=o.audio_duration, own_resolution=own, rule=o.buckets)
    extra: dict = {START_COLUMN: parts.start} if o.start_frames != START_FRAMES_OFF else {}
    if o.audio_vae is not None:
        extra[AUDIO_COLUMN] = parts.sound_track
    items, problems = folder_items(dataset_path(folder), media_part=parts.media, reference_part=parts.reference,
                                   mask_part=parts.mask, masks=True if o.alpha_as_mask else None,
                                   captions=lambda s: shuffled_variants(s.captions, o.caption_shuffles,
                                                                        o.keep_tokens, o.tag_dropout),
                                   extra_parts=extra or None,
                                   flip_columns=FLIPPED_COLUMNS if o.flip_augmentation else frozenset())
    if own:
        items = [dataclasses.replace(i, name=f"{i.name} @{resolution}") for i in items
                 if i.parts["latent"].params.get("resolution") == resolution]
    return items, problems


def encode_fingerprint(folder: str, cache_name: str, images: Any = None) -> tuple:
    """Whether a queued Encode Dataset with unchanged inputs must run again: the folder's files (sizes and
    times), the cache's index, and the cancels so far."""
    try:
        stamp = "" if images is not None else folder_stamp(dataset_path(folder))
        index = os.path.join(cache_path(cache_name), INDEX_NAME)
        st = os.stat(index) if os.path.exists(index) else None
        return stamp, None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size), cancels()
    except Exception as exc:  # the node itself reports bad inputs
        return repr(exc), cancels()


def encode_dataset(node_id: str | None, vae: Any, clip: Any, folder: str, cache_name: str, resolution: int,
                   batch_size: int, options: EncodeOptions, images: Any = None, captions: str = "",
                   notes: Sequence[str] = ()) -> io.NodeOutput:
    """Encode the folder (or the images) into the cache; the node's outputs with its summary as ``ui`` text
    (``notes``: lines after its first)."""
    new_run()
    if vae is None or clip is None:
        raise ValueError("Encode Dataset needs both a VAE and a CLIP; the checkpoint loader gave none for one of "
                         "them. Load them with a VAE Loader / CLIP Loader node.")
    path = cache_path(cache_name)
    if images is not None:
        if options.start_frames != START_FRAMES_OFF:
            raise ValueError("start_frames (image-to-video) needs a folder of video clips; it cannot be used with "
                             "connected images. Set start_frames to off on Encode Options, or encode a folder.")
        if options.audio_vae is not None:
            raise ValueError("audio_vae (audio-video training) needs a folder of video clips with sound; it cannot "
                             "be used with connected images. Disconnect it on Encode Options, or encode a folder.")
        if options.flip_augmentation or parse_resolutions(options.resolutions):
            raise ValueError("flip_augmentation and resolutions make more items of a folder's files; they cannot be "
                             "used with connected images. Turn them off on Encode Options, or encode a folder.")
        items, problems = tensor_items(images, captions or ""), []
    else:
        if folder == NO_FOLDERS:
            raise ValueError(f"no dataset folder: put your images (with name.txt captions) in a folder under "
                             f"{compat.input_folder()}, then refresh the page (R) and pick it")
        o = options
        if o.tag_dropout > 0 and o.caption_shuffles == 0:
            raise ValueError(f"tag_dropout {o.tag_dropout:g} leaves tags out of caption variants, and "
                             "caption_shuffles is 0 (none are made): set caption_shuffles on Encode Options to the "
                             "number of variants per caption (4 gives each caption 4 more), or tag_dropout to 0")
        items, problems = [], []
        for size in dict.fromkeys((resolution, *parse_resolutions(o.resolutions))):
            found, trouble = _folder_at(folder, size, o, own=size != resolution)
            items += found
            problems = list(dict.fromkeys(problems + trouble))  # a folder's problems, once
    if not items:
        raise ValueError(f"no images found in dataset folder {folder!r} (looked for {', '.join(IMAGE_EXTENSIONS)} "
                         f"images, {', '.join(VIDEO_EXTENSIONS)} clips and {', '.join(AUDIO_EXTENSIONS)} audio)"
                         f"{'; problems: ' + '; '.join(problems[:3]) if problems else ''}")
    group = Group.current()
    main = group is None or group.is_main
    pbar = compat.progress_bar(1, node_id)
    images_vae = audio_encoder(vae, batch_size) if media.is_audio_vae(vae) else \
        image_encoder(vae, resolution, batch_size, options.buckets)
    encoders = {"latent": images_vae, "cond": text_encoder(clip, batch_size)}
    columns = set().union(*(item.parts for item in items))
    if "ref" in columns:
        encoders["ref"] = images_vae
    if "mask" in columns:
        encoders["mask"] = mask_encoder(batch_size)
    if AUDIO_COLUMN in columns:
        encoders[AUDIO_COLUMN] = sound_track_encoder(options.audio_vae, vae, batch_size)
    if START_COLUMN in columns:
        encoders[START_COLUMN] = start_frame_encoder(vae, options.clip_vision, options.start_frames, resolution,
                                                     batch_size, options.buckets)
    with torch.inference_mode():
        report = build(path, items, encoders, manifest=MANIFEST, should_stop=compat.interrupt_requested,
                       progress=(lambda done, total: pbar.update_absolute(done, max(total, 1))) if main else None,
                       commit_seconds=30.0, group=group)
        if not report.stopped and report.rows:
            build(path, [Item("empty caption", {"cond": Part(data=b"")})], {"cond": encoders["cond"]},
                  manifest=EMPTY_CAPTION, commit_seconds=30.0, group=group)
    lines = [f"encoded {report.encoded}, reused {report.reused}, failed {report.failed + len(problems)} "
             f"({report.rows} samples, {report.deduplicated} duplicate captions shared) in {report.seconds:.1f}s"]
    if group is not None:
        lines[0] += f" by {group.world_size} processes"
        if not main:
            lines.insert(0, f"rank {group.rank} of {group.world_size}: encoded its share; rank 0 wrote the cache")
    if report.stopped:
        lines.insert(0, f"cancelled: {report.encoded} items encoded so far are kept in {cache_name}; queue again to "
                        "encode the rest")
    lines += list(notes)
    lines += [f"failed: {f.item}: {f.error}" for f in report.failures[:10]]
    lines += [f"failed: {p}" for p in problems[:10]]
    text = "\n".join(lines)
    blank = dataset_preview.blank()
    if report.stopped or report.rows == 0 or not main:
        show_text(node_id, text)
    if report.stopped:
        log.info("encoding cancelled; finished items are kept and the next run resumes")
        note_cancel()
        compat.interrupt()  # the rest of the prompt stops, as Cancel asked
        return io.NodeOutput(DatasetHandle(), text, blank, ui={"text": [text]})
    if report.rows == 0:
        raise ValueError(f"every item failed to encode, nothing to train on:\n{text}")
    handle = DatasetHandle.from_cache(path, MANIFEST)
    if not main:
        return io.NodeOutput(handle, text, blank, ui={"text": [text]})
    page = 0 if media.is_audio_vae(vae) else options.preview_page  # sound has no picture to show
    image, shown, line = dataset_preview.preview(shared_reader(path), MANIFEST, page, name=cache_name,
                                                 captions=dataset_preview.captions_of(items),
                                                 scale=dataset_preview.vae_scale(vae))
    text += f"\n{line}" if line else ""
    show_text(node_id, text)
    return io.NodeOutput(handle, text, image, ui={"text": [text], **shown})


class EncodeDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = encoders_inputs() + [
            io.Combo.Input("folder", options=dataset_folders(),
                           tooltip="A folder under ComfyUI's input folder holding the images or clips (refresh the "
                                   "page, R, after adding one). Ignored when images are connected."),
            cache_name_input(), *size_inputs(),
            EncodeOptionsType.Input("options", optional=True,
                                    tooltip="From Encode Options: video clips, caption variants, alpha masks."),
            *images_inputs(),
            io.Combo.Input(  # added after 0.5.0: last; files saved before it read "none"
                "preset", options=list(presets.PRESET_CHOICES), default="none", optional=True,
                tooltip="auto: a resolution left at 512 becomes the native resolution of the model family whose "
                        "text encoder the CLIP is (1024 for SDXL, SD3, Flux, Lumina 2, Z-Image; 1328 for Qwen-Image; "
                        "512 for SD1.5), and the summary says so; a resolution you change is kept. none: the "
                        "resolution as set (workflows saved before presets came).")]
        return node_schema("StreamingCacheEncode", "Encode Dataset (streaming cache)", DESCRIPTION, inputs, outputs(),
                           output_node=True, search_aliases=["dataset", "cache latents", "training dataset"])

    @classmethod
    def fingerprint_inputs(cls, folder: str = "", cache_name: str = "", images: Any = None, **_: Any) -> tuple:
        return encode_fingerprint(folder, cache_name, images)

    @classmethod
    def execute(cls, vae: Any, clip: Any, folder: str, cache_name: str, resolution: int, batch_size: int,
                options: EncodeOptions | None = None, images: Any = None, captions: str = "",
                preset: str = "none") -> io.NodeOutput:
        presets.check_preset(preset)
        notes = []
        if preset == "auto" and clip is not None:
            resolution, note = presets.resolution_note(resolution, DEFAULT_RESOLUTION, compat.tokenizer_name(clip))
            notes.append(note)
        return encode_dataset(cls.hidden.unique_id, vae, clip, folder, cache_name, resolution, batch_size,
                              options or EncodeOptions(), images, captions, notes=notes)


class EncodeOptionsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        outputs = [EncodeOptionsType.Output("options_out", display_name="options",
                                            tooltip="To Encode Dataset's options.")]
        return node_schema("StreamingCacheEncodeOptions", "Encode Options (streaming cache)", OPTIONS_DESCRIPTION,
                           option_inputs(optional=True) + added_option_inputs(), outputs)

    @classmethod
    def execute(cls, **values: Any) -> io.NodeOutput:
        return io.NodeOutput(EncodeOptions(**values))
