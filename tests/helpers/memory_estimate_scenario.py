"""The step memory estimate of SDXL and Flux dev at 1024 px, inside a process that imports real ComfyUI (see
tests/comfy/test_memory_estimate.py); prints one JSON line of results.

    python memory_estimate_scenario.py COMFYUI_PATH WORKDIR

ComfyUI's model classes at full size on the ``meta`` device, nothing loaded from disk: each family with gradient
checkpointing (the default), without it, and with math attention (to show the fused attention's count is what
changes), and SDXL on fp8 weights in bypass mode; Wan 2.1 1.3B at a small clip with and without checkpointing;
HunyuanVideo 1.5 at a small clip with checkpointing, the family a loaded model of its published configuration is
found as, and a dataset row's conditioning for it; ComfyUI's own TrainLoraNode on SDXL at a small resolution;
then Memory & Precision's plan for SDXL given several sizes of device memory (a one-row cache in ``WORKDIR``).
"""

from __future__ import annotations

import json
import sys

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

RUNS = {
    "sdxl": {"checkpointing": {}, "no_checkpointing": {"gradient_checkpointing": False},
             "math_attention": {"attention": "math"}, "fp8_bypass": {"bypass_fp8": True}},
    "flux-dev": {"checkpointing": {}, "math_attention": {"attention": "math"}},
}


VIDEO = ("wan21-1.3b", 256, 9)
"""A video family beyond the baseline's, at a small clip (family, pixels square, frames): Wan 2.1 1.3B, counted
with and without checkpointing (a few seconds each)."""
VIDEO_RUNS = {"checkpointing": {}, "no_checkpointing": {"gradient_checkpointing": False}}
HUNYUAN15 = ("hunyuan-video-1.5", 256, 9)
"""HunyuanVideo 1.5 at a small clip (family, pixels square, frames), with checkpointing only (about 15 s: 54
blocks of an 8.3 B model)."""
HUNYUAN15_TOKENS = 17
"""The caption length of the dataset row :func:`hunyuan15` conditions (Qwen2.5-VL features do not pad)."""


def hunyuan15(module) -> dict:
    """HunyuanVideo 1.5 (:data:`HUNYUAN15`): one step counted; the :data:`FAMILIES` key of a model that ComfyUI's
    detection configures from the published configuration's weights (as a loaded model's plan finds its family);
    the conditioning shapes a dataset row of :data:`HUNYUAN15_TOKENS` tokens gives a step on its latent."""
    import types

    import comfy.model_detection
    import torch

    key, pixels, frames = HUNYUAN15
    family = module.FAMILIES[key]
    out = {"checkpointing": module.estimate_step(key, pixels, frames).to_json()}
    weights = module.build(family, torch.bfloat16).diffusion_model.state_dict()
    config = comfy.model_detection.model_config_from_unet(weights, "")
    out["detected"] = module._family_of(types.SimpleNamespace(model=types.SimpleNamespace(model_config=config)))[0]
    row = {"cond": [[torch.zeros(1, HUNYUAN15_TOKENS, 3584), {"pooled_output": None}]]}
    x_shape = family.latent(1, pixels, pixels, frames)
    out["row_conditioning"] = {k: list(v) for k, v in module.row_conditioning(family, row, 1, x_shape).items()}
    return out


COMFYUI_STEP = ("sdxl", 256)
"""ComfyUI's own TrainLoraNode estimated on full-size SDXL at a small resolution (family, pixels square): about
10 s a count."""


def comfyui_step(module) -> dict:
    """ComfyUI's TrainLoraNode (``estimate_comfyui_step``, :data:`COMFYUI_STEP`) at its default (checkpointing at
    depth 1) and without checkpointing, beside Train LoRA's step without checkpointing; the parameters a rank-16
    LoRA on every layer the node patches holds by arithmetic on the layers' shapes (a matrix: 16 x (rows +
    columns x kernel) and its alpha, which the node's adapters hold as a parameter; a 1-D weight or a bias:
    its size); and one step counted by ``count_comfyui_step`` directly, the tracker's peak and the trained bytes,
    which the estimate's peak must be made of."""
    import math

    import torch

    if module.comfyui_trainer() is None:
        return {}
    key, pixels = COMFYUI_STEP
    family = module.FAMILIES[key]
    out = {name: module.estimate_comfyui_step(key, pixels, **options).to_json()
           for name, options in (("checkpointing", {}), ("no_checkpointing", {"gradient_checkpointing": False}))}
    out["pack_no_checkpointing"] = module.estimate_step(key, pixels, gradient_checkpointing=False).to_json()
    model = module.build(family, torch.bfloat16)
    expected = 0
    for m in model.modules():
        if not hasattr(m, "weight_function"):
            continue
        if m.weight is not None:
            shape = m.weight.shape
            expected += 16 * (shape[0] + math.prod(shape[1:])) + 1 if len(shape) >= 2 else shape[0]
        if getattr(m, "bias", None) is not None:
            expected += m.bias.shape[0]
    out["expected_trained_parameters"] = expected
    x_shape = family.latent(1, pixels, pixels, None)
    with torch.inference_mode(False), torch.enable_grad():
        count, found = module.count_comfyui_step(model, x_shape, family.inputs(1, x_shape))
    out["counted"] = {"peak": count.peak, "transient": count.transient, "trained_bytes": found["trained_bytes"]}
    return out


