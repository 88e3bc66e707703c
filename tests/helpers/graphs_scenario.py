"""The GPU-only paths of Train LoRA run on the CPU, inside a process that boots real ComfyUI (see
tests/comfy/test_graphs_emulated.py); prints one JSON line of results.

    python graphs_scenario.py COMFYUI_PATH WORKDIR [graphs,retry,placement]   (default: all three)

Graphs: for tiny SD1.5 (the demo checkpoint), SDXL (KOALA-700M's layout: SDXL's model class) and Flux dev models,
Train LoRA through the
executor on a mix of two datasets of another latent size each (two buckets), with gradient accumulation, caption
dropout and (Flux, the fastest of the three: half precision is slow on a CPU) fp16 with the gradient scaler, then
resumed for two more steps; once with its steps recorded
and replayed through the CPU emulation of CUDA graphs (``STREAMING_CACHE_EMULATE_DEVICE=1``), once with the
emulation but no graphs (``STREAMING_CACHE_CUDA_GRAPHS=0``), and (SD1.5) once without any emulation. The LoRAs must
agree to round-off.

Retry: a pass that fails with autograd's in-place error runs again another way only before the first optimizer step.

Placement: the loss of one batch of each family (SD1.5 with caption dropout and a masked loss, SDXL, Flux dev,
Flux Kontext's reference latent, LTXV's image-to-video noise mask) computed with the batch on the ``meta`` device
standing for the GPU and the model call replaced by a check: every tensor the step builds and hands on (noise,
noise levels, the conditioning with what the family adds, masks, loss weights) must be on that device; one left on
the host fails the step there (an operation mixing devices raises) or shows in the report. The meta device holds no
values, so the one value-dependent operation of a step (``torch.equal``, which decides whether a conditioning option
is given once) answers "not equal" there, the general path.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import traceback

from comfy_scenario import run_scenario_main, saved_lora, ui_text
from demo_assets import CKPT
from family_recipes import BY_KEY
from family_sweep import detect, prepare
from values import lora_difference

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

FAMILIES = {"sd15": ("SD15", "fp32", ((8, 8), (8, 12))), "sdxl": ("KOALA_700M", "fp32", ((8, 8), (8, 16))),
            "flux": ("Flux dev", "fp16", ((4, 4), (4, 6)))}
"""family -> (recipe, training dtype, the latent sizes of the mix's two datasets). SD1.5 trains the demo checkpoint
(a one-level UNet, detection's smallest); the recipe gives its conditioning."""
PLACEMENT = ("SD15", "KOALA_700M", "Flux dev", "Flux Kontext", "LTXV image-to-video")
SAMPLES = 4
TRAIN = dict(batch_size=2, grad_accumulation_steps=2, caption_dropout=0.5, rank=4, lora_dtype="fp32", seed=3,
             learning_rate=5e-3)


@contextlib.contextmanager
def environment(**values: str | None):
    """Environment variables set (None: removed) for the block."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


MODES = {"graphs": dict(STREAMING_CACHE_EMULATE_DEVICE="1", STREAMING_CACHE_CUDA_GRAPHS="1"),
         "eager": dict(STREAMING_CACHE_EMULATE_DEVICE="1", STREAMING_CACHE_CUDA_GRAPHS="0"),
         "plain": dict(STREAMING_CACHE_EMULATE_DEVICE=None, STREAMING_CACHE_CUDA_GRAPHS=None)}


def cache_path(name: str) -> str:
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), "streaming_caches", name)


def build(recipe, name: str, spatial: tuple[int, ...], seed: int, mask: bool = False) -> None:
    """A cache ``name`` of ``SAMPLES`` samples of the recipe's conditioning and columns, latents of the recipe's
    channels at ``spatial`` size, and its empty caption (``empty_caption``, as Encode Dataset adds it); ``mask``:
    a mask column (for a masked loss)."""
    import torch

    import streaming_cache as sc

    g = torch.Generator().manual_seed(seed)
    shape = (*recipe_latent(recipe)[:-len(spatial)], *spatial)
    columns: dict[str, list] = {
        "latent": [{"samples": torch.randn(shape, generator=g)} for _ in range(SAMPLES)],
        "cond": [recipe.cond(g, i) for i in range(SAMPLES)]}
    for column_name, column in recipe.columns.items():
        values = [column.value(g) for _ in range(SAMPLES)]
        if column_name == "noise_mask":
            for latent, value in zip(columns["latent"], values):
                latent["noise_mask"] = value
        else:
            columns[column_name] = values
    if mask:
        columns["mask"] = [{"mask": (torch.rand(1, spatial[0] * 8, spatial[1] * 8, generator=g) > 0.3).float()}
                           for _ in range(SAMPLES)]
    items = [sc.Item(f"s{i}", {c: sc.Part(data=f"{name}/{c}/{i}".encode()) for c in columns}) for i in range(SAMPLES)]
    encoders = {c: sc.Encoder(f"{name}-{c}", lambda parts, v=values: [v[int(p.data.rsplit(b"/", 1)[1])]
                                                                     for p in parts])
                for c, values in columns.items()}
    sc.build(cache_path(name), items, encoders)
    empty = recipe.cond(g, 99)
    sc.build(cache_path(name), [sc.Item("empty", {"cond": sc.Part(data=b"")})],
             {"cond": sc.Encoder(f"{name}-empty", lambda parts: [empty for _ in parts])}, manifest="empty_caption")


def recipe_latent(recipe) -> tuple[int, ...]:
    import comfy.supported_models

    if recipe.latent is not None:
        return recipe.latent
    config = getattr(comfy.supported_models, recipe.config)
    fmt = config.latent_format
    return (1, fmt.latent_channels, *{1: (16,), 2: (4, 4), 3: (2, 4, 4)}[fmt.latent_dimensions])


def model_file(recipe) -> str:
    """The recipe's tiny model in models/diffusion_models (its detection proven), by file name."""
    tiny, _ = detect(recipe)
    assert tiny is not None and tiny.config == recipe.config, (recipe.key, tiny and tiny.problem)
    return prepare(recipe, tiny)["model_file"]


def train(server, model: str, caches: list[str], lora: str, steps: int, **settings) -> dict:
    """UNETLoader (the demo checkpoint: Load Checkpoint) -> Load Streaming Cache of each cache -> a Dataset Mix of
    them -> Train LoRA, through the executor."""
    import nodes

    loader = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}} if model == CKPT else \
        {"class_type": "UNETLoader", "inputs": {"unet_name": model, "weight_dtype": "default"}}
    prompt: dict = {"1": loader}
    mix = None
    for i, cache in enumerate(caches):
        prompt[f"load{i}"] = {"class_type": "StreamingCacheLoad",
                              "inputs": {"cache_name": cache, "dataset_name": "default", "repeats": True}}
        prompt[f"mix{i}"] = {"class_type": "StreamingCacheDatasetMix",
                             "inputs": {"dataset": [f"load{i}", 0], "name": f"d{i}", "weight": 1.0, "repeats": 1,
                                        "batch_size": 0, "caption_dropout": -1.0,
                                        **({"mix": mix} if mix else {})}}
        mix = [f"mix{i}", 0]
    train_nodes, nid = headless.train_nodes(nodes.NODE_CLASS_MAPPINGS, ["1", 0], mix,
                                            dict(settings, lora_name=lora, steps=steps), prefix="3")
    prompt.update(train_nodes)
    ok, result, error = headless.run(prompt, server)
    return {"ok": ok, "error": (error or "")[-3000:], "text": ui_text(result, nid) if ok else ""}


