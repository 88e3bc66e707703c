"""Runs inside a process that boots real ComfyUI (see tests/comfy/test_comfyui.py); prints one JSON line of results.

    python comfy_scenario.py COMFYUI_PATH WORKDIR full

It builds tiny random-weight models with ComfyUI's own classes (an SD1.x-shaped checkpoint: a one-level UNet,
the standard CLIP-L and VAE), writes a small kohya-style dataset, and runs this pack's example workflows through
ComfyUI's executor. Nothing here is committed model data: everything is created at run time under WORKDIR.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from demo_assets import CKPT, TINY_DIT, tiny_checkpoint, tiny_sd3_dit, write_dataset

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

PACK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ui_text(result: dict, node: str) -> str:
    return "\n".join((result.get("outputs", {}).get(node) or {}).get("text", []))


ENCODE, TRAIN = "StreamingCacheEncode", "StreamingCacheTrain"


def shown_images(result: dict, node: str) -> list[list[int]]:
    """The sizes of the images node ``node`` shows after a run (its ``ui`` images and its dataset preview's page,
    saved in ComfyUI's temp folder)."""
    import folder_paths
    from PIL import Image

    sizes = []
    output = result.get("outputs", {}).get(node) or {}
    for image in list(output.get("images", [])) + [p["image"] for p in output.get("dataset_preview", [])]:
        path = os.path.join(folder_paths.get_temp_directory(), image.get("subfolder", ""), image["filename"])
        with Image.open(path) as f:
            sizes.append(list(f.size))
    return sizes


def load_example(name: str) -> dict:
    """An example workflow (by its earlier name, e.g. ``encode_and_train``) in API format."""
    import nodes

    with open(headless.example_path(name), encoding="utf-8") as f:
        return headless.ui_to_api(json.load(f), nodes.NODE_CLASS_MAPPINGS)


def unthrottled_progress() -> None:
    """Every progress update of a node reaches the progress hook: ComfyUI 0.33 sends one at most every 0.1 s (the
    first and the last always), so on a fast machine a hook that acts at a given step would never see it."""
    import comfy.utils

    if hasattr(comfy.utils, "PROGRESS_THROTTLE_MIN_INTERVAL"):
        comfy.utils.PROGRESS_THROTTLE_MIN_INTERVAL = 0.0
        comfy.utils.PROGRESS_THROTTLE_MIN_PERCENT = 0.0


def find(prompt: dict, class_type: str) -> str:
    return next(k for k, v in prompt.items() if v["class_type"] == class_type)


def set_train(prompt: dict, nid: str, **settings) -> None:
    """Train LoRA node ``nid`` of ``prompt`` with ``settings`` (flat, by setting name) on top of its own inputs:
    settings of option groups go to Train Options nodes chained into it. They replace the chain it had, whose
    settings stay unless given again."""
    import nodes

    inputs = prompt[nid]["inputs"]
    main = {k: v for k, v in inputs.items() if k not in ("model", "dataset", "options")}
    for key in [k for k in prompt if k.startswith(f"{nid}_options")]:
        # the settings an earlier call put on option nodes stay, under those given now
        main.update({k: v for k, v in prompt.pop(key)["inputs"].items() if k != "options"})
    new, _ = headless.train_nodes(nodes.NODE_CLASS_MAPPINGS, inputs["model"], inputs["dataset"],
                                  {**main, **settings}, prefix=nid)
    prompt.update(new)


def scenario_full(workdir: str, server: headless._Server) -> dict:
    import comfy.model_management
    import folder_paths
    import torch
    from safetensors.torch import load_file

    import nodes

    out: dict = {"node_types": sorted(k for k in nodes.NODE_CLASS_MAPPINGS if k.startswith("StreamingCache")),
                 "device": str(comfy.model_management.get_torch_device())}
    write_dataset(os.path.join(folder_paths.get_input_directory(), "dataset"), include_broken=True)

    # 1. encode + train from a folder (UI-format example workflow)
    prompt = load_example("encode_and_train")
    enc, train = find(prompt, ENCODE), find(prompt, TRAIN)
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    prompt[enc]["inputs"].update(resolution=64, batch_size=2, folder="dataset")
    set_train(prompt, train, steps=3, batch_size=2, lora_name="tiny_lora", training_dtype="fp32", lora_dtype="fp32",
              gradient_checkpointing=True, rank=4, learning_rate=1e-3)
    t = time.perf_counter()
    ok, result, error = headless.run(prompt, server)
    out["first"] = {"ok": ok, "error": error, "encode": ui_text(result, enc), "train": ui_text(result, train),
                    "seconds": time.perf_counter() - t, "encode_images": shown_images(result, enc)}
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

    # 4. cancel mid-training saves the LoRA trained so far, and the node after it never runs; the next run resumes
    set_train(prompt, train, lora_name="cancel_lora", steps=4)
    prompt["4"] = {"class_type": "PreviewImage", "inputs": {"images": [train, 5]}}  # the samples
    import comfy.utils

    seen_in_training, pressed = [], []

    def cancel_at_step_2(value, total, preview, prompt_id=None, node_id=None):
        if node_id == train:
            seen_in_training.append(getattr(comfy.model_management, "in_training", None))
        if node_id == train and value == 2 and not pressed:  # what pressing Cancel does: ComfyUI raises next
            pressed.append(value)
            comfy.model_management.interrupt_current_processing(True)
        comfy.model_management.throw_exception_if_processing_interrupted()

    unthrottled_progress()
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
    out["cancel"] = {"ok": ok, "error": error, "saved_steps": saved_steps, "train": ui_text(result, train)}
    out["in_training"] = {"during": seen_in_training, "after": getattr(comfy.model_management, "in_training", None)}
    ok, result, error = headless.run(prompt, server)
    cstate = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", "cancel_lora.state.pt"),
                        weights_only=True)
    out["cancel_resume"] = {"ok": ok, "error": error, "train": ui_text(result, train), "step": cstate["step"],
                            "losses": len(cstate["losses"])}

    # 5. train from the cache alone: the source images are gone
    import shutil

    shutil.rmtree(os.path.join(folder_paths.get_input_directory(), "dataset"))
    prompt = load_example("train_from_cache")
    train = find(prompt, TRAIN)
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    prompt[find(prompt, "StreamingCacheLoad")]["inputs"]["cache_name"] = "my_dataset"
    set_train(prompt, train, steps=2, batch_size=1, lora_name="sourceless", training_dtype="fp32", lora_dtype="fp32",
              rank=2)
    ok, result, error = headless.run(prompt, server)
    out["sourceless"] = {"ok": ok, "error": error, "train": ui_text(result, train),
                         "load": ui_text(result, find(prompt, "StreamingCacheLoad")),
                         "load_images": shown_images(result, find(prompt, "StreamingCacheLoad"))}

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


