"""ComfyUI nodes of the pack: thin glue that validates inputs, calls ``streaming_cache`` and reports progress."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .encode import EncodeDataset
from .load import LoadStreamingCache
from .train import TrainLoRA

NODES: list[type[io.ComfyNode]] = [EncodeDataset, LoadStreamingCache, TrainLoRA]


class StreamingCacheExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> StreamingCacheExtension:
    return StreamingCacheExtension()
