"""ComfyUI entry point of the streaming-cache node pack.

ComfyUI imports this directory as a package; the engine lives in ``streaming_cache`` (importable on its own,
without ComfyUI), the node glue in ``nodes`` (V3 node API: ``comfy_entrypoint``) and the frontend extension in
``web`` (shows each node's summary on the node, and maps widget values of workflows saved by earlier releases).
Imported anywhere else (test collectors, packaging tools) it registers nothing, since the nodes need ComfyUI's
modules.
"""

import importlib.util

WEB_DIRECTORY = "./web"

if importlib.util.find_spec("comfy_api") is not None:
    from .nodes import comfy_entrypoint

    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
