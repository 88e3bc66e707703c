"""LoRA files in the key formats other tools read (ComfyUI's own, kohya's, diffusers'), converted without ComfyUI.

Every tool names the weights a LoRA patches its own way. The formats written here:

- ``comfyui``: ComfyUI's own keys, what its trainer writes: ``diffusion_model.<module>.lora_up.weight`` /
  ``.lora_down.weight`` / ``.alpha`` (the scale is alpha / rank), plus ``.diff`` / ``.diff_b``, the offsets ComfyUI's
  trainer also learns for norms and biases. Conv layers keep ComfyUI's flattened 2-D matrices, so the file can
  continue training (Train LoRA's ``existing_lora``).
- ``kohya``: ``lora_unet_<module>`` (``lora_te_`` / ``lora_te1_`` / ``lora_te2_`` for text encoders) with
  ``lora_up`` / ``lora_down`` / ``alpha``, conv layers 4-D, under the module names kohya's scripts use: diffusers'
  UNet names for SD 1.x / 2.x, the original names for SDXL and the transformer families. Read by A1111, Forge,
  SD.Next, Civitai, kohya's scripts and diffusers' kohya reader. LyCORIS adapters (LoHa, LoKr, ...) keep their
  LyCORIS keys under the same names.
- ``diffusers``: diffusers' module names under ``unet.`` / ``transformer.`` / ``text_encoder.``, for the families
  diffusers has (:data:`DIFFUSERS_PREFIXES`). Transformers and text encoders get PEFT's ``lora_A`` / ``lora_B``;
  SD UNets get diffusers' attention-processor layout (``...attn1.processor.to_q_lora.down.weight``,
  ``<module>.lora.down.weight``), the one layout of diffusers' UNet names that ComfyUI also reads, and which
  diffusers converts when it loads. PEFT has no per-module alpha, so the scale alpha / rank is multiplied into the
  up matrices. A fused projection (the qkv of Flux and SD3) becomes one LoRA per projection: its up matrix's rows
  with the same down matrix, which is exact; reading such a file fuses them back (exactly: one down matrix when
  they share it, else block-diagonal).

Only ComfyUI reads the norm and bias offsets (diffusers refuses files that have them under kohya's names), so the
kohya and diffusers formats leave them out; :class:`Converted` names what was left out.

Which name a format gives which weight comes from ComfyUI's own map of the LoRA keys it loads for a model
(``comfy.lora.model_lora_keys_unet`` and ``..._clip``), handed here as a :class:`NameTable` by the nodes'
``backend/compat.py``: no per-family tables of our own, every family ComfyUI knows, and every file written is one
ComfyUI loads. Reading accepts every key layout ComfyUI's LoRA loader accepts for those names.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..errors import LoraFormatError

FORMATS = ("comfyui", "kohya", "diffusers")
DEFAULT_FORMAT = "comfyui"
FORMAT_METADATA_KEY = "streaming_cache_lora_format"
"""The safetensors metadata key that records a file's format."""

KOHYA_DIFFUSERS_NAMED = frozenset({"SD15", "SD20"})
"""Families (ComfyUI model config class names) whose kohya names are diffusers' UNet names: kohya trains SD 1.x
and 2.x on diffusers' UNet, SDXL and the transformer families on the original modules."""

DIFFUSERS_PREFIXES: dict[str, str] = {
    **dict.fromkeys(("SD15", "SD20", "SDXL", "SDXLRefiner", "SSD1B", "Segmind_Vega", "KOALA_700M", "KOALA_1B"), "unet"),
    **dict.fromkeys(("SD3", "Flux", "FluxSchnell", "FluxInpaint"), "transformer")}
"""Families diffusers has a LoRA layout for whose names ComfyUI knows, and the prefix of their diffusion model's
keys (SD 1.x, 2.x and SDXL with its distilled variants: ``unet``; SD3 and Flux: ``transformer``)."""
DIFFUSERS_TEXT_PREFIXES = ("text_encoder.", "text_encoder_2.")
DIFFUSERS_ALIASES = (".attn.to_qkv_mlp_proj", ".attn.to_out", ".ff.linear_in", ".ff.linear_out",
                     ".ff_context.linear_in", ".ff_context.linear_out", "unet.class_embedding.")
