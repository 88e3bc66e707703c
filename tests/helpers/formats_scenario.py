"""Runs inside a process that boots real ComfyUI (tests/comfy/test_lora_files_in_comfyui.py); prints one JSON line of results.

    python formats_scenario.py COMFYUI_PATH WORKDIR

For three families diffusers also has (SD1.x: the tiny checkpoint; SDXL: KOALA's layout; Flux dev) a LoRA in
ComfyUI's own layout: for SD1.x trained by Train LoRA through the executor at rank 4 and alpha 2 (then queued
again with ``lora_format`` kohya, which continues the same run and saves kohya's keys; its output through
LoraLoaderModelOnly is compared with the training adapters' own), for the others made by the pack's own
``create_adapters`` (every layer ComfyUI can patch, as training lays it out) with random values and alpha 2.
``convert_lora.convert_file`` writes it in kohya's and diffusers' formats, and back in ComfyUI's (the reference
without the norm and bias offsets those formats leave out). Each file goes through LoraLoaderModelOnly: the keys
ComfyUI logs as not loaded, the weights it patches, the weight deltas it computes (``comfy.lora.calculate_weight``
on zero weights) and one sampling step's output.

For the diffusers check in the test process, each kohya and diffusers file is kept in WORKDIR with the deltas
ComfyUI applied from it, under diffusers' parameter names (ComfyUI's own ``unet_to_diffusers`` /
``flux_to_diffusers`` say which rows of which weight each is), seen through random probes (``lora_probes.py``):
Flux on v0.3.x is 3072 wide, and its full deltas would be gigabytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

from comfy_scenario import boot_with_checkpoint, random_cache, train_from_cache
from demo_assets import CKPT
from families import BY_NAME, flux, flux_cond, random_weights, sdxl_cond, sdxl_unet
from lora_probes import probe

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

FORMATS = ("comfyui", "kohya", "diffusers")


class _NotLoaded(logging.Handler):
    """The keys ComfyUI's LoRA loader logs as not loaded while the block runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.keys: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "lora key not loaded" in message or message.startswith("NOT LOADED"):
            self.keys.append(message)

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)


