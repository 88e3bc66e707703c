"""Where a training micro-step makes the host wait for the device, on ComfyUI's own model classes (see
tests/comfy/test_host_waits_in_comfyui.py); prints one JSON line of results.

    python host_waits_scenario.py COMFYUI_PATH WORKDIR [sdxl,flux,wan]   (default: all three)

For SDXL-, Flux dev- and Wan 2.1-shaped models (their published block counts at a tiny width, detected by ComfyUI as
those families) the pack's backend (``ComfyBackend``) runs a training pass as Train LoRA runs one, and inside it
micro-steps as the loop takes them: a batch collated and marked on the host (``ComfyBackend.prepare``, what the
loader's worker calls), copied to the device, its loss (``ComfyBackend.loss``: the forward pass and the loss) and
the backward pass of that loss, scaled by a gradient scaler in fp16. After a warm-up micro-step, further
micro-steps run under ``graph_devices.HostWaits``, which on the CPU takes every tensor for a device tensor except
the batch as collated on the host, the empty caption as cached, the host copies the batch and the empty caption keep
of options ComfyUI reads on the host (``conditioning.HostRows``) and the model sampling's host copy of its tables
(what ``ComfyBackend._sigmas`` reads on a GPU, where the tables are on the device); each call it counts is
reported with its stack.

The step's noise, noise levels and loss weights are drawn on the host and copied up through
``conditioning.upload``, which on a GPU copies from pinned memory without making the host wait; so is a model
condition ComfyUI's conditioning code makes on the host (SDXL's ``y``, found by ``ComfyBackend.host_tensor``, which
here asks HostWaits). Here (no device emulation) the copy is a plain one, which HostWaits counts: those calls are
reported apart, as ``uploads``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
import traceback

from comfy_scenario import run_scenario_main
from family_recipes import BY_KEY, FLUX, WAN
from graphs_scenario import build, cache_path, model_file

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

FAMILIES = {
    "sdxl": (BY_KEY["SDXL"], {}, (4, 4), "fp32"),  # its transformer depths [0, 0, 2, 2, 10, 10] at 320 channels
    # (the only width detection knows SDXL at), every level at that width, no transformers in the output blocks
    "flux": (BY_KEY["Flux dev"], dict(FLUX, depth=19, depth_single_blocks=38), (4, 4), "fp16"),
    "wan": (BY_KEY["Wan 2.1 / 2.2 A14B T2V"], dict(WAN, num_layers=40), (2, 4, 4), "fp16"),
}
"""family -> (recipe, its shrink at the published depth (empty: the recipe's), the latent's spatial size, the
training dtype of its batch of 4: fp16's backward passes are scaled by a gradient scaler; SDXL's convolutions are
slow in fp16 on a CPU)."""

CASES = {"batch 1": [0], "batch 4": [0, 1, 2, 3]}
PRESERVED = {"sdxl": "preserved"}
"""family -> a case of a batch of 1 whose loss preserves the base model's outputs (a preserved dataset's batch: the
model called again with its adapters off, ``ComfyBackend._base_prediction``)."""
"""case -> the batch's samples of the cache; a batch of 1 trains in fp32. SDXL's samples alternate between two sizes
(``family_recipes.sizes``): its batch of 4 splits into two model calls, of samples 0 and 2 and of samples 1 and 3."""
WARMUP, COUNTED = 1, 2
SETTINGS = dict(caption_dropout=0.5, rank=4, lora_dtype="fp32", seed=16)
"""Seed 16 drops samples 0 and 2 in the warm-up micro-step (the empty caption goes to the device once, there), then
sample 2, then samples 0 and 3: each counted step of 4 drops some captions and keeps others, a batch of 1 keeps its
caption in one and drops it in the other."""
FRAMES = ("host_waits_scenario.py",)


def pack_frames(stack: list) -> list[str]:
    """The frames of ``stack`` outside torch and this file: where a counted call came from."""
    return [f"{'/'.join(f.filename.split('/')[-3:])}:{f.lineno} {f.name}" for f in stack
            if "/torch/" not in f.filename and not f.filename.endswith(FRAMES) and "graph_devices.py" not in f.filename]


def counting_mode(graph_devices):
    """``HostWaits`` that keeps the stack of each call it counts."""

    class Traced(graph_devices.HostWaits):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.stacks: list[list[str]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            before = len(self.calls)
            result = super().__torch_function__(func, types, args, kwargs)
            if len(self.calls) > before:
                self.stacks.append(pack_frames(traceback.extract_stack()[:-1]))
            return result

    return Traced


def calls_of(waits) -> list[dict]:
    """Each counted call: what it is, where (the innermost frame outside torch, without its line) and its stack."""
    return [{"call": call, "where": where(stack[-1]) if stack else "",
             "stack": stack} for call, stack in zip(waits.calls, waits.stacks)]


def where(frame: str) -> str:
    """A frame (``path:line function``) as its file's folder and name and its function: ``wan/model.py
    sinusoidal_embedding_1d``."""
    path, function = frame.split(":", 1)[0], frame.rsplit(" ", 1)[-1]
    return f"{'/'.join(path.split('/')[-2:])} {function}"


def is_upload(entry: dict) -> bool:
    return any(frame.endswith(" upload") for frame in entry["stack"])


def on_device(value):
    """``value`` as the loader's copy puts it on the device: new memory for every tensor."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: on_device(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v) for v in value)
    return value


