"""The Qwen-Image, Qwen-Image-Edit, Wan 2.1 and LTX-2 example workflows as they ship, run headless with tiny files
in place of their models (see tests/comfy/test_examples.py); prints one JSON line of results.

    python examples_scenario.py COMFYUI_PATH WORKDIR

What is swapped, and why: each diffusion model is the family sweep's tiny model of its ComfyUI class (random
weights, one block; detection reads it as that class, so Train LoRA's preset is the family's). The VAE is a tiny Wan
2.1 VAE (Qwen-Image's VAE is Wan 2.1's). Load CLIP Vision gives a tiny CLIP-H-wide vision model. LTX-2's checkpoint
is a tiny one of the same layout (model, video VAE, audio VAE and vocoder in one file, configs in its metadata), so
the example's own Load Checkpoint and Load LTXV Audio VAE load it. The text encoders (Qwen2.5-VL 7B, UMT5-XXL,
Gemma 3 12B) cannot be built small at the width their diffusion models fix (3584, 4096 and 3840: the embedding
tables alone are hundreds of millions of weights), so Load CLIP (LTX-2: Load LTXV Audio Text Encoder) becomes
WideClip: the tiny checkpoint's CLIP-L, its hidden states projected to the family's width by a fixed random matrix
(deterministic: the same caption always gives the same conditioning), for LTX-2 marked as its text encoder marks
them (the model's connectors take them further). Its tokenizer is CLIP-L's, so Encode Dataset's preset cannot say
the family from it; the runs set resolution 64 and Encode Dataset says it kept it.
"""

from __future__ import annotations

import json
import os
import sys
import time

from comfy_scenario import ENCODE, TRAIN, boot_with_checkpoint, find, load_example, set_train, ui_text
from demo_assets import CKPT
from family_recipes import AV, I2V, IMAGE, VIDEO
from media_assets import tiny_ltx2_checkpoint, tiny_wan_vae, write_clip, write_clip_with_sound, write_image
from media_scenario import TinyClipVision, _cache_dir

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

QWEN, QWEN_EDIT, WAN_T2V, WAN_I2V, LTX2 = headless.EXAMPLES[5:10]
TEXT_WIDTH = {"qwen_image": 3584, "wan": 4096, "ltxav": 128}
"""The context width each family's diffusion model fixes (Qwen2.5-VL 7B's hidden size; Wan's text_dim; for LTX-2 the
tiny model's: :data:`LTX2_TEXT`)."""
LTX2_TEXT = dict(caption_channels=128, connector_attention_head_dim=64, connector_num_attention_heads=2)
"""The tiny LTX-2 model's text width (LTX-2's 3840, Gemma 3 12B's, is its checkpoint's setting; its text connectors
are as wide, 177 M weights a layer at 3840 where 128 makes them a few hundred thousand)."""


