"""Writes example_workflows/*.json (UI format, as the ComfyUI frontend saves them) from the live node definitions.

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
               "Any checkpoint ComfyUI loads works (SD1.x, SDXL, ...); put it in `ComfyUI/models/checkpoints`.\n\n")
ENCODE_NOTE = ("## Encode a dataset folder and train a LoRA\n\n"
               "1. Put images with kohya-style captions (`name.txt` beside `name.png`; `N_name` subfolders repeat "
               "N times) in `ComfyUI/input/dataset`.\n2. Pick your checkpoint and press **Run**. Encoding only runs "
               "for new or changed images; training saves `models/loras/my_lora.safetensors` (cancel saves what "
               "was trained so far; the next run resumes).\n\n" + MODEL_LINKS)
PREVIEW_NOTE = ("## Train with sample previews and a validation loss\n\n"
                "1. Put images with captions in `ComfyUI/input/dataset` (as for encode_and_train).\n"
                "2. Write your test prompts in **sample_prompts** (one per line) and press **Run**. Every "
                "`sample_every` steps the prompts are sampled with the LoRA as it is; the images and the live loss "
                "plot show on the Train LoRA node and are saved in `output/lora_training/<lora_name>_samples`. "
                "`validation_split` holds out 10% of the images and plots their loss (fixed timesteps and noise) "
                "beside the training loss.\n\nQueue again with the same settings to continue a run; change the "
                "dataset or a setting and a new numbered LoRA is trained, the old one kept.\n\n" + MODEL_LINKS)
CACHE_NOTE = ("## Train from an existing cache\n\nNo source images needed: pick a cache made by Encode Dataset "
              "(ComfyUI's `datasets` folder, or `output/streaming_caches`) and your checkpoint, then **Run**. "
              "Latents stream from disk while training.\n\n" + MODEL_LINKS)

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
        inputs, values = [], []
        for section in ("required", "optional"):
            for name, value in (spec_inputs.get(section) or {}).items():
                kind = value[0]
                opts = value[1] if len(value) > 1 else {}
                if name in widgets:
                    if name in node.get("values", {}):
                        default = node["values"][name]
                    elif "default" in opts:
                        default = opts["default"]
                    else:
                        default = kind[0] if isinstance(kind, list) and kind else None
                    values.append(default)
                    if kind == "INT" and (opts.get("control_after_generate") or
                                          (name in ("seed", "noise_seed") and opts.get("control_after_generate") is None)):
                        values.append("fixed")
                    continue
                link = None
                if name in node.get("links", {}):
                    link = next(l[0] for l in links if l[3] == node["id"] and l[4] == name)
                inputs.append({"name": name, "type": kind, "link": link})
        for l in links:
            if l[3] == node["id"]:
                l[4] = next(i for i, x in enumerate(inputs) if x["name"] == l[4])
                l[5] = inputs[l[4]]["type"]
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        outputs = [{"name": n, "type": ty, "links": out_links.get((node["id"], i), []), "slot_index": i}
                   for i, (n, ty) in enumerate(zip(names, cls.RETURN_TYPES))]
        entry.update(inputs=inputs, outputs=outputs, widgets_values=values)
        nodes.append(entry)
    return {"last_node_id": max(n["id"] for n in spec), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4}


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        headless.boot(sys.argv[1], ["--cpu", "--base-directory", work], quiet=True)
        import nodes

        m = nodes.NODE_CLASS_MAPPINGS
        loader = {"type": "CheckpointLoaderSimple", "id": 1, "pos": [120, 80], "size": [320, 100],
                  "values": {"ckpt_name": SDXL["name"]}, "properties": {"models": [SDXL]}}
        train = {"type": "StreamingCacheTrainLoRA", "id": 3, "pos": [900, 80], "size": [340, 640],
                 "links": {"model": (1, 0), "dataset": (2, 0)}}
        preview = {"type": "PreviewImage", "id": 4, "pos": [1280, 80], "size": [540, 340], "links": {"images": (3, 3)}}
        workflows = {
            "encode_and_train.json": [
                {"type": "MarkdownNote", "id": 5, "pos": [120, 240], "text": ENCODE_NOTE},
                loader,
                {"type": "StreamingCacheEncodeDataset", "id": 2, "pos": [500, 80], "size": [340, 300],
                 "links": {"vae": (1, 2), "clip": (1, 1)}, "values": {"resolution": 1024}},
                train, preview,
            ],
            "train_with_previews.json": [
                {"type": "MarkdownNote", "id": 5, "pos": [120, 240], "text": PREVIEW_NOTE, "size": [400, 420]},
                loader,
                {"type": "StreamingCacheEncodeDataset", "id": 2, "pos": [500, 80], "size": [340, 300],
                 "links": {"vae": (1, 2), "clip": (1, 1)}, "values": {"resolution": 1024}},
                dict(train, size=[380, 900], links={"model": (1, 0), "dataset": (2, 0), "clip": (1, 1), "vae": (1, 2)},
                     values={"sample_prompts": "a photo of sks dog on a beach\na painting of sks dog, oil on canvas",
                             "sample_every": 100, "validation_split": 0.1, "lora_name": "my_lora_previews"}),
                preview,
            ],
            "train_from_cache.json": [
                {"type": "MarkdownNote", "id": 5, "pos": [120, 240], "text": CACHE_NOTE},
                loader,
                {"type": "StreamingCacheLoad", "id": 2, "pos": [500, 80], "size": [340, 160],
                 "values": {"cache_name": "my_dataset"}},
                train, preview,
            ],
        }
        for name, spec in workflows.items():
            data = build(m, spec)
            with open(os.path.join(PACK, "example_workflows", name), "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
            print("wrote", name)


if __name__ == "__main__":
    main()
