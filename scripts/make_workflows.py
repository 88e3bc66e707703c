"""Writes example_workflows/*.json (UI format, as the ComfyUI frontend saves them) from the live node definitions, and
a thumbnail of each (``<name>.jpg``, which ComfyUI's template browser shows beside the title).

    python scripts/make_workflows.py COMFYUI_PATH

Run it after changing a node's inputs; tests/comfy/ run the written files through real ComfyUI.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import headless

PACK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SDXL = {"name": "sd_xl_base_1.0.safetensors", "directory": "checkpoints",
        "url": "https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/resolve/main/sd_xl_base_1.0.safetensors"}
MODEL_LINKS = (f"## Model links\n\n**checkpoints**\n\n- [{SDXL['name']}]({SDXL['url']})\n\n"
               "Any checkpoint ComfyUI loads works (SD1.x, SDXL, ...); put it in `ComfyUI/models/checkpoints`. For "
               "Flux, Wan, Qwen-Image and other models loaded as separate files, use Load Diffusion Model, Load CLIP "
               "and Load VAE instead of the checkpoint loader.\n\n")
FLUX_DEV = {"name": "flux1-dev.safetensors", "directory": "diffusion_models",
            "url": "https://huggingface.co/black-forest-labs/FLUX.1-dev/resolve/main/flux1-dev.safetensors"}
CLIP_L = {"name": "clip_l.safetensors", "directory": "text_encoders",
          "url": "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors"}
T5XXL = {"name": "t5xxl_fp16.safetensors", "directory": "text_encoders",
         "url": "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors"}
FLUX_VAE = {"name": "ae.safetensors", "directory": "vae",
            "url": "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/"
                   "ae.safetensors"}

QWEN_REPO = "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/"
WAN21_REPO = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
QWEN_IMAGE = {"name": "qwen_image_fp8_e4m3fn.safetensors", "directory": "diffusion_models",
              "url": QWEN_REPO + "diffusion_models/qwen_image_fp8_e4m3fn.safetensors"}
QWEN_IMAGE_EDIT = {"name": "qwen_image_edit_2509_fp8_e4m3fn.safetensors", "directory": "diffusion_models",
                   "url": "https://huggingface.co/Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/"
                          "diffusion_models/qwen_image_edit_2509_fp8_e4m3fn.safetensors"}
QWEN_VL = {"name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "directory": "text_encoders",
           "url": QWEN_REPO + "text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors"}
QWEN_VAE = {"name": "qwen_image_vae.safetensors", "directory": "vae",
            "url": QWEN_REPO + "vae/qwen_image_vae.safetensors"}
WAN_T2V = {"name": "wan2.1_t2v_1.3B_fp16.safetensors", "directory": "diffusion_models",
           "url": WAN21_REPO + "diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors"}
WAN_I2V = {"name": "wan2.1_i2v_480p_14B_fp16.safetensors", "directory": "diffusion_models",
           "url": WAN21_REPO + "diffusion_models/wan2.1_i2v_480p_14B_fp16.safetensors"}
UMT5 = {"name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "directory": "text_encoders",
        "url": WAN21_REPO + "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
WAN_VAE = {"name": "wan_2.1_vae.safetensors", "directory": "vae", "url": WAN21_REPO + "vae/wan_2.1_vae.safetensors"}
CLIP_VISION_H = {"name": "clip_vision_h.safetensors", "directory": "clip_vision",
                 "url": WAN21_REPO + "clip_vision/clip_vision_h.safetensors"}
LTX2_CKPT = {"name": "ltx-2-19b-dev-fp8.safetensors", "directory": "checkpoints",
             "url": "https://huggingface.co/Lightricks/LTX-2/resolve/main/ltx-2-19b-dev-fp8.safetensors"}
GEMMA3 = {"name": "gemma_3_12B_it_fp4_mixed.safetensors", "directory": "text_encoders",
          "url": "https://huggingface.co/Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/"
                 "gemma_3_12B_it_fp4_mixed.safetensors"}
"""The files ComfyUI's own LTX-2 text-to-video template loads (the checkpoint holds the video and audio VAEs)."""


def model_links(*models: dict) -> str:
    """The note's list of the files a workflow loads, by folder, as ComfyUI's templates give them."""
    by_folder: dict[str, list[dict]] = {}
    for m in models:
        by_folder.setdefault(m["directory"], []).append(m)
    return "## Model links\n\n" + "".join(
        f"**{folder}**\n\n" + "".join(f"- [{m['name']}]({m['url']})\n" for m in files) + "\n"
        for folder, files in by_folder.items())


