"""The ComfyUI-free parts of the trainer: the training loop with exact resume, optimizers and schedules,
checkpoint and LoRA files, the EMA of the weights, noise-level sampling and loss weighting, caption shuffling
and dropout, LoRA metadata, run identities (which queued training resumes which run), the loss plot, kohya
dataset folders, aspect buckets, weight fingerprints and the confinement of user-given names to their folders.
The nodes (``nodes/``) wire these to ComfyUI."""