LEGACY_TRAIN = "StreamingCacheTrainLoRA"
"""The first release's Train LoRA id (every setting a widget), which saved workflows still use."""


def train_from_cache(server: headless._Server, unet_name: str, cache_name: str, lora_name: str, *,
                     weight_dtype: str = "default", checkpoint: bool = False, node: str = "StreamingCacheTrain",
                     **train) -> dict:
    """UNETLoader (weights in ``weight_dtype``; ``checkpoint``: Load Checkpoint of ``unet_name``) -> Load Streaming
    Cache -> Train LoRA (the defaults, then the settings ``train``, on option nodes where they belong; ``node=
    LEGACY_TRAIN``: the first release's node with every setting on it), through the executor; the saved training
    state's losses when it worked."""
    import folder_paths
    import torch

    import nodes

    loader = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": unet_name}} if checkpoint else \
        {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": weight_dtype}}
    prompt = {"1": loader,
              "2": {"class_type": "StreamingCacheLoad", "inputs": {"cache_name": cache_name,
                                                                   "dataset_name": "default", "repeats": True}}}
    if node == LEGACY_TRAIN:
        prompt["3"] = {"class_type": node, "inputs": dict(headless.node_defaults(node), **train, lora_name=lora_name,
                                                          model=["1", 0], dataset=["2", 0])}
    else:
        prompt.update(headless.train_nodes(nodes.NODE_CLASS_MAPPINGS, ["1", 0], ["2", 0],
                                           dict(train, lora_name=lora_name), prefix="3")[0])
    prompt["4"] = {"class_type": "PreviewImage", "inputs": {"images": ["3", 3]}}
    ok, result, error = headless.run(prompt, server)
    res: dict = {"ok": ok, "error": error, "train": ui_text(result, "3")}
    if ok:
        state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training",
                                        f"{lora_name}.state.pt"), weights_only=True)
        res["losses"] = state["losses"]
        res["overflow_steps"] = state.get("overflow_steps")
        res["scaler"] = state.get("scaler")
    return res


