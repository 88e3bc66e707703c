"""The nodes of earlier releases, kept under their ids so workflows and API prompts saved with them keep running.

Release 0.3.0 and earlier had one Encode Dataset node with every encoding setting and one Train LoRA node with
every training setting (43 widgets). Their successors (``encode.py``, ``train.py`` with ``options.py``) show
only what a first run needs; these keep the old ids (``StreamingCacheEncodeDataset``, ``StreamingCacheTrainLoRA``),
the old inputs in the old order, and run the same code. They are marked deprecated, so node search offers the
new nodes, while saved files load and run unchanged:

* an input added after the first release is optional with the default it had, so a prompt saved before it
  existed validates and means what it meant;
* the widgets keep the order of the last release that shipped them (UI files store widget values by
  position); files saved by a release whose order differs are re-mapped by ``layouts.py``.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from ..streaming_cache.train.spec import TrainSpec
from .encode import (
    EncodeOptions,
    cache_name_input,
    encode_dataset,
    encode_fingerprint,
    encoders_inputs,
    images_inputs,
    option_inputs,
    size_inputs,
)
from .encode import (
    outputs as encode_outputs,
)
from .inputs import ADVANCED, setting_input, settings_from
from .train import outputs as train_outputs
from .training_run import run_fingerprint, train_lora
from .ui import StreamingDataset, node_schema

# The widgets of release 0.1.0's Train LoRA, then those added since, in the order of release 0.3.0.
TRAIN_FIRST = ["lora_name", "steps", "batch_size", "grad_accumulation_steps", "learning_rate", "lr_schedule",
               "warmup_steps", "rank", "optimizer", "loss_function", "seed", "training_dtype", "lora_dtype",
               "algorithm", "gradient_checkpointing", "existing_lora", "save_every", "resume", "prefetch", "workers"]
TRAIN_ADDED = ["sample_prompts", "sample_every", "sample_steps", "sample_cfg", "sample_seed", "validation_split",
               "validate_every", "timestep_sampling", "timestep_shift", "timestep_scale", "loss_weighting",
               "min_snr_gamma", "noise_offset", "masked_loss", "caption_dropout", "guidance", "max_grad_norm",
               "lora_plus_ratio", "lr_cycles", "ema_decay", "checkpoint_depth", "offloading", "bypass_mode"]
_FOLDED = {"prefetch", "workers", "sample_steps", "sample_cfg", "sample_seed", "timestep_sampling", "timestep_shift",
           "timestep_scale", "loss_weighting", "min_snr_gamma", "noise_offset", "guidance", "max_grad_norm",
           "lora_plus_ratio", "lr_cycles", "ema_decay", "checkpoint_depth"}


class LegacyTrainLoRA(io.ComfyNode):
    """Train LoRA of releases 0.1.0 to 0.3.0, every setting a widget."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [io.Model.Input("model", tooltip="The model to train the LoRA on."),
                  StreamingDataset.Input("dataset", tooltip="From Encode Dataset or Load Streaming Cache.")]
        inputs += [setting_input(n, **(ADVANCED if n in _FOLDED else {})) for n in TRAIN_FIRST]
        inputs += [setting_input(n, optional=True, **(ADVANCED if n in _FOLDED else {})) for n in TRAIN_ADDED]
        inputs += [io.Clip.Input("clip", optional=True, tooltip="The text encoder, to encode the sample prompts."),
                   io.Vae.Input("vae", optional=True, tooltip="The VAE, to decode the sample images."),
                   StreamingDataset.Input("validation_dataset", optional=True,
                                          tooltip="A separate dataset to compute the validation loss on.")]
        return node_schema("StreamingCacheTrainLoRA", "Train LoRA (streaming cache, all options; legacy)",
                           "The Train LoRA node of releases up to 0.3.0, kept so saved workflows run: every setting "
                           "is a widget here. New workflows: Train LoRA (streaming cache) with Train Options nodes.",
                           inputs, train_outputs(), output_node=True, deprecated=True)

    @classmethod
    def fingerprint_inputs(cls, lora_name: str = "my_lora", **_: Any) -> tuple:
        return run_fingerprint(lora_name)

    @classmethod
    def execute(cls, model: Any, dataset: Any, clip: Any = None, vae: Any = None, validation_dataset: Any = None,
                **values: Any) -> io.NodeOutput:
        spec = TrainSpec.build(settings_from(values, TRAIN_FIRST + TRAIN_ADDED))
        return train_lora(cls.hidden.unique_id, model, dataset, spec, clip=clip, vae=vae,
                          validation_dataset=validation_dataset)


class LegacyEncodeDataset(io.ComfyNode):
    """Encode Dataset of releases 0.1.0 to 0.3.0, with its video, caption-variant and mask widgets."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = encoders_inputs() + [
            io.String.Input("folder", default="dataset",
                            tooltip="Dataset folder, relative to ComfyUI's input folder (or an absolute path inside "
                                    "the input or output folder). Ignored when images are connected."),
            cache_name_input(), *size_inputs(), *option_inputs(optional=True), *images_inputs()]
        return node_schema("StreamingCacheEncodeDataset", "Encode Dataset (streaming cache, all options; legacy)",
                           "The Encode Dataset node of releases up to 0.3.0, kept so saved workflows run. New "
                           "workflows: Encode Dataset (streaming cache) with Encode Options.", inputs,
                           encode_outputs(), output_node=True, deprecated=True)

    @classmethod
    def fingerprint_inputs(cls, folder: str = "dataset", cache_name: str = "my_dataset", images: Any = None,
                           **_: Any) -> tuple:
        return encode_fingerprint(folder, cache_name, images)

    @classmethod
    def execute(cls, vae: Any, clip: Any, folder: str, cache_name: str, resolution: int, batch_size: int,
                images: Any = None, captions: str = "", **options: Any) -> io.NodeOutput:
        defaults = EncodeOptions()
        chosen = EncodeOptions(**{k: options.get(k, getattr(defaults, k)) for k in defaults.__dataclass_fields__})
        return encode_dataset(cls.hidden.unique_id, vae, clip, folder, cache_name, resolution, batch_size, chosen,
                              images, captions)
