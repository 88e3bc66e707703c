"""Several datasets in one training, inside a process that boots real ComfyUI (see tests/comfy/test_mix_workflow.py);
prints one JSON line of results.

    python mix_scenario.py COMFYUI_PATH WORKDIR

Runs the example workflow "Train a LoRA with regularisation images" (two folders, two Encode Dataset nodes, two
Dataset Mix nodes, Train LoRA) with the tiny checkpoint, then queues it again unchanged and with another weight,
with a loss weight, and with the regularisation dataset preserving the base model's outputs (beside the style
images, and alone).
"""

from __future__ import annotations

import os

import numpy as np
from comfy_scenario import TRAIN, find, load_example, run_scenario_main, set_train, ui_text
from demo_assets import CKPT, write_dataset
from PIL import Image

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

TRAIN_SETTINGS = dict(steps=6, rank=4, learning_rate=1e-3, training_dtype="fp32", lora_dtype="fp32", seed=2,
                      batch_size=2)


def write_regularization(folder: str) -> None:
    """Three plain images captioned with the class prompt."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(7)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(os.path.join(folder, f"r{i}.png"))
        with open(os.path.join(folder, f"r{i}.txt"), "w", encoding="utf-8") as f:
            f.write("a photo of a thing")


def run(server: headless._Server, weight: float, loss_weight: float = 1.0, preserve: bool = False,
        alone: bool = False, lora_name: str = "mixed", **settings) -> dict:
    """The example with the regularisation dataset's ``weight``, ``loss_weight`` and ``preserve`` (its Dataset
    Mix's preserve_outputs); ``alone``: the regularisation dataset is the whole mix (its ``mix`` input cut);
    ``settings``: Train LoRA's, on top of TRAIN_SETTINGS."""
    import folder_paths
    import torch

    prompt = load_example(headless.EXAMPLES[3])
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    for node in prompt.values():
        if node["class_type"] == "StreamingCacheEncode":
            node["inputs"].update(resolution=64, batch_size=2)
        if node["class_type"] == "StreamingCacheDatasetMix" and node["inputs"]["name"] == "regularization":
            node["inputs"].update(weight=weight, loss_weight=loss_weight, preserve_outputs=preserve)
            if alone:
                del node["inputs"]["mix"]
    nid = find(prompt, TRAIN)
    set_train(prompt, nid, lora_name=lora_name, **TRAIN_SETTINGS, **settings)
    ok, result, error = headless.run(prompt, server)
    out: dict = {"ok": ok, "error": error, "text": ui_text(result, nid),
                 "mix_text": [ui_text(result, k) for k, v in prompt.items()
                              if v["class_type"] == "StreamingCacheDatasetMix"]}
    states = sorted(n for n in os.listdir(os.path.join(folder_paths.get_output_directory(), "lora_training"))
                    if n.endswith(".state.pt") and n.startswith(lora_name))
    out["states"] = states
    if ok:
        state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", states[-1]),
                           weights_only=True)
        out["dataset_losses"] = {k: len(v) for k, v in (state.get("dataset_losses") or {}).items()}
        out["dataset_series"] = {k: [[int(step), float(v)] for step, v in series]
                                 for k, series in (state.get("dataset_losses") or {}).items()}
        out["losses"] = [float(v) for v in state["losses"]]
        out["steps"] = int(state["step"])
    return out


def scenario(server: headless._Server) -> dict:
    import folder_paths

    write_dataset(os.path.join(folder_paths.get_input_directory(), "dataset"))
    write_regularization(os.path.join(folder_paths.get_input_directory(), "regularization"))
    return {"first": run(server, 0.5), "again": run(server, 0.5), "other_weight": run(server, 1.0),
            "loss_weight": run(server, 1.0, loss_weight=0.5),
            "preserved": run(server, 1.0, preserve=True, lora_name="preserved"),
            "preserved_alone": run(server, 1.0, preserve=True, alone=True, lora_name="alone"),
            "preserved_bypass": run(server, 1.0, preserve=True, lora_name="bypassed", bypass_mode=True)
            if headless.pack_module("backend.compat").HAS_BYPASS else {"skipped": "this ComfyUI has no bypass mode"}}


if __name__ == "__main__":
    run_scenario_main(scenario)