PLANNED_GIB = (80, 24, 12, 8, 6, 1)
"""The device memory the memory plan is given (``STREAMING_CACHE_DEVICE_MEMORY``) for SDXL at 1024 px."""


def plans(workdir: str) -> dict:
    """Memory & Precision's plan (``memory_fit.plan``) for full-size SDXL on ``meta`` (as a loaded model: a
    ModelPatcher) and a cache of one 1024 px latent, given each of :data:`PLANNED_GIB`: auto's choice and summary
    line, and manual's line at 12 GiB without checkpointing."""
    import dataclasses
    import os

    import comfy.model_patcher
    import torch

    fit = headless.pack_module("backend.memory_fit")
    estimate = headless.pack_module("backend.memory_estimate")
    engine = headless.pack_module("builder", part="streaming_cache")
    spec_module = headless.pack_module("train.spec", part="streaming_cache")
    cache = os.path.join(workdir, "plan_cache")
    encoders = {"latent": engine.Encoder("toy-vae", lambda parts: [{"samples": torch.zeros(1, 4, 128, 128)}
                                                                   for _ in parts]),
                "cond": engine.Encoder("toy-te", lambda parts: [[[torch.zeros(1, 77, 2048),
                                                                  {"pooled_output": torch.zeros(1, 1280)}]]
                                                                for _ in parts])}
    engine.build(cache, [engine.Item("a", {"latent": engine.Part(data=b"a"), "cond": engine.Part(data=b"a")})],
                 encoders)
    dataset = headless.pack_module("dataset", part="streaming_cache").DatasetHandle.from_cache(cache, "default")
    cpu = torch.device("cpu")
    model = comfy.model_patcher.ModelPatcher(estimate.build(estimate.FAMILIES["sdxl"], torch.bfloat16), cpu, cpu)
    spec = spec_module.TrainSpec(lora_name="plan")
    out: dict = {}
    for gib in PLANNED_GIB:
        os.environ["STREAMING_CACHE_DEVICE_MEMORY"] = f"{gib}GiB"
        with torch.inference_mode():  # as ComfyUI's executor runs a node, Train LoRA's plan included
            plan = fit.plan(model, spec, dataset)
        out[f"auto_{gib}"] = {"label": plan.label, "summary": plan.summary(), "fits": plan.fits,
                              "changed": plan.changed}
    os.environ["STREAMING_CACHE_DEVICE_MEMORY"] = "12GiB"
    manual = dataclasses.replace(spec, memory=spec_module.MemoryOptions(plan="manual", gradient_checkpointing=False))
    with torch.inference_mode():
        out["manual_12"] = {"summary": fit.plan(model, manual, dataset).summary()}
    del os.environ["STREAMING_CACHE_DEVICE_MEMORY"]
    out["cpu"] = {"summary": fit.plan(model, spec, dataset).summary()}
    return out


def main() -> None:
    comfyui, workdir = sys.argv[1:3]
    headless.boot(comfyui, ["--cpu", "--use-pytorch-cross-attention"], quiet=True, others=False)
    module = headless.pack_module("backend.memory_estimate")
    result: dict = {"version": headless.pack_module("backend.compat").comfyui_version()}
    for family, runs in RUNS.items():
        result[family] = {name: module.estimate_step(family, 1024, **options).to_json()
                          for name, options in runs.items()}
    family, pixels, frames = VIDEO
    result[family] = {name: module.estimate_step(family, pixels, frames, **options).to_json()
                      for name, options in VIDEO_RUNS.items()}
    result[HUNYUAN15[0]] = hunyuan15(module)
    result["comfyui_step"] = comfyui_step(module)
    result["plans"] = plans(workdir)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