def saved_lora(name: str) -> dict:
    """The LoRA ``name`` in models/loras: its ``tensors`` and ``metadata``."""
    import folder_paths
    from safetensors import safe_open

    path = os.path.join(folder_paths.get_folder_paths("loras")[0], f"{name}.safetensors")
    with safe_open(path, "pt") as f:
        return {"metadata": f.metadata(), "tensors": {k: f.get_tensor(k) for k in f.keys()}}


def run_scenario_main(scenario) -> None:
    """``python <helper>.py COMFYUI_PATH WORKDIR``: boot ComfyUI with the tiny checkpoint, run ``scenario(server)``
    and print its result as the one ``RESULT`` line the tests read."""
    server = boot_with_checkpoint(*sys.argv[1:3])
    print("RESULT " + json.dumps(scenario(server)), flush=True)


def lora_targets(lora: dict) -> set[str]:
    """The model weights a saved LoRA changes: ``<module>.weight`` for each adapter and weight difference,
    ``<module>.bias`` for each bias difference."""
    out = set()
    for k in lora:
        if k.endswith(".lora_up.weight"):
            out.add(k[:-len(".lora_up.weight")] + ".weight")
        elif k.endswith(".diff"):
            out.add(k[:-len(".diff")] + ".weight")
        elif k.endswith(".diff_b"):
            out.add(k[:-len(".diff_b")] + ".bias")
    return out


def lora_changes_output(unet_name: str, lora_name: str, cond: list, latent: dict,
                        weight_dtype: str = "default") -> dict:
    """Load Diffusion Model (weights in ``weight_dtype``) + LoraLoaderModelOnly with the saved LoRA: how many of
    its keys ComfyUI applied, and how much one sampling step's output moves with the LoRA (same noise, same
    conditioning)."""
    import torch

    import nodes

    with torch.inference_mode():  # as the executor runs them (v0.3.x's Stable Zero123 loads only so)
        model = nodes.UNETLoader().load_unet(unet_name, weight_dtype)[0]
        patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, f"{lora_name}.safetensors", 1.0)[0]
    lora = saved_lora(lora_name)["tensors"]
    targets = lora_targets(lora)
    res = {"patched_weights": len(patched.patches), "lora_targets": len(targets),
           "unapplied": sorted(targets - set(patched.patches))[:20],
           "model_type": type(model.model).__name__, "config_type": type(model.model.model_config).__name__}
    with torch.inference_mode():
        base = nodes.common_ksampler(model, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
        with_lora = nodes.common_ksampler(patched, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
    base, with_lora = _flat(base), _flat(with_lora)
    res["output_change"] = float((base.float() - with_lora.float()).abs().max())
    res["outputs_finite"] = bool(torch.isfinite(base).all() and torch.isfinite(with_lora).all())
    res["base_finite"] = bool(torch.isfinite(base).all())
    return res


def _flat(samples):
    """A sampler's output as one tensor: the streams of a joint audio-video latent (ComfyUI's NestedTensor)
    flattened and joined."""
    import torch

    streams = getattr(samples, "tensors", None)
    return samples if streams is None else torch.cat([t.flatten() for t in streams])


def random_cache(name: str, latent: tuple[int, ...], text: tuple[int, ...], pooled: int, seed: int = 1) -> tuple[list, dict]:
    """A cache ``name`` of six samples built with the Python API: random latents of shape ``latent`` and
    conditioning of the shapes a family's text encoders give (``text``, a ``pooled`` vector); returns a
    conditioning and latent to sample with."""
    import folder_paths
    import torch

    import streaming_cache as sc

    cache = os.path.join(folder_paths.get_output_directory(), "streaming_caches", name)
    g = torch.Generator().manual_seed(seed)
    items = [sc.Item(f"s{i}", {"latent": sc.Part(data=bytes([i])), "cond": sc.Part(data=bytes([i % 3]))}) for i in range(6)]
    encoders = {
        "latent": sc.Encoder("toy-vae", lambda parts: [{"samples": torch.randn(latent, generator=g)} for _ in parts]),
        "cond": sc.Encoder("toy-te", lambda parts: [[[torch.randn(text, generator=g),
                                                      {"pooled_output": torch.randn(1, pooled, generator=g)}]]
                                                    for _ in parts])}
    sc.build(cache, items, encoders)
    cond = [[torch.randn(text, generator=g), {"pooled_output": torch.randn(1, pooled, generator=g)}]]
    return cond, {"samples": torch.zeros(latent)}


def dit_cache(name: str = "sd3_toy") -> tuple[list, dict]:
    """The tiny SD3 DiT in models/diffusion_models and a cache ``name`` of six samples for it (random latents,
    conditioning of the shapes its text encoders would give); returns a conditioning and latent to sample with."""
    import folder_paths

    path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], TINY_DIT)
    if not os.path.exists(path):
        tiny_sd3_dit(path)
    return random_cache(name, (1, 16, 8, 8), (1, 10, 48), 32)