def graphs_family(server, family: str) -> dict:
    key, dtype, sizes = FAMILIES[family]
    recipe = BY_KEY[key]
    t0 = time.perf_counter()
    model = CKPT if family == "sd15" else model_file(recipe)
    caches = [f"graphs_{family}_{i}" for i in range(len(sizes))]
    for i, (cache, spatial) in enumerate(zip(caches, sizes)):
        build(recipe, cache, spatial, seed=10 + i)
    settings = dict(TRAIN, training_dtype=dtype, learning_rate=recipe.learning_rate,
                    gradient_checkpointing=recipe.checkpointing)
    out: dict = {}
    for mode in ("graphs", "eager", "plain") if family == "sd15" else ("graphs", "eager"):
        name = f"graphs_{family}_{mode}"
        with environment(**MODES[mode]):
            first = train(server, model, caches, name, 3, **settings)
            resumed = train(server, model, caches, name, 5, **settings) if first["ok"] else first
        out[mode] = {"first": first, "resumed": resumed}
    modes = list(out)
    out["scaler"] = scaler_state(f"graphs_{family}_graphs")
    if all(out[m]["resumed"]["ok"] for m in modes):
        lora = {m: saved_lora(f"graphs_{family}_{m}")["tensors"] for m in modes}
        out["graphs_vs_eager"] = lora_difference(lora["graphs"], lora["eager"])
        if "plain" in out:
            out["eager_vs_plain"] = lora_difference(lora["eager"], lora["plain"])
    out["seconds"] = time.perf_counter() - t0
    return out


