"""The family sweep, inside a ComfyUI process: every recipe of ``family_recipes.py`` that this ComfyUI lists, end to
end, one after the other; prints one JSON line (``RESULT {...}``) with a row per recipe.

    python family_sweep.py COMFYUI_PATH WORKDIR KEY[,KEY...]|all [MAX_PARAMS [compare|- [KEY[,KEY...]|all]]]

Per family: the tiny model from ComfyUI's own classes, proven by its detection (``tiny_models.build``); a file of
random bf16 weights in ``models/diffusion_models``; a cache of two samples holding what the family's encoders and
conditioning nodes produce (``family_recipes``); two steps of Train LoRA through the executor (UNETLoader with
bf16 weights, Load Streaming Cache); then Load Diffusion Model + LoraLoaderModelOnly with the saved file (every
key must apply) and one KSampler step with and without it. A family whose model detection fixes at more than
``MAX_PARAMS`` parameters is reported, not run. The families of the last argument (default all) also train one step
in each training precision with the LoRA in each dtype, through the current Train LoRA and the first release's id
(every combination). Each row says
what the family was detected as, what it was trained on, what reached the diffusion model, and how long each part
took.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import traceback

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

TRAINING_DTYPES = ("bf16", "fp16", "fp32")  # streaming_cache.train.spec's, which tests/comfy/test_families.py checks
LORA_DTYPES = ("bf16", "fp32")
TRAIN_IDS = ("StreamingCacheTrain", "StreamingCacheTrainLoRA")  # the current node, the first release's

DEFAULT_MAX_PARAMS = 1_200_000_000


def _describe(value: object) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return value


def _latent_shape(recipe, config) -> tuple[int, ...]:
    """The recipe's latent, or one from the class's latent format: 4x4 (images), 2 frames (video), 16 steps
    (audio)."""
    if recipe.latent is not None:
        return recipe.latent
    fmt = config.latent_format
    spatial = {1: (16,), 2: (4, 4), 3: (2, 4, 4)}[fmt.latent_dimensions]
    return (1, fmt.latent_channels, *spatial)


class _Unloaded(logging.Handler):
    """ComfyUI's reports of weights its loader did not use or did not find ('unet missing', 'left over keys')."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith(("unet missing", "unet unexpected", "left over keys")):
            self.messages.append(text[:300])

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)


def _tag(recipe) -> str:
    """The recipe's name as it goes into file and cache names."""
    return recipe.key.replace(" ", "_").replace("/", "_")


def build_cache(recipe, shape: tuple[int, ...], samples: int = 2, other: str = "") -> dict:
    """A cache ``family_<key>`` of ``samples`` samples made with the Python API: the latent (with an
    image-to-video node's ``noise_mask`` in it where the recipe has one), the conditioning and the recipe's
    columns (and a column ``other`` no family reads, if named). Returns the values cached."""
    import folder_paths
    import torch

    import streaming_cache as sc

    g = torch.Generator().manual_seed(7)
    conds = [recipe.cond(g, i) for i in range(samples)]
    latents = []
    for _ in range(samples):
        value = {"samples": torch.randn(shape, generator=g)}
        if "noise_mask" in recipe.columns:
            value["noise_mask"] = recipe.columns["noise_mask"].value(g)
        latents.append(value)
    columns: dict[str, list] = {"latent": latents, "cond": conds}
    for name, column in recipe.columns.items():
        if name != "noise_mask":
            columns[name] = [column.value(g) for _ in range(samples)]
    if other:
        columns[other] = [torch.zeros(1) for _ in range(samples)]
    tag = _tag(recipe) + (f"_{other}" if other else "")
    items = [sc.Item(f"s{i}", {c: sc.Part(data=f"{tag}/{c}/{i}".encode()) for c in columns}) for i in range(samples)]
    encoders = {c: sc.Encoder(f"{tag}-{c}", lambda parts, v=values: [v[int(p.data.rsplit(b"/", 1)[1])]
                                                                     for p in parts])
                for c, values in columns.items()}
    sc.build(os.path.join(folder_paths.get_output_directory(), "streaming_caches", f"family_{tag}"), items, encoders)
    return {"name": f"family_{tag}", "columns": columns}


