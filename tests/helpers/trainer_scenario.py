"""The trainer's behaviour as a user meets it, inside a process that boots real ComfyUI (see
tests/comfy/test_trainer.py); prints one JSON line of results.

    python trainer_scenario.py COMFYUI_PATH WORKDIR

Re-queueing after the dataset grew or the seed changed, continuing a run, sample previews and the live loss plot
(captured from ComfyUI's progress hook, the channel the frontend's node previews come from), validation, every
loss and optimizer option at once, LoRA metadata, and exact continuation of a run with all of them on.
"""

from __future__ import annotations

import hashlib
import os

from comfy_scenario import (
    ENCODE,
    TRAIN,
    find,
    load_example,
    run_scenario_main,
    saved_lora,
    set_train,
    ui_text,
    unthrottled_progress,
)
from demo_assets import CKPT, write_dataset
from media_assets import write_image

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)


def _sha(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class PreviewCapture:
    """Wraps ComfyUI's progress hook and records every preview image sent for a node."""

    def __init__(self) -> None:
        import comfy.utils

        self.inner = comfy.utils.PROGRESS_BAR_HOOK
        self.previews: list[dict] = []
        self.cancel_at: int | None = None  # press Cancel when a node reports this step
        unthrottled_progress()  # every step reaches the hook, however fast the machine
        comfy.utils.set_progress_bar_global_hook(self)

    def __call__(self, value, total, preview, prompt_id=None, node_id=None):
        if self.cancel_at is not None and value == self.cancel_at:
            import comfy.model_management

            self.cancel_at = None
            comfy.model_management.interrupt_current_processing()
        if preview is not None:
            image = preview[1]
            self.previews.append({"node": node_id, "format": preview[0], "size": list(image.size), "step": value})
        return self.inner(value, total, preview, prompt_id=prompt_id, node_id=node_id)


def _image_size(image: dict) -> list:
    """(width, height) of an image a node returned in its ``ui`` (a file in ComfyUI's output or temp folder)."""
    import folder_paths
    from PIL import Image

    folder = folder_paths.get_temp_directory() if image["type"] == "temp" else folder_paths.get_output_directory()
    with Image.open(os.path.join(folder, image.get("subfolder") or "", image["filename"])) as img:
        return [image["type"], *img.size]


def attention_matrices(checkpoint: str) -> list[str]:
    """The attention projections of the checkpoint's UNet, read from its file (``diffusion_model.<module>``)."""
    import folder_paths
    from safetensors import safe_open

    with safe_open(folder_paths.get_full_path("checkpoints", checkpoint), "pt") as f:
        return [k.removeprefix("model.").removesuffix(".weight") for k in f.keys()
                if k.startswith("model.diffusion_model.") and k.endswith(".weight") and ".attn" in k
                and len(f.get_slice(k).get_shape()) == 2]


def _prompt(encode: dict | None = None, **train) -> dict:
    example = load_example("encode_and_train")
    prompt = {k: v for k, v in example.items() if v["class_type"] != "PreviewImage"}
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    enc = find(prompt, ENCODE)
    prompt[enc]["inputs"].update(folder="trainset", cache_name="trainset", resolution=64, batch_size=2)
    if encode:
        prompt["encode_options"] = {"class_type": "StreamingCacheEncodeOptions", "inputs": dict(encode)}
        prompt[enc]["inputs"]["options"] = ["encode_options", 0]
    set_train(prompt, find(prompt, TRAIN), **{**dict(steps=2, batch_size=1, rank=4, training_dtype="fp32",
                                                      lora_dtype="fp32", learning_rate=1e-3), **train})
    return prompt


def _run(server, prompt: dict) -> dict:
    ok, result, error = headless.run(prompt, server)
    t = find(prompt, TRAIN)
    out = {"ok": ok, "error": error, "train": ui_text(result, t), "encode": ui_text(result, find(prompt, ENCODE))}
    ui = (result.get("outputs") or {}).get(t) or {}
    out["ui_images"] = [_image_size(image) for image in ui.get("images") or []]
    return out


def scenario(server) -> dict:
    import folder_paths
    import torch

    folder = os.path.join(folder_paths.get_input_directory(), "trainset")
    write_dataset(folder)
    write_image(os.path.join(folder, "a_mask.png"), seed=13, mode="L")  # a loss mask for one image
    loras = folder_paths.get_folder_paths("loras")[0]
    out: dict = {}

    # 1. re-queue: a first run, then the dataset grows, then the seed changes, then steps are raised
    out["first"] = _run(server, _prompt(lora_name="rq"))
    first_hash = _sha(os.path.join(loras, "rq.safetensors"))
    write_image(os.path.join(folder, "f.png"), seed=11)
    write_image(os.path.join(folder, "g.png"), seed=12)
    with open(os.path.join(folder, "f.txt"), "w", encoding="utf-8") as f:
        f.write("sks, red, square, bright")  # tags to shuffle
    out["grown"] = _run(server, _prompt(lora_name="rq"))
    out["reseeded"] = _run(server, _prompt(lora_name="rq", seed=7))
    out["continued"] = _run(server, _prompt(lora_name="rq", seed=7, steps=3))
    out["resume_off"] = _run(server, _prompt(lora_name="rq", seed=7, steps=3, resume=False))
    out["first_kept"] = _sha(os.path.join(loras, "rq.safetensors")) == first_hash
    out["rq_files"] = sorted(f for f in os.listdir(loras) if f.startswith("rq"))

    # 2. previews, live loss and validation
    capture = PreviewCapture()
    ckpt = find(_prompt(), "CheckpointLoaderSimple")
    prompt = _prompt(lora_name="pv", steps=4, sample_prompts="a red square\na blue circle", sample_every=2,
                     sample_steps=2, sample_cfg=1.0, validation_split=0.3, validate_every=2, clip=[ckpt, 1],
                     vae=[ckpt, 2], save_every=1, keep_step_saves=2, loss_weighting="debiased",
                     lr_schedule="polynomial", lr_power=2.0)
    t = find(prompt, TRAIN)
    out["previews"] = _run(server, prompt)
    out["previews"]["sent"] = [p for p in capture.previews if p["node"] == t]
    samples = os.path.join(folder_paths.get_output_directory(), "lora_training", "pv_samples")
    out["previews"]["saved"] = sorted(os.listdir(samples)) if os.path.isdir(samples) else []
    out["previews"]["step_saves"] = sorted(f for f in os.listdir(loras) if f.startswith("pv_step"))
    state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", "pv.state.pt"),
                       weights_only=True)
    out["previews"]["validation"] = [list(v) for v in state.get("validation") or []]

    # 3. every loss, caption and optimizer option at once; a run cancelled at step 2 and queued again ends
    # bit for bit where the uninterrupted run does
    options = dict(timestep_sampling="logit_normal", loss_weighting="min_snr", noise_offset=0.05,
                   caption_dropout=0.5, max_grad_norm=1.0, lora_plus_ratio=4.0, lr_schedule="cosine_with_restarts",
                   lr_cycles=2, ema_decay=0.9, validation_split=0.3, validate_every=1, masked_loss=True, steps=4,
                   weight_decay=0.01, alpha=2.0, min_timestep=450, max_timestep=550, min_lr_ratio=0.1,
                   optimizer_args="betas=0.85,0.99", input_perturbation=0.1, target_layers="attention")
    shuffled = {"caption_shuffles": 2, "keep_tokens": 1}
    training = headless.pack_module("backend.training")
    drawn: list[float] = []
    draw = training.noise_and_levels

    def recorded(*args, **kwargs):  # the training steps' noise levels (validation's are fixed: ``t`` given)
        noise, levels = draw(*args, **kwargs)
        if kwargs.get("t") is None:
            drawn.extend(levels.tolist())
        return noise, levels

    training.noise_and_levels = recorded
    try:
        out["all_whole"] = _run(server, _prompt(shuffled, lora_name="all_whole", **options))
    finally:
        training.noise_and_levels = draw
    out["all_levels"] = [len(drawn), min(drawn, default=None), max(drawn, default=None)]
    capture.cancel_at = 2
    out["all_half"] = _run(server, _prompt(shuffled, lora_name="all_split", **options))
    out["all_rest"] = _run(server, _prompt(shuffled, lora_name="all_split", **options))
    whole, split = saved_lora("all_whole"), saved_lora("all_split")
    out["all_equal"] = sorted(whole["tensors"]) == sorted(split["tensors"]) and all(
        torch.equal(whole["tensors"][k], split["tensors"][k]) for k in whole["tensors"])
    out["all_metadata"] = {k: v for k, v in whole["metadata"].items() if k.startswith("ss_")}
    out["all_layers"] = sorted({k.rsplit(".", 2 if k.endswith(".weight") else 1)[0] for k in whole["tensors"]})
    out["all_parts"] = sorted({k[len(m):] for k in whole["tensors"] for m in out["all_layers"] if k.startswith(m + ".")})
    out["attention_layers"] = sorted(attention_matrices(CKPT))
    out["ema_file"] = os.path.exists(os.path.join(loras, "all_whole_ema.safetensors"))

    # 4. the losses read a few steps at a time, as where the optimizer step is fused (AdamW on a GPU): read every
    # step, or only where a preview, a save or the end needs them, the run trains and shows the same
    out["reads"] = _reads(server, capture)
    return out