class WideClip:
    """The tiny checkpoint's CLIP-L with its hidden states projected to ``width`` (a scenario node, see the module
    docstring); the projection is seeded by the width, so a caption always encodes the same. ``ltxav``: the output
    marked ``unprocessed_ltxav_embeds``, as LTX-2's text encoder marks it."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": ("INT", {"default": 4096, "min": 1, "max": 8192})},
                "optional": {"ltxav": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "tests"

    def load(self, width, ltxav=False):
        import torch

        import nodes

        clip = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[1].clone()
        encode = clip.encode_from_tokens_scheduled
        projections: dict[int, torch.Tensor] = {}

        def widened(tokens, *args, **kwargs):
            out = []
            for cond, extra in encode(tokens, *args, **kwargs):
                if cond.shape[-1] not in projections:
                    g = torch.Generator().manual_seed(width)
                    projections[cond.shape[-1]] = torch.randn(cond.shape[-1], width, generator=g) / cond.shape[-1] ** 0.5
                extra = {**extra, "unprocessed_ltxav_embeds": True} if ltxav else extra
                out.append([cond @ projections[cond.shape[-1]].to(cond), extra])
            return out

        clip.encode_from_tokens_scheduled = widened
        return (clip,)


def _captioned(folder: str, stems: dict[str, str]) -> None:
    os.makedirs(folder, exist_ok=True)
    for stem, text in stems.items():
        with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
            f.write(text)


def _tiny_model(config: str, kind: str, model_file: str, **transformer) -> str | None:
    """The family sweep's tiny model of ComfyUI class ``config`` (its recipe of ``kind``; ``transformer``: more of
    its settings, also written to the file's config as LTX-2's checkpoints carry them) in
    ``models/diffusion_models/model_file``, once; a reason where this ComfyUI has no such class."""
    import dataclasses
    import json

    import comfy.supported_models
    import folder_paths
    from family_recipes import RECIPES
    from family_sweep import detect
    from tiny_models import write

    if not hasattr(comfy.supported_models, config):
        return f"this ComfyUI has no {config} model class"
    path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], model_file)
    if not os.path.exists(path):
        recipe = next(r for r in RECIPES if r.config == config and r.kind == kind)
        if transformer:
            settings = {**json.loads((recipe.metadata or {}).get("config", "{}")).get("transformer", {}),
                        **transformer}
            recipe = dataclasses.replace(recipe, shrink={**recipe.shrink, **transformer},
                                         metadata={"config": json.dumps({"transformer": settings})})
        tiny, _ = detect(recipe)
        if tiny is None or tiny.problem:
            return f"no tiny {config} loads here: {getattr(tiny, 'problem', 'skipped')}"
        write(tiny, path, recipe.metadata)
    return None


def _run_example(server: headless._Server, name: str, model_file: str, folder: str, unlinked: str = "",
                 **options) -> dict:
    """Example ``name`` in API form with its model files swapped (module docstring), encoding ``folder`` at 64 px
    (``options``: Encode Options' values) and training 2 steps at rank 4 in fp32. ``model_file``: the diffusion
    model's file, or for an example that loads a checkpoint, the checkpoint's. ``unlinked``: an input of Encode
    Options disconnected, as a user does (the cache and LoRA then named after it)."""
    import folder_paths

    prompt = load_example(name)
    if unlinked:
        del prompt[find(prompt, "StreamingCacheEncodeOptions")]["inputs"][unlinked]
        prompt[find(prompt, ENCODE)]["inputs"]["cache_name"] += f"_without_{unlinked}"
        prompt[find(prompt, TRAIN)]["inputs"]["lora_name"] += f"_without_{unlinked}"
    kinds = {v["class_type"] for v in prompt.values()}
    if "CLIPLoader" in kinds:
        clip = find(prompt, "CLIPLoader")
        prompt[clip] = {"class_type": "WideClip", "inputs": {"width": TEXT_WIDTH[prompt[clip]["inputs"]["type"]]}}
    if "LTXAVTextEncoderLoader" in kinds:
        prompt[find(prompt, "LTXAVTextEncoderLoader")] = {"class_type": "WideClip",
                                                          "inputs": {"width": TEXT_WIDTH["ltxav"], "ltxav": True}}
    if "UNETLoader" in kinds:
        prompt[find(prompt, "UNETLoader")]["inputs"]["unet_name"] = model_file
    for loader in ("CheckpointLoaderSimple", "LTXVAudioVAELoader"):
        if loader in kinds:
            prompt[find(prompt, loader)]["inputs"]["ckpt_name"] = model_file
    if "VAELoader" in kinds:
        vae = os.path.join(folder_paths.get_folder_paths("vae")[0], "tiny_wan21_vae.safetensors")
        if not os.path.exists(vae):
            tiny_wan_vae(vae)
        prompt[find(prompt, "VAELoader")]["inputs"]["vae_name"] = "tiny_wan21_vae.safetensors"
    if "CLIPVisionLoader" in kinds:
        prompt[find(prompt, "CLIPVisionLoader")] = {"class_type": "TinyClipVision", "inputs": {}}
    if options:
        prompt[find(prompt, "StreamingCacheEncodeOptions")]["inputs"].update(options)
    encode, train = find(prompt, ENCODE), find(prompt, TRAIN)
    prompt[encode]["inputs"].update(folder=folder, resolution=64, batch_size=2)
    set_train(prompt, train, steps=2, batch_size=1, rank=4, training_dtype="fp32", lora_dtype="fp32")
    t0 = time.perf_counter()
    ok, result, error = headless.run(prompt, server)
    out = {"ok": ok, "error": error, "encode": ui_text(result, encode), "train": ui_text(result, train),
           "presets": [prompt[encode]["inputs"].get("preset"), prompt[train]["inputs"].get("preset")],
           "seconds": round(time.perf_counter() - t0, 1)}
    if ok:
        import streaming_cache as sc

        cache = _cache_dir(prompt[encode]["inputs"]["cache_name"])
        out["columns"] = sorted(sc.DatasetHandle.from_cache(cache, "default", repeats=False).columns)
    return out


def scenario_qwen(server: headless._Server) -> dict:
    import folder_paths

    skipped = _tiny_model("QwenImage", IMAGE, "tiny_qwen_image.safetensors")
    if skipped:
        return {"skipped": skipped}
    folder = os.path.join(folder_paths.get_input_directory(), "qwen_dataset")
    _captioned(folder, {"a": "sks a, a photo", "b": "sks b, a photo"})
    for i, stem in enumerate(("a", "b")):
        write_image(os.path.join(folder, f"{stem}.png"), seed=30 + i)
    return _run_example(server, QWEN, "tiny_qwen_image.safetensors", "qwen_dataset")


def scenario_qwen_edit(server: headless._Server) -> dict:
    """Edit pairs in both layouts the pack reads (``a_ref.png`` beside ``a.png``, ``ref/b.png``)."""
    import folder_paths

    skipped = _tiny_model("QwenImage", IMAGE, "tiny_qwen_image.safetensors")
    if skipped:
        return {"skipped": skipped}
    folder = os.path.join(folder_paths.get_input_directory(), "qwen_edits")
    _captioned(folder, {"a": "make a brighter", "b": "make b brighter"})
    os.makedirs(os.path.join(folder, "ref"), exist_ok=True)
    write_image(os.path.join(folder, "a.png"), seed=40)
    write_image(os.path.join(folder, "a_ref.png"), seed=41)
    write_image(os.path.join(folder, "b.png"), seed=42)
    write_image(os.path.join(folder, "ref", "b.png"), seed=43)
    return _run_example(server, QWEN_EDIT, "tiny_qwen_image.safetensors", "qwen_edits")


def _clips(name: str) -> str:
    import folder_paths

    folder = os.path.join(folder_paths.get_input_directory(), name)
    _captioned(folder, {"walk": "a pattern moving right", "slide": "a pattern moving"})
    write_clip(os.path.join(folder, "walk.mp4"), frames=9, width=64, height=64)
    write_clip(os.path.join(folder, "slide.mp4"), frames=7, width=64, height=64, seed=5)
    return name


def scenario_wan_t2v(server: headless._Server) -> dict:
    skipped = _tiny_model("WAN21_T2V", VIDEO, "tiny_wan21_t2v.safetensors")
    if skipped:
        return {"skipped": skipped}
    return _run_example(server, WAN_T2V, "tiny_wan21_t2v.safetensors", _clips("wan_clips"), frames=5)


def scenario_wan_i2v(server: headless._Server) -> dict:
    skipped = _tiny_model("WAN21_I2V", I2V, "tiny_wan21_i2v.safetensors")
    if skipped:
        return {"skipped": skipped}
    return _run_example(server, WAN_I2V, "tiny_wan21_i2v.safetensors", _clips("wan_i2v_clips"), frames=5)


def scenario_ltx2(server: headless._Server, unlinked: str = "") -> dict:
    """Clips with sound tracks at 25 fps (the example samples clips at 25 a second): each clip's sound is encoded
    by the checkpoint's audio VAE beside its frames (``unlinked="audio_vae"``: video alone, as the example's note
    offers)."""
    import folder_paths

    skipped = _tiny_model("LTXAV", AV, "tiny_ltx2_text128.safetensors", **LTX2_TEXT)
    if skipped:
        return {"skipped": skipped}
    checkpoint = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], "tiny_ltx2.safetensors")
    if not os.path.exists(checkpoint):
        tiny_ltx2_checkpoint(checkpoint, folder_paths.get_full_path_or_raise("diffusion_models",
                                                                             "tiny_ltx2_text128.safetensors"))
    folder = os.path.join(folder_paths.get_input_directory(), "ltx2_clips")
    if not os.path.isdir(folder):
        _captioned(folder, {"walk": "a pattern moving right, a rising tone", "slide": "a pattern moving, a tone"})
        write_clip_with_sound(os.path.join(folder, "walk.mp4"), frames=12, fps=25)
        write_clip_with_sound(os.path.join(folder, "slide.mp4"), frames=10, fps=25, seed=5)
    return _run_example(server, LTX2, "tiny_ltx2.safetensors", "ltx2_clips", unlinked, frames=9)


def main() -> None:
    server = boot_with_checkpoint(*sys.argv[1:3])
    import nodes

    nodes.NODE_CLASS_MAPPINGS.update(WideClip=WideClip, TinyClipVision=TinyClipVision)
    result = {}
    for name, scenario in (("qwen", scenario_qwen), ("qwen_edit", scenario_qwen_edit), ("wan_t2v", scenario_wan_t2v),
                           ("wan_i2v", scenario_wan_i2v), ("ltx2", scenario_ltx2),
                           ("ltx2_video_only", lambda s: scenario_ltx2(s, "audio_vae"))):
        t0 = time.perf_counter()
        result[name] = scenario(server)
        result[name]["total_seconds"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
