"""The metadata written into a trained LoRA's safetensors header, in kohya sd-scripts' ``ss_*`` vocabulary.

LoRA browsers, A1111/Forge, ComfyUI-Manager and civitai read kohya's keys, so the same names and value formats
are used where an equivalent exists (``train_network.py`` turns every value into a string with ``str()``: ints
``"16"``, floats ``"0.0001"``, booleans ``"True"``, unset options ``"None"``). Everything else is kept in
``streaming_cache_settings`` (JSON of every setting of the :class:`~.spec.TrainSpec`) next to
``streaming_cache_dataset`` (the dataset's fingerprint), ``streaming_cache_base_model`` (ComfyUI's name of the
model's family) and ``streaming_cache_lora_format`` (the file's key format: ``lora_formats.FORMATS``).

The values come from the training spec, where each setting is named once; settings of the dataset (its
resolution, caption shuffling) are given separately, as the cache recorded them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .lora_formats import FORMAT_METADATA_KEY
from .optim import OPTIMIZER_CLASSES

if TYPE_CHECKING:
    from .spec import TrainSpec

# ComfyUI model configs (``model.model_config.__class__.__name__``) -> kohya's ``ss_base_model_version``.
BASE_MODEL_VERSIONS = {"SD15": "sd_v1", "SD20": "sd_v2", "SDXL": "sdxl_base_v1-0", "SDXLRefiner": "sdxl_refiner",
                       "SD3": "sd3", "Flux": "flux1", "FluxSchnell": "flux1", "Lumina2": "lumina2"}
# ComfyUI adapter names -> LyCORIS ``algo`` (kohya records LyCORIS networks as module lycoris.kohya + algo).
LYCORIS_ALGOS = {"LoHa": "loha", "LoKr": "lokr", "OFT": "diag-oft", "BOFT": "boft", "GLoRA": "glora"}
LOSS_TYPES = {"MSE": "l2", "L1": "l1", "Huber": "huber", "SmoothL1": "smooth_l1"}
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
TIMESTEP_SAMPLING_NAMES = {"uniform": "uniform", "sigmoid": "sigmoid", "shifted": "shift",
                           "logit_normal": "logit_normal"}


def base_model_version(model_class: str, *, v_prediction: bool = False) -> str | None:
    """kohya's ``ss_base_model_version`` for a ComfyUI model config's class name (``SDXL``, ``Flux``, ...), or
    None when kohya has no name for it."""
    version = BASE_MODEL_VERSIONS.get(model_class)
    if version is not None and v_prediction and version.startswith("sd_v"):
        version += "_v"
    return version




def _off_if_zero(v: float) -> str:
    return "None" if not v else str(float(v))


def lora_metadata(spec: TrainSpec, *, dataset_fingerprint: str, steps_done: int | None = None,
                  num_train_images: int | None = None, validating: bool = False, model_config: str | None = None,
                  v_prediction: bool = False, dataset_settings: Mapping[str, Any] | None = None,
                  started_at: float | None = None, finished_at: float | None = None, world_size: int = 1,
                  extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The safetensors metadata of a LoRA trained as ``spec`` says on the dataset with fingerprint
    ``dataset_fingerprint``. ``steps_done`` (``ss_steps``): optimizer steps done so far; ``num_train_images``:
    samples per epoch, repeats included; ``validating``: a validation loss is computed (every
    ``validate_every`` steps); ``model_config``: ComfyUI's model config class name (``SDXL``, ``Flux``, ...),
    mapped to kohya's base model version where kohya has one; ``dataset_settings``: ``resolution``,
    ``caption_shuffles`` and ``keep_tokens`` as the cache was encoded with; ``started_at`` / ``finished_at``:
    Unix times (``finished_at`` defaults to now); ``world_size``: processes that trained together (each with
    ``batch_size`` samples); ``extra``: more keys, written last. Every value is a string."""
    o, obj, mem, adapter = spec.optimizer, spec.objective, spec.memory, spec.adapter
    data = dict(dataset_settings or {})
    meta: dict[str, str] = {}
    network_args: dict[str, str] = {}
    if adapter.algorithm in LYCORIS_ALGOS:
        meta["ss_network_module"] = "lycoris.kohya"
        network_args["algo"] = LYCORIS_ALGOS[adapter.algorithm]
    elif adapter.algorithm.lower() == "lora":
        meta["ss_network_module"] = "networks.lora"
    else:
        meta["ss_network_module"] = adapter.algorithm
    meta["ss_network_dim"] = str(spec.rank)
    meta["ss_network_alpha"] = str(adapter.alpha)
    if o.lora_plus_ratio != 1.0:
        network_args["loraplus_lr_ratio"] = str(o.lora_plus_ratio)
    if adapter.dora:  # LyCORIS' names: weight decomposition, the magnitude per input column
        network_args.update(dora_wd="True", wd_on_out="False")
    if adapter.layers.narrows:  # the layers chosen, as sd-scripts' block_dims / train_blocks go in its args
        network_args["target_layers"] = adapter.target_layers
        network_args.update({k: v for k, v in (("layer_filter", adapter.layer_filter),
                                               ("layer_ranks", adapter.layer_ranks)) if v})
    if network_args:
        meta["ss_network_args"] = json.dumps(network_args)
    meta["ss_learning_rate"] = meta["ss_unet_lr"] = str(spec.learning_rate)
    meta["ss_lr_scheduler"] = o.lr_schedule
    meta["ss_lr_warmup_steps"] = str(o.warmup_steps)
    if o.lr_schedule == "cosine_with_restarts":
        meta["ss_lr_scheduler_num_cycles"] = str(o.lr_cycles)
    if o.lr_schedule == "polynomial":
        meta["ss_lr_scheduler_power"] = str(o.lr_power)
    meta["ss_max_train_steps"] = str(spec.steps)
    if steps_done is not None:
        meta["ss_steps"] = str(int(steps_done))
    meta["ss_seed"] = str(spec.seed)
    meta["ss_optimizer"] = OPTIMIZER_CLASSES.get(o.optimizer, o.optimizer)
    arguments = {**({"weight_decay": o.weight_decay} if o.weight_decay else {}), **o.arguments}
    if arguments:  # as sd-scripts writes an optimizer's arguments
        meta["ss_optimizer"] += f"({','.join(f'{k}={v}' for k, v in arguments.items())})"
    meta["ss_noise_offset"] = _off_if_zero(obj.noise_offset)
    meta["ss_min_snr_gamma"] = _off_if_zero(obj.snr_gamma)
    meta["ss_caption_dropout_rate"] = str(spec.data.caption_dropout)
    if "caption_shuffles" in data:
        meta["ss_shuffle_caption"] = str(int(data["caption_shuffles"]) > 0)
    if "keep_tokens" in data:
        meta["ss_keep_tokens"] = str(int(data["keep_tokens"]))
    meta["ss_gradient_accumulation_steps"] = str(o.grad_accumulation_steps)
    meta["ss_max_grad_norm"] = str(o.max_grad_norm)
    meta["ss_batch_size_per_device"] = str(spec.batch_size)
    meta["ss_total_batch_size"] = str(spec.global_batch_size(world_size) * o.grad_accumulation_steps)
    if world_size > 1:
        meta["streaming_cache_processes"] = str(int(world_size))
    meta["ss_mixed_precision"] = MIXED_PRECISION.get(mem.training_dtype, mem.training_dtype)
    meta["ss_gradient_checkpointing"] = str(mem.gradient_checkpointing)
    meta["ss_loss_type"] = LOSS_TYPES.get(obj.loss_function, obj.loss_function.lower())
    if "resolution" in data:
        r = data["resolution"]
        meta["ss_resolution"] = str((int(r), int(r))) if isinstance(r, (int, float)) else str(r)
    meta["ss_timestep_sampling"] = TIMESTEP_SAMPLING_NAMES.get(obj.timestep_sampling, obj.timestep_sampling)
    meta["ss_sigmoid_scale"] = str(obj.timestep_scale)
    meta["ss_min_timestep"], meta["ss_max_timestep"] = str(obj.min_timestep), str(obj.max_timestep)
    if obj.timestep_sampling == "shifted":
        meta["ss_discrete_flow_shift"] = str(obj.timestep_shift)
    if validating:
        meta["ss_validate_every_n_steps"] = str(spec.previews.validate_every)
    if num_train_images is not None:
        meta["ss_num_train_images"] = str(int(num_train_images))
    meta["ss_output_name"] = spec.lora_name
    if model_config is not None:
        version = base_model_version(model_config, v_prediction=v_prediction)
        if version is not None:
            meta["ss_base_model_version"] = version
        meta["streaming_cache_base_model"] = model_config
    if started_at is not None:
        meta["ss_training_started_at"] = str(float(started_at))
    meta["ss_training_finished_at"] = str(float(time.time() if finished_at is None else finished_at))
    meta["streaming_cache_dataset"] = dataset_fingerprint
    meta[FORMAT_METADATA_KEY] = adapter.lora_format
    meta["streaming_cache_settings"] = json.dumps({**spec.settings(), **data}, sort_keys=True, default=str)
    for k, v in (extra or {}).items():
        meta[str(k)] = str(v)
    return meta