HOW_IT_DIFFERS = ("Unlike core *Load Training Dataset* / *Train LoRA*, the dataset is encoded once into a "
                  "content-addressed cache on disk (a second run encodes only what changed) and streams from disk "
                  "while training, so it never has to fit in RAM; each sample keeps its own caption.\n\n")
FOLDER_NOTE = ("## Train a LoRA from an image folder\n\n"
               "1. Put images with kohya-style captions (`name.txt` beside `name.png`; `N_name` subfolders repeat N "
               "times) in a folder under `ComfyUI/input`, e.g. `ComfyUI/input/dataset`, and pick it in **Encode "
               "Dataset** (press R to refresh the list).\n2. Pick your checkpoint and press **Run**. Training saves "
               "`models/loras/my_lora.safetensors`. Encode Dataset shows a page of the dataset as the trainer sees "
               "it (its arrows turn pages); Train LoRA draws the loss as it trains (hover for values, drag to zoom) "
               "and says what it did. Cancel saves what was trained so far; queue again to continue.\n\n"
               "More settings (optimizer, loss, previews, memory, captions, adapter "
               "type): add a **Train Options** node and wire it to Train LoRA's `options`.\n\n" + HOW_IT_DIFFERS
               + MODEL_LINKS)
PREVIEW_NOTE = ("## Train with sample previews and a validation loss\n\n"
                "1. Put images with captions in a folder under `ComfyUI/input` and pick it in **Encode Dataset**.\n"
                "2. Write your test prompts in **sample_prompts** (one per line) on *Train Options: Previews & "
                "Validation* and press **Run**. Every `sample_every` steps the prompts are sampled with the LoRA as "
                "it is; the latest show on Train LoRA while it trains and in the Preview Image beside it, and all are "
                "saved in `output/lora_training/<lora_name>_samples`. `validation_split` holds out 10% of the images; "
                "Train LoRA's loss chart draws their loss beside the training loss.\n\n"
                "Option nodes chain: *Optimizer & Schedule* feeds "
                "*Previews & Validation*, which feeds Train LoRA's `options`. Queue again with the same settings to "
                "continue a run; change the dataset or a setting and a new numbered LoRA is trained, the old one "
                "kept.\n\n" + MODEL_LINKS)
MIX_NOTE = ("## Train a LoRA with regularisation images\n\n"
            "Two datasets in one training, each sampled its own way (what other trainers call concepts):\n\n"
            "1. Put your subject or style images (with captions) in `ComfyUI/input/dataset` and regularisation "
            "images of the same class (e.g. generated by the base model from the class prompt, with that prompt as "
            "caption) in `ComfyUI/input/regularization`; pick them in the two **Encode Dataset** nodes.\n"
            "2. Each **Dataset Mix** node adds one dataset: its name (on the loss chart), `weight` (how many of its "
            "batches an epoch holds: 0.5 half), `repeats`, its own `batch_size` and `caption_dropout`. A batch "
            "never mixes datasets.\n3. Pick your checkpoint and press **Run**. Train LoRA's loss chart shows each "
            "dataset's loss in its own colour.\n\n" + MODEL_LINKS)
CACHE_NOTE = ("## Train a LoRA from a saved dataset cache\n\nNo source images needed: pick a cache made by Encode "
              "Dataset (ComfyUI's `datasets` folder, or `output/streaming_caches`) and your checkpoint, then "
              "**Run**. Latents stream from disk while training.\n\n" + HOW_IT_DIFFERS + MODEL_LINKS)

FLUX_NOTE = ("## Train a Flux LoRA from an image folder\n\n"
             "1. Put images with captions (`name.txt` beside `name.png`) in a folder under `ComfyUI/input` and pick it "
             "in **Encode Dataset** (press R to refresh the list).\n2. Put the four files below in their folders "
             "(FLUX.1 dev is gated: accept its licence on Hugging Face first) and press **Run**.\n\n"
             "`preset` is auto on both pack nodes: Encode Dataset encodes at Flux's 1024 px (its resolution is left "
             "at 512, and the CLIP says Flux), and Train LoRA trains with the settings published for Flux (rank 16, "
             "alpha 16, sd-scripts' shifted sampling at 3.1582, the velocity loss, attention and MLP layers; "
             "docs/presets.md). A value you change is kept; the summaries say what auto chose.\n\n"
             "**GPU memory** (FLUX.1 dev, 1024 px, batch 1, rank 16 on every layer, gradient checkpointing; "
             "docs/vram.md; the preset trains fewer layers): 25.1 GiB measured on an H200, 25.0 estimated; "
             "14.1 estimated with the model loaded as fp8 (Load Diffusion Model's weight_dtype fp8_e4m3fn) and "
             "bypass_mode on *Train Options: Memory & Precision*. Train LoRA's memory plan (auto) picks the "
             "settings that fit your GPU before the first step (offloading for the bf16 model on a 24 GB GPU) and "
             "says what it chose.\n\n"
             "Needs a ComfyUI that loads FLUX.1 (v0.3.64 or newer).\n\n" + HOW_IT_DIFFERS
             + model_links(FLUX_DEV, CLIP_L, T5XXL, FLUX_VAE))

