"""What each model family needs in training beyond ComfyUI's own preparation, in one table.

Training runs the model through ComfyUI's conditioning code (``extra_conds`` of its ``model_base`` class), so a
family trains the way it samples once its conditioning holds what ComfyUI's nodes put there. The text encoders'
part is the cached ``cond`` column. What a conditioning node adds per sample (an image-to-video start frame, an
edit pair's reference, a CLIP vision output) comes from the dataset's other columns, and this module says which
for each family:

* :data:`FAMILIES` maps a ``model_base`` class name to its :class:`Needs`; a class not listed takes the entry of
  its nearest listed base class (``WAN22_S2V`` is a ``WAN21``), ``BaseModel`` is every model's fallback.
* A column named after a conditioning key the family reads goes into each sample's conditioning under that key
  (``concat_latent_image``, ``concat_mask``, ``clip_vision_output``, ...), shaped as the node that sets it
  shapes it (:data:`KEY_KINDS`: a LATENT's samples, a tensor, or a CLIP vision output rebuilt from its tensors).
* ``start`` (what an image-to-video node set for a clip's first frame, cached by Encode Dataset's
  ``start_frames``) sets each conditioning key that node set, and its latent ``noise_mask`` where it gave one.
* ``ref`` (an edit pair's reference latent) is appended to ``reference_latents`` as ReferenceLatent does.
* A latent's ``noise_mask`` (LTXVImgToVideo, Wan22ImageToVideoLatent: 0 on the given start frames) is honoured
  by the loss (``training.py``) for every family, as ComfyUI's samplers honour it for every model.
* ``audio`` (the sound track's latent) joins the video latent for joint audio-video models, as
  LTXVConcatAVLatent does.
* Guidance-distilled models (:func:`compat.guidance_distilled`) get the run's ``guidance`` where the cached
  conditioning has none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...streaming_cache.train.conditioning import append_reference, flatten_batch, set_default, set_values
from . import compat

LATENT, TENSOR, CLIP_VISION = "latent", "tensor", "clip_vision"

KEY_KINDS: dict[str, str] = {
    "concat_latent_image": LATENT, "concat_mask": TENSOR, "concat_image": TENSOR, "clip_vision_output": CLIP_VISION,
    "stable_cascade_prior": LATENT, "time_dim_concat": LATENT, "time_dim_replace": LATENT,
    "pose_video_latent": LATENT, "ref_latent": LATENT, "audio_embed": TENSOR, "camera_conditions": TENSOR,
}
"""How a dataset column becomes the conditioning value of the same name: a LATENT column gives its samples (one
row per sample of the batch), a tensor column its tensor, a CLIP vision column (a dict of the output's tensors:
``penultimate_hidden_states``, ``last_hidden_state``, ``image_embeds``) ComfyUI's CLIP vision output."""

REFERENCE_COLUMN = "ref"
AUDIO_COLUMN = "audio"
START_COLUMN = "start"


@dataclasses.dataclass(frozen=True)
class Needs:
    """A family's entry: the conditioning keys it reads that a dataset column supplies (``columns``), whether
    its latent is a joint audio-video latent (``audio``: the ``audio`` column is its second stream), and whether
    its model reads the latent by its streams' shapes even when it has one (``shaped``: LTX-2's takes no plain
    latent; trained on video alone, its sound stream is empty)."""

    columns: tuple[str, ...] = ()
    audio: bool = False
    shaped: bool = False


_IMAGE_CONCAT = ("concat_latent_image", "concat_mask")

FAMILIES: dict[str, Needs] = {
    "BaseModel": Needs(_IMAGE_CONCAT),  # inpainting and image-to-video models with concat channels
    "SVD_img2vid": Needs(("concat_latent_image",)),
    "Stable_Zero123": Needs(("concat_latent_image",)),
    "SD_X4Upscaler": Needs(("concat_image",)),
    "IP2P": Needs(("concat_latent_image",)),
    "StableCascade_B": Needs(("stable_cascade_prior",)),
    "HunyuanVideo": Needs((*_IMAGE_CONCAT, "ref_latent")),
    "HunyuanVideo15": Needs((*_IMAGE_CONCAT, "clip_vision_output")),
    "WAN21": Needs((*_IMAGE_CONCAT, "clip_vision_output", "time_dim_concat")),
    "WAN22_S2V": Needs((*_IMAGE_CONCAT, "clip_vision_output", "audio_embed")),
    "WAN21_HuMo": Needs((*_IMAGE_CONCAT, "audio_embed")),
    "WAN21_Camera": Needs((*_IMAGE_CONCAT, "clip_vision_output", "camera_conditions")),
    "WAN22_Animate": Needs((*_IMAGE_CONCAT, "clip_vision_output", "pose_video_latent")),
    "Kandinsky5": Needs(("concat_mask", "time_dim_replace")),
    "LTXAV": Needs(("concat_mask",), audio=True, shaped=True),
    "MiniMaxH3": Needs(audio=True),
}