def scaler_state(lora: str) -> dict | None:
    """The gradient scaler's state a run saved (fp16 training), or None."""
    import folder_paths
    import torch

    path = os.path.join(folder_paths.get_output_directory(), "lora_training", f"{lora}.state.pt")
    if not os.path.exists(path):
        return None
    scaler = torch.load(path, weights_only=True).get("scaler")
    return None if scaler is None else {k: float(v) for k, v in scaler.items() if isinstance(v, (int, float))}


class ModelCallCheck:
    """Stands for ComfyUI's model wrapper in a training pass: records the devices of what the model would be
    called with, and returns zeros where the input is."""

    def __init__(self, inner) -> None:
        self.inner_model = inner
        self.conds = None
        self.calls: list[dict] = []

    def __call__(self, x, sigma, **extra):
        import torch

        self.calls.append({"x": str(x.device), "sigma": str(sigma.device)})
        return torch.zeros_like(x)


def devices_in(value, found: dict, where: str = "") -> None:
    """Every tensor's device in ``value`` (dicts, lists, tuples) by where it is, into ``found``."""
    import torch

    if isinstance(value, torch.Tensor):
        found[where] = str(value.device)
    elif isinstance(value, dict):
        for k, v in value.items():
            devices_in(v, found, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            devices_in(v, found, f"{where}[{i}]")


def placement(key: str) -> dict:
    """One batch's loss of the recipe ``key`` with the batch on the ``meta`` device (see the module docstring)."""
    import torch

    import nodes

    training = headless.pack_module("backend.training")
    handles = headless.pack_module("dataset", "streaming_cache")
    compat = headless.pack_module("backend.compat")
    spec_module = headless.pack_module("train.spec", "streaming_cache")
    conditioning = headless.pack_module("train.conditioning", "streaming_cache")
    draws_module = headless.pack_module("train.draws", "streaming_cache")
    recipe = BY_KEY[key]
    cache = f"placement_{key.replace(' ', '_')}"
    build(recipe, cache, recipe_latent(recipe)[2:], seed=5, mask=key == "SD15")
    with torch.inference_mode():
        model = nodes.UNETLoader().load_unet(model_file(recipe), "default")[0]
    dataset = handles.DatasetHandle.from_cache(cache_path(cache), "default")
    empty = handles.DatasetHandle.from_cache(cache_path(cache), "empty_caption")[0].materialize()["cond"]
    spec = spec_module.TrainSpec.build(dict(caption_dropout=1.0 if key == "SD15" else 0.0, training_dtype="fp32",
                                            masked_loss=key == "SD15", rank=4, batch_size=2))
    meta = torch.device("meta")
    backend = training.ComfyBackend(model, spec, dataset, empty_caption=empty)
    check = ModelCallCheck(backend.patcher.model)
    handed: dict = {}

    def process_conds(inner, noise, positive, device, latent, generated, seed, shapes):
        devices_in({"noise": noise, "conditioning": positive, "latent": latent, "generated": generated}, handed)
        handed["device"] = str(device)
        return {}

    original = compat.process_conds
    compat.process_conds = process_conds
    res: dict = {}
    try:
        batch = conditioning.to_device(dataset.collate([0, 1]), meta)
        backend._bind(check, {}, meta)
        with torch.inference_mode(False), torch.enable_grad():
            loss = backend.loss(batch, draws_module.Draws(spec.seed, 0, 0, None))
        res = {"ok": True, "loss": str(loss.device), "calls": check.calls, "handed": handed}
    except Exception as e:  # noqa: BLE001  (reported: a tensor on the host fails the step on meta)
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        compat.process_conds = original
    return res


INPLACE = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
           "[torch.FloatTensor [2, 4]] is at version 3; expected version 2 instead")


