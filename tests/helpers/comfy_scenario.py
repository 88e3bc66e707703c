"""Runs inside a process that boots real ComfyUI (see tests/comfy/test_comfyui.py); prints one JSON line of results.

    python comfy_scenario.py COMFYUI_PATH WORKDIR SCENARIO

It builds tiny random-weight models with ComfyUI's own classes (an SD1.x-shaped checkpoint: a one-level UNet,
the standard CLIP-L and VAE), writes a small kohya-style dataset, and runs this pack's example workflows through
ComfyUI's executor. Nothing here is committed model data: everything is created at run time under WORKDIR.
"""

from __future__ import annotations

import json
import os
import sys
import time

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)
from demo_assets import CKPT, TINY_DIT, tiny_checkpoint, tiny_sd3_dit, write_dataset

PACK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ui_text(result: dict, node: str) -> str:
    return "\n".join((result.get("outputs", {}).get(node) or {}).get("text", []))


def load_example(name: str) -> dict:
    import nodes

    with open(os.path.join(PACK, "example_workflows", name), encoding="utf-8") as f:
        return headless.ui_to_api(json.load(f), nodes.NODE_CLASS_MAPPINGS)


def find(prompt: dict, class_type: str) -> str:
    return next(k for k, v in prompt.items() if v["class_type"] == class_type)


def scenario_full(workdir: str, server: headless._Server) -> dict:
    import torch
    from safetensors.torch import load_file

    import comfy.model_management
    import folder_paths
    import nodes

    out: dict = {"node_types": sorted(k for k in nodes.NODE_CLASS_MAPPINGS if k.startswith("StreamingCache")),
                 "device": str(comfy.model_management.get_torch_device())}
    write_dataset(os.path.join(folder_paths.get_input_directory(), "dataset"), include_broken=True)

    # 1. encode + train from a folder (UI-format example workflow)
    prompt = load_example("encode_and_train.json")
    enc, train = find(prompt, "StreamingCacheEncodeDataset"), find(prompt, "StreamingCacheTrainLoRA")
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    prompt[enc]["inputs"].update(resolution=64, batch_size=2)
    prompt[train]["inputs"].update(steps=3, batch_size=2, lora_name="tiny_lora", training_dtype="fp32",
                                   lora_dtype="fp32", gradient_checkpointing=True, rank=4, learning_rate=1e-3)
    t = time.perf_counter()
    ok, result, error = headless.run(prompt, server)
    out["first"] = {"ok": ok, "error": error, "encode": ui_text(result, enc), "train": ui_text(result, train),
                    "seconds": time.perf_counter() - t}
    lora_file = os.path.join(folder_paths.get_folder_paths("loras")[0], "tiny_lora.safetensors")
    out["lora_exists"] = os.path.exists(lora_file)
    state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", "tiny_lora.state.pt"),
                       weights_only=True)
    out["losses"] = state["losses"]

    # 2. the same workflow again, in a fresh executor: nothing is encoded again, training resumes at its end
    ok, result, error = headless.run(prompt, server)
    out["second"] = {"ok": ok, "error": error, "encode": ui_text(result, enc), "train": ui_text(result, train)}

    # 3. LoraLoader accepts the saved file, and it changes the model's output
    model, clip, _ = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[:3]
    lora = load_file(lora_file)
    patched, _ = nodes.LoraLoader().load_lora(model, clip, "tiny_lora.safetensors", 1.0, 0.0)
    out["lora_keys"] = len(lora)
    out["patched_weights"] = len(patched.patches)
    out["lora_targets"] = len({k.rsplit(".", 2)[0] for k in lora if k.endswith("lora_up.weight")}) + \
        sum(k.endswith((".diff", ".diff_b")) for k in lora)
    with torch.inference_mode():
        cond = nodes.CLIPTextEncode().encode(clip, "a red square")[0]
        latent = {"samples": torch.zeros(1, 4, 8, 8)}
        base = nodes.common_ksampler(model, 1, 2, 1.0, "euler", "normal", cond, cond, latent)[0]["samples"]
        with_lora = nodes.common_ksampler(patched, 1, 2, 1.0, "euler", "normal", cond, cond, latent)[0]["samples"]
    out["output_change"] = float((base - with_lora).abs().max())
    out["outputs_finite"] = bool(torch.isfinite(base).all() and torch.isfinite(with_lora).all())

    # 4. cancel mid-training saves the LoRA trained so far; the next run resumes from there
    prompt[train]["inputs"].update(lora_name="cancel_lora", steps=4)
    import comfy.utils

    seen_in_training = []

    def cancel_at_step_2(value, total, preview, prompt_id=None, node_id=None):
        if node_id == train:
            seen_in_training.append(getattr(comfy.model_management, "in_training", None))
        if node_id == train and value == 2:  # what pressing Cancel does: ComfyUI raises at the next check
            comfy.model_management.interrupt_current_processing(True)
        comfy.model_management.throw_exception_if_processing_interrupted()

    previous_hook = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(cancel_at_step_2)
    try:
        ok, result, error = headless.run(prompt, server)
    finally:
        comfy.utils.set_progress_bar_global_hook(previous_hook)
        comfy.model_management.interrupt_current_processing(False)
    cancel_file = os.path.join(folder_paths.get_folder_paths("loras")[0], "cancel_lora.safetensors")
    from safetensors import safe_open

    with safe_open(cancel_file, "pt") as f:
        saved_steps = int(f.metadata()["ss_steps"])
    out["cancel"] = {"ok": ok, "error": error, "saved_steps": saved_steps}
    out["in_training"] = {"during": seen_in_training, "after": getattr(comfy.model_management, "in_training", None)}
    ok, result, error = headless.run(prompt, server)
    cstate = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", "cancel_lora.state.pt"),
                        weights_only=True)
    out["cancel_resume"] = {"ok": ok, "error": error, "train": ui_text(result, train), "step": cstate["step"],
                            "losses": len(cstate["losses"])}

    # 5. train from the cache alone: the source images are gone
    import shutil

    shutil.rmtree(os.path.join(folder_paths.get_input_directory(), "dataset"))
    prompt = load_example("train_from_cache.json")
    train = find(prompt, "StreamingCacheTrainLoRA")
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    prompt[find(prompt, "StreamingCacheLoad")]["inputs"]["cache_name"] = "my_dataset"
    prompt[train]["inputs"].update(steps=2, batch_size=1, lora_name="sourceless", training_dtype="fp32",
                                   lora_dtype="fp32", rank=2)
    ok, result, error = headless.run(prompt, server)
    out["sourceless"] = {"ok": ok, "error": error, "train": ui_text(result, train),
                         "load": ui_text(result, find(prompt, "StreamingCacheLoad"))}

    # 6. a LoRA file this node did not train is never overwritten
    with open(os.path.join(folder_paths.get_folder_paths("loras")[0], "foreign.safetensors"), "wb") as f:
        f.write(b"not ours")
    prompt[train]["inputs"]["lora_name"] = "foreign"
    ok, result, error = headless.run(prompt, server)
    out["foreign"] = {"ok": ok, "error": error}

    # 7. a DiT family (SD3 MMDiT, flow matching) trains from a cache built with the Python API
    out["dit"] = dit_scenario(server)

    # 8. a traversal attempt is refused with a clear error
    prompt[find(prompt, "StreamingCacheLoad")]["inputs"]["cache_name"] = "../../etc"
    ok, result, error = headless.run(prompt, server)
    out["traversal"] = {"ok": ok, "error": error}
    return out


