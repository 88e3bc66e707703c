"""LoadStreamingCache: open an existing cache by name or path; no source images needed (sourceless training)."""

from __future__ import annotations

import os

from comfy_api.latest import io

from ..streaming_cache.dataset import DatasetHandle, shared_reader
from ..streaming_cache.layout import INDEX_NAME
from . import dataset_preview
from .folders import existing_cache_path, list_caches, roots_text
from .ui import StreamingDataset, node_schema, show_text

NO_CACHES = "(no caches yet)"


DESCRIPTION = ("Opens a cache built by Encode Dataset. Only the index is read; latents stream from disk "
               "during training, and the source images need not exist.")


def _inputs() -> list:
    return [
        io.Combo.Input("cache_name", options=list_caches() or [NO_CACHES],
                       tooltip="A cache in ComfyUI's datasets folder (or output/streaming_caches). "
                               "Refresh the page (R) after building a new one."),
        io.String.Input("dataset_name", default="default",
                        tooltip="Which dataset of the cache (Encode Dataset writes 'default')."),
        io.Boolean.Input("repeats", default=True,
                         tooltip="Repeat samples of N_name folders N times per epoch, as when encoded."),
        io.String.Input("path", optional=True, default="",
                        tooltip="Optional: the full path of a cache folder anywhere on this machine (for "
                                "example on another disk), used instead of cache_name. Read only."),
        dataset_preview.page_input(),
    ]


def _outputs() -> list:
    return [StreamingDataset.Output("dataset", display_name="dataset", tooltip="The cached dataset (a lazy handle)."),
            dataset_preview.output()]


class LoadStreamingCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema("StreamingCacheLoad", "Load Streaming Cache", DESCRIPTION, _inputs(), _outputs())

    @classmethod
    def validate_inputs(cls, cache_name, dataset_name, repeats, path="", preview_page=1):
        if cache_name == NO_CACHES and not (path or "").strip():
            return f"no caches found in {roots_text()}; build one with Encode Dataset first or give a path"
        return True

    @classmethod
    def fingerprint_inputs(cls, cache_name, dataset_name, repeats, path="", preview_page=1):
        try:
            st = os.stat(os.path.join(existing_cache_path((path or "").strip() or cache_name), INDEX_NAME))
            return (st.st_ino, st.st_mtime_ns, st.st_size)
        except Exception as exc:
            return repr(exc)

    @classmethod
    def execute(cls, cache_name, dataset_name, repeats, path="", preview_page=1) -> io.NodeOutput:
        name = (path or "").strip() or cache_name
        where = existing_cache_path(name)
        reader = shared_reader(where)
        if dataset_name not in reader.manifests:
            have = ", ".join(reader.manifests) or "none"
            raise ValueError(f"cache {name!r} has no dataset {dataset_name!r} (it has: {have})")
        handle = DatasetHandle.from_cache(where, dataset_name, repeats=repeats)
        text = f"{name}: {len(handle)} samples, {len(reader)} cached entries"
        image, shown, line = dataset_preview.preview(reader, dataset_name, preview_page,
                                                     name=os.path.basename(os.path.normpath(name)))
        text += f"\n{line}" if line else ""
        show_text(cls.hidden.unique_id, text)
        return io.NodeOutput(handle, image, ui={"text": [text], **shown})