def sampling_inputs(columns: dict) -> tuple[list, dict]:
    """The first sample as ComfyUI's nodes hand it to KSampler: its conditioning with what the family's
    image-to-video or edit node adds (ReferenceLatent, WanImageToVideo, ...), and its latent (with the node's noise
    mask; the sound track joined as LTXVConcatAVLatent joins it). At full denoise KSampler replaces the latent by
    noise; it is not empty because ComfyUI leaves an all-zero latent out of the latent format's processing."""
    families = headless.pack_module("backend.families")
    cond = columns["cond"][0]
    values = {name: column[0] for name, column in columns.items() if name not in ("latent", "cond", "audio")}
    cond = families.conditioning_for_sampling(cond, values)
    first = columns["latent"][0]
    latent = {"samples": first["samples"].clone()}
    if "noise_mask" in first:
        latent["noise_mask"] = first["noise_mask"]
    if "audio" in columns:  # LTXVConcatAVLatent: one latent of the video and sound streams
        from comfy.nested_tensor import NestedTensor

        latent["samples"] = NestedTensor((latent["samples"], columns["audio"][0]["samples"]))
    return cond, latent


def _too_large(tiny, max_params: int) -> str:
    """Why a model detection only recognises at more than ``max_params`` parameters is not run."""
    fixed = ", ".join(f"{k} {v[1]}" for k, v in tiny.fixed.items() if isinstance(v[1], int))
    why = f"detection fixes {fixed}" if fixed else "the smallest model detection recognises"
    return f"needs {_size(tiny.params)} parameters ({why}); more than the {_size(max_params)} this sweep runs"


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"


def layer_kinds(shapes: dict) -> dict[str, list[str]]:
    """The weight matrices of a model's state dict by what the pack's layer presets take them for
    (``streaming_cache.train.layers.layer_kind``: attention, mlp, other)."""
    layers = headless.pack_module("train.layers", "streaming_cache")
    out: dict[str, list[str]] = {kind: [] for kind in layers.KINDS}
    for key, shape in shapes.items():
        if key.endswith(".weight") and len(shape) >= 2:
            name = key.removesuffix(".weight").removeprefix("model.").removeprefix("diffusion_model.")
            out[layers.layer_kind(name)].append(name)
    return out


def detect(recipe) -> tuple[object, dict]:
    """The recipe's tiny model as detection makes it, and the row's detection fields."""
    import comfy.supported_models
    from tiny_models import build

    t0 = time.perf_counter()
    config_cls = next((c for c in comfy.supported_models.models if c.__name__ == recipe.config), None)
    extra = recipe.extra_weights() if recipe.extra_weights else None
    if recipe.skip and not recipe.shrink:
        return None, {}
    tiny = build(config_cls, recipe.shrink, extra, recipe.metadata)
    return tiny, {"detected": tiny.config, "params": tiny.params, "problem": tiny.problem,
                  "layer_kinds": layer_kinds(tiny.shapes),
                  "fixed": {k: [str(a), str(b)] for k, (a, b) in tiny.fixed.items()},
                  "detect_seconds": time.perf_counter() - t0}


def prepare(recipe, tiny) -> dict:
    """The family's model file in ``models/diffusion_models`` (``model_file``, at ``path``) and its cache (``name``,
    the values cached as ``columns``), for one latent ``shape``."""
    import comfy.supported_models
    import folder_paths
    from tiny_models import write

    config_cls = getattr(comfy.supported_models, recipe.config)
    shape = _latent_shape(recipe, config_cls(dict(tiny.unet_config)))
    model_file = f"tiny_{_tag(recipe)}.safetensors"
    path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], model_file)
    write(tiny, path, recipe.metadata)
    return dict(build_cache(recipe, shape), model_file=model_file, path=path, shape=shape)


def precision_combinations(every: bool = False) -> list[tuple[str, str, str]]:
    """(training_dtype, lora_dtype, Train LoRA node id): through the current node every training precision with the
    LoRA in every dtype; through the first release's (the same training behind its old inputs) each training
    precision once, the LoRA dtypes taking turns, or (``every``, the full sweep) every combination too."""
    current, first = TRAIN_IDS
    combinations = [(t, lora, current) for t in TRAINING_DTYPES for lora in LORA_DTYPES]
    if every:
        return combinations + [(t, lora, first) for t in TRAINING_DTYPES for lora in LORA_DTYPES]
    return combinations + [(t, LORA_DTYPES[(i + 1) % len(LORA_DTYPES)], first) for i, t in enumerate(TRAINING_DTYPES)]


PARTIAL = ("bf16", "fp32", TRAIN_IDS[0])
"""The combination that trains only the attention and MLP layers (``target_layers`` attention_mlp): the family's
embedders and first block's inputs then need no gradient, which a block that updates its input in place must still
recompute correctly."""


