"""ComfyUI nodes of the pack: thin glue that validates inputs, calls ``streaming_cache`` and reports progress.

Everything of ComfyUI beyond its public node API (``comfy_api``) is reached through ``nodes/backend``.
"""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .encode import EncodeDataset, EncodeOptionsNode
from .legacy import LegacyEncodeDataset, LegacyTrainLoRA
from .load import LoadStreamingCache
from .mix import DatasetMixNode
from .options import OPTION_NODES
from .train import TrainLoRA

NODES: list[type[io.ComfyNode]] = [EncodeDataset, EncodeOptionsNode, LoadStreamingCache, DatasetMixNode, TrainLoRA,
                                   *OPTION_NODES, LegacyEncodeDataset, LegacyTrainLoRA]


class StreamingCacheExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> StreamingCacheExtension:
    return StreamingCacheExtension()
