"""Settings that follow the model: one row per family, each value with the source it comes from.

Train LoRA's ``preset`` ``auto`` gives the settings left at their defaults the values of the model's family
(:func:`resolve`): the learning rate, rank and alpha, how noise levels are drawn and shifted, the loss weighting
and the layers trained. A setting changed from its default is kept, so a value set by hand always wins (set it to
anything but the default). ``none``, and a model without a row, train with the defaults.

The values are those the trainers people come from publish for LoRAs of each family, read in their repositories
(ostris/ai-toolkit at 27a03a91, kohya-ss/sd-scripts at 48d368fa, kohya-ss/musubi-tuner at 30c658c4,
Nerogar/OneTrainer at 23df3832, bghira/SimpleTuner at bc8e6ab7). Where they disagree, a row takes one source's
learning rate, rank and alpha together (they are chosen together: alpha / rank scales the update) and says which.
How they map onto this pack's settings:

- ``alpha`` :data:`RANK` is alpha = rank (scale 1, ai-toolkit's convention); sd-scripts' and musubi-tuner's
  alpha 1 is this pack's default.
- sd-scripts' and musubi-tuner's ``--timestep_sampling shift --discrete_flow_shift S`` is ``shifted`` with
  ``timestep_shift`` S (both draw sigmoid(N(0, 1)) and shift it); their ``sigmoid`` is ``sigmoid``;
  OneTrainer's ``LOGIT_NORMAL`` is ``logit_normal`` (here through the model's own shifted schedule).
- Flow-matching trainers compare the model's velocity with ``noise - latent``, and sd-scripts' SD and SDXL
  trainers the model's noise (or v) prediction with its target: ``loss_weighting`` ``native``. This pack's default,
  ``x0``, is ComfyUI's own trainer's.
- ``attention_mlp`` is OneTrainer's ``attn-mlp`` layer preset; sd-scripts and musubi-tuner train whole
  transformer blocks, which is that plus the blocks' modulation layers.

A learning rate is only given with the AdamW family of optimizers, whose rates the sources publish; Prodigy,
Lion and the others keep the one set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PRESET_CHOICES = ("auto", "none")
RANK = "rank"
"""An alpha equal to the rank in effect (scale 1)."""
ADAMW_FAMILY = frozenset({"AdamW", "Adam", "AdamW8bit"})
PAIRED = {"timestep_shift": "timestep_sampling", "alpha": "rank"}
"""A setting given only with another: the shift with its sampling, alpha with the rank (alpha / rank is what the
source chose). An alpha of :data:`RANK` follows any rank, set by hand or not."""


@dataclass(frozen=True)
class Value:
    """A preset's value of one setting and where it comes from."""

    value: Any
    source: str


@dataclass(frozen=True)
class Preset:
    """The settings of one family (``configs``: ComfyUI's model config class names of its models) and, where
    known, its native training resolution (the side of a square of the same area)."""

    name: str
    configs: tuple[str, ...]
    settings: Mapping[str, Value]
    resolution: Value | None = None


AT, KS, MT, OT = "ostris/ai-toolkit", "kohya-ss/sd-scripts", "kohya-ss/musubi-tuner", "Nerogar/OneTrainer"
_NATIVE_SD = Value("native", f"{KS} train_network.py: the loss compares the model's noise (or v) prediction with "
                             "its target")
_NATIVE_FLOW = Value("native", f"{KS} and {MT}: the loss compares the model's velocity with noise - latent")


def _attn_mlp(where: str) -> Value:
    return Value("attention_mlp", f"{OT} {where}: layer_filter_preset attn-mlp")


def _ai_toolkit(config: str, lr: str, rank: int) -> dict[str, Value]:
    """Learning rate, rank and alpha = rank, from one of ai-toolkit's example configs (``linear`` and
    ``linear_alpha`` equal); ``lr`` as the file writes it."""
    return {"learning_rate": Value(float(lr), f"{AT} config/examples/{config}: lr {lr}"),
            "rank": Value(rank, f"{AT} {config}: linear {rank}"),
            "alpha": Value(RANK, f"{AT} {config}: linear_alpha {rank}")}


