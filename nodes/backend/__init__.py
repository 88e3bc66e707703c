"""The pack's seam to ComfyUI: the only code that reaches ComfyUI beyond its public node API (``comfy_api``).

``compat`` holds what differs between ComfyUI versions and the small accessors the nodes need (folders,
progress and Cancel, server messages, LoRA files); ``training`` is ComfyUI's model as the trainer's backend
(``streaming_cache.train.backend.TrainBackend``); ``media`` is the VAE, text encoder, image loading and sampler
as the encoders and previews use them. ``tests/engine/test_layering.py`` checks that no other module of the pack
imports ComfyUI's internals.
"""