def train_precisions(server: headless._Server, recipe, cache: dict, combinations: list) -> dict:
    """One Train LoRA step per combination on the family's model and cache (:data:`PARTIAL` with only the attention
    and MLP layers): whether it ran, its loss, and (fp16) whether the scaler skipped the step."""
    import math

    from comfy_scenario import train_from_cache

    out = {}
    for training_dtype, lora_dtype, node in combinations:
        name = f"{cache['name']}_{training_dtype}_{lora_dtype}_{node}"
        t0 = time.perf_counter()
        partial = {"target_layers": "attention_mlp"} if (training_dtype, lora_dtype, node) == PARTIAL else {}
        res = train_from_cache(server, cache["model_file"], cache["name"], name, node=node, steps=1,
                               batch_size=recipe.batch, rank=4, learning_rate=recipe.learning_rate,
                               training_dtype=training_dtype, lora_dtype=lora_dtype,
                               gradient_checkpointing=recipe.checkpointing, **partial)
        losses = res.get("losses") or []
        out[f"{training_dtype}/{lora_dtype}/{node}"] = {
            "ok": res["ok"], "error": (res["error"] or "")[-1500:], "loss": losses[-1] if losses else None,
            "finite": bool(losses) and all(math.isfinite(x) for x in losses),
            "overflow_steps": res.get("overflow_steps"), "seconds": round(time.perf_counter() - t0, 2)}
    return out


def train_recipe(server: headless._Server, recipe, tiny, compare: bool, precisions: list | None = None) -> dict:
    """Model file, cache, two Train LoRA steps through the executor, the LoRA through ComfyUI's loader and a
    sampler step; one step in each of ``precisions`` (``precision_combinations``); with ``compare``, one step of
    ComfyUI's TrainLoraNode on the same model and data."""
    import comfy.model_management
    from comfy_scenario import ModelInputs, PackWarnings, lora_changes_output, train_from_cache

    t0 = time.perf_counter()
    cache = prepare(recipe, tiny)
    model_file, path, shape = cache["model_file"], cache["path"], cache["shape"]
    row: dict = {"latent": list(shape), "cond": _describe(cache["columns"]["cond"][0]),
                 "columns": {k: _describe(v[0]) for k, v in cache["columns"].items() if k not in ("latent", "cond")},
                 "build_seconds": time.perf_counter() - t0}
    t1 = time.perf_counter()
    with ModelInputs() as spy, PackWarnings() as warnings, _Unloaded() as unloaded:
        row.update(train_from_cache(server, model_file, cache["name"], f"{cache['name']}_lora", steps=2,
                                    batch_size=recipe.batch, rank=4, learning_rate=recipe.learning_rate,
                                    training_dtype=recipe.training_dtype, lora_dtype="fp32",
                                    gradient_checkpointing=recipe.checkpointing))
    row["train_seconds"] = time.perf_counter() - t1
    row["warnings"] = warnings.messages
    extra = set(tiny.extra)
    row["unloaded"] = [m for m in unloaded.messages if not (extra and all(k in m for k in extra))]
    row["model_inputs"] = spy.calls[:1] + [c for c in spy.calls[1:] if c["keys"] != spy.calls[0]["keys"]]
    row["guidance_seen"] = sorted({g for c in spy.calls for g in (c["guidance"] or [])})
    row["model_calls"] = len(spy.calls)
    if row["ok"]:
        t2 = time.perf_counter()
        cond, latent = sampling_inputs(cache["columns"])
        row.update(lora_changes_output(model_file, f"{cache['name']}_lora", cond, latent))
        row["check_seconds"] = time.perf_counter() - t2
        row["trained"] = True
    if precisions and row["ok"]:
        row["precisions"] = train_precisions(server, recipe, cache, precisions)
    if recipe.refuses_other_columns:
        other = build_cache(recipe, shape, other="pose_keypoints")
        refused = train_from_cache(server, model_file, other["name"], f"{other['name']}_lora", steps=1)
        row["other_column"] = {"ok": refused["ok"], "error": refused["error"]}
    if compare:
        import comfy_trainer
        import torch

        import nodes

        try:
            with torch.inference_mode():  # as the executor runs Load Diffusion Model
                model = nodes.UNETLoader().load_unet(model_file, "default")[0]
        except Exception as e:  # noqa: BLE001  (ComfyUI's trainer cannot start; this pack's result stands)
            row["comfy_trainer"] = {"ok": False, "error": f"Load Diffusion Model: {type(e).__name__}: {e}"[:500],
                                    "seconds": 0.0, "version": _version()}
        else:
            conds = [sampling_inputs({k: v[i:] for k, v in cache["columns"].items()})[0]
                     for i in range(len(cache["columns"]["cond"]))]
            row["comfy_trainer"] = dict(comfy_trainer.run(model, cache["columns"]["latent"], conds),
                                        version=_version())
            del model
    os.remove(path)
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()
    gc.collect()
    return row