def _kohya(doc: str, lr: str, dim: int, alpha: int) -> dict[str, Value]:
    """Learning rate, rank and alpha from an example command of sd-scripts' docs; ``lr`` as the doc writes it."""
    return {"learning_rate": Value(float(lr), f"{KS} docs/{doc}: --learning_rate={lr}"),
            "rank": Value(dim, f"{KS} docs/{doc}: --network_dim={dim} --network_alpha={alpha}"),
            "alpha": Value(RANK if alpha == dim else float(alpha), f"{KS} docs/{doc}: --network_alpha={alpha}")}


def _musubi(doc: str, lr: str, dim: int, shift: float) -> dict[str, Value]:
    """Learning rate, rank (musubi-tuner's alpha defaults to 1) and its shifted sampling, from an example command
    of musubi-tuner's docs; ``lr`` as the doc writes it."""
    return {"learning_rate": Value(float(lr), f"{MT} docs/{doc}: --learning_rate {lr}"),
            "rank": Value(dim, f"{MT} docs/{doc}: --network_dim {dim} (alpha 1)"),
            "alpha": Value(1.0, f"{MT} training/parser_common.py: --network_alpha default 1"),
            "timestep_sampling": Value("shifted", f"{MT} docs/{doc}: --timestep_sampling shift "
                                                  f"--discrete_flow_shift {shift}"),
            "timestep_shift": Value(shift, f"{MT} docs/{doc}: --discrete_flow_shift {shift}")}


def _blocks(where: str) -> Value:
    return Value("attention_mlp", f"{where}: the transformer blocks' attention and MLP (feed-forward) layers")


