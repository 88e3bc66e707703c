"""Dataset Mix: several datasets in one training, each sampled its own way (``streaming_cache.mix``).

Chain one node per dataset (each takes the mix so far on ``mix``) and wire the last one into Train LoRA's
``dataset``: style images beside regularisation images, a subject beside its class.
"""

from __future__ import annotations

import os
from typing import Any

from comfy_api.latest import io

from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.mix import DatasetMix, MixPart
from .ui import StreamingDataset, node_schema, show_text

DESCRIPTION = ("Adds a dataset to a mix that Train LoRA trains on: each dataset with its own name (shown on the loss "
               "plot), weight, repeats, batch size and caption dropout. A batch never mixes datasets. Chain one node "
               "per dataset (into 'mix') and connect the last to Train LoRA's dataset.")


def _name_of(handle: DatasetHandle) -> str:
    caches = handle.caches
    return os.path.basename(caches[0]) if len(caches) == 1 else "dataset"


class DatasetMixNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [
            StreamingDataset.Input("dataset", tooltip="A dataset from Encode Dataset or Load Streaming Cache."),
            io.String.Input("name", default="", tooltip="Its name on the loss plot and in the summary (empty: the "
                                                        "cache's name). Names in one mix must differ."),
            io.Float.Input("weight", default=1.0, min=0.01, max=100.0, step=0.05,
                           tooltip="How many of its batches an epoch holds, relative to its size: 1 all of them "
                                   "once, 0.5 half of them (the other half the next epoch), 2 each twice. Use it "
                                   "to balance a small dataset against a large one."),
            io.Int.Input("repeats", default=1, min=1, max=1000,
                         tooltip="Every sample this many times per epoch, like kohya's N_name folders (multiplies "
                                 "the repeats the dataset was encoded with)."),
            io.Int.Input("batch_size", default=0, min=0, max=256,
                         tooltip="Samples per batch of this dataset (0: Train LoRA's batch_size)."),
            io.Float.Input("caption_dropout", default=-1.0, min=-1.0, max=1.0, step=0.01,
                           tooltip="Share of this dataset's samples trained on the empty caption (-1: the setting "
                                   "of Train Options: Captions & Data)."),
            StreamingDataset.Input("mix", optional=True,
                                   tooltip="The mix so far (from another Dataset Mix node), or a dataset, which "
                                           "then joins with the settings it would have alone."),
            io.Float.Input("loss_weight", default=1.0, min=0.01, max=100.0, step=0.05, optional=True,
                           tooltip="How much this dataset's loss counts in training: 0.5 for regularisation images "
                                   "that should pull half as hard (sd-scripts' prior_loss_weight). Unlike weight, "
                                   "it does not change how often the dataset is drawn. The loss plot shows each "
                                   "dataset's own loss, before its weight."),
            io.Boolean.Input("preserve_outputs", default=False, optional=True,
                             tooltip="Differential output preservation, for regularisation data: this dataset "
                                     "trains toward what the base model (without the LoRA) predicts for its "
                                     "images and captions, not toward the images, so the LoRA learns to leave "
                                     "such prompts as the model had them (ai-toolkit's diff_output_preservation, "
                                     "OneTrainer's prior prediction). Costs one more forward pass per batch of "
                                     "this dataset."),
        ]
        outputs = [StreamingDataset.Output("dataset_out", display_name="dataset",
                                           tooltip="The mix, for Train LoRA's dataset (or the next Dataset Mix).")]
        return node_schema("StreamingCacheDatasetMix", "Dataset Mix (streaming cache)", DESCRIPTION, inputs, outputs,
                           search_aliases=["concepts", "regularization", "multiple datasets"])

    @classmethod
    def execute(cls, dataset: DatasetHandle | DatasetMix, name: str, weight: float, repeats: int, batch_size: int,
                caption_dropout: float, mix: Any = None, loss_weight: float = 1.0,
                preserve_outputs: bool = False) -> io.NodeOutput:
        if isinstance(dataset, DatasetMix):
            raise ValueError("'dataset' takes one dataset; connect a mix to 'mix' instead")
        before = [] if mix is None else list(mix.parts) if isinstance(mix, DatasetMix) else \
            [MixPart(mix, _name_of(mix))]
        part = MixPart(dataset, name.strip() or _name_of(dataset), weight=weight, repeats=repeats,
                       batch_size=batch_size, caption_dropout=None if caption_dropout < 0 else caption_dropout,
                       loss_weight=loss_weight, preserve=bool(preserve_outputs))
        out = DatasetMix([*before, part])
        text = "mix: " + ", ".join(f"{p.name} ({len(p.handle)} samples, weight {p.weight:g}, repeats {p.repeats}"
                                   + (f", loss weight {p.loss_weight:g}" if p.loss_weight != 1.0 else "")
                                   + (", preserving the base model's outputs" if p.preserve else "") + ")"
                                   for p in out.parts)
        show_text(cls.hidden.unique_id, text)
        return io.NodeOutput(out, ui={"text": [text]})