HOST_OPTIONS: dict[str, tuple[str, ...]] = {
    "SDXL": ("pooled_output",),
    "SDXLRefiner": ("pooled_output",),
}
"""Conditioning options a family's ``extra_conds`` reads on the host (ComfyUI's SDXL models build their size
embedding there and copy the pooled output to it, with ``torch.cat``), by ``model_base`` class name; a subclass
takes its nearest listed base class's entry (``SDXL_instructpix2pix`` is an ``SDXL``). A training step hands
ComfyUI the host copies of these (``conditioning.keep_on_host``): the same values, and no copy from the device
that would make the host wait for it at every model call."""


def host_options(model: Any) -> tuple[str, ...]:
    """The options ``model``'s conditioning code reads on the host (:data:`HOST_OPTIONS`)."""
    for cls in type(model).__mro__:
        if cls.__name__ in HOST_OPTIONS:
            return HOST_OPTIONS[cls.__name__]
    return ()


def needs(model: Any) -> Needs:
    """The entry of ``model``'s class (a ComfyUI ``model_base`` instance) or of its nearest listed base class."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    return Needs()


def column_values(batch: Mapping[str, Any], entry: Needs) -> dict[str, Any]:
    """The conditioning values of a collated batch's columns that ``entry`` reads, one row per sample."""
    out: dict[str, Any] = {}
    for key in entry.columns:
        if key in batch:
            out[key] = _value(KEY_KINDS.get(key, TENSOR), batch[key], stacked=True)
    return out


def conditioning(cond: list, batch: Mapping[str, Any], model: Any, *, guidance: float) -> list:
    """``cond`` (the batch's CONDITIONING) with what the family's nodes add from the batch's other columns (the
    reference latent of an edit pair, the conditioning keys ``model``'s family reads) and, for a
    guidance-distilled model, ``guidance`` where the cached conditioning has none."""
    if REFERENCE_COLUMN in batch:
        cond = append_reference(cond, flatten_batch(batch[REFERENCE_COLUMN]["samples"]))
    values = column_values(batch, needs(model))
    if START_COLUMN in batch:
        values.update({k: _value(CLIP_VISION if isinstance(v, Mapping) else TENSOR, v, stacked=True)
                       for k, v in batch[START_COLUMN]["conditioning"].items()})
    if values:
        cond = set_values(cond, values)
    if compat.guidance_distilled(model):
        cond = set_default(cond, "guidance", guidance)
    return cond


def conditioning_for_sampling(cond: list, values: Mapping[str, Any]) -> list:
    """What a family's nodes hand a sampler for one sample: its cached ``cond`` with the values of its other
    columns (one sample, as cached) set as those nodes set them. For checks that sample with a trained LoRA."""
    if REFERENCE_COLUMN in values:
        cond = append_reference(cond, values[REFERENCE_COLUMN]["samples"])
    out = {k: _value(KEY_KINDS.get(k, TENSOR), v, stacked=False) for k, v in values.items()
           if k in KEY_KINDS}
    return set_values(cond, out) if out else cond


def _value(kind: str, value: Any, *, stacked: bool) -> Any:
    flat = flatten_batch if stacked else (lambda t: t)
    if kind == LATENT:
        return flat(value["samples"])
    if kind == CLIP_VISION:
        from comfy.clip_vision import Output

        output = Output()
        for name, tensor in value.items():
            output[name] = flat(tensor)
        return output
    return flat(value)


def dataset_columns(model: Any) -> tuple[str, ...]:
    """The dataset columns besides ``latent``, ``cond`` and ``mask`` that training ``model`` reads."""
    entry = needs(model)
    return (REFERENCE_COLUMN, START_COLUMN, *entry.columns, *((AUDIO_COLUMN,) if entry.audio else ()))


def latent_streams(batch: Mapping[str, Any], model: Any) -> list[Any]:
    """The batch's latents, one row per sample: the ``latent`` column, and for a joint audio-video family the
    ``audio`` column after it (the order LTXVConcatAVLatent gives them)."""
    streams = [flatten_batch(batch["latent"]["samples"])]
    if needs(model).audio and AUDIO_COLUMN in batch:
        streams.append(flatten_batch(batch[AUDIO_COLUMN]["samples"]))
    return streams


def noise_mask(batch: Mapping[str, Any]) -> Any:
    """The batch's latent noise mask (0 where a node gave the latent), one row per sample, or None: the latent's
    own, else the one an image-to-video node set for the clip's start frames (the ``start`` column)."""
    mask = batch["latent"].get("noise_mask")
    if mask is None and START_COLUMN in batch:
        mask = batch[START_COLUMN].get("noise_mask")
    return mask
