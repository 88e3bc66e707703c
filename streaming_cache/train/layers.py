"""Which of a model's layers a LoRA trains, and at which rank, by the layers' module names.

By default every layer ComfyUI can patch trains, the offsets of norms and biases included (what ComfyUI's own
trainer does). A preset narrows that as OneTrainer's ``layer_filter_preset`` and ai-toolkit's ``only_if_contains``
do, for every family ComfyUI runs, from the module names of its own model classes:

- ``matrices``: every weight matrix (linear and convolution layers), no norm or bias offsets (what kohya's and
  diffusers' files hold);
- ``attention_mlp``: the matrices of attention and MLP (feed-forward) layers, not the embedders, modulation,
  projections in and out or a UNet's convolutions;
- ``attention``: the attention matrices only.

A layer is attention when a part of its dotted name holds ``attn`` or ``attention`` (``attn1.to_q``,
``img_attn.qkv``, ``self_attn.q``, ``attention.qkv``), MLP when a part holds ``mlp`` or starts with ``ff`` or
``feed_forward`` (``ff.net.0.proj``, ``img_mlp.0``, ``ffn.0``, ``feed_forward.w1``). The single-stream blocks of
Flux, Flux.2, Chroma and HunyuanVideo compute the attention projections and the MLP's input in one matrix
(``single_blocks.N.linear1``, and ``linear2`` for both outputs): they count as attention, since leaving them out
would leave most of those models' attention untrained.

A filter narrows further: items separated by commas or new lines, each a piece of the layer's name or, after
``re:``, a regular expression searched in it; a layer trains when it passes the preset and matches an item (an
empty filter matches every layer). Ranks per block group: ``pattern=rank`` items in the same syntax, the first
that matches a layer gives its rank (0: the layer does not train), other layers take the run's rank. Names are
ComfyUI's, without the ``diffusion_model.`` prefix: ``input_blocks.4.1.transformer_blocks.0.attn1.to_q``,
``double_blocks.3.img_attn.qkv``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

TARGET_LAYERS = ("all", "matrices", "attention_mlp", "attention")
KINDS = ("attention", "mlp", "other")
_SINGLE_STREAM = ("single_blocks", "single_transformer_blocks")
_FUSED = ("linear1", "linear2")


def layer_kind(name: str) -> str:
    """``attention``, ``mlp`` or ``other``: what the layer ``name`` computes, read from its module name."""
    parts = name.lower().split(".")
    if parts[-1] in _FUSED and any(p in _SINGLE_STREAM for p in parts):
        return "attention"
    if any("attn" in p or "attention" in p for p in parts):
        return "attention"
    if any("mlp" in p or p.startswith(("ff", "feed_forward")) for p in parts):
        return "mlp"
    return "other"


@dataclass(frozen=True)
class NamePattern:
    """One item of a filter: a piece of a layer's name, or (``regex``) a regular expression searched in it."""

    text: str
    regex: re.Pattern[str] | None = None

    def matches(self, name: str) -> bool:
        return bool(self.regex.search(name)) if self.regex is not None else self.text in name


def _items(text: str) -> list[str]:
    return [item.strip() for line in (text or "").splitlines() for item in line.split(",") if item.strip()]


def _pattern(item: str, setting: str) -> NamePattern:
    if not item.startswith("re:"):
        return NamePattern(item)
    try:
        return NamePattern(item, re.compile(item[3:]))
    except re.error as exc:
        raise ValueError(f"{setting}: {item!r} is not a regular expression ({exc}); write the piece of the name "
                         "without 're:' to match it as plain text") from exc


def parse_filter(text: str) -> tuple[NamePattern, ...]:
    """The items of a layer filter (``layer_filter``)."""
    return tuple(_pattern(item, "layer_filter") for item in _items(text))


def parse_ranks(text: str) -> tuple[tuple[NamePattern, int], ...]:
    """The ``pattern=rank`` items of ``layer_ranks``, in order."""
    out = []
    for item in _items(text):
        pattern, sep, rank = item.rpartition("=")
        if not sep or not pattern.strip() or not rank.strip().isdigit():
            raise ValueError(f"layer_ranks: {item!r} is not 'pattern=rank' (for example 'single_blocks=8' or "
                             "'re:input_blocks\\.[0-3]\\.=0'); the rank is a whole number, 0 leaves the layers out")
        out.append((_pattern(pattern.strip(), "layer_ranks"), int(rank)))
    return tuple(out)


def check_choice(preset: str) -> None:
    if preset not in TARGET_LAYERS:
        raise ValueError(f"target_layers must be one of {', '.join(TARGET_LAYERS)}; got {preset!r}")


@dataclass(frozen=True)
class LayerChoice:
    """Which layers train (a ``preset`` of :data:`TARGET_LAYERS` and a ``layer_filter``) and their ranks
    (``layer_ranks``), from the settings' text."""

    preset: str = "all"
    layer_filter: str = ""
    layer_ranks: str = ""

    def __post_init__(self) -> None:
        check_choice(self.preset)
        object.__setattr__(self, "_filter", parse_filter(self.layer_filter))
        object.__setattr__(self, "_ranks", parse_ranks(self.layer_ranks))

    @property
    def narrows(self) -> bool:
        """Whether a layer may be left out (anything but every layer at the run's rank)."""
        return self.preset != "all" or bool(self._filter) or bool(self._ranks)  # type: ignore[attr-defined]

    def rank(self, name: str, default: int) -> int:
        """The rank of layer ``name`` (0: left out by ``layer_ranks``); ``default``: the run's rank."""
        for pattern, rank in self._ranks:  # type: ignore[attr-defined]
            if pattern.matches(name):
                return rank
        return default

    def trains(self, name: str, matrix: bool) -> bool:
        """Whether layer ``name`` trains: a weight ``matrix``, or else a norm's weight or a bias (an offset)."""
        if self.preset == "all":
            chosen = True
        elif not matrix:
            chosen = False
        elif self.preset == "matrices":
            chosen = True
        else:
            kind = layer_kind(name)
            chosen = kind == "attention" or (self.preset == "attention_mlp" and kind == "mlp")
        if chosen and self._filter:  # type: ignore[attr-defined]
            chosen = any(p.matches(name) for p in self._filter)  # type: ignore[attr-defined]
        return chosen and self.rank(name, 1) > 0

    def nothing_chosen(self, names: Iterable[str]) -> str:
        """The error when no layer of a model (``names``: its layers) is chosen: what was asked and the layers'
        names to choose from."""
        names = list(names)
        kinds = {k: [n for n in names if layer_kind(n) == k] for k in KINDS}
        examples = "; ".join(f"{k}: {', '.join(v[:3])}" for k, v in kinds.items() if v)
        return (f"target_layers {self.preset!r}, layer_filter {self.layer_filter!r} and layer_ranks "
                f"{self.layer_ranks!r} leave none of this model's {len(names)} layers to train; its layers are named "
                f"like {examples}. Widen the filter or choose target_layers 'all'.")