PLAN = ("Train LoRA's memory plan (auto) picks gradient checkpointing and offloading to fit your GPU before the "
        "first step and says what it chose; docs/vram.md has the estimates per family.")
VRAM_NOTES = {
    "Qwen-Image": "Qwen-Image's diffusion model has 20 billion parameters: its weights alone take 38 GiB in bf16 and "
                  "19 GiB in fp8 (the file below). Estimated peak of a step at 1024 px (batch 1, rank 16 on every "
                  "layer, gradient checkpointing; docs/vram.md, not measured yet): 41.7 GiB in bf16, 22.8 GiB with "
                  "fp8 weights and bypass_mode on *Train Options: Memory & Precision* (the LoRA runs beside the fp8 "
                  "weights instead of being merged into them). " + PLAN,
    "Wan 2.1 1.3B": "Wan 2.1 T2V 1.3B's weights take 2.6 GiB in fp16 or bf16. Estimated peak of a step at 832x480 "
                    "(batch 1, rank 16 on every layer, gradient checkpointing; docs/vram.md, not measured yet): "
                    "6.1 GiB for 33 frames, 10.5 GiB for 81. " + PLAN,
    "Wan 2.1 14B": "Wan 2.1 14B's weights alone take 26.6 GiB in fp16 or bf16 and 13.3 GiB in fp8 (Load Diffusion "
                   "Model's weight_dtype fp8_e4m3fn); the image-to-video model adds a few input layers to the "
                   "text-to-video one that docs/vram.md estimates. Estimated peak of a step at 832x480, 33 frames "
                   "(batch 1, rank 16 on every layer, gradient checkpointing; docs/vram.md, not measured yet): "
                   "37.8 GiB in bf16, 24.9 GiB with fp8 weights and bypass_mode on *Train Options: Memory & "
                   "Precision*; 81 frames: 52.0 and 39.1 GiB. " + PLAN,
    "LTX-2": "LTX-2's audio-video model has 19.6 billion parameters (its text connectors included): its weights "
             "alone take 36.5 GiB in bf16 (ltx-2-19b-dev.safetensors) and 18.2 GiB in fp8 (the file below). "
             "Estimated peak of a step at 768x512 with its sound track (batch 1, rank 16 on every layer, gradient "
             "checkpointing; docs/vram.md, not measured yet): 40.2 GiB in bf16 and 22.3 GiB with fp8 weights and "
             "bypass_mode on *Train Options: Memory & Precision* for 49 frames; 43.2 and 25.4 GiB for 121. " + PLAN,
}
"""What is known of each family's GPU memory today: its weights' size and the estimated peak of a step
(docs/vram.md's rows, counted on the CPU; no family here is measured on a GPU yet)."""

LAYERS_NOTE = "A value you change is kept; the summaries say what auto chose.\n\n"
QWEN_PRESET = ("Train LoRA trains with the settings published for Qwen-Image (rank 16, alpha 16, learning rate 1e-4, "
               "musubi-tuner's shifted sampling at 2.2, the velocity loss, attention and MLP layers; "
               "docs/presets.md). " + LAYERS_NOTE)
WAN_PRESET = ("Train LoRA trains with the settings published for Wan 2.1 (rank 32, alpha 32, learning rate 1e-4, "
              "musubi-tuner's shifted sampling at 3.0, the velocity loss, the blocks' attention and MLP layers; "
              "docs/presets.md). " + LAYERS_NOTE)
WAN_RESOLUTION = ("Encode Dataset keeps resolution 512: UMT5 serves Wan models made for several resolutions, so "
                  "its CLIP cannot say which (ai-toolkit trains Wan 2.1 at 632, about 480p's area; set 640 for it). "
                  "*Encode Options* sets the frames per clip (33; 1 + 4k frames encode whole).")
QWEN_NOTE = ("## Train a Qwen-Image LoRA from an image folder\n\n"
             "1. Put images with captions (`name.txt` beside `name.png`) in a folder under `ComfyUI/input` and pick "
             "it in **Encode Dataset** (press R to refresh the list).\n2. Put the three files below in their folders "
             "and press **Run**.\n\n"
             "`preset` is auto on both pack nodes: Encode Dataset encodes at Qwen-Image's 1328 px (its resolution "
             "is left at 512, and the CLIP says Qwen-Image), and " + QWEN_PRESET
             + "**GPU memory**: " + VRAM_NOTES["Qwen-Image"] + "\n\n"
             "Needs a ComfyUI that loads Qwen-Image (v0.3.64 or newer).\n\n" + HOW_IT_DIFFERS
             + model_links(QWEN_IMAGE, QWEN_VL, QWEN_VAE))
