"""LoadStreamingCache: open an existing cache by name; no source images needed (sourceless training)."""

from __future__ import annotations

import os

from comfy_api.latest import io

from ..streaming_cache.dataset import DatasetHandle, shared_reader
from ..streaming_cache.format import INDEX_NAME
from .common import StreamingDataset, cache_path, list_caches, show_text


class LoadStreamingCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamingCacheLoad",
            display_name="Load Streaming Cache",
            category="training/streaming cache",
            description="Opens a cache built by Encode Dataset (from output/streaming_caches). Only the index is "
                        "read; latents stream from disk during training, and the source images need not exist.",
            inputs=[
                io.Combo.Input("cache_name", options=list_caches() or ["(no caches yet)"],
                               tooltip="A cache under output/streaming_caches."),
                io.String.Input("dataset_name", default="default",
                                tooltip="Which dataset of the cache (Encode Dataset writes 'default')."),
                io.Boolean.Input("repeats", default=True,
                                 tooltip="Repeat samples of N_name folders N times per epoch, as when encoded."),
            ],
            outputs=[StreamingDataset.Output("dataset", display_name="dataset",
                                             tooltip="The cached dataset (a lazy handle).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, cache_name, dataset_name, repeats):
        if cache_name == "(no caches yet)":
            return "no caches found in output/streaming_caches; build one with Encode Dataset first"
        return True

    @classmethod
    def fingerprint_inputs(cls, cache_name, dataset_name, repeats):
        try:
            st = os.stat(os.path.join(cache_path(cache_name), INDEX_NAME))
            return (st.st_ino, st.st_mtime_ns, st.st_size)
        except Exception as exc:
            return repr(exc)

    @classmethod
    def execute(cls, cache_name, dataset_name, repeats) -> io.NodeOutput:
        path = cache_path(cache_name)
        if not os.path.isfile(os.path.join(path, INDEX_NAME)):
            raise FileNotFoundError(f"cache {cache_name!r} not found at {path}; build it with Encode Dataset or "
                                    "pick one from the list")
        reader = shared_reader(path)
        if dataset_name not in reader.manifests:
            have = ", ".join(reader.manifests) or "none"
            raise ValueError(f"cache {cache_name!r} has no dataset {dataset_name!r} (it has: {have})")
        handle = DatasetHandle.from_cache(path, dataset_name, repeats=repeats)
        text = f"{cache_name}: {len(handle)} samples, {len(reader)} cached entries"
        show_text(cls.hidden.unique_id, text)
        return io.NodeOutput(handle, ui={"text": [text]})
