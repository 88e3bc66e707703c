"""Train LoRA: a LoRA from a streaming dataset through ComfyUI's own model and sampling machinery.

The node shows what a first LoRA needs (model, dataset, name, steps, learning rate, rank, batch size, seed);
every other setting comes from the option nodes chained into ``options`` (``nodes/options.py``), each with
defaults that train well. The node builds the training spec once and hands it to ``training_run.train_lora``.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from ..streaming_cache.group import Group
from ..streaming_cache.train import presets
from ..streaming_cache.train.spec import TrainOptions, TrainSpec
from .backend import compat
from .inputs import ADVANCED, setting_input, settings_from
from .training_run import run_fingerprint, train_lora
from .ui import StreamingDataset, TrainOptionsType, node_schema
from .workers import train_on_devices

MAIN_SETTINGS = ["lora_name", "steps", "learning_rate", "rank", "batch_size", "seed", "resume", "save_every"]

DESCRIPTION = ("Trains a LoRA on a streaming dataset. Batches are read from disk in the background, so the dataset "
               "never has to fit in RAM. Saves models/loras/<lora_name>.safetensors (usable by Load LoRA). Queue "
               "again with the same dataset and settings to continue (e.g. after raising steps or a cancel); "
               "anything else trains a new numbered LoRA and keeps the old one. Every other setting (optimizer, "
               "loss, sample previews, memory, captions, adapter type) comes from the Train Options nodes wired into "
               "'options'. Unlike core Train LoRA with Load Training Dataset, the dataset is never loaded into RAM "
               "and each sample keeps its own caption.")


def outputs() -> list:
    """Train LoRA's outputs (the legacy node has the same)."""
    return [
        io.Model.Output("model_with_lora", display_name="model_with_lora",
                        tooltip="The model with the trained LoRA applied."),
        io.LoraModel.Output("lora", display_name="lora",
                            tooltip="The LoRA weights (for Save LoRA / Load LoRA Model)."),
        io.LossMap.Output("loss", display_name="loss", tooltip="Loss per step."),
        io.Image.Output("loss_plot", display_name="loss_plot",
                        tooltip="Loss per step (light), its moving average (dark), the validation loss and the "
                                "learning rate."),
        io.Int.Output("steps_trained", display_name="steps_trained", tooltip="Steps trained in total."),
        io.Image.Output("samples", display_name="samples",
                        tooltip="The last sample previews (a blank image when there are none)."),
    ]


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [io.Model.Input("model", tooltip="The model to train the LoRA on."),
                  StreamingDataset.Input("dataset", tooltip="From Encode Dataset or Load Streaming Cache.")]
        inputs += [setting_input(name) for name in MAIN_SETTINGS]
        inputs.append(TrainOptionsType.Input("options", optional=True,
                                             tooltip="Settings from the Train Options nodes (optimizer, loss, "
                                                     "previews, memory, captions, adapter); defaults without."))
        inputs.append(setting_input("devices", optional=True))  # added in 0.5.0: optional, last
        inputs.append(setting_input("keep_step_saves", optional=True, **ADVANCED))  # added after 0.5.0: last
        inputs.append(io.Combo.Input(  # added after 0.5.0: last; files saved before it read "none"
            "preset", options=list(presets.PRESET_CHOICES), default="none", optional=True,
            tooltip="auto: the settings you leave at their defaults take the values trainers publish for this "
                    "model's family (learning rate, rank and alpha, noise-level sampling and shift, loss weighting, "
                    "the layers trained; sources in docs/presets.md); a value you change is kept. The summary says "
                    "what auto chose. none: the defaults as they are (workflows saved before presets came)."))
        return node_schema("StreamingCacheTrain", "Train LoRA (streaming cache)", DESCRIPTION, inputs, outputs(),
                           output_node=True, search_aliases=["lora trainer", "train lora", "finetune"])

    @classmethod
    def fingerprint_inputs(cls, lora_name: str = "my_lora", **_: Any) -> tuple:
        return run_fingerprint(lora_name)

    @classmethod
    def execute(cls, model: Any, dataset: Any, options: TrainOptions | None = None, devices: int = 1,
                keep_step_saves: int = 0, preset: str = "none", **values: Any) -> io.NodeOutput:
        presets.check_preset(preset)
        spec = TrainSpec.from_options(options, **settings_from(values, MAIN_SETTINGS), devices=devices,
                                      keep_step_saves=keep_step_saves)
        notes = []
        if preset == "auto":
            family = compat.model_config_name(model)
            resolved = presets.resolve(spec, family)
            spec, notes = resolved.spec, [resolved.summary(family)]
        objects = options.objects if options is not None else {}
        train = train_lora if spec.devices == 1 or Group.current() is not None else train_on_devices
        return train(cls.hidden.unique_id, model, dataset, spec, clip=objects.get("clip"), vae=objects.get("vae"),
                     validation_dataset=objects.get("validation_dataset"), notes=notes)