"""Names ComfyUI's map also accepts for weights that have another name in diffusers' models of these families (a
name ending so, or containing the last): Flux 2's fused single-block projections (Flux.1 has ``to_q`` ... ``proj_mlp``
and ``proj_out``), LyCORIS LoKr's feed-forward names (diffusers: ``ff.net.0.proj``, ``ff.net.2``), the class
embedding of unCLIP models (SDXL's is ``add_embedding``)."""

UP, DOWN, MID, ALPHA = "lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha"
OFFSETS = ("diff", "diff_b")
_READ_AS = {"lora_B.weight": UP, "lora_A.weight": DOWN, "lora.up.weight": UP, "lora.down.weight": DOWN,
            "lora_linear_layer.up.weight": UP, "lora_linear_layer.down.weight": DOWN, "lora_B.default.weight": UP,
            "lora_A.default.weight": DOWN, "lora_B": UP, "lora_A": DOWN, "w_norm": "diff", "b_norm": "diff_b"}
"""Key endings ComfyUI's loader reads after a module's name -> ComfyUI's own ending."""
_GLUED = {"_lora.up.weight": UP, "_lora.down.weight": DOWN}
"""Endings written without a dot after the name (diffusers' attention-processor layout)."""
LYCORIS_KEYS = frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lokr_w1",
                          "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "oft_blocks",
                          "rescale", "a1.weight", "a2.weight", "b1.weight", "b2.weight"})
_OWN = frozenset({UP, DOWN, MID, ALPHA, "dora_scale", *OFFSETS}) | LYCORIS_KEYS


@dataclass(frozen=True)
class Target:
    """What a LoRA module name patches: the model's weight ``weight`` (its state-dict key), or its rows ``rows``
    (offset, count) for a projection of a fused weight; ``swapped``: the name's rows are the weight's two halves
    in the other order (diffusers' ``norm_out.linear`` of Flux and SD3)."""

    weight: str
    rows: tuple[int, int] | None = None
    swapped: bool = False


@dataclass
class Converted:
    """A LoRA in a format: its ``tensors`` and what of the input was ``left_out`` (ComfyUI keys of the norm and bias
    offsets, which only ComfyUI's format holds)."""

    tensors: dict[str, torch.Tensor]
    left_out: list[str] = field(default_factory=list)


class NameTable:
    """The names of one model's weights in every format: ``targets`` (every LoRA module name ComfyUI loads for the
    model -> :class:`Target`), ``shapes`` (the model's weights' shapes, by state-dict key) and ``family`` (ComfyUI's
    model config class name: ``SD15``, ``SDXL``, ``Flux``, ...)."""

    def __init__(self, targets: Mapping[str, Target], shapes: Mapping[str, Sequence[int]], family: str):
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.targets = {n: t for n, t in targets.items() if t.weight in self.shapes}
        self.family = family
        self.candidates: dict[str, list[str]] = defaultdict(list)
        for name, target in sorted(self.targets.items()):
            self.candidates[target.weight].append(name)
        self._chosen: dict[str, dict[str, tuple[str, ...]]] = {}

    def names(self, fmt: str) -> dict[str, tuple[str, ...]]:
        """Weight key -> the module names ``fmt`` writes it under (several: the projections of a fused weight);
        weights the format has no name for are absent."""
        check_format(fmt)
        if fmt not in self._chosen:
            pick = {"comfyui": self._comfyui, "kohya": self._kohya, "diffusers": self._diffusers}[fmt]
            chosen = {w: pick(w, names) for w, names in self.candidates.items()}
            self._chosen[fmt] = {w: n for w, n in chosen.items() if n}
        return self._chosen[fmt]

    def comfy_name(self, weight: str) -> str:
        """ComfyUI's own module name of ``weight`` (for messages)."""
        return (self._comfyui(weight, self.candidates.get(weight, [])) or (weight.removesuffix(".weight"),))[0]

    def _comfyui(self, weight: str, names: list[str]) -> tuple[str, ...]:
        own = weight.removesuffix(".weight")
        return tuple(n for n in (own, f"text_encoders.{own}") if n in names and self.targets[n] == Target(weight))[:1]

    def _kohya(self, weight: str, names: list[str]) -> tuple[str, ...]:
        whole = [n for n in names if self.targets[n] == Target(weight)]
        if weight.startswith("diffusion_model."):
            native = "lora_unet_" + weight[len("diffusion_model."):].removesuffix(".weight").replace(".", "_")
            found = [n for n in whole if n.startswith("lora_unet_")]
            others = [n for n in found if n != native]
            if others and self.family in KOHYA_DIFFUSERS_NAMED:
                return tuple(others[:1])
            return (native,) if native in found else tuple(found[:1])
        te = [n for n in whole if n.startswith("lora_te")]
        two = any(n.startswith("lora_te2_") for n in self.targets)
        te.sort(key=lambda n: (not n.startswith(("lora_te1_", "lora_te2_")) if two else not n.startswith("lora_te_"),
                               n))
        return tuple(te[:1])

    def _diffusers(self, weight: str, names: list[str]) -> tuple[str, ...]:
        prefix = DIFFUSERS_PREFIXES.get(self.family)
        if prefix is None:
            return ()
        starts = (f"{prefix}.",) if weight.startswith("diffusion_model.") else DIFFUSERS_TEXT_PREFIXES
        found = [n for n in names if n.startswith(starts) and not _alias(n)]
        whole = sorted((n for n in found if self.targets[n].rows is None), key=lambda n: (self.targets[n].swapped, n))
        if whole:
            return tuple(whole[:1])
        cover, end = [], 0
        for name in sorted(found, key=lambda n: (self.targets[n].rows, n)):
            offset, count = self.targets[name].rows  # type: ignore[misc]
            if offset == end:
                cover.append(name)
                end += count
            elif offset > end:
                return ()
        return tuple(cover) if end == self.shapes[weight][0] else ()


