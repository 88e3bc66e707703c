"""ComfyUI entry point of the streaming-cache node pack.

ComfyUI imports this directory as a package; the engine lives in ``streaming_cache`` (importable on its own,
without ComfyUI) and the node glue in ``nodes``.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