def retry(server, fail_at: int) -> dict:
    """Train LoRA (SD1.5, 3 steps, no gradient checkpointing) whose ``fail_at``-th loss raises autograd's in-place error: before the first
    optimizer step the pass runs again (its blocks keeping copies of their inputs), after it the error is the
    node's; how many passes ran and what the node said."""
    training = headless.pack_module("backend.training")
    original_loss, original_run = training.ComfyBackend.loss, training.ComfyBackend._run
    calls, passes = [0], []

    def loss(self, batch, draws, *, t=None):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError(INPLACE)
        return original_loss(self, batch, draws, t=t)

    def run(self, work, plan):
        passes.append(plan.keep_inputs)
        return original_run(self, work, plan)

    build(BY_KEY["SD15"], "retry", (8, 8), seed=3)
    training.ComfyBackend.loss, training.ComfyBackend._run = loss, run
    try:
        res = train(server, CKPT, ["retry"], f"retry_{fail_at}", 3, rank=4, learning_rate=1e-3,
                    training_dtype="fp32", lora_dtype="fp32", batch_size=2, gradient_checkpointing=False)
    finally:
        training.ComfyBackend.loss, training.ComfyBackend._run = original_loss, original_run
    return dict(res, passes=passes, calls=calls[0])


def graph_decisions() -> dict:
    """Where Train LoRA records its steps (``ComfyBackend._graph_device``) for a device, a build of PyTorch (ROCm
    or not), the emulation switch and the memory options: the recorder's name, or None with the summary's reason.
    Nothing here touches a GPU: choosing makes no CUDA call."""
    import torch

    training = headless.pack_module("backend.training")
    spec_module = headless.pack_module("train.spec", "streaming_cache")
    backend = training.ComfyBackend.__new__(training.ComfyBackend)
    backend.spec, backend.bypass = spec_module.TrainSpec.build({}), None
    cases = {"cuda": ("cuda", None, "0", False), "rocm": ("cuda", "6.4", "0", False),
             "cuda_offloading": ("cuda", None, "0", True), "cpu": ("cpu", None, "0", False),
             "cpu_emulated": ("cpu", None, "1", False)}
    out = {}
    hip = torch.version.hip
    try:
        for name, (device, version, emulate, offloading) in cases.items():
            torch.version.hip = version
            backend.graph_report = None
            with environment(STREAMING_CACHE_EMULATE_DEVICE=emulate, STREAMING_CACHE_CUDA_GRAPHS=None):
                recorder = backend._graph_device(torch.device(device), offloading, "off")
            out[name] = {"recorder": None if recorder is None else recorder.name, "report": backend.graph_report}
    finally:
        torch.version.hip = hip
    return out


def scenario(server, parts: tuple[str, ...] = ("graphs", "retry", "placement")) -> dict:
    import comfy.model_management
    import torch

    out: dict = {"graphs": {}, "placement": {}}
    for family in FAMILIES if "graphs" in parts else ():
        out["graphs"][family] = graphs_family(server, family)
        comfy.model_management.unload_all_models()
        gc.collect()
    if "retry" in parts:
        out["retry"] = {"first_step": retry(server, 1), "third_step": retry(server, 3)}
    equal_kernels = torch.library.Library("aten", "IMPL")  # kept: the kernels stay registered while it lives
    equal_kernels.impl("equal", lambda a, b: False, "Meta")
    for key in PLACEMENT if "placement" in parts else ():
        out["placement"][key] = placement(key)
    if "placement" in parts:
        out["graph_decisions"] = graph_decisions()
    return out


if __name__ == "__main__":
    import sys

    chosen = tuple(sys.argv.pop(3).split(",")) if len(sys.argv) > 3 else ("graphs", "retry", "placement")
    run_scenario_main(lambda server: scenario(server, chosen))