QWEN_EDIT_NOTE = ("## Train a Qwen-Image-Edit LoRA from edit pairs\n\n"
                  "1. Put edit pairs in a folder under `ComfyUI/input`, e.g. `ComfyUI/input/edits`: the edited "
                  "image `name.png`, the image before the edit `name_ref.png` beside it (or `ref/name.png`), the "
                  "instruction in `name.txt`, and optionally a loss mask `name_mask.png` (white counts). Pick the "
                  "folder in **Encode Dataset** (press R to refresh the list); each reference is encoded in its "
                  "target's bucket and reaches the model as Qwen-Image-Edit's reference latent.\n2. Put the three "
                  "files below in their folders and press **Run**.\n\n"
                  "`preset` is auto on both pack nodes: Encode Dataset encodes at Qwen-Image's 1328 px (the CLIP "
                  "says Qwen-Image), and " + QWEN_PRESET
                  + "**GPU memory** (a reference doubles a step's image tokens): " + VRAM_NOTES["Qwen-Image"]
                  + "\n\nNeeds a ComfyUI that loads Qwen-Image-Edit 2509 (v0.3.64 or newer). The first "
                  "Qwen-Image-Edit (qwen_image_edit_fp8_e4m3fn.safetensors) trains the same way.\n\n"
                  + HOW_IT_DIFFERS + model_links(QWEN_IMAGE_EDIT, QWEN_VL, QWEN_VAE))
WAN_T2V_NOTE = ("## Train a Wan 2.1 text-to-video LoRA from video clips\n\n"
                "1. Put clips (MP4, WebM, GIF, ...) with captions (`name.txt` beside `name.mp4`) in a folder under "
                "`ComfyUI/input`, e.g. `ComfyUI/input/videos`, and pick it in **Encode Dataset** (press R to "
                "refresh the list); images in it train as one-frame clips.\n2. Put the three files below in their "
                "folders and press **Run**.\n\n"
                "`preset` is auto on both pack nodes. " + WAN_RESOLUTION + " " + WAN_PRESET
                + "Other Wan files load the same way: Wan 2.1 T2V 14B (wan2.1_t2v_14B_fp16.safetensors, same "
                "encoders and VAE), and each of Wan 2.2 T2V A14B's high- and low-noise models (trained one at a "
                "time). Wan 2.2 TI2V 5B needs its own VAE (wan2.2_vae.safetensors) and trains with Wan 2.2 5B's "
                "preset.\n\n**GPU memory**: " + VRAM_NOTES["Wan 2.1 1.3B"] + "\n\n"
                "Needs a ComfyUI that loads Wan 2.1 (v0.3.64 or newer).\n\n" + HOW_IT_DIFFERS
                + model_links(WAN_T2V, UMT5, WAN_VAE))
WAN_I2V_NOTE = ("## Train a Wan 2.1 image-to-video LoRA from video clips\n\n"
                "1. Put clips with captions (`name.txt` beside `name.mp4`) in a folder under `ComfyUI/input`, e.g. "
                "`ComfyUI/input/videos`, and pick it in **Encode Dataset** (press R to refresh the list).\n2. Put "
                "the four files below in their folders and press **Run**.\n\n"
                "*Encode Options* gives each clip its start frame as your generation workflow does: `start_frames` "
                "WanImageToVideo runs ComfyUI's own node on the clip's first frame, with the CLIP vision model, and "
                "what it adds to the conditioning (the start image's latent and mask, CLIP vision output) is cached "
                "with the clip.\n\n`preset` is auto on both pack nodes. " + WAN_RESOLUTION + " " + WAN_PRESET
                + "Wan 2.1 I2V 14B 720p (wan2.1_i2v_720p_14B_fp16.safetensors) loads the same way; for first/last "
                "frame models pick WanFirstLastFrameToVideo.\n\n**GPU memory**: " + VRAM_NOTES["Wan 2.1 14B"]
                + "\n\nNeeds a ComfyUI that loads Wan 2.1 (v0.3.64 or newer).\n\n" + HOW_IT_DIFFERS
                + model_links(WAN_I2V, UMT5, WAN_VAE, CLIP_VISION_H))