def _reads(server, capture: PreviewCapture) -> dict:
    """Two runs with the fused AdamW step (the CPU has one too): the losses read at every step, and read only where
    the loop must (``REPORT_SECONDS`` infinite)."""
    import folder_paths
    import torch

    optim = headless.pack_module("train.optim", part="streaming_cache")
    node = headless.pack_module("training_run")
    fused, every = optim._fused, node.REPORT_SECONDS
    optim._fused = lambda groups: True
    runs: dict = {}
    try:
        for name, seconds in (("every_step", 0.0), ("together", float("inf"))):
            node.REPORT_SECONDS = seconds
            ckpt = find(_prompt(), "CheckpointLoaderSimple")
            prompt = _prompt(lora_name=f"reads_{name}", steps=5, sample_prompts="a red square", sample_every=2,
                             sample_steps=1, sample_cfg=1.0, clip=[ckpt, 1], vae=[ckpt, 2], save_every=3)
            t = find(prompt, TRAIN)
            first = len(capture.previews)
            run = _run(server, prompt)
            run["preview_steps"] = [p["step"] for p in capture.previews[first:] if p["node"] == t]
            state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training",
                                            f"reads_{name}.state.pt"), weights_only=True)
            run["losses"] = list(state["losses"])
            run["fused"] = [bool(g["fused"]) for g in state["optimizer"]["param_groups"]]
            run["lora"] = saved_lora(f"reads_{name}")["tensors"]
            runs[name] = run
    finally:
        optim._fused, node.REPORT_SECONDS = fused, every
    a, b = runs["every_step"].pop("lora"), runs["together"].pop("lora")
    runs["same_lora"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a) and bool(a)
    return runs


if __name__ == "__main__":
    run_scenario_main(scenario)