def dit_scenario(server: headless._Server) -> dict:
    import torch

    import folder_paths
    import nodes

    import streaming_cache as sc

    tiny_sd3_dit(os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], TINY_DIT))
    cache = os.path.join(folder_paths.get_output_directory(), "streaming_caches", "sd3_toy")
    g = torch.Generator().manual_seed(1)
    items = [sc.Item(f"s{i}", {"latent": sc.Part(data=bytes([i])), "cond": sc.Part(data=bytes([i % 3]))}) for i in range(6)]
    encoders = {
        "latent": sc.Encoder("toy-vae", lambda parts: [{"samples": torch.randn(1, 16, 8, 8, generator=g)} for _ in parts]),
        "cond": sc.Encoder("toy-te", lambda parts: [[[torch.randn(1, 10, 48, generator=g),
                                                      {"pooled_output": torch.randn(1, 32, generator=g)}]]
                                                    for _ in parts])}
    sc.build(cache, items, encoders)
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_DIT, "weight_dtype": "default"}},
              "2": {"class_type": "StreamingCacheLoad", "inputs": {"cache_name": "sd3_toy", "dataset_name": "default",
                                                                   "repeats": True}}}
    example = load_example("train_from_cache.json")
    train_inputs = dict(example[find(example, "StreamingCacheTrainLoRA")]["inputs"])  # the node's defaults
    train_inputs.update(model=["1", 0], dataset=["2", 0], steps=3, batch_size=2, rank=4, lora_name="dit_lora",
                        training_dtype="fp32", lora_dtype="fp32", learning_rate=1e-3)
    prompt["3"] = {"class_type": "StreamingCacheTrainLoRA", "inputs": train_inputs}
    prompt["4"] = {"class_type": "PreviewImage", "inputs": {"images": ["3", 3]}}
    ok, result, error = headless.run(prompt, server)
    res: dict = {"ok": ok, "error": error, "train": ui_text(result, "3")}
    if not ok:
        return res
    state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", "dit_lora.state.pt"),
                       weights_only=True)
    res["losses"] = state["losses"]
    model = nodes.UNETLoader().load_unet(TINY_DIT, "default")[0]
    patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, "dit_lora.safetensors", 1.0)[0]
    from safetensors.torch import load_file

    lora = load_file(os.path.join(folder_paths.get_folder_paths("loras")[0], "dit_lora.safetensors"))
    res["patched_weights"] = len(patched.patches)
    res["lora_targets"] = len({k.rsplit(".", 2)[0] for k in lora if k.endswith("lora_up.weight")}) + \
        sum(k.endswith((".diff", ".diff_b")) for k in lora)
    cond = [[torch.randn(1, 10, 48, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    with torch.inference_mode():
        latent = {"samples": torch.zeros(1, 16, 8, 8)}
        base = nodes.common_ksampler(model, 1, 2, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
        with_lora = nodes.common_ksampler(patched, 1, 2, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
    res["output_change"] = float((base - with_lora).abs().max())
    res["model_type"] = type(model.model).__name__
    return res


def main() -> None:
    comfyui, workdir, scenario = sys.argv[1:4]
    server = headless.boot(comfyui, ["--base-directory", workdir], quiet=True)  # --cpu added without CUDA
    import folder_paths

    ckpt = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], CKPT)
    if not os.path.exists(ckpt):
        tiny_checkpoint(ckpt)
    result = {"full": scenario_full}[scenario](workdir, server)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
