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

from comfy_scenario import TRAIN, boot_with_checkpoint, find, load_example, set_train, ui_text
from demo_assets import CKPT
from media_assets import (
    random_weights,
    stable_audio_vae,
    tiny_flux,
    tiny_hunyuan_video,
    tiny_ltx_audio_vae,
    tiny_vae16,
    tiny_wan_vae,
    write_clip,
    write_clip_with_sound,
    write_gif,
    write_image,
    write_wav,
)

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
        out["flipped"] = flipped_copies(server, prompt, vae, folder)
        out["sizes"] = more_resolutions(server, prompt, vae)
    return out


def more_resolutions(server: headless._Server, prompt: dict, vae: list) -> dict:
    """The edit folder encoded again at its resolution (64) and at 128 (Encode Options' resolutions) into another
    cache, and once more with no bucket side under 128 (``min_bucket_side``): each row's latent, reference and mask
    shapes."""
    import streaming_cache as sc

    out: dict = {}
    for cache, options in (("edits_sizes", {"resolutions": "128"}), ("edits_min_side", {"min_bucket_side": 128})):
        encode = {k: v for k, v in prompt.items() if k in ("1", "2")}
        _encode(encode, vae, ["1", 1], "edits", cache, **options)
        ok, result, error = headless.run(encode, server)
        run: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3")}
        if ok:
            handle = sc.DatasetHandle.from_cache(_cache_dir(cache), "default", repeats=False)
            rows = [handle[i].materialize() for i in range(len(handle))]
            run["shapes"] = sorted([list(r["latent"]["samples"].shape), list(r["ref"]["samples"].shape),
                                    list(r["mask"]["mask"].shape)] for r in rows)
        out[cache] = run
    return out


def flipped_copies(server: headless._Server, prompt: dict, vae: list, folder: str) -> dict:
    """The edit folder encoded again with flip_augmentation into another cache: the items it holds, and how far
    sample a's mirrored latent, reference and mask are from the VAE's encoding of its image and reference mirrored
    by hand (numpy, from the files: both are 64 x 64, their bucket) and from its own mask mirrored."""
    import numpy as np
    import torch
    from PIL import Image

    import nodes
    import streaming_cache as sc

    encode = {k: v for k, v in prompt.items() if k in ("1", "2")}
    _encode(encode, vae, ["1", 1], "edits", "edits_flipped", flip_augmentation=True)
    ok, result, error = headless.run(encode, server)
    out: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3")}
    if not ok:
        return out
    handle = sc.DatasetHandle.from_cache(_cache_dir("edits_flipped"), "default", repeats=False)
    rows = {i: handle[i].materialize() for i in range(len(handle))}
    out["rows"] = len(rows)
    loaded = nodes.VAELoader().load_vae("tiny_vae16.safetensors")[0] if vae == ["2", 0] else \
        nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[2]

    def encoded(path: str) -> torch.Tensor:
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)[:, ::-1] / 255.0
        return loaded.encode(torch.from_numpy(pixels.copy())[None]).float()

    target, reference = encoded(os.path.join(folder, "a.png")), encoded(os.path.join(folder, "a_ref.png"))
    a_rows = [r for r in rows.values() if r["latent"]["samples"].shape == target.shape]  # a and its mirror: 64 x 64
    out["latent_gap"] = min(float((r["latent"]["samples"].float() - target).abs().max()) for r in a_rows)
    out["latent_scale"] = float(target.abs().max())
    out["ref_gap"] = min(float((r["ref"]["samples"].float() - reference).abs().max()) for r in a_rows)
    masks = [r["mask"]["mask"].float() for r in rows.values()]
    out["mask_pairs"] = sum(any(torch.equal(m.flip(-1), n) for n in masks) and not torch.equal(m, m.flip(-1))
                            for m in masks)
    return out


