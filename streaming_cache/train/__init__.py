"""The ComfyUI-free parts of the trainer: the training loop with exact resume, optimizers and schedules,
checkpoint and LoRA files, the loss plot, kohya dataset folders, aspect buckets, weight fingerprints and
the confinement of user-given names to their folders. The nodes (``nodes/``) wire these to ComfyUI."""