def run_recipe(server: headless._Server, recipe, train: bool, max_params: int, compare: bool,
               precisions: list | None = None) -> dict:
    """One recipe's row: detection always; training when ``train`` and the model is at most ``max_params``, in
    ``precisions`` too."""
    t0 = time.perf_counter()
    row: dict = {"config": recipe.config, "kind": recipe.kind, "encoders": recipe.text(), "notes": recipe.notes,
                 "trained": False, "ok": False}
    if not train and not recipe.skip:
        row["reason"] = "not run by the default test run (STREAMING_CACHE_SWEEP=all runs it)"
        return row
    tiny, detected = detect(recipe)
    row.update(detected)
    if recipe.skip:
        row["reason"] = recipe.skip
    elif tiny is None or tiny.config != recipe.config:
        row["reason"] = (tiny.problem if tiny is not None and tiny.problem
                         else f"a file of these weights loads as {tiny.config if tiny else None}")
    elif tiny.params > max_params or recipe.cond is None:
        row["reason"] = _too_large(tiny, max_params)
    else:
        row.update(train_recipe(server, recipe, tiny, compare, precisions))
    row["seconds"] = time.perf_counter() - t0
    return row


def sweep(server: headless._Server, workdir: str, keys: list[str] | None, max_params: int, compare: bool,
          precision_keys: list[str] | None = None) -> dict:
    """A row for every recipe whose class this ComfyUI lists; families in ``keys`` (None: all) are trained, those in
    ``precision_keys`` (None: all, and every combination) also in each training and LoRA dtype through each Train
    LoRA id (``precision_combinations``). The
    rows so far are kept in ``WORKDIR/sweep-partial.json`` after each family, so that a long sweep stopped midway
    still leaves a report of what it reached."""
    import comfy.supported_models
    from family_recipes import RECIPES

    listed = [c.__name__ for c in comfy.supported_models.models]
    combinations = precision_combinations(every=precision_keys is None)
    out: dict = {"comfyui": _version(), "supported_models": listed, "max_params": max_params, "families": {}}
    t0 = time.perf_counter()
    for recipe in RECIPES:
        if recipe.config not in listed:
            continue
        try:
            precisions = combinations if precision_keys is None or recipe.key in precision_keys else None
            row = run_recipe(server, recipe, keys is None or recipe.key in keys, max_params, compare, precisions)
        except Exception as e:  # noqa: BLE001  (reported per family; the next one still runs)
            row = {"config": recipe.config, "kind": recipe.kind, "encoders": recipe.text(), "ok": False,
                   "trained": False, "error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-4000:], "seconds": 0.0}
        out["families"][recipe.key] = row
        _write_partial(workdir, out)
        state = "trained" if row.get("trained") else row.get("reason") or row.get("error") or "fails"
        print(f"family {recipe.key}: {state} ({row.get('seconds', 0.0):.1f} s)", file=sys.stderr, flush=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def _write_partial(workdir: str, out: dict) -> None:
    path = os.path.join(workdir, "sweep-partial.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)


def _version() -> str:
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except ImportError:
        return "unknown"


def main() -> None:
    comfyui, workdir, names, *rest = sys.argv[1:]  # boot() replaces sys.argv with ComfyUI's
    max_params = int(rest[0]) if rest else DEFAULT_MAX_PARAMS
    compare = len(rest) > 1 and rest[1] == "compare"
    precisions = rest[2] if len(rest) > 2 else "all"  # KEY,KEY, all, or - (none)
    # bf16 weights in memory (ComfyUI picks fp32 on the CPU): half the RAM
    server = headless.boot(comfyui, ["--base-directory", workdir, "--bf16-unet"], quiet=True)
    result = sweep(server, workdir, None if names == "all" else names.split(","), max_params, compare,
                   None if precisions == "all" else precisions.split(","))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