def dit_scenario(server: headless._Server) -> dict:
    cond, latent = dit_cache()
    res = train_from_cache(server, TINY_DIT, "sd3_toy", "dit_lora", steps=3, batch_size=2, rank=4,
                           training_dtype="fp32", lora_dtype="fp32", learning_rate=1e-3)
    if not res["ok"]:
        return res
    res.update(lora_changes_output(TINY_DIT, "dit_lora", cond, latent))
    return res


class ModelInputs:
    """Records what the diffusion model is called with while gradients are on (training, not the sampling
    check): the keys of its conditioning, the shapes of ``x``, the text and any reference latents, and the
    guidance values. A spy on ``BaseModel.apply_model``, ComfyUI's one entry point for every family."""

    def __init__(self) -> None:
        import comfy.model_base

        self.base = comfy.model_base.BaseModel
        self.original = self.base.apply_model
        self.calls: list[dict] = []

    def __enter__(self):
        import torch

        spy, original = self, self.original

        def apply_model(model, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                        **kwargs):
            if torch.is_grad_enabled():
                extra = {k: v for k, v in kwargs.items() if v is not None}
                spy.calls.append({
                    "x": list(x.shape), "c_crossattn": None if c_crossattn is None else list(c_crossattn.shape),
                    "keys": sorted(["c_crossattn"] * (c_crossattn is not None) + ["c_concat"] * (c_concat is not None)
                                   + list(extra)),
                    "guidance": [round(float(g), 4) for g in extra["guidance"].flatten()] if "guidance" in extra
                    else None,
                    "ref_latents": [list(r.shape) for r in extra.get("ref_latents", [])]})
            return original(model, x, t, c_concat, c_crossattn, control,
                            {} if transformer_options is None else transformer_options, **kwargs)

        self.base.apply_model = apply_model
        return self

    def __exit__(self, *exc) -> None:
        self.base.apply_model = self.original


class PackWarnings(logging.Handler):
    """Warnings the pack logs while the block runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("streaming_cache").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("streaming_cache").removeHandler(self)


def boot_with_checkpoint(comfyui: str, workdir: str) -> headless._Server:
    """ComfyUI booted in this process on ``workdir`` (``--cpu`` added without CUDA), with the tiny SD1.x
    checkpoint in its checkpoints folder."""
    server = headless.boot(comfyui, ["--base-directory", workdir], quiet=True)
    import folder_paths

    ckpt = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], CKPT)
    if not os.path.exists(ckpt):
        tiny_checkpoint(ckpt)
    return server


def main() -> None:
    comfyui, workdir, scenario = sys.argv[1:4]  # boot() replaces sys.argv with ComfyUI's
    server = boot_with_checkpoint(comfyui, workdir)
    result = {"full": scenario_full}[scenario](workdir, server)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