LTX2_NEEDS = headless.NEEDS_NEWER_COMFYUI["Train an LTX-2 LoRA from video clips"][0]
LTX2_NOTE = ("## Train an LTX-2 LoRA from video clips\n\n"
             "1. Put clips with sound (MP4, WebM, ...) and captions (`name.txt` beside `name.mp4`) in a folder under "
             "`ComfyUI/input`, e.g. `ComfyUI/input/videos`, and pick it in **Encode Dataset** (press R to refresh "
             "the list).\n2. Put the two files below in their folders and press **Run**.\n\n"
             "LTX-2 makes sound with its video, and trains on both: *Encode Options* sends each clip's sound track "
             "through LTX-2's audio VAE (Load LTXV Audio VAE, from the checkpoint) over the same seconds as its "
             "frames, and Train LoRA trains the model on the two together. A clip without sound fails on its own "
             "(give it a silent track), or disconnect `audio_vae` to train on video alone. Encode Options samples "
             "clips at 25 frames a second (`fps`: the rate LTX-2 is told in training) and 49 frames per clip (1 + "
             "8k frames encode whole, about 2 seconds).\n\n"
             "`preset` is auto on both pack nodes. Encode Dataset keeps resolution 512 (the estimates below are at "
             "768x512; set 640 for about that area). Train LoRA trains with the settings published for LTX-2 "
             "(rank 32, alpha 32, learning rate 1e-4, the velocity loss, the blocks' attention and MLP layers; "
             "docs/presets.md). " + LAYERS_NOTE
             + "The bf16 checkpoint (ltx-2-19b-dev.safetensors, same repository) loads the same way.\n\n"
             "**GPU memory**: " + VRAM_NOTES["LTX-2"] + "\n\n"
             f"Needs ComfyUI v{'.'.join(map(str, LTX2_NEEDS))} or newer (older versions lack its LTX-2 loaders and "
             "show them as missing nodes).\n\n" + HOW_IT_DIFFERS
             + model_links(LTX2_CKPT, GEMMA3))

# Example workflows by file name, which the template browser shows as their title.
(FOLDER, CACHE, PREVIEWS, MIX, FLUX, QWEN, QWEN_EDIT, WAN_T2V_EXAMPLE, WAN_I2V_EXAMPLE,
 LTX2_EXAMPLE) = headless.EXAMPLES


def build(mappings: dict, spec: list[dict]) -> dict:
    nodes, links = [], []
    out_links: dict[tuple[int, int], list[int]] = {}
    for node in spec:
        for name, (src, slot) in node.get("links", {}).items():
            link_id = len(links) + 1
            links.append([link_id, src, slot, node["id"], name, None])
            out_links.setdefault((src, slot), []).append(link_id)
    order = {n["id"]: i for i, n in enumerate(spec)}
    for node in spec:
        t = node["type"]
        entry = {"id": node["id"], "type": t, "pos": node["pos"], "size": node.get("size", [320, 260]),
                 "flags": {}, "order": order[node["id"]], "mode": 0,
                 "properties": {"Node name for S&R": t, **node.get("properties", {})}}
        if t == "MarkdownNote":
            entry.update(inputs=[], outputs=[], widgets_values=[node["text"]], size=node.get("size", [400, 330]))
            nodes.append(entry)
            continue
        cls = mappings[t]
        spec_inputs = cls.INPUT_TYPES()
        widgets = dict(headless._widget_inputs(cls))
        created = headless.created_values().get(t, {})
        inputs, values = [], []
        for section in ("required", "optional"):
            for name, value in (spec_inputs.get(section) or {}).items():
                kind = value[0]
                opts = value[1] if len(value) > 1 else {}
                if name in widgets:
                    if name in node.get("values", {}):
                        default = node["values"][name]
                    elif name in created:
                        default = created[name]
                    elif "default" in opts:
                        default = opts["default"]
                    else:
                        default = kind[0] if isinstance(kind, list) and kind else None
                    values.append(default)
                    control = opts.get("control_after_generate")
                    if kind == "INT" and (control or (name in ("seed", "noise_seed") and control is None)):
                        values.append("fixed")
                    continue
                link = None
                if name in node.get("links", {}):
                    link = next(lk[0] for lk in links if lk[3] == node["id"] and lk[4] == name)
                inputs.append({"name": name, "type": kind, "link": link})
        for lk in links:
            if lk[3] == node["id"]:
                lk[4] = next(i for i, x in enumerate(inputs) if x["name"] == lk[4])
                lk[5] = inputs[lk[4]]["type"]
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        outputs = [{"name": n, "type": ty, "links": out_links.get((node["id"], i), []), "slot_index": i}
                   for i, (n, ty) in enumerate(zip(names, cls.RETURN_TYPES))]
        entry.update(inputs=inputs, outputs=outputs, widgets_values=values)
        nodes.append(entry)
    return {"last_node_id": max(n["id"] for n in spec), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4}