def applied(model, lora_file: str, cond: list, latent: dict, each) -> dict:
    """LoraLoaderModelOnly with ``lora_file``: the keys ComfyUI logs as not loaded, the weights it patches (each
    one's delta handed to ``each(key, delta)`` as it is computed: a 3072-wide Flux's deltas are gigabytes), and one
    sampling step's output."""
    import comfy.lora
    import torch

    import nodes

    with _NotLoaded() as log:
        patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, os.path.basename(lora_file), 1.0)[0]
    shapes = {k: v.shape for k, v in patched.model.state_dict().items()}
    for key, patches in patched.patches.items():
        each(key, comfy.lora.calculate_weight(patches, torch.zeros(shapes[key]), key))
    with torch.inference_mode():
        output = nodes.common_ksampler(patched, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
    return {"not_loaded": log.keys, "patched": sorted(patched.patches), "output": output.float()}


def diffusers_names(model) -> dict[str, list[tuple]]:
    """ComfyUI weight key -> [(diffusers' parameter name, rows or None, swapped halves)], from ComfyUI's own maps."""
    import comfy.model_base
    import comfy.utils

    config = model.model.model_config.unet_config
    if isinstance(model.model, comfy.model_base.Flux):
        raw = comfy.utils.flux_to_diffusers(config, output_prefix="diffusion_model.")
    else:
        raw = {k: f"diffusion_model.{v}" for k, v in comfy.utils.unet_to_diffusers(config).items()}
    out: dict[str, list[tuple]] = {}
    for name, to in raw.items():
        if not name.endswith(".weight"):
            continue
        if isinstance(to, str):
            out.setdefault(to, []).append((name, None, False))
        elif to[1] is not None:
            out.setdefault(to[0], []).append((name, (to[1][1], to[1][2]), False))
        else:
            out.setdefault(to[0], []).append((name, None, to[2] is comfy.utils.swap_scale_shift))
    return out


def probes_of(key: str, delta, names: dict[str, list[tuple]]) -> dict:
    """The probes of one weight's ``delta`` under each diffusers name ComfyUI gives (rows of) that weight."""
    import torch

    out = {}
    for name, rows, swapped in names.get(key, []):
        part = delta if rows is None else delta[rows[0]:rows[0] + rows[1]]
        part = torch.cat(part.chunk(2)[::-1]) if swapped else part
        out[name] = probe(name, part).contiguous()
    return out


class Compared:
    """How the deltas one file makes ComfyUI apply differ from the reference file's (``reference``: weight key ->
    delta; ``scale``: its largest), and their probes under diffusers' names, gathered weight by weight."""

    def __init__(self, reference: dict, names: dict[str, list[tuple]], scale: float):
        self.reference, self.names, self.scale = reference, names, scale
        self.difference, self.probes = 0.0, {}

    def __call__(self, key: str, delta) -> None:
        if key in self.reference:
            self.difference = max(self.difference, float((self.reference[key] - delta).abs().max()))
        self.probes.update(probes_of(key, delta, self.names))

    def report(self, reference: dict, other: dict) -> dict:
        return {"only_reference": sorted(set(reference["patched"]) - set(other["patched"])),
                "only_other": sorted(set(other["patched"]) - set(reference["patched"])),
                "delta_difference": self.difference / self.scale, "largest_delta": self.scale,
                "output_difference": float((reference["output"] - other["output"]).abs().max())}


def check_formats(model, family: str, comfy_file: str, model_file: str, cond: list, latent: dict, workdir: str, *,
                  offsets: bool) -> dict:
    """``comfy_file`` converted to every format with the CLI's own function and each loaded by ComfyUI, compared
    with the reference (ComfyUI's format without the offsets the others leave out); ``offsets``: ``comfy_file``
    itself too (a trained LoRA: how much its offsets change the output)."""
    import torch
    from convert_lora import convert_file
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nodes

    loras = os.path.dirname(comfy_file)
    files = {"comfyui": comfy_file}
    res: dict = {"reports": {}, "keys": {}, "metadata_format": {}}
    for fmt in ("kohya", "diffusers"):
        files[fmt] = os.path.join(loras, f"{family}_{fmt}.safetensors")
        res["reports"][fmt] = convert_file(comfy_file, files[fmt], fmt, model_file)
    files["reference"] = os.path.join(loras, f"{family}_reference.safetensors")
    res["reports"]["reference"] = convert_file(files["kohya"], files["reference"], "comfyui", model_file)
    for fmt, path in files.items():
        with safe_open(path, "pt") as f:
            res["keys"][fmt] = sorted(f.keys())
            res["metadata_format"][fmt] = (f.metadata() or {}).get("streaming_cache_lora_format")
    with torch.inference_mode():
        base = nodes.common_ksampler(model, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"].float()
    names = diffusers_names(model)
    deltas: dict = {}
    loaded = {"reference": applied(model, files["reference"], cond, latent, deltas.__setitem__)}
    res["diffusers_files"], res["vs_reference"] = {}, {}
    largest = max(float(d.abs().max()) for d in deltas.values())
    for fmt in FORMATS[0 if offsets else 1:]:
        compared = Compared(deltas, names, largest)
        loaded[fmt] = applied(model, files[fmt], cond, latent, compared)
        res["vs_reference"][fmt] = compared.report(loaded["reference"], loaded[fmt])
        if fmt != "comfyui":
            kept = os.path.join(workdir, "for_diffusers", f"{family}_{fmt}.safetensors")
            os.makedirs(os.path.dirname(kept), exist_ok=True)
            shutil.copyfile(files[fmt], kept)
            save_file(compared.probes, kept[:-len(".safetensors")] + ".probes.safetensors")
            res["diffusers_files"][fmt] = kept
    res["not_loaded"] = {fmt: r["not_loaded"] for fmt, r in loaded.items()}
    res["patched"] = {fmt: len(r["patched"]) for fmt, r in loaded.items()}
    res["lora_change"] = float((loaded["reference"]["output"] - base).abs().max())
    if offsets:
        res["offsets_change"] = float((loaded["comfyui"]["output"] - loaded["reference"]["output"]).abs().max())
    res["diffusers_names"] = {name: key for key, found in names.items() if key in deltas for name, _, _ in found}
    return res


def random_lora(model, seed: int) -> dict:
    """A LoRA as Train LoRA lays it out for ``model`` (the pack's ``create_adapters``: every layer ComfyUI can
    patch, offsets of norms and biases included), with random values and alpha 2."""
    import torch

    training = headless.pack_module("backend.training")
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(False):
        adapters = training.create_adapters(model.clone(), 4, "LoRA", torch.float32, {})
    out = {}
    for key, value in adapters.items():
        if key.endswith(".alpha"):
            out[key] = torch.tensor(2.0)
        else:
            std = 0.01 if key.endswith(("diff", "diff_b")) else 0.05
            out[key] = torch.randn(value.shape, generator=g) * std
    return out


def sd15(server, workdir: str) -> dict:
    """Train LoRA on the tiny SD1.x checkpoint, in ComfyUI's format for two steps, then queued again with
    ``lora_format`` kohya and three steps: the same run continues, and its file has kohya's keys; then once more
    with ``lora_format`` diffusers and the same three steps: nothing to train, and the file is converted."""
    import folder_paths
    import torch
    from safetensors import safe_open

    import nodes

    cond, latent = random_cache("fmt_sd15", (1, 4, 8, 8), (1, 77, 768), 768)
    settings = {"batch_size": 2, "rank": 4, "alpha": 2.0, "learning_rate": 1e-2, "training_dtype": "fp32",
                "lora_dtype": "fp32", "checkpoint": True}
    res: dict = {"first": train_from_cache(server, CKPT, "fmt_sd15", "fmt_sd15", steps=2, **settings)}
    loras = folder_paths.get_folder_paths("loras")[0]
    trained = os.path.join(loras, "fmt_sd15.safetensors")
    comfy_file = os.path.join(loras, "sd15_comfyui.safetensors")
    shutil.copyfile(trained, comfy_file)
    res["again"] = train_from_cache(server, CKPT, "fmt_sd15", "fmt_sd15", steps=3, lora_format="kohya", **settings)
    with safe_open(trained, "pt") as f:
        res["kohya_run"] = {"keys": sorted(f.keys()), "metadata": f.metadata()}
        saved = {k: f.get_tensor(k) for k in f.keys()}
    state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training", "fmt_sd15.state.pt"),
                       weights_only=True)
    compat = headless.pack_module("backend.compat")
    lora_formats = headless.pack_module("train.lora_formats", "streaming_cache")
    ckpt = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], CKPT)
    back = lora_formats.convert(saved, compat.lora_name_table_of_file(ckpt), "comfyui").tensors
    params = {k: v for k, v in state["params"].items() if not k.endswith(("diff", "diff_b"))}
    res["kohya_run"]["step"] = int(state["step"])
    res["kohya_run"]["same_as_state"] = back.keys() == params.keys() and all(
        torch.equal(back[k].float(), params[k].float()) for k in params)
    res["converted"] = train_from_cache(server, CKPT, "fmt_sd15", "fmt_sd15", steps=3, lora_format="diffusers",
                                        **settings)
    with safe_open(trained, "pt") as f:
        res["converted"]["keys"] = sorted(f.keys())
        res["converted"]["metadata"] = f.metadata()
    model = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[0]
    res.update(check_formats(model, "sd15", comfy_file, ckpt, cond, latent, workdir, offsets=True))
    res["continued"] = continue_from(server, "sd15_kohya.safetensors", os.path.join(loras, "sd15_reference.safetensors"),
                                     settings)
    res["alpha"] = alpha_applied(model, comfy_file, cond, latent, settings)
    res["dora"] = dora_applied(server, model, cond, latent, settings)
    return res


