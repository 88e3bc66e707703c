"""One training request, typed and frozen: every setting of a LoRA training, grouped by concern, checked once.

The Train LoRA node builds a :class:`TrainSpec` from its inputs and its option nodes (one option node per group
below) and everything downstream reads it: the loop's configuration (:meth:`TrainSpec.loop_config`), the run's
identity (which saved run a queued training continues: :meth:`TrainSpec.identity_settings`), and the LoRA
file's metadata (``metadata.lora_metadata``). A setting is named once, here; its name is the node input's name.

Groups (each a frozen dataclass with the defaults a first LoRA needs):

- :class:`OptimizerOptions`: optimizer, schedule, warm-up, gradient accumulation and clipping, LoRA+, EMA;
- :class:`ObjectiveOptions`: loss function, noise-level sampling, loss weighting, noise offset, masks, guidance;
- :class:`PreviewOptions`: sample previews and the validation loss;
- :class:`MemoryOptions`: dtypes, gradient checkpointing, offloading, bypass mode;
- :class:`DataOptions`: caption dropout and how batches are read;
- :class:`AdapterOptions`: the adapter type, its alpha, the layers it trains and their ranks, an existing LoRA to
  continue and the saved file's key format.

Whether a setting is part of the run identity is declared on its field (``identity=False``: changing it
continues the same run: the number of steps, how often things are saved or shown, memory options, reader
threads, the LoRA file's key format). The identity keys and values are those earlier releases used, so a run saved
by one resumes here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .layers import TARGET_LAYERS, LayerChoice
from .loop import TrainConfig
from .lora_formats import DEFAULT_FORMAT, FORMATS
from .memory_plan import PLANS
from .optim import OPTIMIZERS, SCHEDULES, lr_factor, parse_optimizer_args
from .runs import run_identity
from .timesteps import TIMESTEP_SAMPLING

LOSS_FUNCTIONS = ("MSE", "L1", "Huber", "SmoothL1")
LOSS_WEIGHTINGS = ("x0", "native", "min_snr", "debiased")
TRAINING_DTYPES = ("bf16", "fp16", "fp32")
LORA_DTYPES = ("bf16", "fp32")
PLOT_SCALES = ("linear", "log")
NO_LORA = "[None]"


def _setting(default: Any, *, identity: bool = True, added: bool = False) -> Any:
    """A setting's field. ``identity``: part of the run identity. ``added``: a setting that came after runs were
    first saved, counted in the identity only when it differs from its default, so a run saved before it came
    (which trained as the default does) is continued by the same settings."""
    return field(default=default, metadata={"identity": identity, "added": added})


def _check_choice(name: str, value: Any, choices: tuple[str, ...] | Mapping[str, Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_range(name: str, value: float, lo: float, hi: float | None = None, *, lo_open: bool = False) -> None:
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and (hi is None or value <= hi)
    if not ok:
        bound = f"above {lo}" if lo_open else f"at least {lo}"
        raise ValueError(f"{name} must be {bound}{'' if hi is None else f' and at most {hi}'}; got {value!r}")


def _coerce(part: Any) -> None:
    """Give every field the type its default has (a JSON prompt may carry 1 for 1.0): frozen, so via setattr."""
    for f in dataclasses.fields(part):
        value, default = getattr(part, f.name), f.default
        if isinstance(default, bool):
            value = bool(value)
        elif isinstance(default, int):
            value = int(value)
        elif isinstance(default, float):
            value = float(value)
        elif isinstance(default, tuple):
            value = tuple(value)
        object.__setattr__(part, f.name, value)


@dataclass(frozen=True)
class OptimizerOptions:
    """How the weights move: the optimizer, the learning-rate schedule and the step's gradient handling."""

    GROUP: ClassVar[str] = "optimizer"
    optimizer: str = _setting("AdamW")
    lr_schedule: str = _setting("constant")
    warmup_steps: int = _setting(0)
    lr_cycles: int = _setting(1)
    grad_accumulation_steps: int = _setting(1)
    max_grad_norm: float = _setting(1.0)
    lora_plus_ratio: float = _setting(1.0)
    ema_decay: float = _setting(0.0)
    weight_decay: float = _setting(0.0, added=True)
    lr_power: float = _setting(1.0, added=True)
    min_lr_ratio: float = _setting(0.0, added=True)
    optimizer_args: str = _setting("", added=True)

    def __post_init__(self) -> None:
        _coerce(self)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("lr_schedule", self.lr_schedule, SCHEDULES)
        _check_range("warmup_steps", self.warmup_steps, 0)
        _check_range("lr_cycles", self.lr_cycles, 1)
        _check_range("grad_accumulation_steps", self.grad_accumulation_steps, 1)
        _check_range("max_grad_norm", self.max_grad_norm, 0)
        _check_range("lora_plus_ratio", self.lora_plus_ratio, 0, lo_open=True)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) (0 = off); got {self.ema_decay!r}")
        _check_range("weight_decay", self.weight_decay, 0, 1)
        _check_range("lr_power", self.lr_power, 0, lo_open=True)
        _check_range("min_lr_ratio", self.min_lr_ratio, 0, 1)
        object.__setattr__(self, "optimizer_args", " ".join(self.optimizer_args.split()))
        self.arguments  # noqa: B018  (arguments that do not parse are refused here)

    @property
    def arguments(self) -> dict[str, Any]:
        """The optimizer's arguments beyond learning rate and weight decay (``optim.parse_optimizer_args``)."""
        return parse_optimizer_args(self.optimizer_args)