def _alias(name: str) -> bool:
    return name.endswith(DIFFUSERS_ALIASES[:-1]) or DIFFUSERS_ALIASES[-1] in name


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise LoraFormatError(f"unknown LoRA format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _split(key: str, targets: Mapping[str, Target]) -> tuple[str, str] | None:
    """(module name, ComfyUI's ending) of a key of a LoRA file, as ComfyUI's loader reads it; None: unknown."""
    for glued, own in _GLUED.items():
        if key.endswith(glued) and key[:-len(glued)] in targets:
            return key[:-len(glued)], own
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name, ending = ".".join(parts[:i]), ".".join(parts[i:])
        if name in targets:
            if ending in _READ_AS or ending in _OWN:
                return name, _READ_AS.get(ending, ending)
    return None


def _scale(parts: Mapping[str, torch.Tensor]) -> float:
    """The factor ComfyUI applies to up @ down: alpha / rank, or 1 without an alpha."""
    alpha = parts.get(ALPHA)
    return 1.0 if alpha is None else float(alpha.item()) / parts[DOWN].shape[0]


def _swap(t: torch.Tensor) -> torch.Tensor:
    """Rows in the other order of halves (ComfyUI's ``swap_scale_shift``: its own inverse)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _mixed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def read_lora(tensors: Mapping[str, torch.Tensor], table: NameTable) -> dict[str, dict[str, torch.Tensor]]:
    """A LoRA file's tensors, in any layout ComfyUI's loader reads for this model, as one module per weight
    (weight key -> ComfyUI's ending -> tensor). Projections of a fused weight are fused; LoRA matrices are
    checked against the weight's shape. :class:`LoraFormatError` names keys no reader knows for this model and
    modules that do not fit it."""
    groups: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    unknown = []
    for key, value in tensors.items():
        found = _split(key, table.targets)
        if found is None:
            unknown.append(key)
            continue
        name, own = found
        if own in groups[name]:
            raise LoraFormatError(f"the LoRA has two tensors for {name}.{own} (one is {key}); keep one of them")
        groups[name][own] = value
    if unknown:
        raise LoraFormatError(f"{len(unknown)} keys of the LoRA name no module ComfyUI knows in this "
                              f"{table.family} model: {_mixed(sorted(unknown))}. Give the model the LoRA was made "
                              "for (a text encoder's keys need a checkpoint that has it)")
    by_weight: dict[str, list[tuple[Target, dict[str, torch.Tensor]]]] = defaultdict(list)
    for name, parts in groups.items():
        by_weight[table.targets[name].weight].append((table.targets[name], parts))
    return {weight: _module(weight, found, table) for weight, found in by_weight.items()}


def _module(weight: str, found: list[tuple[Target, dict[str, torch.Tensor]]],
            table: NameTable) -> dict[str, torch.Tensor]:
    """One weight's module in ComfyUI's layout from the file's modules that patch it."""
    shape, label = table.shapes[weight], table.comfy_name(weight)
    out: dict[str, torch.Tensor] = {}
    loras = []
    for target, parts in found:
        is_lora = UP in parts or DOWN in parts
        if is_lora:
            if UP not in parts or DOWN not in parts:
                raise LoraFormatError(f"the LoRA module for {label} has only one of its two matrices; the file is "
                                      "incomplete")
            loras.append((target, {k: v for k, v in parts.items() if k in (UP, DOWN, ALPHA, MID)}))
        for own, value in parts.items():
            if is_lora and own in (UP, DOWN, ALPHA, MID):
                continue
            if target != Target(weight) or own in out:
                raise LoraFormatError(f"the LoRA has several adapters for {label} ({own}); keep one")
            out[own] = value
    if loras and set(out) - {*OFFSETS, "dora_scale"}:
        raise LoraFormatError(f"the LoRA has several adapters for {label} (LoRA and "
                              f"{', '.join(sorted(set(out) - {*OFFSETS, 'dora_scale'}))}); keep one")
    for target, parts in loras:
        rows = target.rows[1] if target.rows else shape[0]
        up, down = parts[UP], parts[DOWN]
        if MID not in parts and (up.shape[0] != rows or down[0].numel() != math.prod(shape[1:])
                                 or up[0].numel() != down.shape[0]):
            raise LoraFormatError(f"the LoRA module for {label} has matrices {tuple(up.shape)} and "
                                  f"{tuple(down.shape)}, which do not fit the model's weight {tuple(shape)}: the "
                                  "LoRA was made for another model")
    if len(loras) == 1 and loras[0][0] == Target(weight):
        out.update({k: v for k, v in loras[0][1].items() if k in (UP, DOWN, ALPHA, MID)})
    elif loras:
        if any(MID in parts for _, parts in loras):
            raise LoraFormatError(f"{label}: a LoRA with a mid matrix (Tucker) cannot be fused with others")
        out.update(_fuse(loras, shape[0]))
    return out


def _fuse(loras: list[tuple[Target, dict[str, torch.Tensor]]], rows: int) -> dict[str, torch.Tensor]:
    """One LoRA whose product is the sum of ``loras`` (each on its rows, scaled): with the one down matrix they
    share, or block-diagonal (rank the sum of theirs); the scale is multiplied into the up matrix (alpha = rank)."""
    dtype = loras[0][1][UP].dtype
    ups, downs = [], []
    for target, parts in loras:
        up = parts[UP].flatten(1).float() * _scale(parts)
        up = _swap(up) if target.swapped else up
        offset, count = target.rows or (0, rows)
        full = torch.zeros(rows, up.shape[1])
        full[offset:offset + count] = up
        ups.append(full)
        downs.append(parts[DOWN].flatten(1))
    if all(torch.equal(d, downs[0]) for d in downs):
        up, down = sum(ups[1:], ups[0]), downs[0]
    else:
        up, down = torch.cat(ups, dim=1), torch.cat(downs, dim=0)
    return {UP: up.to(dtype), DOWN: down, ALPHA: torch.tensor(float(down.shape[0]), dtype=down.dtype)}


def write_lora(modules: Mapping[str, Mapping[str, torch.Tensor]], table: NameTable, fmt: str) -> Converted:
    """Modules in ComfyUI's layout (from :func:`read_lora`) written in ``fmt``. :class:`LoraFormatError` names
    modules the format has no name for and adapters it cannot hold."""
    check_format(fmt)
    if fmt == "diffusers" and table.family not in DIFFUSERS_PREFIXES:
        raise LoraFormatError(f"diffusers has no LoRA layout ComfyUI knows for {table.family} models (it has "
                              f"{', '.join(sorted(DIFFUSERS_PREFIXES))}); save it as kohya or comfyui")
    names = table.names(fmt)
    missing = sorted(table.comfy_name(w) for w in modules if w not in names)
    if missing:
        raise LoraFormatError(f"{len(missing)} modules of the LoRA have no name in the {fmt} format for this "
                              f"{table.family} model: {_mixed(missing)}; save it as comfyui")
    out = Converted({})
    for weight, parts in modules.items():
        label = table.comfy_name(weight)
        out.left_out += [f"{label}.{o}" for o in OFFSETS if o in parts and fmt != "comfyui"]
        kept = {k: v for k, v in parts.items() if fmt == "comfyui" or k not in OFFSETS}
        if fmt == "diffusers":
            other = sorted(set(kept) - {UP, DOWN, ALPHA})
            if other:
                kind = "DoRA's magnitude" if other == ["dora_scale"] else "another adapter type"
                raise LoraFormatError(f"the diffusers format holds LoRA matrices only, and {label} has "
                                      f"{', '.join(other)} ({kind}); save it as kohya or comfyui")
            if kept:
                out.tensors.update(_diffusers_module(weight, kept, names[weight], table))
            continue
        name = names[weight][0]
        for own, value in _shaped(kept, table.shapes[weight], fmt).items():
            out.tensors[f"{name}.{own}"] = value
    return out


def _shaped(parts: Mapping[str, torch.Tensor], shape: tuple[int, ...], fmt: str) -> dict[str, torch.Tensor]:
    """LoRA matrices as ``fmt`` stores them: 2-D (ComfyUI), or 4-D for conv weights (kohya); kohya gets an alpha
    (the rank: scale 1) where there was none."""
    out = dict(parts)
    if UP not in parts or MID in parts:
        return out
    rank = parts[DOWN].shape[0]
    if fmt == "comfyui":
        out[UP], out[DOWN] = parts[UP].flatten(1), parts[DOWN].flatten(1)
    elif len(shape) > 2:
        out[DOWN] = parts[DOWN].reshape(rank, *shape[1:])
        out[UP] = parts[UP].reshape(parts[UP].shape[0], rank, *[1] * (len(shape) - 2))
    if fmt == "kohya" and ALPHA not in out:
        out[ALPHA] = torch.tensor(float(rank), dtype=parts[DOWN].dtype)
    return out


def _diffusers_module(weight: str, parts: Mapping[str, torch.Tensor], names: tuple[str, ...],
                      table: NameTable) -> dict[str, torch.Tensor]:
    """One module's LoRA under diffusers' names: the scale in the up matrix, split by projection (each tensor a copy
    of its own: safetensors refuses tensors that share memory)."""
    shape = table.shapes[weight]
    up, down = parts[UP].flatten(1), parts[DOWN].flatten(1)
    scale = _scale(parts)
    if scale != 1.0:
        up = (up.float() * scale).to(up.dtype)
    out = {}
    for name in names:
        target = table.targets[name]
        offset, count = target.rows or (0, shape[0])
        rows = up[offset:offset + count]
        rows = _swap(rows) if target.swapped else rows
        shaped = {k: v.clone() for k, v in _shaped({UP: rows, DOWN: down}, (count, *shape[1:]), "diffusers").items()}
        if name.startswith("unet."):  # diffusers' attention-processor layout (ComfyUI reads no other for UNets)
            glue = "_lora." if ".processor." in name else ".lora."
            out[f"{name}{glue}up.weight"], out[f"{name}{glue}down.weight"] = shaped[UP], shaped[DOWN]
        else:
            out[f"{name}.lora_B.weight"], out[f"{name}.lora_A.weight"] = shaped[UP], shaped[DOWN]
    return out


def convert(tensors: Mapping[str, torch.Tensor], table: NameTable, fmt: str) -> Converted:
    """A LoRA file's tensors (any layout ComfyUI reads for this model) in the format ``fmt``."""
    check_format(fmt)
    return write_lora(read_lora(tensors, table), table, fmt)


def file_format(path: str) -> str | None:
    """The format a LoRA file records in its metadata (``comfyui`` for files of earlier releases, which record
    none); None when there is no readable file."""
    try:
        with safe_open(path, "pt") as f:
            return (f.metadata() or {}).get(FORMAT_METADATA_KEY, DEFAULT_FORMAT)
    except Exception:  # safetensors raises its own types for a missing or damaged file
        return None


def detect_format(tensors: Mapping[str, torch.Tensor], table: NameTable) -> str | None:
    """The format whose names every key of the file uses (None: none of them, or a mix)."""
    used = set()
    for key in tensors:
        found = _split(key, table.targets)
        if found is None:
            return None
        used.add(found[0])
    for fmt in FORMATS:
        names = {n for chosen in table.names(fmt).values() for n in chosen}
        if used and used <= names:
            return fmt
    return None
