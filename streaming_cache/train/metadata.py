"""The metadata written into a trained LoRA's safetensors header, in kohya sd-scripts' ``ss_*`` vocabulary.

LoRA browsers, A1111/Forge, ComfyUI-Manager and civitai read kohya's keys, so the same names and value formats
are used where an equivalent exists (``train_network.py`` turns every value into a string with ``str()``: ints
``"16"``, floats ``"0.0001"``, booleans ``"True"``, unset options ``"None"``). Everything else is kept in
``streaming_cache_settings`` (JSON of all settings) next to ``streaming_cache_dataset`` (the dataset's
fingerprint).

Recognised setting names (the Train LoRA node's inputs): ``rank``, ``alpha``, ``algorithm``, ``learning_rate``,
``lr_schedule`` (or ``schedule``), ``warmup_steps``, ``cycles``, ``steps``, ``seed``, ``optimizer``,
``weight_decay``, ``noise_offset``, ``min_snr_gamma``, ``caption_dropout``, ``caption_shuffles``, ``keep_tokens``,
``grad_accumulation_steps`` (or ``grad_accumulation``), ``max_grad_norm``, ``batch_size``, ``training_dtype``,
``gradient_checkpointing``, ``loss_function``, ``resolution``, ``timestep_sampling``, ``timestep_scale``,
``timestep_shift``, ``lora_plus_ratio``, ``validate_every``. Missing ones are left out of the ``ss_*`` keys.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from .optim import OPTIMIZER_CLASSES

# ComfyUI model classes (``model.model_config.__class__.__name__``) -> kohya's ``ss_base_model_version``.
BASE_MODEL_VERSIONS = {"SD15": "sd_v1", "SD20": "sd_v2", "SDXL": "sdxl_base_v1-0", "Flux": "flux1",
                       "FluxSchnell": "flux1"}
# ComfyUI adapter names -> LyCORIS ``algo`` (kohya records LyCORIS networks as module lycoris.kohya + algo).
LYCORIS_ALGOS = {"LoHa": "loha", "LoKr": "lokr", "OFT": "diag-oft", "BOFT": "boft", "GLoRA": "glora"}
LOSS_TYPES = {"MSE": "l2", "L1": "l1", "Huber": "huber", "SmoothL1": "smooth_l1"}
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
TIMESTEP_SAMPLING_NAMES = {"uniform": "uniform", "sigmoid": "sigmoid", "shifted": "shift",
                           "logit_normal": "logit_normal"}


def base_model_version(model_class: str, *, v_prediction: bool = False) -> str | None:
    """kohya's ``ss_base_model_version`` for a ComfyUI model class name, or None when kohya has no name for it."""
    version = BASE_MODEL_VERSIONS.get(model_class)
    if version is not None and v_prediction and version.startswith("sd_v"):
        version += "_v"
    return version


