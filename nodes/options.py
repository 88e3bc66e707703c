"""The option nodes of Train LoRA: one small node per group of settings, chained into Train LoRA's ``options``.

A first LoRA needs none of them (every setting has a default that trains well); each node sets one group
(``streaming_cache.train.spec``) and passes the chain on, so the groups a workflow changes are visible as nodes,
and one option node can feed several trainers. The same group twice in one chain is an error. Every setting is an
optional input with its default, so an API prompt names only the settings it changes.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from ..streaming_cache.train import spec
from .inputs import setting_input, settings_from
from .ui import OPTIONS_CATEGORY, StreamingDataset, TrainOptionsType, node_schema


class _OptionNode(io.ComfyNode):
    """An option node: the chain input, one widget per setting of ``PART``, the chain output."""

    NODE_ID: str
    TITLE: str
    DESCRIPTION: str
    PART: type

    @classmethod
    def extra_inputs(cls) -> list:
        return []

    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [TrainOptionsType.Input("options", optional=True,
                                         tooltip="More option nodes, chained (each kind once).")]
        inputs += [setting_input(name, optional=True) for name in spec.part_fields(cls.PART)] + cls.extra_inputs()
        outputs = [TrainOptionsType.Output("options_out", display_name="options",
                                           tooltip="To Train LoRA's options input, or to another option node.")]
        return node_schema(cls.NODE_ID, cls.TITLE, cls.DESCRIPTION, inputs, outputs, category=OPTIONS_CATEGORY)

    @classmethod
    def execute(cls, options: spec.TrainOptions | None = None, **values: Any) -> io.NodeOutput:
        names = spec.part_fields(cls.PART)
        settings = settings_from(values, names)
        if "sample_prompts" in settings:
            settings["sample_prompts"] = spec.PreviewOptions.prompts_of(settings["sample_prompts"])
        objects = {k: v for k, v in values.items() if k not in names}
        return io.NodeOutput((options or spec.TrainOptions()).with_part(cls.PART(**settings), **objects))


class OptimizerOptions(_OptionNode):
    NODE_ID = "StreamingCacheOptimizerOptions"
    TITLE = "Train Options: Optimizer & Schedule"
    DESCRIPTION = ("The optimizer, the learning-rate schedule and warm-up, gradient accumulation and clipping, LoRA+ "
                   "and an EMA of the weights, for Train LoRA (streaming cache).")
    PART = spec.OptimizerOptions


class ObjectiveOptions(_OptionNode):
    NODE_ID = "StreamingCacheLossOptions"
    TITLE = "Train Options: Timesteps & Loss"
    DESCRIPTION = ("How noise levels are drawn and the loss is weighted (x0, native, min-SNR), noise offset, loss "
                   "masks and the guidance given to guidance-distilled models, for Train LoRA (streaming cache).")
    PART = spec.ObjectiveOptions


class PreviewOptions(_OptionNode):
    NODE_ID = "StreamingCachePreviewOptions"
    TITLE = "Train Options: Previews & Validation"
    DESCRIPTION = ("Sample images drawn with the LoRA as it trains (shown live on Train LoRA), a validation loss on "
                   "held-out images or a separate dataset, and the loss plot's scale.")
    PART = spec.PreviewOptions

    @classmethod
    def extra_inputs(cls) -> list:
        return [io.Clip.Input("clip", optional=True, tooltip="The text encoder, to encode the sample prompts."),
                io.Vae.Input("vae", optional=True, tooltip="The VAE, to decode the sample images."),
                StreamingDataset.Input("validation_dataset", optional=True,
                                       tooltip="A separate dataset to compute the validation loss on (instead of a "
                                               "split).")]


class MemoryOptions(_OptionNode):
    NODE_ID = "StreamingCacheMemoryOptions"
    TITLE = "Train Options: Memory & Precision"
    DESCRIPTION = ("Big models on small GPUs: training and LoRA dtypes (fp16 with a gradient scaler), gradient "
                   "checkpointing (its depth, the share of blocks recomputed), offloading the frozen model, bypass "
                   "mode for fp8 weights, CUDA graphs. These change where tensors live, not what is learned: "
                   "changing them continues the same run.")
    PART = spec.MemoryOptions


class DataOptions(_OptionNode):
    NODE_ID = "StreamingCacheDataOptions"
    TITLE = "Train Options: Captions & Data"
    DESCRIPTION = ("Caption dropout (train on the empty caption for a share of samples) and how batches are read "
                   "from the cache (reader threads, batches read ahead).")
    PART = spec.DataOptions


class AdapterOptions(_OptionNode):
    NODE_ID = "StreamingCacheAdapterOptions"
    TITLE = "Train Options: Adapter"
    DESCRIPTION = ("The adapter type (LoRA, LoHa, LoKr, OFT, ...), an existing LoRA to continue training, and the key "
                   "format of the saved file (ComfyUI's own, kohya's for A1111/Forge/Civitai, or diffusers').")
    PART = spec.AdapterOptions


OPTION_NODES: list[type[io.ComfyNode]] = [OptimizerOptions, ObjectiveOptions, PreviewOptions, MemoryOptions,
                                          DataOptions, AdapterOptions]