class TinyClipVision:
    """A CLIP vision model built with ComfyUI's own class from a tiny config, with random weights (a scenario
    node: no loader reads a model this small). Its width is CLIP-H's 1280, which Wan's image projection takes."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("CLIP_VISION",)
    FUNCTION = "load"
    CATEGORY = "tests"

    def load(self):
        import tempfile

        import comfy.clip_vision

        config = {"hidden_act": "quick_gelu", "hidden_size": 1280, "image_size": 28, "intermediate_size": 64,
                  "layer_norm_eps": 1e-05, "model_type": "clip_vision_model", "num_attention_heads": 2,
                  "num_channels": 3, "num_hidden_layers": 2, "patch_size": 14, "projection_dim": 16}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(config, f)
        try:
            model = comfy.clip_vision.ClipVisionModel(f.name)
        finally:
            os.remove(f.name)
        model.load_sd(random_weights(model.get_sd(), seed=11))
        return (model,)


def _frame(path: str, index: int):
    """Frame ``index`` of a clip as an IMAGE, decoded independently of the pack (the clips are made at their
    bucket's size, so nothing is resized)."""
    import av
    import numpy as np
    import torch

    with av.open(path) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i == index:
                return torch.from_numpy(np.asarray(frame.to_image().convert("RGB"), dtype=np.float32) / 255.0)[None]
    raise ValueError(f"{path} has no frame {index}")


def scenario_start_frames(server: headless._Server) -> dict:
    """Wan image-to-video and first/last-frame start frames through Encode Options: the cached values are what
    ComfyUI's own nodes give for each clip's first frame, CLIP vision output included."""
    import folder_paths
    import torch

    import nodes
    import streaming_cache as sc

    nodes.NODE_CLASS_MAPPINGS["TinyClipVision"] = TinyClipVision
    folder = os.path.join(folder_paths.get_input_directory(), "i2v")
    os.makedirs(folder, exist_ok=True)
    write_clip(os.path.join(folder, "walk.mp4"), frames=12, width=64, height=64)
    write_clip(os.path.join(folder, "slide.mp4"), frames=7, width=64, height=64, seed=5)
    _captions_and_wan_vae(folder, ("walk", "slide"))
    out: dict = {}
    for node in ("WanImageToVideo", "WanFirstLastFrameToVideo"):
        prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
                  "2": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan21_vae.safetensors"}},
                  "6": {"class_type": "TinyClipVision", "inputs": {}}}
        _encode(prompt, ["2", 0], ["1", 1], "i2v", f"i2v_{node}", frames=5, start_frames=node, clip_vision=["6", 0])
        ok, result, error = headless.run(prompt, server)
        run: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3")}
        out[node] = run
        if not ok:
            continue
        vae = nodes.VAELoader().load_vae("tiny_wan21_vae.safetensors")[0]
        clip_vision = TinyClipVision().load()[0]
        handle = sc.DatasetHandle.from_cache(_cache_dir(f"i2v_{node}"), "default", repeats=False)
        run["columns"] = list(handle.columns)
        media = headless.pack_module("backend.media")
        direct = {name: media.start_frame_values(node, vae=vae, clip_vision=clip_vision,
                                                 start=_frame(os.path.join(folder, name), 0),
                                                 end=_frame(os.path.join(folder, name), 4),
                                                 width=64, height=64, length=5)["conditioning"]
                  for name in ("walk.mp4", "slide.mp4")}

        def same(a: dict, b: dict) -> bool:
            return sorted(a) == sorted(b) and all(
                same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)

        run["clips"] = []
        for row in handle:
            values = row.materialize()
            cond = values["start"]["conditioning"]
            mask = cond["concat_mask"]
            run["clips"].append({
                "keys": sorted(cond), "latent": list(values["latent"]["samples"].shape),
                "concat_latent_image": list(cond["concat_latent_image"].shape), "concat_mask": list(mask.shape),
                "mask_by_frame": mask.amax(dim=(3, 4))[0].tolist(),  # 0 where a frame is given
                "clip_vision": sorted(cond["clip_vision_output"]),
                "same_as_node": [name for name, d in direct.items() if same(cond, d)],
            })
    if out["WanImageToVideo"]["ok"]:
        out["train"] = train_start_frames(server, "i2v_WanImageToVideo")
    return out


def _tiny_model_and_rows(config: str, model_file: str, name: str) -> list[dict]:
    """The sweep's tiny model of ComfyUI class ``config`` written to ``models/diffusion_models/model_file``, and the
    materialized rows of cache ``name`` (whose columns a training cache for it copies)."""
    import folder_paths
    from family_recipes import RECIPES
    from family_sweep import detect
    from tiny_models import write

    import streaming_cache as sc

    recipe = next(r for r in RECIPES if r.config == config)
    tiny, _ = detect(recipe)
    write(tiny, os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], model_file), recipe.metadata)
    return [row.materialize() for row in sc.DatasetHandle.from_cache(_cache_dir(name), "default", repeats=False)]