def _first(settings: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if n in settings and settings[n] is not None:
            return settings[n]
    return None


def _off_if_zero(v: Any) -> str:
    return "None" if not v else str(float(v))


def lora_metadata(settings: Mapping[str, Any], *, dataset_fingerprint: str, steps_done: int | None = None,
                  num_train_images: int | None = None, output_name: str | None = None,
                  base_model: str | None = None, started_at: float | None = None,
                  finished_at: float | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The safetensors metadata of a LoRA trained with ``settings`` (node input name -> value; see the module
    docstring) on the dataset with fingerprint ``dataset_fingerprint``. ``steps_done`` (``ss_steps``): optimizer
    steps done so far; ``num_train_images``: samples per epoch, repeats included; ``base_model``: kohya's
    base model version (see :func:`base_model_version`); ``started_at`` / ``finished_at``: Unix times
    (``finished_at`` defaults to now); ``extra``: more keys, written last. Every value is a string."""
    s = settings
    meta: dict[str, str] = {}

    def put(key: str, names: tuple[str, ...], fmt: Callable[[Any], str] = str) -> None:
        v = _first(s, *names)
        if v is not None:
            meta[key] = fmt(v)

    algorithm = str(_first(s, "algorithm") or "LoRA")
    network_args: dict[str, str] = {}
    if algorithm in LYCORIS_ALGOS:
        meta["ss_network_module"] = "lycoris.kohya"
        network_args["algo"] = LYCORIS_ALGOS[algorithm]
    elif algorithm.lower() == "lora":
        meta["ss_network_module"] = "networks.lora"
    else:
        meta["ss_network_module"] = algorithm
    put("ss_network_dim", ("rank",), lambda v: str(int(v)))
    meta["ss_network_alpha"] = str(float(_first(s, "alpha") or 1.0))  # ComfyUI's trainable adapters use alpha 1
    ratio = _first(s, "lora_plus_ratio")
    if ratio is not None and float(ratio) != 1.0:
        network_args["loraplus_lr_ratio"] = str(float(ratio))
    if network_args:
        meta["ss_network_args"] = json.dumps(network_args)
    put("ss_learning_rate", ("learning_rate",), lambda v: str(float(v)))
    put("ss_unet_lr", ("learning_rate",), lambda v: str(float(v)))
    put("ss_lr_scheduler", ("lr_schedule", "schedule"))
    put("ss_lr_warmup_steps", ("warmup_steps",), lambda v: str(int(v)))
    if _first(s, "lr_schedule", "schedule") == "cosine_with_restarts":
        put("ss_lr_scheduler_num_cycles", ("cycles",), lambda v: str(int(v)))
    put("ss_max_train_steps", ("steps",), lambda v: str(int(v)))
    if steps_done is not None:
        meta["ss_steps"] = str(int(steps_done))
    put("ss_seed", ("seed",), lambda v: str(int(v)))
    optimizer = _first(s, "optimizer")
    if optimizer is not None:
        name = OPTIMIZER_CLASSES.get(str(optimizer), str(optimizer))
        wd = _first(s, "weight_decay")
        meta["ss_optimizer"] = name + (f"(weight_decay={float(wd)})" if wd else "")
    put("ss_noise_offset", ("noise_offset",), _off_if_zero)
    put("ss_min_snr_gamma", ("min_snr_gamma",), _off_if_zero)
    put("ss_caption_dropout_rate", ("caption_dropout",), lambda v: str(float(v)))
    put("ss_shuffle_caption", ("caption_shuffles",), lambda v: str(int(v) > 0))
    put("ss_keep_tokens", ("keep_tokens",), lambda v: str(int(v)))
    put("ss_gradient_accumulation_steps", ("grad_accumulation_steps", "grad_accumulation"), lambda v: str(int(v)))
    put("ss_max_grad_norm", ("max_grad_norm",), lambda v: str(float(v)))
    put("ss_batch_size_per_device", ("batch_size",), lambda v: str(int(v)))
    batch, accumulation = _first(s, "batch_size"), _first(s, "grad_accumulation_steps", "grad_accumulation")
    if batch is not None:
        meta["ss_total_batch_size"] = str(int(batch) * int(accumulation or 1))
    put("ss_mixed_precision", ("training_dtype",), lambda v: MIXED_PRECISION.get(str(v), str(v)))
    put("ss_gradient_checkpointing", ("gradient_checkpointing",), lambda v: str(bool(v)))
    put("ss_loss_type", ("loss_function",), lambda v: LOSS_TYPES.get(str(v), str(v).lower()))
    put("ss_resolution", ("resolution",), lambda v: str((int(v), int(v))) if isinstance(v, (int, float)) else str(v))
    sampling = _first(s, "timestep_sampling")
    if sampling is not None:
        meta["ss_timestep_sampling"] = TIMESTEP_SAMPLING_NAMES.get(str(sampling), str(sampling))
        put("ss_sigmoid_scale", ("timestep_scale",), lambda v: str(float(v)))
        if sampling == "shifted":
            put("ss_discrete_flow_shift", ("timestep_shift",), lambda v: str(float(v)))
    validate_every = _first(s, "validate_every")
    if validate_every:
        meta["ss_validate_every_n_steps"] = str(int(validate_every))
    if num_train_images is not None:
        meta["ss_num_train_images"] = str(int(num_train_images))
    if output_name is not None:
        meta["ss_output_name"] = output_name
    if base_model is not None:
        meta["ss_base_model_version"] = base_model
    if started_at is not None:
        meta["ss_training_started_at"] = str(float(started_at))
    meta["ss_training_finished_at"] = str(float(time.time() if finished_at is None else finished_at))
    meta["streaming_cache_dataset"] = dataset_fingerprint
    meta["streaming_cache_settings"] = json.dumps(dict(settings), sort_keys=True, default=str)
    for k, v in (extra or {}).items():
        meta[str(k)] = str(v)
    return meta