COLORS = {"StreamingCache": (54, 92, 140), "MarkdownNote": (70, 70, 70)}


def thumbnail(workflow: dict, mappings: dict, titles: dict, path: str, width: int = 960, height: int = 540) -> None:
    """A picture of the workflow for the template browser: each node a titled box where the canvas has it, with
    its first widget values (a note: its first lines), links as lines, the pack's nodes in blue; saved as JPEG."""
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    nodes = workflow["nodes"]
    x0 = min(n["pos"][0] for n in nodes) - 20
    y0 = min(n["pos"][1] for n in nodes) - 40
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes) + 20
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes) + 20
    scale = min(width / (x1 - x0), height / (y1 - y0))
    ox, oy = (width - (x1 - x0) * scale) / 2, (height - (y1 - y0) * scale) / 2

    def at(x: float, y: float) -> tuple[float, float]:
        return ox + (x - x0) * scale, oy + (y - y0) * scale

    img = Image.new("RGB", (width, height), (32, 32, 34))
    draw = ImageDraw.Draw(img)
    size = max(9, round(14 * scale))
    font, bold = ImageFont.load_default(size=size), ImageFont.load_default(size=size + 1)
    by_id = {n["id"]: n for n in nodes}
    for _, src, _, dst, _, _ in workflow["links"]:
        a, b = by_id[src], by_id[dst]
        draw.line([at(a["pos"][0] + a["size"][0], a["pos"][1] + 20), at(b["pos"][0], b["pos"][1] + 20)],
                  fill=(150, 160, 120), width=2)
    for n in nodes:
        title = "Note" if n["type"] == "MarkdownNote" else titles.get(n["type"], n["type"])
        color = next((c for prefix, c in COLORS.items() if n["type"].startswith(prefix)), (60, 60, 64))
        (ax, ay), (bx, by) = at(*n["pos"]), at(n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
        draw.rounded_rectangle([ax, ay - size - 10, bx, by], radius=6, fill=(48, 48, 52), outline=(90, 90, 96))
        draw.rounded_rectangle([ax, ay - size - 10, bx, ay], radius=6, fill=color)
        draw.text((ax + 6, ay - size - 6), title, fill=(240, 240, 240), font=bold)
        chars = max(8, int((bx - ax - 12) / (size * 0.55)))
        if n["type"] == "MarkdownNote":
            text = " ".join(line.strip("# ") for line in (n.get("widgets_values") or [""])[0].splitlines())
            lines = textwrap.wrap(text.replace("**", "").replace("`", ""), chars)
        else:
            cls = mappings.get(n["type"])
            names = [name for name, _ in headless._widget_inputs(cls)] if cls is not None else []
            lines = [f"{name}: {value}"[:chars] for name, value in zip(names, n.get("widgets_values") or [])
                     if not isinstance(value, str) or "\n" not in value]
        for k, line in enumerate(lines):
            y = ay + 6 + k * (size + 4)
            if y + size > by - 4:
                break
            draw.text((ax + 6, y), line, fill=(190, 190, 190), font=font)
    img.save(path, "JPEG", quality=88)


def workflows() -> dict[str, list[dict]]:
    loader = {"type": "CheckpointLoaderSimple", "id": 1, "pos": [60, 80], "size": [320, 100],
              "values": {"ckpt_name": SDXL["name"]}, "properties": {"models": [SDXL]}}
    encode = {"type": "StreamingCacheEncode", "id": 2, "pos": [420, 80], "size": [480, 240],
              "links": {"vae": (1, 2), "clip": (1, 1)}, "values": {"resolution": 1024, "folder": "dataset"}}
    train = {"type": "StreamingCacheTrain", "id": 3, "pos": [940, 80], "size": [340, 420],
             "links": {"model": (1, 0), "dataset": (2, 0)}}
    samples = {"type": "PreviewImage", "id": 4, "pos": [1320, 80], "size": [540, 340], "links": {"images": (3, 5)}}
    return {
        FOLDER: [{"type": "MarkdownNote", "id": 5, "pos": [60, 240], "text": FOLDER_NOTE, "size": [340, 520]},
                 loader, encode, train],
        CACHE: [{"type": "MarkdownNote", "id": 5, "pos": [60, 240], "text": CACHE_NOTE, "size": [340, 420]},
                loader,
                {"type": "StreamingCacheLoad", "id": 2, "pos": [420, 80], "size": [480, 160],
                 "values": {"cache_name": "my_dataset"}},
                train],
        PREVIEWS: [{"type": "MarkdownNote", "id": 5, "pos": [60, 240], "text": PREVIEW_NOTE, "size": [340, 600]},
                   loader, encode,
                   {"type": "StreamingCacheOptimizerOptions", "id": 6, "pos": [420, 760], "size": [340, 260],
                    "values": {"lr_schedule": "cosine", "warmup_steps": 50}},
                   {"type": "StreamingCachePreviewOptions", "id": 7, "pos": [420, 1080], "size": [340, 330],
                    "links": {"options": (6, 0), "clip": (1, 1), "vae": (1, 2)},
                    "values": {"sample_prompts": "a photo of sks dog on a beach\na painting of sks dog, oil on canvas",
                               "sample_every": 100, "validation_split": 0.1}},
                   dict(train, links={"model": (1, 0), "dataset": (2, 0), "options": (7, 0)},
                        values={"lora_name": "my_lora_previews"}),
                   samples],
        MIX: [{"type": "MarkdownNote", "id": 5, "pos": [60, 240], "text": MIX_NOTE, "size": [340, 640]},
              loader, encode,
              {"type": "StreamingCacheEncode", "id": 8, "pos": [420, 760], "size": [480, 240],
               "links": {"vae": (1, 2), "clip": (1, 1)},
               "values": {"resolution": 1024, "folder": "regularization", "cache_name": "my_regularization"}},
              {"type": "StreamingCacheDatasetMix", "id": 9, "pos": [940, 80], "size": [320, 220],
               "links": {"dataset": (2, 0)}, "values": {"name": "style"}},
              {"type": "StreamingCacheDatasetMix", "id": 10, "pos": [940, 360], "size": [320, 220],
               "links": {"dataset": (8, 0), "mix": (9, 0)}, "values": {"name": "regularization", "weight": 0.5}},
              dict(train, pos=[1300, 80], links={"model": (1, 0), "dataset": (10, 0)},
                   values={"lora_name": "my_lora_regularized"})],
        FLUX: [{"type": "MarkdownNote", "id": 5, "pos": [60, 420], "text": FLUX_NOTE, "size": [340, 760]},
               {"type": "UNETLoader", "id": 1, "pos": [60, 80], "size": [320, 110],
                "values": {"unet_name": FLUX_DEV["name"]}, "properties": {"models": [FLUX_DEV]}},
               {"type": "DualCLIPLoader", "id": 6, "pos": [60, 210], "size": [320, 130],
                "values": {"clip_name1": CLIP_L["name"], "clip_name2": T5XXL["name"], "type": "flux"},
                "properties": {"models": [CLIP_L, T5XXL]}},
               {"type": "VAELoader", "id": 7, "pos": [60, 360], "size": [320, 60],
                "values": {"vae_name": FLUX_VAE["name"]}, "properties": {"models": [FLUX_VAE]}},
               {"type": "StreamingCacheEncode", "id": 2, "pos": [420, 80], "size": [480, 260],
                "links": {"vae": (7, 0), "clip": (6, 0)}, "values": {"folder": "dataset"}},
               dict(train, links={"model": (1, 0), "dataset": (2, 0)}, values={"lora_name": "my_flux_lora"})],
        QWEN: split_loaders(QWEN_IMAGE, QWEN_VL, "qwen_image", QWEN_VAE, QWEN_NOTE, train,
                            ("dataset", "my_qwen_dataset", "my_qwen_image_lora")),
        QWEN_EDIT: split_loaders(QWEN_IMAGE_EDIT, QWEN_VL, "qwen_image", QWEN_VAE, QWEN_EDIT_NOTE, train,
                                 ("edits", "my_qwen_edits", "my_qwen_edit_lora")),
        WAN_T2V_EXAMPLE: split_loaders(WAN_T2V, UMT5, "wan", WAN_VAE, WAN_T2V_NOTE, train,
                                       ("videos", "my_wan_clips", "my_wan_t2v_lora"), options={}),
        WAN_I2V_EXAMPLE: split_loaders(WAN_I2V, UMT5, "wan", WAN_VAE, WAN_I2V_NOTE, train,
                                       ("videos", "my_wan_i2v_clips", "my_wan_i2v_lora"),
                                       options={"start_frames": "WanImageToVideo"}, clip_vision=CLIP_VISION_H),
        LTX2_EXAMPLE: ltx2_workflow(train),
    }


def ltx2_workflow(train: dict) -> list[dict]:
    """LTX-2 as ComfyUI's own template loads it: the checkpoint (model and video VAE), Load LTXV Audio Text Encoder
    (Gemma 3 with the checkpoint's text projection) and Load LTXV Audio VAE (from the checkpoint) feeding Encode
    Options' audio_vae, so each clip's sound track is cached beside its frames."""
    return [{"type": "MarkdownNote", "id": 5, "pos": [60, 500], "text": LTX2_NOTE, "size": [340, 900]},
            {"type": "CheckpointLoaderSimple", "id": 1, "pos": [60, 80], "size": [320, 100],
             "values": {"ckpt_name": LTX2_CKPT["name"]}, "properties": {"models": [LTX2_CKPT]}},
            {"type": "LTXAVTextEncoderLoader", "id": 6, "pos": [60, 230], "size": [320, 110],
             "values": {"text_encoder": GEMMA3["name"], "ckpt_name": LTX2_CKPT["name"], "device": "default"},
             "properties": {"models": [LTX2_CKPT, GEMMA3]}},
            {"type": "LTXVAudioVAELoader", "id": 9, "pos": [60, 390], "size": [320, 60],
             "values": {"ckpt_name": LTX2_CKPT["name"]}, "properties": {"models": [LTX2_CKPT]}},
            {"type": "StreamingCacheEncodeOptions", "id": 8, "pos": [420, 400], "size": [480, 520],
             "links": {"audio_vae": (9, 0)}, "values": {"frames": 49, "fps": 25.0}},
            {"type": "StreamingCacheEncode", "id": 2, "pos": [420, 80], "size": [480, 260],
             "links": {"vae": (1, 2), "clip": (6, 0), "options": (8, 0)},
             "values": {"folder": "videos", "cache_name": "my_ltx2_clips"}},
            dict(train, links={"model": (1, 0), "dataset": (2, 0)}, values={"lora_name": "my_ltx2_lora"})]


def split_loaders(unet: dict, text_encoder: dict, clip_type: str, vae: dict, note: str, train: dict,
                  names: tuple[str, str, str], options: dict | None = None,
                  clip_vision: dict | None = None) -> list[dict]:
    """A workflow on separate model files (Load Diffusion Model, Load CLIP of ``clip_type``, Load VAE, and Load
    CLIP Vision where ``clip_vision`` is given), laid out as the Flux one; ``names``: the dataset folder, its cache
    (one per family: a cache holds one family's encodings) and the LoRA. Encode Options (with ``options``) sits
    under Encode Dataset where ``options`` is given (video: the frames, start frames)."""
    nodes = [{"type": "UNETLoader", "id": 1, "pos": [60, 80], "size": [320, 110],
              "values": {"unet_name": unet["name"]}, "properties": {"models": [unet]}},
             {"type": "CLIPLoader", "id": 6, "pos": [60, 230], "size": [320, 110],
              "values": {"clip_name": text_encoder["name"], "type": clip_type},
              "properties": {"models": [text_encoder]}},
             {"type": "VAELoader", "id": 7, "pos": [60, 380], "size": [320, 60],
              "values": {"vae_name": vae["name"]}, "properties": {"models": [vae]}}]
    folder, cache_name, lora_name = names
    encode = {"type": "StreamingCacheEncode", "id": 2, "pos": [420, 80], "size": [480, 260],
              "links": {"vae": (7, 0), "clip": (6, 0)}, "values": {"folder": folder, "cache_name": cache_name}}
    note_y = 480
    if clip_vision is not None:
        nodes.append({"type": "CLIPVisionLoader", "id": 9, "pos": [60, 480], "size": [320, 60],
                      "values": {"clip_name": clip_vision["name"]}, "properties": {"models": [clip_vision]}})
        note_y = 580
    if options is not None:
        nodes.append({"type": "StreamingCacheEncodeOptions", "id": 8, "pos": [420, 400], "size": [480, 520],
                      "links": {"clip_vision": (9, 0)} if clip_vision is not None else {}, "values": options})
        encode["links"]["options"] = (8, 0)
    note_node = {"type": "MarkdownNote", "id": 5, "pos": [60, note_y], "text": note, "size": [340, 820]}
    return [note_node, *nodes, encode,
            dict(train, links={"model": (1, 0), "dataset": (2, 0)}, values={"lora_name": lora_name})]


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        headless.boot(sys.argv[1], ["--cpu", "--base-directory", work], quiet=True)
        import nodes

        folder = os.path.join(PACK, "example_workflows")
        for name, spec in workflows().items():
            data = build(nodes.NODE_CLASS_MAPPINGS, spec)
            with open(os.path.join(folder, f"{name}.json"), "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
            thumbnail(data, nodes.NODE_CLASS_MAPPINGS, nodes.NODE_DISPLAY_NAME_MAPPINGS,
                      os.path.join(folder, f"{name}.jpg"))
            print("wrote", name, "and its thumbnail")


if __name__ == "__main__":
    main()
