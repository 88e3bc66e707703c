"""Tiny stand-ins for a real setup, built at run time with ComfyUI's own classes: an SD1.x-shaped checkpoint
with random weights (a one-level UNet, the standard CLIP-L and VAE; ~0.5 GB in fp16) and a small kohya-style
dataset folder. Used by ``headless.py --demo`` and the tests; nothing here is a trained model.

Standalone like ``headless.py``: ComfyUI must already be imported (see ``headless.boot``).

With ``STREAMING_CACHE_DEMO_MODELS`` naming a folder, the checkpoint is built there once per ComfyUI
installation and hard-linked into each ComfyUI home that asks for it: a test run that sets up twenty homes
then holds one 0.5 GB file per installation on disk instead of twenty.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable

CKPT = "tiny_sd15.safetensors"
MODEL_STORE_ENV = "STREAMING_CACHE_DEMO_MODELS"


def tiny_checkpoint(path: str) -> None:
    """Write the tiny SD1.x checkpoint to ``path`` (from the model store when one is set)."""
    store = os.environ.get(MODEL_STORE_ENV, "")
    if store:
        import comfy.sd

        # ComfyUI's classes decide the weights' names and shapes: one stored file per installation.
        from_store(path, store, _build_checkpoint, os.path.dirname(os.path.dirname(os.path.abspath(comfy.sd.__file__))))
    else:
        _build_checkpoint(path)


def from_store(path: str, store: str, build: Callable[[str], None], identity: str) -> None:
    """Put at ``path`` the file ``build`` writes, building it into ``store`` only the first time.

    The stored file is named for ``path``'s file name, ``build``'s name and ``identity`` (whatever else decides
    the file's bytes); a lock file makes processes that ask at once build it once. The copy at ``path`` is a hard
    link where the file system allows one."""
    key = hashlib.sha256(f"{build.__module__}.{build.__qualname__}\0{identity}".encode()).hexdigest()[:16]
    os.makedirs(store, exist_ok=True)
    stored = os.path.join(store, f"{key}-{os.path.basename(path)}")
    with open(stored + ".lock", "a+b") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no fcntl (Windows): concurrent first builds each write their own temporary file
            pass
        if not os.path.exists(stored):
            build(stored)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.link(stored, path)
    except OSError:
        shutil.copyfile(stored, path + ".tmp")
        os.replace(path + ".tmp", path)


def _build_checkpoint(path: str) -> None:
    import comfy.ldm.models.autoencoder
    import comfy.sd1_clip
    import comfy.supported_models
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)

    def rand(sd: dict, prefix: str) -> dict:
        out = {}
        for k, v in sd.items():
            if not v.dtype.is_floating_point:
                out[prefix + k] = v.clone()
            elif k.endswith(("norm.weight", "norm1.weight", "norm2.weight", "norm3.weight", "norm_out.weight",
                             "layer_norm1.weight", "layer_norm2.weight", "final_layer_norm.weight")):
                out[prefix + k] = torch.ones(v.shape, dtype=torch.float16)
            else:
                out[prefix + k] = (torch.randn(v.shape, generator=g) * 0.02).to(torch.float16)
        return out

    cfg = {"use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
           "in_channels": 4, "out_channels": 4, "model_channels": 320, "num_res_blocks": [1], "channel_mult": [1],
           "transformer_depth": [1], "transformer_depth_output": [1, 1], "transformer_depth_middle": -1,
           "use_linear_in_transformer": False, "context_dim": 768, "adm_in_channels": None,
           "use_temporal_attention": False, "num_heads": 8, "num_head_channels": -1}
    sd = rand(comfy.supported_models.SD15(cfg).get_model({}).state_dict(), "model.")
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    vae = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
    sd.update(rand(vae.state_dict(), "first_stage_model."))
    clip = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
    sd.update(rand(clip.state_dict(), "cond_stage_model."))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)


def write_dataset(folder: str, include_broken: bool = False) -> None:
    """Five images (two sizes, a shared caption, a 2-repeat folder); ``include_broken`` adds a zero-byte image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(folder, "2_red thing"), exist_ok=True)
    specs = [("a.png", (64, 64), "a red square\na square, red"), ("b.png", (64, 64), "a blue circle"),
             ("c.jpg", (96, 64), "a blue circle"), ("d.webp", (96, 64), "a green triangle"),
             ("2_red thing/e.png", (64, 96), None)]
    for name, (w, h), caption in specs:
        arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(arr).save(os.path.join(folder, name))
        if caption is not None:
            with open(os.path.join(folder, os.path.splitext(name)[0] + ".txt"), "w", encoding="utf-8") as f:
                f.write(caption)
    if include_broken:
        open(os.path.join(folder, "broken.png"), "wb").close()  # zero bytes: must fail alone


TINY_DIT = "tiny_sd3_dit.safetensors"


def tiny_sd3_dit(path: str) -> None:
    """A two-block SD3-family MMDiT (flow matching, 16-channel latents) with random weights, ~1 M parameters;
    loadable by Load Diffusion Model. Its text conditioning is 48-wide with a 32-wide pooled vector."""
    import comfy.supported_models
    import torch
    from safetensors.torch import save_file

    cfg = {"in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 2, "input_size": None,
           "adm_in_channels": 32, "num_patches": 256, "pos_embed_max_size": 16, "pos_embed_scaling_factor": None,
           "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 48, "out_features": 128}},
           "x_block_self_attn_layers": []}
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in comfy.supported_models.SD3(cfg).get_model({}).state_dict().items():
        if k.startswith("diffusion_model."):
            sd[k[len("diffusion_model."):]] = (torch.randn(v.shape, generator=g) * 0.02) if v.dtype.is_floating_point \
                else v.clone()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)