def train_start_frames(server: headless._Server, name: str) -> dict:
    """Train LoRA on a tiny Wan 2.1 image-to-video model (ComfyUI's own classes, random weights) from cache
    ``name``'s latents and start frames; the captions' conditioning is replaced by UMT5-shaped random tensors
    (no text encoder that small gives Wan's 4096 wide states). Records what the model was called with."""
    import torch
    from comfy_scenario import ModelInputs, train_from_cache

    import streaming_cache as sc

    rows = _tiny_model_and_rows("WAN21_I2V", "tiny_wan21_i2v.safetensors", name)
    g = torch.Generator().manual_seed(3)

    def copied(column: str) -> sc.Encoder:
        return sc.Encoder(f"copy-{column}", lambda parts: [rows[p.data[0]][column] for p in parts])

    items = [sc.Item(f"clip{i}", {c: sc.Part(data=bytes([i])) for c in ("latent", "cond", "start")})
             for i in range(len(rows))]
    sc.build(_cache_dir("i2v_train"), items, {
        "latent": copied("latent"), "start": copied("start"),
        "cond": sc.Encoder("umt5-shaped", lambda parts: [[[torch.randn(1, 12, 4096, generator=g), {}]] for _ in parts])})
    with ModelInputs() as spy:
        res = train_from_cache(server, "tiny_wan21_i2v.safetensors", "i2v_train", "i2v_lora", steps=2, batch_size=2,
                               rank=4, learning_rate=1e-3, training_dtype="fp32", lora_dtype="fp32")
    res["model_calls"] = spy.calls
    return res


class TestAudioVAE:
    """An audio VAE built with ComfyUI's own classes, random weights (a scenario node: Stable Audio's VAE, or LTX-2's
    at a tiny width where this ComfyUI has it); built once per process."""

    built: dict = {}

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"kind": (["stable_audio", "ltx2"],)}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load"
    CATEGORY = "tests"

    def load(self, kind):
        if kind not in self.built:
            self.built[kind] = stable_audio_vae() if kind == "stable_audio" else tiny_ltx_audio_vae()
        return (self.built[kind],)


def _direct_audio(path: str, node: str, vae, start: float = 0.0, duration: float = 0.0):
    """A file's latent from ComfyUI's own nodes called directly: LoadAudio, TrimAudioDuration when cut, and
    ``node`` (VAEEncodeAudio or LTXVAudioVAEEncode), with the seed the pack draws a sampled latent with."""
    import folder_paths
    import torch

    media = headless.pack_module("backend.media")
    encoders = headless.pack_module("encoders")
    name = os.path.relpath(path, folder_paths.get_input_directory()).replace(os.sep, "/")
    audio = media.run_node("LoadAudio", audio=name)[0]
    if start or duration:
        audio = media.run_node("TrimAudioDuration", audio=audio, start_index=start, duration=duration)[0]
    inputs = {"audio": audio, "audio_vae" if node == "LTXVAudioVAEEncode" else "vae": vae}
    with torch.inference_mode(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(encoders.audio_seed(audio))
        return media.run_node(node, **inputs)[0]["samples"]


def scenario_audio(server: headless._Server) -> dict:
    """Audio files with captions through Encode Dataset with Stable Audio's VAE (what LoadAudio + VAEEncodeAudio
    give; audio_duration re-encodes only the audio; a corrupt file and one with a loss mask file fail alone), and clips' sound tracks through
    Encode Options' audio_vae (LTX-2's audio VAE where ComfyUI has it, else Stable Audio's)."""
    import folder_paths
    import torch

    import nodes
    import streaming_cache as sc

    nodes.NODE_CLASS_MAPPINGS["TestAudioVAE"] = TestAudioVAE
    folder = os.path.join(folder_paths.get_input_directory(), "sounds")
    os.makedirs(folder, exist_ok=True)
    write_wav(os.path.join(folder, "tone.wav"), seconds=0.5, rate=22050, channels=2)
    # stereo: v0.3.64's VAEEncodeAudio gives Stable Audio's VAE mono sound unchanged, which it cannot encode
    write_wav(os.path.join(folder, "hum.wav"), seconds=0.4, rate=44100, channels=2, freq=110.0)
    with open(os.path.join(folder, "broken.mp3"), "wb") as f:
        f.write(b"ID3 this is not an mp3 stream " * 40)
    write_wav(os.path.join(folder, "voice.wav"), seconds=0.3, rate=44100, channels=2, freq=220.0)
    from PIL import Image

    Image.new("L", (8, 8), 255).save(os.path.join(folder, "voice_mask.png"))  # a loss mask: only pixels have one
    for stem in ("tone", "hum", "broken", "voice"):
        with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
            f.write(f"a {stem}")
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
              "2": {"class_type": "TestAudioVAE", "inputs": {"kind": "stable_audio"}}}
    _encode(prompt, ["2", 0], ["1", 1], "sounds", "sounds", audio_duration=0.0)
    out: dict = {}
    vae = TestAudioVAE().load("stable_audio")[0]
    for run_name, duration in (("whole", 0.0), ("cut", 0.25)):
        prompt["3o"]["inputs"]["audio_duration"] = duration
        ok, result, error = headless.run(prompt, server)
        run: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3")}
        out[run_name] = run
        if not ok:
            continue
        handle = sc.DatasetHandle.from_cache(_cache_dir("sounds"), "default", repeats=False)
        run["columns"] = list(handle.columns)
        direct = {n: _direct_audio(os.path.join(folder, n), "VAEEncodeAudio", vae, 0.0, duration)
                  for n in ("tone.wav", "hum.wav")}
        run["files"] = {}
        for row in handle:
            latent = row.materialize()["latent"]["samples"]
            same = [n for n, d in direct.items() if d.shape == latent.shape and torch.equal(d, latent)]
            run["files"][",".join(same) or "unmatched"] = list(latent.shape)
    out["sound_track"] = scenario_sound_track(server)
    return out


