"""Video and edit-pair datasets through the real nodes, inside a process that boots real ComfyUI (see
tests/comfy/test_media.py); prints one JSON line of results.

    python media_scenario.py COMFYUI_PATH WORKDIR

Video: generated clips (MPEG-4 and GIF) plus a still image with captions are encoded by EncodeDataset with a
Wan 2.1 VAE and CLIP-L, and TrainLoRA trains a HunyuanVideo-family model (5-D latents) on them. Edit pairs:
targets with references (``name_ref.png`` and ``ref/name.png``) and a loss mask are encoded and trained on a
Flux-family model that takes reference latents (ComfyUI 0.33; v0.3.64 hard-codes Flux at full width, so there
the pairs train the SD1.x model, which ignores references).
"""

from __future__ import annotations

import json
import os
import sys

from comfy_scenario import boot_with_checkpoint, ui_text
from demo_assets import CKPT
from media_assets import tiny_flux, tiny_hunyuan_video, tiny_vae16, tiny_wan_vae, write_clip, write_gif, write_image

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)


def _train(prompt: dict, model: list, dataset: list, lora_name: str) -> None:
    """Train LoRA as node "5" (options chained in as needed)."""
    import nodes

    settings = dict(steps=2, batch_size=1, rank=4, training_dtype="fp32", lora_dtype="fp32", learning_rate=1e-3,
                    lora_name=lora_name)
    prompt.update(headless.train_nodes(nodes.NODE_CLASS_MAPPINGS, model, dataset, settings, prefix="5")[0])


def _encode(prompt: dict, vae: list, clip: list, folder: str, cache_name: str, **options) -> None:
    """Encode Dataset as node "3", with Encode Options as node "3o" when ``options`` are given."""
    prompt["3"] = {"class_type": "StreamingCacheEncode",
                   "inputs": {"vae": vae, "clip": clip, "folder": folder, "cache_name": cache_name, "resolution": 64,
                              "batch_size": 2}}
    if options:
        prompt["3o"] = {"class_type": "StreamingCacheEncodeOptions", "inputs": {**headless.node_defaults(
            "StreamingCacheEncodeOptions"), **options}}
        prompt["3"]["inputs"]["options"] = ["3o", 0]


def _shapes(cache: str, column: str) -> dict:
    import streaming_cache as sc

    handle = sc.DatasetHandle.from_cache(cache, "default", repeats=False)
    out = {}
    for row in handle:
        value = row.materialize()[column]
        out[row.keys["latent"][:8]] = list(next(iter(value.values())).shape)
    return out


def scenario_video(server: headless._Server) -> dict:
    import folder_paths

    folder = os.path.join(folder_paths.get_input_directory(), "videos")
    os.makedirs(folder, exist_ok=True)
    write_clip(os.path.join(folder, "walk.mp4"), frames=12)
    write_gif(os.path.join(folder, "spin.gif"), frames=9)
    write_image(os.path.join(folder, "still.png"))
    for stem, text in (("walk", "a pattern moving right"), ("spin", "a pattern moving"), ("still", "a still")):
        with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    tiny_wan_vae(os.path.join(folder_paths.get_folder_paths("vae")[0], "tiny_wan21_vae.safetensors"))
    tiny_hunyuan_video(os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], "tiny_hunyuan.safetensors"))
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan21_vae.safetensors"}},
        "4": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_hunyuan.safetensors", "weight_dtype": "default"}},
    }
    _encode(prompt, ["2", 0], ["1", 1], "videos", "videos", frames=5)
    _train(prompt, ["4", 0], ["3", 0], "video_lora")
    ok, result, error = headless.run(prompt, server)
    out: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3"), "train": ui_text(result, "5")}
    cache = _cache_dir("videos")
    if ok:
        out["latent_shapes"] = sorted(_shapes(cache, "latent").values())
    # a different frame count is a different cache key for the clips only
    prompt["3o"]["inputs"]["frames"] = 9
    ok, result, error = headless.run(prompt, server)
    out["reframed"] = {"ok": ok, "error": error, "encode": ui_text(result, "3")}
    if ok:
        out["reframed"]["latent_shapes"] = sorted(_shapes(cache, "latent").values())
    return out


def scenario_edit(server: headless._Server) -> dict:
    import inspect

    import comfy.model_detection
    import folder_paths

    folder = os.path.join(folder_paths.get_input_directory(), "edits")
    os.makedirs(os.path.join(folder, "ref"), exist_ok=True)
    write_image(os.path.join(folder, "a.png"), seed=3)
    write_image(os.path.join(folder, "a_ref.png"), seed=4)
    write_image(os.path.join(folder, "a_mask.png"), seed=5, mode="L")
    write_image(os.path.join(folder, "b.png"), 96, 64, seed=6)
    write_image(os.path.join(folder, "ref", "b.png"), 128, 96, seed=7)  # other size: cropped to b's bucket
    for stem in ("a", "b"):
        with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
            f.write(f"make {stem} brighter")
    # v0.3.64 fixes Flux at its full width (3072); newer versions read it from the weights
    kontext = 'dit_config["hidden_size"] = w.shape[0]' in inspect.getsource(comfy.model_detection.detect_unet_config)
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}}}
    if kontext:
        tiny_vae16(os.path.join(folder_paths.get_folder_paths("vae")[0], "tiny_vae16.safetensors"))
        tiny_flux(os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], "tiny_flux.safetensors"))
        prompt["2"] = {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_vae16.safetensors"}}
        prompt["4"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_flux.safetensors",
                                                              "weight_dtype": "default"}}
        vae, model = ["2", 0], ["4", 0]
    else:
        vae, model = ["1", 2], ["1", 0]
    _encode(prompt, vae, ["1", 1], "edits", "edits")
    _train(prompt, model, ["3", 0], "edit_lora")
    ok, result, error = headless.run(prompt, server)
    out: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3"), "train": ui_text(result, "5"),
                 "model": "flux" if kontext else "sd1"}
    if ok:
        import streaming_cache as sc

        cache = sc.DatasetHandle.from_cache(_cache_dir("edits"), "default", repeats=False)
        out["columns"] = list(cache.columns)
        rows = [row.materialize() for row in cache]
        out["pairs"] = [[list(r["latent"]["samples"].shape), list(r["ref"]["samples"].shape),
                         list(r["mask"]["mask"].shape)] for r in rows]
        out["mask_values"] = sorted({round(float(r["mask"]["mask"].float().mean()), 3) for r in rows})
    return out


def _cache_dir(name: str) -> str:
    import folder_paths

    if "datasets" in folder_paths.folder_names_and_paths:
        return os.path.join(folder_paths.get_folder_paths("datasets")[0], name)
    return os.path.join(folder_paths.get_output_directory(), "streaming_caches", name)


def main() -> None:
    server = boot_with_checkpoint(*sys.argv[1:3])
    result = {"video": scenario_video(server), "edit": scenario_edit(server)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
