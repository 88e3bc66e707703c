"""Tiny random-weight diffusion models built from ComfyUI's own classes, proven loadable by its own detection.

A family's tiny model starts from its ``supported_models`` class: the class's ``unet_config`` (what detection
must match) plus a recipe's ``shrink`` (block counts, widths, constructor settings) is instantiated with the
class's own ``get_model`` on the meta device, which costs no memory at any size. Detection then reads that state
dict as a file of those weights would be read (``model_detection.detect_unet_config`` and the first
``supported_models`` entry matching it, with the recipe's safetensors metadata), and the model ComfyUI would
build from what it detected is instantiated in turn. When both have the same keys and shapes the file loads
without a missing or unexpected key; when they differ (detection hard-codes a width or a depth the recipe
shrank) the detected model is taken and detected again, until nothing changes. The result names the class
detection chose, the parameter count and every setting detection fixed against the recipe: a family too large
to run says exactly why.

Runs inside a process that imported ComfyUI (the sweep scenario); nothing here is committed model data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

Shapes = dict[str, tuple[int, ...]]


@dataclasses.dataclass
class Tiny:
    """What detection makes of a recipe: ``config`` is the ``supported_models`` class it picks (None: not
    recognised, ``problem`` says why), ``unet_config`` what it detected, ``shapes`` the state dict ComfyUI builds
    from it (the file to write, with ``extra`` keys outside the diffusion model that ``get_model`` reads),
    ``fixed`` the settings detection set to other values than the recipe asked for."""

    config: str | None
    unet_config: dict
    shapes: Shapes
    extra: Shapes
    dtypes: dict[str, torch.dtype]
    fixed: dict[str, tuple[Any, Any]]
    problem: str = ""

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())


def _meta_state(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def instantiate(config_cls: type, unet_config: dict, extra: Shapes, device: str = "meta") -> Any:
    """``config_cls(unet_config).get_model`` as ComfyUI's loader calls it (``extra`` stands in for the weights
    outside the diffusion model that ``get_model`` reads), on ``device``; meta where the model allows it."""
    cfg = config_cls(unet_config)
    state = _meta_state(extra) if device == "meta" else {k: torch.zeros(s) for k, s in extra.items()}
    with torch.device(device), torch.no_grad():  # as in ComfyUI, where loading runs in inference mode
        return cfg.get_model(state, "", device=torch.device(device))


_UNKNOWN_SETTING = re.compile(r"unexpected keyword argument '(\w+)'")


def model_state(config_cls: type, unet_config: dict, extra: Shapes) -> tuple[Shapes, dict[str, torch.dtype]]:
    """Keys, shapes and dtypes of the diffusion model ``get_model`` builds; on the CPU where a model computes
    values at construction (``.item()``) that the meta device cannot give. A setting this ComfyUI's classes do
    not take (one newer versions added) is left out."""
    config = dict(unet_config)
    while True:
        try:
            try:
                model = instantiate(config_cls, config, extra)
            except (RuntimeError, NotImplementedError, TypeError) as e:
                if "meta" not in str(e):
                    raise
                model = instantiate(config_cls, dict(config, dtype=torch.bfloat16), extra, device="cpu")
            break
        except TypeError as e:
            unknown = _UNKNOWN_SETTING.search(str(e))
            if unknown is None or unknown.group(1) not in config:
                raise
            del config[unknown.group(1)]
    sd = model.diffusion_model.state_dict()
    return {k: tuple(v.shape) for k, v in sd.items()}, {k: v.dtype for k, v in sd.items()}


def detect(shapes: Shapes, extra: Shapes, metadata: dict[str, str] | None) -> tuple[type | None, dict | None]:
    """The ``supported_models`` class and config ComfyUI's detection gives a file of ``shapes`` (and ``extra``)."""
    import comfy.model_detection as md

    sd = _meta_state({**shapes, **extra})
    unet_config = md.detect_unet_config(sd, "", metadata=metadata)
    if unet_config is None:
        return None, None
    found = md.model_config_from_unet_config(unet_config, sd)
    return (type(found) if found is not None else None), unet_config


def _differences(asked: dict, detected: dict) -> dict[str, tuple[Any, Any]]:
    return {k: (asked[k], detected[k]) for k in asked if k in detected and _plain(asked[k]) != _plain(detected[k])}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def build(config_cls: type, shrink: dict, extra: Shapes | None = None, metadata: dict[str, str] | None = None,
          rounds: int = 4) -> Tiny:
    """The tiny model of ``config_cls`` with ``shrink`` over its ``unet_config``, to detection's fixed point."""
    extra = extra or {}
    asked = {**shrink, **config_cls.unet_config}
    shapes, dtypes = model_state(config_cls, asked, extra)
    config: dict = asked
    for _ in range(rounds):
        found, detected = detect(shapes, extra, metadata)
        if found is None:
            why = "not recognised by detection" if detected is None else f"no supported model matches {detected}"
            return Tiny(None, detected or {}, shapes, extra, dtypes, {}, why)
        try:
            rebuilt, rebuilt_dtypes = model_state(found, detected, extra)
        except Exception as e:  # noqa: BLE001  (ComfyUI cannot build what it detected: the recipe is wrong)
            return Tiny(found.__name__, detected, shapes, extra, dtypes, {},
                        f"detected as {found.__name__}, which ComfyUI then fails to build: {type(e).__name__}: {e}")
        config = detected
        if rebuilt == shapes:
            return Tiny(found.__name__, detected, shapes, extra, dtypes, _differences(asked, detected))
        shapes, dtypes = rebuilt, rebuilt_dtypes
    return Tiny(found.__name__, config, shapes, extra, dtypes, _differences(asked, config),
                "detection reaches no fixed point")


def random_weights(tiny: Tiny, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Weights for ``tiny``'s file: norm scales (1-D ``weight``/``scale``/``gamma``) one, biases and other 1-D
    tensors zero, everything else N(0, 0.02), so activations stay finite through every block; integer buffers
    zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in {**tiny.shapes, **tiny.extra}.items():
        kind = tiny.dtypes.get(key, torch.float32)
        if not kind.is_floating_point:
            out[key] = torch.zeros(shape, dtype=kind)
        elif len(shape) <= 1:
            scale = key.rsplit(".", 1)[-1] in ("weight", "scale", "gamma")
            out[key] = (torch.ones(shape) if scale else torch.zeros(shape)).to(dtype)
        else:
            out[key] = torch.empty(shape).normal_(0.0, 0.02, generator=g).to(dtype)
    return out


def write(tiny: Tiny, path: str, metadata: dict[str, str] | None = None,
          weights: Callable[[Tiny], dict[str, torch.Tensor]] = random_weights) -> None:
    """``tiny``'s weights as a safetensors file at ``path`` (written whole, then renamed)."""
    import os

    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(weights(tiny), path + ".tmp", metadata=metadata)
    os.replace(path + ".tmp", path)


def config_metadata(transformer: dict) -> dict[str, str]:
    """Safetensors metadata carrying a model config, as LTX-2, Wan and MiniMax checkpoints ship it (detection
    reads its ``transformer`` settings)."""
    return {"config": json.dumps({"transformer": transformer})}