PRESETS: tuple[Preset, ...] = (
    Preset("SD 1.x", ("SD15",), {
        **_kohya("train_network.md", "1e-4", 16, 1), "loss_weighting": _NATIVE_SD,
        "target_layers": _attn_mlp("training_presets/SD1.5/#sd 1.5 LoRA.json"),
    }, Value(512, f"{OT} #sd 1.5 LoRA.json: resolution 512; {KS} train_README: SD1.x trains at 512")),
    Preset("SD 2.x", ("SD20", "SD21UnclipL", "SD21UnclipH"), {
        **_kohya("train_network.md", "1e-4", 16, 1), "loss_weighting": _NATIVE_SD,
        "target_layers": _attn_mlp("training_presets/SD2.1/#sd 2.1 LoRA.json"),
    }),
    Preset("SDXL", ("SDXL", "SSD1B", "Segmind_Vega", "KOALA_700M", "KOALA_1B"), {
        **_kohya("sdxl_train_network.md", "1e-4", 32, 16), "loss_weighting": _NATIVE_SD,
        "target_layers": _attn_mlp("training_presets/SDXL/#sdxl 1.0 LoRA.json"),
    }, Value(1024, f"{OT} #sdxl 1.0 LoRA.json: resolution 1024")),
    Preset("SD3 / SD3.5", ("SD3",), {
        **_ai_toolkit("train_lora_sd35_large_24gb.yaml", "1e-4", 16),
        "timestep_sampling": Value("logit_normal", f"{OT} training_presets/SD3/#sd 3 LoRA.json: "
                                                   "timestep_distribution LOGIT_NORMAL (the SD3 paper's)"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks(f"{KS} networks/lora_sd3.py trains SingleDiTBlock, with its modulation"),
    }, Value(1024, f"{AT} train_lora_sd35_large_24gb.yaml: resolution [1024]")),
    Preset("Flux.1", ("Flux", "FluxSchnell", "FluxInpaint"), {
        **_ai_toolkit("train_lora_flux_24gb.yaml", "1e-4", 16),
        "timestep_sampling": Value("shifted", f"{KS} docs/flux_train_network.md, Recommended Settings: "
                                              "--timestep_sampling shift --discrete_flow_shift 3.1582"),
        "timestep_shift": Value(3.1582, f"{KS} docs/flux_train_network.md: --discrete_flow_shift 3.1582"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _attn_mlp("modules/modelSetup/BaseFluxSetup.py LAYER_PRESETS"),
    }, Value(1024, f"{AT} train_lora_flux_24gb.yaml: resolution [512, 768, 1024]; a 1024 px model")),
    Preset("Flux.2", ("Flux2",), {
        "learning_rate": Value(1e-4, f"{MT} docs/flux_2.md: --learning_rate 1e-4; bghira/SimpleTuner "
                                     "FLUX2.md: learning_rate 1e-4"),
        "rank": Value(16, "bghira/SimpleTuner documentation/quickstart/FLUX2.md: lora_rank 16"),
        "alpha": Value(RANK, "bghira/SimpleTuner field registry: lora_alpha defaults to the rank"),
        "timestep_sampling": Value("logit_normal", f"{OT} training_presets/Flux 2/#flux2 LoRA 16GB.json: "
                                                   "timestep_distribution LOGIT_NORMAL"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _attn_mlp("BaseFluxSetup.py LAYER_PRESETS (Flux.1's, the same blocks)"),
    }, Value(1024, "bghira/SimpleTuner FLUX2.md: resolution 1024")),
    Preset("Chroma", ("Chroma",), {
        **_ai_toolkit("train_lora_chroma_24gb.yaml", "1e-4", 16),
        "timestep_sampling": Value("sigmoid", f"{KS} docs/flux_train_network.md, Chroma: --timestep_sampling "
                                              "sigmoid"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _attn_mlp("training_presets/Chroma/#chroma LoRA 24GB.json"),
    }, Value(1024, f"{AT} train_lora_chroma_24gb.yaml: samples at 1024x1024")),
    Preset("Qwen-Image", ("QwenImage",), {
        **_ai_toolkit("train_lora_qwen_image_24gb.yaml", "1e-4", 16),
        "timestep_sampling": Value("shifted", f"{MT} docs/qwen_image.md: --timestep_sampling shift "
                                              "--discrete_flow_shift 2.2"),
        "timestep_shift": Value(2.2, f"{MT} docs/qwen_image.md: --discrete_flow_shift 2.2"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _attn_mlp("training_presets/QwenImage/#qwen LoRA 24GB.json (attn, img_mlp, txt_mlp)"),
    }, Value(1328, f"{MT} gui/config_manager.py, Qwen-Image: resolution (1328, 1328)")),
    Preset("Wan 2.1", ("WAN21_T2V", "WAN21_I2V"), {
        **_ai_toolkit("train_lora_wan21_14b_24gb.yaml", "1e-4", 32),
        "timestep_sampling": Value("shifted", f"{MT} docs/wan.md: --timestep_sampling shift "
                                              "--discrete_flow_shift 3.0"),
        "timestep_shift": Value(3.0, f"{MT} docs/wan.md: --discrete_flow_shift 3.0"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks(f"{MT} networks/lora_wan.py trains WanAttentionBlock"),
    }, Value(632, f"{AT} train_lora_wan21_14b_24gb.yaml: resolution [632] ('will be around 480p')")),
    Preset("Wan 2.2 5B", ("WAN22_T2V",), {
        "learning_rate": Value(1e-4, f"{AT} ui/src/app/jobs/new/jobConfig.ts: lr 0.0001 (wan22_5b keeps it)"),
        "rank": Value(32, f"{AT} ui/src/app/jobs/new/options.tsx: defaultLinearRank 32"),
        "alpha": Value(RANK, f"{AT} jobConfig.ts: linear_alpha 32"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks(f"{MT} networks/lora_wan.py trains WanAttentionBlock"),
    }),
    Preset("HunyuanVideo", ("HunyuanVideo", "HunyuanVideoI2V"), {
        **_musubi("hunyuan_video.md", "2e-4", 32, 7.0), "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks(f"{MT} networks/lora.py trains MMDoubleStreamBlock and MMSingleStreamBlock"),
    }),
    Preset("HunyuanVideo 1.5", ("HunyuanVideo15",), {
        **_musubi("hunyuan_video_1_5.md", "1e-4", 32, 2.0), "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks(f"{MT} networks/lora_hv_1_5.py trains MMDoubleStreamBlock"),
    }),
    Preset("LTX-2", ("LTXAV",), {
        "learning_rate": Value(1e-4, f"{AT} ui/src/app/jobs/new/jobConfig.ts: lr 0.0001 (ltx2 keeps it)"),
        "rank": Value(32, f"{AT} ui/src/app/jobs/new/options.tsx: defaultLinearRank 32"),
        "alpha": Value(RANK, f"{AT} jobConfig.ts: linear_alpha 32"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks("bghira/SimpleTuner ltxvideo2 DEFAULT_LORA_TARGET: attention; "
                                 f"{AT}: every linear layer of the blocks"),
    }),
    Preset("Lumina 2", ("Lumina2",), {
        **_kohya("lumina_train_network.md", "1e-4", 8, 8),
        "timestep_sampling": Value("shifted", f"{KS} docs/lumina_train_network.md: --timestep_sampling "
                                              "nextdit_shift --discrete_flow_shift=6.0"),
        "timestep_shift": Value(6.0, f"{KS} docs/lumina_train_network.md: --discrete_flow_shift=6.0"),
        "loss_weighting": _NATIVE_FLOW,
        "target_layers": _blocks(f"{KS} networks/lora_lumina.py trains JointTransformerBlock"),
    }, Value(1024, "bghira/SimpleTuner LUMINA2.md: resolution 1024")),
    Preset("Z-Image", ("ZImage",), {
        **_musubi("zimage.md", "1e-4", 32, 2.0), "loss_weighting": _NATIVE_FLOW,
        "target_layers": _attn_mlp("training_presets/Z-Image/#z-image LoRA 16GB.json (attention, feed_forward)"),
    }, Value(1024, f"{MT} gui/config_manager.py, Z-Image: resolution (1024, 1024)")),
    Preset("HiDream", ("HiDream",), {
        **_ai_toolkit("train_lora_hidream_48.yaml", "2e-4", 32), "loss_weighting": _NATIVE_FLOW,
        "layer_filter": Value("re:^(?!.*ff_i\\.(experts|gate))", f"{AT} train_lora_hidream_48.yaml: "
                                                                  "ignore_if_contains ff_i.experts, ff_i.gate"),
    }, Value(1024, "bghira/SimpleTuner HIDREAM.md: resolution 1024")),
)

_BY_CONFIG: dict[str, Preset] = {config: preset for preset in PRESETS for config in preset.configs}

TOKENIZERS: dict[str, str] = {
    "SD1Tokenizer": "SD15", "SDXLTokenizer": "SDXL", "SD3Tokenizer": "SD3", "FluxTokenizer": "Flux",
    "Flux2Tokenizer": "Flux2", "KleinTokenizer": "Flux2", "KleinTokenizer8B": "Flux2",
    "QwenImageTokenizer": "QwenImage", "LuminaTokenizer": "Lumina2", "ZImageTokenizer": "ZImage",
    "HiDreamTokenizer": "HiDream"}
"""ComfyUI's tokenizer classes (a CLIP's ``tokenizer``, by its own class name: many subclass SD1's) -> the model
config of the family whose text encoders they are, where one family has them (UMT5's, Wan's, serves models of
different resolutions; SD 2.x's base and 768-v models share theirs)."""


def preset_for(model_config: str) -> Preset | None:
    """The preset of a model whose ComfyUI model config class is named ``model_config``, or None."""
    return _BY_CONFIG.get(model_config)


def native_resolution(tokenizer: str) -> tuple[Preset, Value] | None:
    """The preset and native resolution of the family whose text encoders a CLIP with this ``tokenizer`` class is
    (Encode Dataset's preset), or None where that is not known."""
    preset = preset_for(TOKENIZERS.get(tokenizer, ""))
    return (preset, preset.resolution) if preset is not None and preset.resolution is not None else None


def resolution_note(resolution: int, default: int, tokenizer: str) -> tuple[int, str]:
    """Encode Dataset's resolution under preset auto and the line its summary shows: the family's native
    resolution where ``resolution`` was left at its ``default`` and the CLIP's ``tokenizer`` says the family."""
    found = native_resolution(tokenizer)
    if found is None:
        return resolution, f"preset auto: no native resolution known for this CLIP ({tokenizer}); resolution " \
                           f"{resolution}"
    preset, value = found
    if resolution != default:
        return resolution, f"preset auto: resolution {resolution} kept as set ({preset.name} trains at {value.value})"
    return int(value.value), f"preset auto: resolution {value.value}, {preset.name}'s (known from its CLIP)"


def check_preset(choice: str) -> None:
    if choice not in PRESET_CHOICES:
        raise ValueError(f"preset must be one of {', '.join(PRESET_CHOICES)}; got {choice!r}")


def _default(spec: Any, name: str) -> Any:
    """The default of setting ``name`` of a :class:`~.spec.TrainSpec` (on the spec or one of its parts)."""
    for f in dataclasses.fields(spec):
        if f.name == name:
            return f.default
        value = getattr(spec, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                if g.name == name:
                    return g.default
    raise KeyError(name)


@dataclass(frozen=True)
class Resolved:
    """What ``auto`` did: the spec to train, the settings it gave (name -> value) and those it kept because they
    were set by hand (name -> value)."""

    spec: Any
    preset: Preset | None
    given: dict[str, Any]
    kept: dict[str, Any]

    def summary(self, model_config: str) -> str:
        """One line for the node's summary."""
        if self.preset is None:
            return f"preset auto: no preset for {model_config} models; the defaults train"
        given = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.given.items())
        line = f"preset auto ({self.preset.name}): {given or 'nothing to change'}"
        if self.kept:
            line += "; kept as set: " + ", ".join(self.kept)
        return line


def resolve(spec: Any, model_config: str) -> Resolved:
    """``spec`` with the settings left at their defaults given the values of ``model_config``'s preset (see the
    module docstring); ``spec`` itself where there is none."""
    preset = preset_for(model_config)
    if preset is None:
        return Resolved(spec, None, {}, {})
    settings = spec.settings()
    given: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    for name, value in preset.settings.items():
        if name == "learning_rate" and spec.optimizer.optimizer not in ADAMW_FAMILY:
            continue
        partner = PAIRED.get(name)
        tied = partner is not None and partner in kept and value.value != RANK
        if settings[name] != _default(spec, name) or tied:
            kept[name] = settings[name]
            continue
        given[name] = value.value
    if given.get("alpha") == RANK:
        given["alpha"] = float(given.get("rank", settings["rank"]))
    return Resolved(type(spec).build({**settings, **given}), preset, given, kept)


def _shown(value: Any) -> str:
    if value == RANK:
        return "= rank"
    return f"{value:g}" if isinstance(value, float) else str(value)


def table_markdown() -> str:
    """The presets as ``docs/presets.md`` shows them: a row per family with its values, then each value's source."""
    names = ["learning_rate", "rank", "alpha", "timestep_sampling", "timestep_shift", "loss_weighting",
             "target_layers", "layer_filter"]
    lines = ["| family | ComfyUI model | " + " | ".join(names) + " | resolution |",
             "|" + "---|" * (len(names) + 3)]
    for p in PRESETS:
        cells = [_shown(p.settings[n].value) if n in p.settings else "" for n in names]
        resolution = str(p.resolution.value) if p.resolution else ""
        lines.append(f"| {p.name} | {', '.join(p.configs)} | " + " | ".join(c.replace("|", "\\|") for c in cells)
                     + f" | {resolution} |")
    lines.append("")
    for p in PRESETS:
        lines.append(f"**{p.name}**")
        lines.append("")
        for name, value in p.settings.items():
            lines.append(f"- `{name}` {_shown(value.value)}: {value.source}")
        if p.resolution is not None:
            lines.append(f"- resolution {p.resolution.value}: {p.resolution.source}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