def dora_applied(server, model, cond: list, latent: dict, settings: dict) -> dict:
    """Train LoRA with ``dora`` for two steps, in the kohya format: the file's keys, one sampling step's output
    through the training's own layers (``create_adapters`` continuing from the file converted back to ComfyUI's keys:
    DoRA weight wrappers holding the file's matrices and magnitudes), through LoraLoaderModelOnly with the file, and
    with the same file without its magnitudes (a plain LoRA)."""
    import folder_paths
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nodes

    res = train_from_cache(server, CKPT, "fmt_sd15", "fmt_dora", steps=2, dora=True, lora_format="kohya",
                           **settings)
    if not res["ok"]:
        return res
    loras = folder_paths.get_folder_paths("loras")[0]
    with safe_open(os.path.join(loras, "fmt_dora.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
        res["network_args"] = f.metadata().get("ss_network_args")
    res["ups"] = sum(k.endswith(".lora_up.weight") for k in saved)
    res["magnitudes"] = sum(k.endswith(".dora_scale") for k in saved)
    res["magnitude_shapes"] = sorted({str(list(v.shape[:2])) + f"x{v.dim()}" for k, v in saved.items()
                                      if k.endswith(".dora_scale")})[:4]
    save_file({k: v for k, v in saved.items() if not k.endswith(".dora_scale")},
              os.path.join(loras, "fmt_dora_plain.safetensors"))
    compat = headless.pack_module("backend.compat")
    lora_formats = headless.pack_module("train.lora_formats", "streaming_cache")
    training = headless.pack_module("backend.training")
    ckpt = os.path.join(folder_paths.get_folder_paths("checkpoints")[0], CKPT)
    existing = lora_formats.convert(saved, compat.lora_name_table_of_file(ckpt), "comfyui").tensors
    trained = model.clone()
    with torch.inference_mode(False):
        adapters = training.create_adapters(trained, settings["rank"], "LoRA", torch.float32, existing)
    res["dora_layers"] = sum(k.endswith(".dora_scale") for k in adapters)
    outputs = {}
    with torch.inference_mode():
        outputs["base"] = nodes.common_ksampler(model, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
        outputs["training"] = nodes.common_ksampler(trained, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0][
            "samples"]
        for name in ("fmt_dora.safetensors", "fmt_dora_plain.safetensors"):
            patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
            outputs[name] = nodes.common_ksampler(patched, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0][
                "samples"]
    res["lora_change"] = float((outputs["training"] - outputs["base"]).abs().max())
    res["loaded_vs_training"] = float((outputs["fmt_dora.safetensors"] - outputs["training"]).abs().max())
    res["plain_vs_training"] = float((outputs["fmt_dora_plain.safetensors"] - outputs["training"]).abs().max())
    return res


def alpha_applied(model, lora_file: str, cond: list, latent: dict, settings: dict) -> dict:
    """The alphas the first run's file (``settings``: rank 4, alpha 2) holds, and one sampling step's output through
    the training's own adapters (``create_adapters`` with that rank and alpha, holding the file's matrices: the
    weight wrappers training runs), through LoraLoaderModelOnly with the file, and with the same file whose alphas
    are 1."""
    import folder_paths
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nodes

    res: dict = {}
    with safe_open(lora_file, "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
        res["metadata_alpha"] = f.metadata().get("ss_network_alpha")
    res["alphas"] = sorted({float(v) for k, v in saved.items() if k.endswith(".alpha")})
    res["alpha_keys"] = sum(k.endswith(".alpha") for k in saved)
    res["up_keys"] = sum(k.endswith("lora_up.weight") for k in saved)
    training = headless.pack_module("backend.training")
    trained = model.clone()
    with torch.inference_mode(False):
        adapters = training.create_adapters(trained, settings["rank"], "LoRA", torch.float32, {}, None,
                                            settings["alpha"])
        with torch.no_grad():
            for key, parameter in adapters.items():
                if not key.endswith(".alpha"):
                    parameter.copy_(saved[key])
    res["adapter_alphas"] = sorted({float(v) for k, v in adapters.items() if k.endswith(".alpha")})
    one = {k: torch.ones_like(v) if k.endswith(".alpha") else v for k, v in saved.items()}
    save_file(one, os.path.join(folder_paths.get_folder_paths("loras")[0], "fmt_alpha_1.safetensors"))
    outputs = {}
    with torch.inference_mode():
        outputs["base"] = nodes.common_ksampler(model, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
        outputs["training"] = nodes.common_ksampler(trained, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0][
            "samples"]
        for name in (os.path.basename(lora_file), "fmt_alpha_1.safetensors"):
            patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
            outputs[name] = nodes.common_ksampler(patched, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0][
                "samples"]
    res["lora_change"] = float((outputs["training"] - outputs["base"]).abs().max())
    res["loaded_vs_training"] = float((outputs[os.path.basename(lora_file)] - outputs["training"]).abs().max())
    res["alpha_1_vs_training"] = float((outputs["fmt_alpha_1.safetensors"] - outputs["training"]).abs().max())
    return res


def continue_from(server, existing: str, reference: str, settings: dict) -> dict:
    """Train LoRA starting from the kohya file ``existing`` (``existing_lora``), one step at the smallest learning
    rate: how far its LoRA matrices are from ``reference`` (the same LoRA in ComfyUI's format)."""
    import folder_paths
    import torch
    from safetensors.torch import load_file

    res = train_from_cache(server, CKPT, "fmt_sd15", "fmt_continued", steps=1, existing_lora=existing,
                           **dict(settings, learning_rate=1e-7))
    if res["ok"]:
        state = torch.load(os.path.join(folder_paths.get_output_directory(), "lora_training",
                                        "fmt_continued.state.pt"), weights_only=True)
        ref = load_file(reference)
        matrices = [k for k in ref if k.endswith(("lora_up.weight", "lora_down.weight"))]
        res["matrices"] = len(matrices)
        res["missing"] = [k for k in matrices if k not in state["params"]]
        res["largest"] = max(float(ref[k].abs().max()) for k in matrices)
        res["difference"] = max(float((state["params"][k].float() - ref[k].float()).abs().max())
                                for k in matrices if k in state["params"])
    return res


def wrong_model(lora_file: str, model_file: str) -> dict:
    """The converter given a model the LoRA was not made for: its error, and whether it wrote anything."""
    from convert_lora import convert_file

    out = lora_file[:-len(".safetensors")] + "_wrong.safetensors"
    try:
        convert_file(lora_file, out, "comfyui", model_file)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"input": lora_file, "error": error, "written": os.path.exists(out)}


def flux_reads_width() -> bool:
    """Whether this ComfyUI's detection reads Flux's width from the weights (newer) or hard-codes 3072
    (v0.3.x): asked of its own detection, on shapes alone."""
    import comfy.model_detection
    import torch

    sd = {k: torch.empty(s, device="meta") for k, s in flux(128, True, 1).items()}
    return comfy.model_detection.detect_unet_config(sd, "").get("hidden_size") == 128


def synthetic(family_name: str, tiny_flux: bool, workdir: str) -> dict:
    """The family's tiny model (SDXL's with transformers in its output blocks, as diffusers' reading of kohya's
    SDXL names expects), a random LoRA in ComfyUI's layout for it, and :func:`check_formats`."""
    import folder_paths
    import torch
    from safetensors.torch import save_file

    import nodes

    family = BY_NAME[family_name]
    path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], family.model_file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(random_weights(sdxl_unet(1) if family_name == "sdxl" else family.weights(tiny_flux)), path)
    model = nodes.UNETLoader().load_unet(family.model_file, "default")[0]
    comfy_file = os.path.join(folder_paths.get_folder_paths("loras")[0], f"{family_name}_comfyui.safetensors")
    save_file(random_lora(model, seed=len(family_name)), comfy_file)
    g = torch.Generator().manual_seed(3)
    cond = {"sdxl": sdxl_cond, "flux_dev": flux_cond}[family_name](g, 0)
    res = check_formats(model, family_name, comfy_file, path, cond, {"samples": torch.zeros(family.latent)}, workdir,
                        offsets=False)
    res["config_type"] = type(model.model.model_config).__name__
    res["hidden_size"] = model.model.model_config.unet_config.get("hidden_size")
    return res


def main() -> None:
    comfyui, workdir = sys.argv[1:3]
    server = boot_with_checkpoint(comfyui, workdir)
    import comfy.model_management
    import folder_paths

    out: dict = {"tiny_flux": flux_reads_width(), "families": {}}
    out["families"]["sd15"] = sd15(server, workdir)
    for name in ("sdxl", "flux_dev"):
        comfy.model_management.unload_all_models()
        out["families"][name] = synthetic(name, out["tiny_flux"], workdir)
    sd15_kohya = out["families"]["sd15"]["diffusers_files"]["kohya"]
    flux_model = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], BY_NAME["flux_dev"].model_file)
    out["families"]["sd15"]["wrong_model"] = wrong_model(sd15_kohya, flux_model)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