@dataclass(frozen=True)
class ObjectiveOptions:
    """What a step learns: the loss function, how noise levels are drawn, how the loss is weighted."""

    GROUP: ClassVar[str] = "objective"
    loss_function: str = _setting("MSE")
    loss_weighting: str = _setting("x0")
    min_snr_gamma: float = _setting(5.0)
    timestep_sampling: str = _setting("uniform")
    timestep_shift: float = _setting(3.0)
    timestep_scale: float = _setting(1.0)
    noise_offset: float = _setting(0.0)
    masked_loss: bool = _setting(True)
    guidance: float = _setting(1.0)
    min_timestep: int = _setting(0, added=True)
    max_timestep: int = _setting(1000, added=True)
    input_perturbation: float = _setting(0.0, added=True)

    def __post_init__(self) -> None:
        _coerce(self)
        _check_choice("loss_function", self.loss_function, LOSS_FUNCTIONS)
        _check_choice("loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)
        _check_choice("timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLING)
        _check_range("min_snr_gamma", self.min_snr_gamma, 0, lo_open=True)
        _check_range("timestep_shift", self.timestep_shift, 0, lo_open=True)
        _check_range("timestep_scale", self.timestep_scale, 0, lo_open=True)
        _check_range("noise_offset", self.noise_offset, 0)
        _check_range("guidance", self.guidance, 0)
        _check_range("min_timestep", self.min_timestep, 0, 999)
        _check_range("max_timestep", self.max_timestep, 1, 1000)
        _check_range("input_perturbation", self.input_perturbation, 0, 1)
        if self.min_timestep >= self.max_timestep:
            raise ValueError(f"min_timestep ({self.min_timestep}) must be below max_timestep ({self.max_timestep})")

    @property
    def space(self) -> str:
        """The space the loss compares in (``timesteps.LOSS_SPACES``)."""
        return "native" if self.loss_weighting == "native" else "x0"

    @property
    def t_range(self) -> tuple[float, float]:
        """The noise levels drawn, as fractions of 1 (``timesteps.sample_t``'s ``t_range``)."""
        return self.min_timestep / 1000, self.max_timestep / 1000

    @property
    def debiased(self) -> bool:
        """Whether the loss is weighted by debiased estimation (``timesteps.loss_weight``)."""
        return self.loss_weighting == "debiased"

    @property
    def snr_gamma(self) -> float:
        """Min-SNR gamma in effect (0: no min-SNR weighting)."""
        return self.min_snr_gamma if self.loss_weighting == "min_snr" else 0.0


@dataclass(frozen=True)
class PreviewOptions:
    """What the node shows while it trains: sample images, the validation loss and the loss plot."""

    GROUP: ClassVar[str] = "previews"
    sample_prompts: tuple[str, ...] = _setting((), identity=False)
    sample_every: int = _setting(250, identity=False)
    sample_steps: int = _setting(20, identity=False)
    sample_cfg: float = _setting(4.0, identity=False)
    sample_seed: int = _setting(42, identity=False)
    validation_split: float = _setting(0.0)
    validate_every: int = _setting(100, identity=False)
    plot_scale: str = _setting("linear", identity=False)

    def __post_init__(self) -> None:
        _coerce(self)
        object.__setattr__(self, "sample_prompts", tuple(p.strip() for p in self.sample_prompts if p.strip()))
        _check_range("sample_every", self.sample_every, 0)
        _check_range("sample_steps", self.sample_steps, 1)
        _check_range("sample_cfg", self.sample_cfg, 0)
        _check_range("validate_every", self.validate_every, 1)
        if not 0.0 <= self.validation_split <= 0.5:
            raise ValueError(f"validation_split must be between 0 and 0.5; got {self.validation_split!r}")
        _check_choice("plot_scale", self.plot_scale, PLOT_SCALES)

    @staticmethod
    def prompts_of(text: str) -> tuple[str, ...]:
        """The prompts of a multi-line text box: one per non-empty line."""
        return tuple(line.strip() for line in (text or "").splitlines() if line.strip())

    def preview_due(self, step: int, last: int) -> bool:
        """Whether samples are drawn after ``step`` (every ``sample_every`` steps and at the last)."""
        return bool(self.sample_prompts) and (step == last or (self.sample_every > 0 and step % self.sample_every == 0))

    def next_preview(self, step: int, last: int) -> int:
        """The step at which the next preview after ``step`` is due (``last`` when none is before it)."""
        if not self.sample_prompts or self.sample_every <= 0:
            return last
        return min(last, (step // self.sample_every + 1) * self.sample_every)


@dataclass(frozen=True)
class MemoryOptions:
    """Where tensors live and in which dtype: what lets a big model train on a small GPU."""

    GROUP: ClassVar[str] = "memory"
    training_dtype: str = _setting("bf16")
    lora_dtype: str = _setting("bf16")
    gradient_checkpointing: bool = _setting(True)
    checkpoint_depth: int = _setting(1, identity=False)
    offloading: bool = _setting(False, identity=False)
    bypass_mode: bool = _setting(False, identity=False)
    cuda_graphs: bool = _setting(True, identity=False)
    checkpoint_share: float = _setting(1.0, identity=False)
    plan: str = _setting("auto", identity=False)

    def __post_init__(self) -> None:
        _coerce(self)
        _check_choice("training_dtype", self.training_dtype, TRAINING_DTYPES)
        _check_choice("plan", self.plan, PLANS)
        _check_choice("lora_dtype", self.lora_dtype, LORA_DTYPES)
        _check_range("checkpoint_depth", self.checkpoint_depth, 1)
        if not 0.0 <= self.checkpoint_share <= 1.0:
            raise ValueError(f"checkpoint_share must be between 0 and 1; got {self.checkpoint_share!r}")

    @property
    def depth(self) -> int:
        """The checkpoint depth in effect (0: no gradient checkpointing)."""
        return self.checkpoint_depth if self.gradient_checkpointing else 0


@dataclass(frozen=True)
class DataOptions:
    """What the samples of a batch are given (caption dropout) and how batches are read from the cache."""

    GROUP: ClassVar[str] = "data"
    caption_dropout: float = _setting(0.0)
    workers: int = _setting(2, identity=False)
    prefetch: int = _setting(2, identity=False)

    def __post_init__(self) -> None:
        _coerce(self)
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be between 0 and 1; got {self.caption_dropout!r}")
        _check_range("workers", self.workers, 0)
        _check_range("prefetch", self.prefetch, 1)


@dataclass(frozen=True)
class AdapterOptions:
    """The adapter trained: its type, an existing LoRA whose weights it starts from, and the key format its file
    is saved in (``lora_formats.FORMATS``; the file only, so it does not change the run)."""

    GROUP: ClassVar[str] = "adapter"
    algorithm: str = _setting("LoRA")
    existing_lora: str = _setting(NO_LORA)
    lora_format: str = _setting(DEFAULT_FORMAT, identity=False)
    alpha: float = _setting(1.0, added=True)
    target_layers: str = _setting("all", added=True)
    layer_filter: str = _setting("", added=True)
    layer_ranks: str = _setting("", added=True)
    dora: bool = _setting(False, added=True)

    def __post_init__(self) -> None:
        _coerce(self)
        _check_choice("lora_format", self.lora_format, FORMATS)
        _check_range("alpha", self.alpha, 0, lo_open=True)
        _check_choice("target_layers", self.target_layers, TARGET_LAYERS)
        object.__setattr__(self, "layer_filter", self.layer_filter.strip())
        object.__setattr__(self, "layer_ranks", self.layer_ranks.strip())
        self.layers  # noqa: B018  (a filter or a rank that does not parse is refused here)
        if self.dora and self.algorithm != "LoRA":
            raise ValueError(f"dora decomposes LoRA layers; the {self.algorithm} algorithm has none: choose LoRA or "
                             "turn dora off")

    @property
    def layers(self) -> LayerChoice:
        """Which layers train and at which ranks (``layers.LayerChoice``)."""
        return LayerChoice(self.target_layers, self.layer_filter, self.layer_ranks)


PARTS: tuple[type, ...] = (OptimizerOptions, ObjectiveOptions, PreviewOptions, MemoryOptions, DataOptions,
                           AdapterOptions)
_PART_BY_GROUP = {p.GROUP: p for p in PARTS}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TrainOptions:
    """What the option nodes hand along their chain to Train LoRA: the option groups set so far (group name ->
    part) and objects some of them bring (``clip`` and ``vae`` for sample previews, a ``validation_dataset``).
    Each group may be set once per chain: two option nodes of one kind would leave it unclear which wins."""

    parts: Mapping[str, Any] = field(default_factory=dict)
    objects: Mapping[str, Any] = field(default_factory=dict)

    def with_part(self, part: Any, **objects: Any) -> TrainOptions:
        group = type(part).GROUP
        if group in self.parts:
            raise ValueError(f"two {type(part).__name__} nodes are chained into one Train LoRA; keep one (each "
                             "kind of option node may appear once in a chain)")
        kept = {k: v for k, v in objects.items() if v is not None}
        return TrainOptions({**self.parts, group: part}, {**self.objects, **kept})

    def part(self, cls: type) -> Any:
        """The group ``cls`` as set, or its defaults."""
        return self.parts.get(cls.GROUP) or cls()  # type: ignore[attr-defined]

    def __repr__(self) -> str:  # shown in ComfyUI's logs; the objects are large
        return f"TrainOptions({', '.join(sorted(self.parts))})"


@dataclass(frozen=True)
class TrainSpec:
    """A whole training request: what the main node asks (name, steps, learning rate, rank, batch size per
    process, seed, ..., ``devices``: local GPUs to train on, each in a process of its own) and one part per option
    group. Build it with :meth:`build` from flat settings (node input name ->
    value), with :meth:`from_options` from the main inputs and a :class:`TrainOptions`, or directly."""

    lora_name: str = _setting("my_lora", identity=False)
    steps: int = _setting(500, identity=False)
    learning_rate: float = _setting(1e-4)
    rank: int = _setting(16)
    batch_size: int = _setting(1)
    seed: int = _setting(0)
    resume: bool = _setting(True, identity=False)
    save_every: int = _setting(0, identity=False)
    devices: int = _setting(1, identity=False)
    keep_step_saves: int = _setting(0, identity=False)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    previews: PreviewOptions = field(default_factory=PreviewOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    data: DataOptions = field(default_factory=DataOptions)
    adapter: AdapterOptions = field(default_factory=AdapterOptions)

    def __post_init__(self) -> None:
        _coerce_main(self)
        _check_range("steps", self.steps, 1)
        _check_range("learning_rate", self.learning_rate, 0, lo_open=True)
        _check_range("rank", self.rank, 1)
        _check_range("batch_size", self.batch_size, 1)
        _check_range("save_every", self.save_every, 0)
        _check_range("devices", self.devices, 1)
        _check_range("keep_step_saves", self.keep_step_saves, 0)
        if self.seed < 0:
            raise ValueError(f"seed must be at least 0; got {self.seed}")

    # ---- construction

    @classmethod
    def build(cls, settings: Mapping[str, Any]) -> TrainSpec:
        """A spec from flat settings named as the node inputs are (``{"steps": 100, "optimizer": "Adam"}``);
        absent settings take their defaults, an unknown name is an error naming it. ``sample_prompts`` may be
        the text of the node's box (one prompt per line)."""
        known = setting_names()
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ValueError(f"unknown training settings: {', '.join(unknown)}")
        values = dict(settings)
        if isinstance(values.get("sample_prompts"), str):
            values["sample_prompts"] = PreviewOptions.prompts_of(values["sample_prompts"])
        parts = {}
        for part_cls in PARTS:
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[_attribute(part_cls)] = part_cls(**{k: v for k, v in values.items() if k in names})
        main = {f.name for f in dataclasses.fields(cls) if f.name not in parts}
        return cls(**{k: v for k, v in values.items() if k in main}, **parts)

    @classmethod
    def from_options(cls, options: TrainOptions | None, **main: Any) -> TrainSpec:
        """A spec from the main node's inputs and the option groups chained into it (defaults for the rest)."""
        options = options or TrainOptions()
        parts = {_attribute(p): options.part(p) for p in PARTS}
        return cls(**main, **parts)

    # ---- what it means

    def settings(self) -> dict[str, Any]:
        """Every setting, flat, by node input name (``sample_prompts`` as a list)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                out.update({g.name: _plain(getattr(value, g.name)) for g in dataclasses.fields(value)})
            else:
                out[f.name] = value
        return out

    def identity_settings(self) -> dict[str, Any]:
        """The settings a run's identity is made of (``runs.run_identity``): those an exact resume depends on."""
        settings = self.settings()
        added = _added_defaults()
        return {name: settings[name] for name, identity in _identity_flags().items()
                if identity and not (name in added and settings[name] == added[name])}

    def identities(self, dataset_fingerprint: str, *, model: str, validation: str | None,
                   world_size: int = 1) -> tuple[str, ...]:
        """The run identities of this training of the dataset ``dataset_fingerprint`` on the model whose trained
        layout is ``model`` (a digest of its class and adapter shapes) with the validation set ``validation``
        (its fingerprint, or None), on ``world_size`` processes: first the one a new run records, then the ones
        earlier releases recorded for the same settings (their values as a prompt carried them: a browser sends
        ``1`` for ``1.0``), which a queued training also continues. The batch size counted is the global one
        (``batch_size`` x ``world_size``): a run continues on another number of processes with the same global
        batch, and sees the same batches."""
        settings = dict(self.identity_settings(), model=model, validation=validation)
        settings["batch_size"] = self.global_batch_size(world_size)
        legacy = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in settings.items()}
        found = [run_identity(dataset_fingerprint, settings), run_identity(dataset_fingerprint, legacy)]
        return tuple(dict.fromkeys(found))

    def global_batch_size(self, world_size: int = 1) -> int:
        """Samples per micro-step over all ``world_size`` processes (each takes ``batch_size`` of them)."""
        return self.batch_size * int(world_size)

    def learning_rates(self, steps: int) -> list[float]:
        """The scheduled learning rate of steps 1..``steps`` (an adaptive optimizer such as Prodigy scales it by
        its own estimate)."""
        o = self.optimizer
        return [self.learning_rate * lr_factor(o.lr_schedule, s, self.steps, o.warmup_steps, o.lr_cycles,
                                               power=o.lr_power, floor=o.min_lr_ratio) for s in range(steps)]

    def loop_config(self, *, validating: bool) -> TrainConfig:
        """The training loop's configuration; ``validating``: a validation set exists."""
        o = self.optimizer
        return TrainConfig(steps=self.steps, learning_rate=self.learning_rate, optimizer=o.optimizer,
                           schedule=o.lr_schedule, warmup_steps=o.warmup_steps,
                           grad_accumulation=o.grad_accumulation_steps, max_grad_norm=o.max_grad_norm,
                           seed=self.seed, save_every=self.save_every, lora_plus_ratio=o.lora_plus_ratio,
                           cycles=o.lr_cycles, ema_decay=o.ema_decay, weight_decay=o.weight_decay,
                           lr_power=o.lr_power, min_lr_ratio=o.min_lr_ratio, optimizer_args=o.arguments,
                           validate_every=self.previews.validate_every if validating else 0,
                           grad_scaling=self.memory.training_dtype == "fp16")


def _attribute(part_cls: type) -> str:
    return {OptimizerOptions: "optimizer", ObjectiveOptions: "objective", PreviewOptions: "previews",
            MemoryOptions: "memory", DataOptions: "data", AdapterOptions: "adapter"}[part_cls]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _coerce_main(spec: TrainSpec) -> None:
    for name, kind in (("steps", int), ("learning_rate", float), ("rank", int), ("batch_size", int), ("seed", int),
                       ("resume", bool), ("save_every", int), ("devices", int), ("keep_step_saves", int)):
        object.__setattr__(spec, name, kind(getattr(spec, name)))
    object.__setattr__(spec, "lora_name", str(spec.lora_name))


def _identity_flags() -> dict[str, bool]:
    """Setting name -> whether it is part of the run identity, in a fixed order."""
    flags: dict[str, bool] = {}
    for f in dataclasses.fields(TrainSpec):
        if f.name in {_attribute(p) for p in PARTS}:
            continue
        flags[f.name] = bool(f.metadata.get("identity", True))
    for part_cls in PARTS:
        for f in dataclasses.fields(part_cls):
            flags[f.name] = bool(f.metadata.get("identity", True))
    return flags


def _added_defaults() -> dict[str, Any]:
    """Setting name -> default, of the settings added after runs were first saved (``_setting(added=True)``)."""
    return {f.name: f.default for part_cls in PARTS for f in dataclasses.fields(part_cls) if f.metadata.get("added")}


def setting_names() -> list[str]:
    """Every setting's name (the node inputs that make a spec)."""
    return list(_identity_flags())


def part_fields(part_cls: type) -> list[str]:
    """The setting names of one group, in order (the widgets of its option node)."""
    return [f.name for f in dataclasses.fields(part_cls)]


def defaults(part_cls: type) -> dict[str, Any]:
    """The defaults of one group, by setting name."""
    return {f.name: _plain(f.default) for f in dataclasses.fields(part_cls)}