def host_copies(value) -> list:
    """The host copies a value keeps for ComfyUI's host reads (``conditioning.HostRows``, inside its options)."""
    if hasattr(value, "values") and type(value).__name__ == "HostRows":
        return list(value.values.values())
    if isinstance(value, dict):
        return [t for v in value.values() for t in host_copies(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in host_copies(v)]
    return []


def run_case(name: str, model, dataset, empty, samples: list[int], dtype: str, preserve: bool = False) -> dict:
    """Warm-up and counted micro-steps of one case (see the module docstring)."""
    import torch

    training = headless.pack_module("backend.training")
    spec_module = headless.pack_module("train.spec", "streaming_cache")
    draws_module = headless.pack_module("train.draws", "streaming_cache")
    captions = headless.pack_module("train.captions", "streaming_cache")
    graph_devices = headless.pack_module("train.graph_devices", "streaming_cache")
    Traced = counting_mode(graph_devices)
    spec = spec_module.TrainSpec.build(dict(SETTINGS, training_dtype=dtype, batch_size=len(samples)))
    backend = training.ComfyBackend(model, spec, dataset, empty_caption=empty)
    scaler = torch.amp.GradScaler("cpu") if dtype == "fp16" else None
    host = dataset.collate(samples)
    prepared = backend.prepare(host)
    out: dict = {"dtype": dtype, "scaled": scaler is not None, "warmup": [], "steps": [], "uploads": [], "groups": [],
                 "dropped": []}

    def work(device):
        ms = backend.inner.model_sampling  # on a GPU its tables are on the device and read from a host copy
        backend._host_sampling = (ms, copy.deepcopy(ms))
        host_side = [host, empty, list(backend._host_sampling[1].buffers())]
        for micro in range(WARMUP + COUNTED):
            started = time.perf_counter()
            batch = on_device(prepared)
            draws = draws_module.Draws(spec.seed, micro, 0, None)
            out["dropped"].append([captions.dropout(spec.seed, micro, spec.data.caption_dropout, i)
                                   for i in range(len(samples))])
            kept = host_copies(prepared) + host_copies(backend._empty_on)  # host memory on a GPU too
            with Traced(host=[*host_side, kept]) as waits:
                backend.host_tensor = waits.on_host  # on the CPU, what the mode knows for host memory
                loss = backend.loss(batch, draws, preserve=preserve)
                (loss if scaler is None else scaler.scale(loss)).backward()
            found = calls_of(waits)
            print(f"{name} micro-step {micro}: {time.perf_counter() - started:.1f} s, {len(found)} calls",
                  file=sys.stderr, flush=True)
            if micro < WARMUP:
                out["warmup"].append(found)
            else:
                out["steps"].append([c for c in found if not is_upload(c)])
                out["uploads"].append([c["where"] for c in found if is_upload(c)])
        out["loss"] = float(loss.detach())
        out["adapter_searches"] = backend._adapters_off.searches  # the trained wrappers found once a run
        return None

    conditioning = headless.pack_module("train.conditioning", "streaming_cache")
    out["groups"] = conditioning.option_groups(prepared["cond"], len(samples))
    backend.run(work)
    return out


def family(key: str) -> dict:
    import torch

    import nodes

    handles = headless.pack_module("dataset", "streaming_cache")
    recipe, shrink, spatial, dtype = FAMILIES[key]
    recipe = dataclasses.replace(recipe, shrink=shrink or recipe.shrink, name=f"host_waits_{key}")
    t0 = time.perf_counter()
    cache = f"host_waits_{key}"
    build(recipe, cache, spatial, seed=7)
    with torch.inference_mode():
        model = nodes.UNETLoader().load_unet(model_file(recipe), "default")[0]
    dataset = handles.DatasetHandle.from_cache(cache_path(cache), "default")
    empty = handles.DatasetHandle.from_cache(cache_path(cache), "empty_caption")[0].materialize()["cond"]
    print(f"{key}: built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    out: dict = {"model": type(model.model.model_config).__name__,
                 "blocks": {n: len(m) for n, m in model.model.diffusion_model.named_children()
                            if isinstance(m, torch.nn.ModuleList)},
                 "setup_seconds": time.perf_counter() - t0, "cases": {}}
    for case, samples in CASES.items():
        t1 = time.perf_counter()
        out["cases"][case] = run_case(case, model, dataset, empty, samples, dtype if len(samples) > 1 else "fp32")
        out["cases"][case]["seconds"] = time.perf_counter() - t1
    if key in PRESERVED:
        t1 = time.perf_counter()
        case = PRESERVED[key]
        out["cases"][case] = run_case(case, model, dataset, empty, CASES["batch 1"], "fp32", preserve=True)
        out["cases"][case]["seconds"] = time.perf_counter() - t1
    return out


def scenario(server, chosen: tuple[str, ...] = tuple(FAMILIES)) -> dict:
    import torch

    torch.set_num_threads(1)  # tiny operations: threads waiting on each other beside other work cost ten times more
    return {key: family(key) for key in chosen}


if __name__ == "__main__":
    chosen = tuple(sys.argv.pop(3).split(",")) if len(sys.argv) > 3 else tuple(FAMILIES)
    run_scenario_main(lambda server: scenario(server, chosen))
