"""ComfyUI nodes of the pack (thin glue over ``streaming_cache``); the node set is filled in as nodes land."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