def scenario_sound_track(server: headless._Server) -> dict:
    import folder_paths
    import torch

    import nodes
    import streaming_cache as sc

    nodes.NODE_CLASS_MAPPINGS["TestAudioVAE"] = TestAudioVAE
    ltx = "LTXVAudioVAEEncode" in nodes.NODE_CLASS_MAPPINGS
    kind, node = ("ltx2", "LTXVAudioVAEEncode") if ltx else ("stable_audio", "VAEEncodeAudio")
    folder = os.path.join(folder_paths.get_input_directory(), "av")
    os.makedirs(folder, exist_ok=True)
    write_clip_with_sound(os.path.join(folder, "walk.mp4"), frames=12, fps=8)
    write_clip(os.path.join(folder, "mute.mp4"), frames=12, width=64, height=64, seed=4)
    _captions_and_wan_vae(folder, ("walk", "mute"))
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
              "2": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan21_vae.safetensors"}},
              "6": {"class_type": "TestAudioVAE", "inputs": {"kind": kind}}}
    _encode(prompt, ["2", 0], ["1", 1], "av", "av", frames=5, start=0.25, audio_vae=["6", 0])
    ok, result, error = headless.run(prompt, server)
    out: dict = {"ok": ok, "error": error, "encode": ui_text(result, "3"), "audio_vae": kind, "node": node}
    if ok:
        handle = sc.DatasetHandle.from_cache(_cache_dir("av"), "default", repeats=False)
        out["columns"] = list(handle.columns)
        # Wan's VAE keeps 5 frames (1 + 4k) at the clip's 8 fps: 0.625 s of sound from 0.25 s on
        direct = _direct_audio(os.path.join(folder, "walk.mp4"), node, TestAudioVAE().load(kind)[0], 0.25, 5 / 8)
        rows = [row.materialize() for row in handle]
        out["rows"] = [{"latent": list(r["latent"]["samples"].shape), "audio": list(r["audio"]["samples"].shape),
                        "same_as_node": torch.equal(r["audio"]["samples"], direct)} for r in rows]
        out["direct"] = list(direct.shape)
        if ltx:
            out["train"] = train_sound_track(server, "av")
    return out


def train_sound_track(server: headless._Server, name: str) -> dict:
    """Train LoRA on a tiny LTX-2 model (ComfyUI's own classes, random weights) with cache ``name``'s sound track
    in the audio column; the video latent (LTX-2's 128 channels; the cache's is Wan's) and the captions'
    conditioning (Gemma-shaped) are random tensors, as no VAE or text encoder that small exists for them."""
    import torch
    from comfy_scenario import ModelInputs, train_from_cache
    from family_recipes import RECIPES

    import streaming_cache as sc

    rows = _tiny_model_and_rows("LTXAV", "tiny_ltxav.safetensors", name)
    recipe = next(r for r in RECIPES if r.config == "LTXAV")
    g = torch.Generator().manual_seed(5)
    items = [sc.Item(f"clip{i}", {c: sc.Part(data=bytes([i])) for c in ("latent", "cond", "audio")})
             for i in range(2)]
    sc.build(_cache_dir("av_train"), items, {
        "audio": sc.Encoder("copy-audio", lambda parts: [rows[0]["audio"] for _ in parts]),
        "latent": sc.Encoder("ltx2-shaped", lambda parts: [{"samples": torch.randn(1, 128, 2, 2, 2, generator=g)}
                                                           for _ in parts]),
        "cond": sc.Encoder("gemma-shaped", lambda parts: [recipe.cond(g, i) for i, _ in enumerate(parts)])})
    with ModelInputs() as spy:
        res = train_from_cache(server, "tiny_ltxav.safetensors", "av_train", "av_lora", steps=2, batch_size=1,
                               rank=4, learning_rate=1e-3, training_dtype="fp32", lora_dtype="fp32")
    res["model_calls"] = spy.calls
    res["audio"] = list(rows[0]["audio"]["samples"].shape)
    return res


def _captions_and_wan_vae(folder: str, stems: tuple[str, ...]) -> None:
    """A caption beside each clip ``stems`` of ``folder``, and the tiny Wan 2.1 VAE in models/vae."""
    import folder_paths

    for stem in stems:
        with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
            f.write(f"a pattern, {stem}")
    vae_file = os.path.join(folder_paths.get_folder_paths("vae")[0], "tiny_wan21_vae.safetensors")
    if not os.path.exists(vae_file):
        tiny_wan_vae(vae_file)


def scenario_flux_example(server: headless._Server) -> dict:
    """The Flux example workflow as it ships, with tiny files in place of FLUX.1 dev, its VAE and its text encoders
    (the tiny checkpoint's CLIP-L, which the tiny Flux's context width matches), run headless with its presets; on
    a ComfyUI that hard-codes Flux at full width (v0.3.64) there is no tiny Flux to load."""
    import inspect

    import comfy.model_detection
    import folder_paths

    if 'dit_config["hidden_size"] = w.shape[0]' not in inspect.getsource(comfy.model_detection.detect_unet_config):
        return {"skipped": "this ComfyUI fixes Flux at its full width (3072): no tiny Flux loads"}
    folder = os.path.join(folder_paths.get_input_directory(), "flux_dataset")
    os.makedirs(folder, exist_ok=True)
    for i, stem in enumerate(("a", "b")):
        write_image(os.path.join(folder, f"{stem}.png"), seed=20 + i)
        with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
            f.write(f"sks {stem}, a photo")
    tiny_vae16(os.path.join(folder_paths.get_folder_paths("vae")[0], "tiny_vae16.safetensors"))
    tiny_flux(os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], "tiny_flux.safetensors"))
    prompt = load_example(headless.EXAMPLES[4])
    clip = find(prompt, "DualCLIPLoader")
    prompt[clip] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}}
    for node in prompt.values():  # what took the text encoders' CLIP takes the checkpoint's (its output 1)
        for name, value in node["inputs"].items():
            if value == [clip, 0]:
                node["inputs"][name] = [clip, 1]
    prompt[find(prompt, "UNETLoader")]["inputs"]["unet_name"] = "tiny_flux.safetensors"
    prompt[find(prompt, "VAELoader")]["inputs"]["vae_name"] = "tiny_vae16.safetensors"
    encode = find(prompt, "StreamingCacheEncode")
    prompt[encode]["inputs"].update(folder="flux_dataset", cache_name="flux_example", resolution=64, batch_size=2)
    train = find(prompt, TRAIN)
    set_train(prompt, train, steps=2, batch_size=1, rank=4, training_dtype="fp32", lora_dtype="fp32")
    ok, result, error = headless.run(prompt, server)
    return {"ok": ok, "error": error, "encode": ui_text(result, encode), "train": ui_text(result, train),
            "presets": [prompt[encode]["inputs"].get("preset"), prompt[train]["inputs"].get("preset")]}


def _cache_dir(name: str) -> str:
    import folder_paths

    if "datasets" in folder_paths.folder_names_and_paths:
        return os.path.join(folder_paths.get_folder_paths("datasets")[0], name)
    return os.path.join(folder_paths.get_output_directory(), "streaming_caches", name)


def main() -> None:
    server = boot_with_checkpoint(*sys.argv[1:3])
    result = {"video": scenario_video(server), "edit": scenario_edit(server),
              "start_frames": scenario_start_frames(server), "audio": scenario_audio(server),
              "flux_example": scenario_flux_example(server)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
