"""TrainLoRA: trains a LoRA from a streaming dataset through ComfyUI's own model and sampling machinery.

The node validates its inputs, decides which run a request continues and where its files go
(``streaming_cache.train.runs``), shows progress, the live loss plot and sample previews, and saves. The training
itself is ``lora.train_lora`` (ComfyUI side) around ``streaming_cache.train.loop`` (ComfyUI-free).

Training runs in chunks that end where sample previews are due: each chunk is one pass of ComfyUI's guider, so
previews are drawn between chunks by ComfyUI's ordinary sampling path, never inside a running training pass.
Chunks continue each other from the in-memory checkpoint, exactly as a resume from disk would.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import torch
import tqdm

import comfy.model_management
import comfy.utils
import node_helpers
from comfy_api.latest import io

from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.train import checkpoint, holdout, loop, optim, runs, timesteps
from ..streaming_cache.train.metadata import lora_metadata
from ..streaming_cache.train.paths import plain_name
from ..streaming_cache.train.plot import loss_plot
from . import compat, lora
from .folders import EMPTY_CAPTION, loras_folder, output_folder, state_folder
from .previews import LivePreview, Previews, PreviewSettings
from .ui import ADVANCED, StreamingDataset, log, node_schema, show_text

LOSS_WEIGHTING = ("x0", "native", "min_snr")
TRAINING_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VALIDATION_ROWS = 16  # validation samples scored at every validation (fixed timesteps, fixed noise)


class _Progress:
    """ComfyUI's progress bar (which also checks the Cancel button), the terminal bar, the loss as node text and
    the live preview (samples above the loss plot)."""

    def __init__(self, node_id: str | None, name: str, steps: int, start: int, losses: list[float],
                 validation: list[tuple[int, float]]):
        self.node_id, self.steps, self.step = node_id, steps, start
        self.losses, self.validation = list(losses), list(validation)
        self.pbar = comfy.utils.ProgressBar(steps, node_id=node_id)
        self.live = LivePreview(self.pbar)
        self.bar = tqdm.tqdm(total=steps, initial=start, desc=f"Training {name}",
                             disable=not comfy.utils.PROGRESS_BAR_ENABLED)
        self.last_text = 0.0

    def __call__(self, step: int, loss: float) -> None:
        self.step = step
        self.losses.append(loss)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        self.pbar.update_absolute(step, self.steps)
        self.live.update(step, self.steps, self.losses, self.validation)
        now = time.monotonic()
        if now - self.last_text > 0.25 or step == self.steps:
            self.last_text = now
            val = f"  validation {self.validation[-1][1]:.4f}" if self.validation else ""
            show_text(self.node_id, f"step {step}/{self.steps}  loss {loss:.4f}{val}", log_it=False)
        comfy.model_management.throw_exception_if_processing_interrupted()

    def samples(self, image: torch.Tensor) -> None:
        self.live.samples = image
        self.live.update(self.step, self.steps, self.losses, self.validation, force=True)

    def close(self) -> None:
        self.bar.close()


class _Files:
    """The files of one run (``runs.RunPlan``): resume state with its identity, the LoRA with its metadata, the
    EMA copy and periodic snapshots. Every write is atomic."""

    def __init__(self, plan: runs.RunPlan, identity: str, dtype: torch.dtype, save_every: int, metadata: Any):
        self.plan, self.identity, self.dtype, self.save_every, self.metadata = plan, identity, dtype, save_every, metadata
        self.last: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        return checkpoint.load_checkpoint(self.plan.resume_state_path) if self.plan.resumes else None

    def save(self, state: dict[str, Any], final: bool) -> None:
        self.last = state
        checkpoint.save_checkpoint(self.plan.state_path, state)
        runs.write_run_identity(self.plan.state_path, self.identity)
        meta = self.metadata(state["step"])
        weights = {k: v.to(self.dtype) for k, v in (state.get("weights") or state["params"]).items()}
        checkpoint.save_lora(self.plan.lora_path, weights, meta)
        if state.get("ema_weights"):
            checkpoint.save_lora(self.plan.ema_path, {k: v.to(self.dtype) for k, v in state["ema_weights"].items()},
                                 dict(meta, streaming_cache_ema="true"))
        if not final and self.save_every and state["step"] % self.save_every == 0:
            checkpoint.save_lora(self.plan.step_path(state["step"]), weights, meta)
        log.info("saved %s at step %d", self.plan.lora_path, state["step"])


DESCRIPTION = ("Trains a LoRA on a streaming dataset. Batches are read from disk in the background, so the dataset "
               "never has to fit in RAM. Saves to models/loras/<lora_name>.safetensors (usable by Load LoRA). "
               "Queue again with the same dataset and settings to continue (e.g. after raising steps or a cancel); "
               "anything else trains a new numbered LoRA and keeps the old one. Optional sample previews and a "
               "validation loss show live on the node.")


def _inputs() -> list:
    loras = compat.lora_names()
    return [
        io.Model.Input("model", tooltip="The model to train the LoRA on."),
        StreamingDataset.Input("dataset", tooltip="From Encode Dataset or Load Streaming Cache."),
        io.String.Input("lora_name", default="my_lora",
                        tooltip="File name of the LoRA in models/loras (without extension). A different dataset or "
                                "settings under the same name train a new numbered file (my_lora_00002_) and keep "
                                "the old one."),
        io.Int.Input("steps", default=500, min=1, max=1_000_000,
                     tooltip="Optimizer steps to train in total (a continued run counts the steps already done)."),
        io.Int.Input("batch_size", default=1, min=1, max=256,
                     tooltip="Samples per step. Batches only mix images of the same bucket (size)."),
        io.Int.Input("grad_accumulation_steps", default=1, min=1, max=1024,
                     tooltip="Batches whose gradients are summed before each optimizer step."),
        io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=10.0, step=1e-6,
                       tooltip="Peak learning rate (Prodigy: 1.0, it adapts the step size itself)."),
        io.Combo.Input("lr_schedule", options=list(optim.SCHEDULES), default="constant",
                       tooltip="How the learning rate changes over the steps (after warm-up). cosine_with_restarts "
                               "restarts lr_cycles times."),
        io.Int.Input("warmup_steps", default=0, min=0, max=100_000,
                     tooltip="Steps over which the learning rate ramps up linearly from zero."),
        io.Int.Input("rank", default=16, min=1, max=256, tooltip="Rank of the LoRA layers."),
        io.Combo.Input("optimizer", options=list(optim.OPTIMIZERS), default="AdamW",
                       tooltip="The optimizer. Prodigy and AdamWScheduleFree need their pip packages (prodigyopt, "
                               "schedulefree); AdamW8bit needs bitsandbytes and a CUDA GPU."),
        io.Combo.Input("loss_function", options=list(lora.LOSSES), default="MSE", tooltip="The loss function."),
        io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=False,
                     tooltip="Seeds LoRA initialisation, the data order, the noise and caption dropout."),
        io.Combo.Input("training_dtype", options=list(TRAINING_DTYPES), default="bf16",
                       tooltip="The dtype the model computes in while training. bf16 for current GPUs; fp16 for "
                               "GPUs without bf16 (T4, V100, RTX 20xx), with a gradient scaler that skips the "
                               "rare step whose gradients overflow; fp32 is exact and slow."),
        io.Combo.Input("lora_dtype", options=["bf16", "fp32"], default="bf16",
                       tooltip="The dtype of the LoRA weights."),
        io.Combo.Input("algorithm", options=compat.ALGORITHMS, default=compat.ALGORITHMS[0],
                       tooltip="The adapter type (LoRA, LoHa, LoKr, OFT, ...)."),
        io.Boolean.Input("gradient_checkpointing", default=True,
                         tooltip="Recompute activations in the backward pass: much less memory, ~30% slower."),
        io.Combo.Input("existing_lora", options=["[None]"] + loras, default="[None]",
                       tooltip="Continue training the weights of an existing LoRA (its layout is kept)."),
        io.Int.Input("save_every", default=0, min=0, max=1_000_000,
                     tooltip="Also save <lora_name>_stepN.safetensors and the resume state every N steps "
                             "(0: only at the end and on cancel)."),
        io.Boolean.Input("resume", default=True,
                         tooltip="Continue the saved run of this lora_name when dataset and settings are the same "
                                 "(weights, optimizer, schedule and data position). Off: always a new run; the old "
                                 "LoRA is kept."),
        io.Int.Input("prefetch", default=2, min=1, max=64, tooltip="Batches read ahead in the background.", **ADVANCED),
        io.Int.Input("workers", default=2, min=0, max=64,
                     tooltip="Reader threads (clamped to the CPU count; 0 reads in the training thread).", **ADVANCED),
        # ---- sample previews
        io.String.Input("sample_prompts", default="", multiline=True,
                        tooltip="Prompts for sample images during training, one per line (empty: no samples). "
                                "Needs clip and vae connected. Shown live on the node and saved in "
                                "output/lora_training/<lora_name>_samples."),
        io.Int.Input("sample_every", default=250, min=0, max=1_000_000,
                     tooltip="Sample the prompts every N steps (0: only at the end)."),
        io.Int.Input("sample_steps", default=20, min=1, max=200, tooltip="Sampling steps per preview image.", **ADVANCED),
        io.Float.Input("sample_cfg", default=4.0, min=0.0, max=30.0, step=0.1,
                       tooltip="CFG of the previews (1.0 for guidance-distilled models such as Flux).", **ADVANCED),
        io.Int.Input("sample_seed", default=42, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=False,
                     tooltip="Seed of the previews: the same for every preview, so they show what training changed.",
                     **ADVANCED),
        # ---- validation
        io.Float.Input("validation_split", default=0.0, min=0.0, max=0.5, step=0.01,
                       tooltip="Share of the images held out for a validation loss (0: none, unless a validation "
                               "dataset is connected). The same images stay held out as the dataset grows."),
        io.Int.Input("validate_every", default=100, min=1, max=1_000_000,
                     tooltip="Score the validation images every N steps, with fixed timesteps and noise, so the "
                             "values compare across steps and runs."),
        # ---- timesteps and loss
        io.Combo.Input("timestep_sampling", options=list(timesteps.TIMESTEP_SAMPLING), default="uniform",
                       tooltip="How noise levels are drawn: uniform (the model's own schedule, with the shift its "
                               "family uses), logit_normal (SD3: more mid-range noise), sigmoid (kohya/musubi), "
                               "shifted (flow models: timestep_shift overrides the family's shift).", **ADVANCED),
        io.Float.Input("timestep_shift", default=3.0, min=0.1, max=20.0, step=0.1,
                       tooltip="The shift of 'shifted' sampling (Flux/SD3 use about 3).", **ADVANCED),
        io.Float.Input("timestep_scale", default=1.0, min=0.1, max=10.0, step=0.1,
                       tooltip="Spread of logit_normal / sigmoid sampling.", **ADVANCED),
        io.Combo.Input("loss_weighting", options=list(LOSS_WEIGHTING), default="x0",
                       tooltip="x0: compare the predicted clean latent (as ComfyUI's trainer); native: the model's "
                               "own objective (noise, v or velocity); min_snr: min-SNR-gamma weighting.", **ADVANCED),
        io.Float.Input("min_snr_gamma", default=5.0, min=0.1, max=100.0, step=0.1,
                       tooltip="Gamma of min_snr weighting (5 is the paper's choice).", **ADVANCED),
        io.Float.Input("noise_offset", default=0.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Noise offset (0.05-0.1 helps very dark/bright images on eps models; 0 = off).",
                       **ADVANCED),
        io.Boolean.Input("masked_loss", default=True,
                         tooltip="Where the dataset has loss masks (name_mask.png or alpha), only the masked area "
                                 "counts."),
        io.Float.Input("caption_dropout", default=0.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Share of samples trained with the empty caption (helps the LoRA work without its "
                               "trigger words and with CFG; 0.05-0.1 typical)."),
        io.Float.Input("guidance", default=1.0, min=0.0, max=30.0, step=0.1,
                       tooltip="Guidance value given to guidance-distilled models (Flux dev, Kontext, "
                               "HunyuanVideo) while training; 1.0 as kohya and ai-toolkit train Flux.", **ADVANCED),
        # ---- optimizer extras
        io.Float.Input("max_grad_norm", default=1.0, min=0.0, max=1000.0, step=0.1,
                       tooltip="Clip the gradient norm to this (0: no clipping).", **ADVANCED),
        io.Float.Input("lora_plus_ratio", default=1.0, min=1.0, max=64.0, step=1.0,
                       tooltip="LoRA+: learning-rate multiplier of the LoRA up matrices (16 is the paper's choice; "
                               "1 = off).", **ADVANCED),
        io.Int.Input("lr_cycles", default=1, min=1, max=100,
                     tooltip="Restarts of the cosine_with_restarts schedule.", **ADVANCED),
        io.Float.Input("ema_decay", default=0.0, min=0.0, max=0.99999, step=0.0001,
                       tooltip="Keep an exponential moving average of the LoRA weights, saved as "
                               "<lora_name>_ema.safetensors (0.999 typical; 0 = off).", **ADVANCED),
        # ---- big models on small GPUs
        io.Int.Input("checkpoint_depth", default=1, min=1, max=5,
                     tooltip="With gradient_checkpointing: which level of blocks is recomputed in the backward pass. "
                             "1: the model's top-level blocks (least memory); 2 and more: smaller pieces inside "
                             "them, which keep more activations. (ComfyUI's own trainer counts the whole model as "
                             "depth 1: its depth 2 is this depth 1.)", **ADVANCED),
        io.Boolean.Input("offloading", default=False,
                         tooltip="Keep only part of the frozen model on the GPU and stream the rest from RAM layer "
                                 "by layer: trains models larger than the GPU's memory, more slowly. Needs a "
                                 "ComfyUI newer than v0.3.64."),
        io.Boolean.Input("bypass_mode", default=False,
                         tooltip="Run the LoRA as a branch beside each layer instead of adding it to the layer's "
                                 "weight: the base weights stay untouched, so fp8 and other quantized models train, "
                                 "and big models use less memory. The saved LoRA is the same. Needs a ComfyUI "
                                 "newer than v0.3.64."),
        # ---- optional inputs
        io.Clip.Input("clip", optional=True, tooltip="The text encoder, to encode the sample prompts."),
        io.Vae.Input("vae", optional=True, tooltip="The VAE, to decode the sample images."),
        StreamingDataset.Input("validation_dataset", optional=True,
                               tooltip="A separate dataset to compute the validation loss on (instead of a split)."),
    ]


def _outputs() -> list:
    return [
        io.Model.Output("model_with_lora", display_name="model_with_lora",
                        tooltip="The model with the trained LoRA applied."),
        io.LoraModel.Output("lora", display_name="lora",
                            tooltip="The LoRA weights (for Save LoRA / Load LoRA Model)."),
        io.LossMap.Output("loss", display_name="loss", tooltip="Loss per step."),
        io.Image.Output("loss_plot", display_name="loss_plot",
                        tooltip="Loss per step (light), its moving average (dark) and the validation loss."),
        io.Int.Output("steps_trained", display_name="steps_trained", tooltip="Steps trained in total."),
        io.Image.Output("samples", display_name="samples",
                        tooltip="The last sample previews (a blank image when there are none)."),
    ]


# Settings whose change starts a new run (the engine ignores the ones that never affect the weights).
_RUN_SETTINGS = ("batch_size", "grad_accumulation_steps", "learning_rate", "lr_schedule", "warmup_steps", "rank",
                 "optimizer", "loss_function", "seed", "training_dtype", "lora_dtype", "algorithm", "existing_lora",
                 "validation_split", "timestep_sampling", "timestep_shift", "timestep_scale", "loss_weighting",
                 "min_snr_gamma", "noise_offset", "masked_loss", "caption_dropout", "guidance", "max_grad_norm",
                 "lora_plus_ratio", "lr_cycles", "ema_decay", "gradient_checkpointing")


def _layout_digest(model: Any, lora_sd: dict[str, torch.Tensor]) -> str:
    """The model class and the trained tensors' names and shapes: another base model is another run."""
    text = json.dumps([type(model.model).__name__, sorted((k, list(v.shape)) for k, v in lora_sd.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema("StreamingCacheTrainLoRA", "Train LoRA (streaming cache)", DESCRIPTION,
                           _inputs(), _outputs(), output_node=True)

    @classmethod
    def execute(cls, model, dataset, clip=None, vae=None, validation_dataset=None, **s) -> io.NodeOutput:
        name = plain_name(s["lora_name"], what="lora_name")
        _check_dataset(dataset)
        compat.check_memory_options(offloading=s["offloading"], bypass=s["bypass_mode"])
        started = time.time()
        train_data, val_data = _validation_data(dataset, validation_dataset, s["validation_split"])
        config = loop.TrainConfig(
            steps=s["steps"], learning_rate=s["learning_rate"], optimizer=s["optimizer"], schedule=s["lr_schedule"],
            warmup_steps=s["warmup_steps"], grad_accumulation=s["grad_accumulation_steps"], seed=s["seed"],
            save_every=s["save_every"], max_grad_norm=s["max_grad_norm"], lora_plus_ratio=s["lora_plus_ratio"],
            cycles=s["lr_cycles"], ema_decay=s["ema_decay"], validate_every=s["validate_every"] if val_data else 0,
            grad_scaling=s["training_dtype"] == "fp16")
        missing = optim.missing_package(s["optimizer"])
        if missing:
            raise ValueError(missing)
        previews = Previews(PreviewSettings.parse(s["sample_prompts"], s["sample_every"], s["sample_steps"],
                                                  s["sample_cfg"], s["sample_seed"]), clip, vae,
                            os.path.join(output_folder(), "lora_training", f"{name}_samples"), name)
        fingerprint = train_data.fingerprint()
        ldtype = node_helpers.string_to_torch_dtype(s["lora_dtype"])
        dtype = TRAINING_DTYPES[s["training_dtype"]]
        mp = compat.training_clone(model)
        mp.set_model_compute_dtype(dtype)
        with compat.training_mode():
            existing = {} if s["existing_lora"] == "[None]" else \
                comfy.utils.load_torch_file(compat.existing_lora_path(s["existing_lora"]))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(s["seed"])
                lora_sd = lora.create_adapters(mp, s["rank"], s["algorithm"], ldtype, existing,
                                               bypass=s["bypass_mode"])
        if not lora_sd:
            raise ValueError("this model has no layers ComfyUI can train a LoRA on")
        settings = {k: s[k] for k in _RUN_SETTINGS}
        identity = runs.run_identity(fingerprint, dict(settings, model=_layout_digest(mp, lora_sd),
                                                       validation=val_data.fingerprint() if val_data else None))
        plan = runs.plan_run(loras_folder(), state_folder(), name, identity, s["resume"])
        log.info("%s", plan.reason)

        def metadata(step: int) -> dict[str, str]:
            return lora_metadata(dict(settings, steps=s["steps"]), dataset_fingerprint=fingerprint,
                                 steps_done=step, num_train_images=len(train_data), output_name=plan.name,
                                 base_model=type(mp.model).__name__, started_at=started)

        files = _Files(plan, identity, ldtype, s["save_every"], metadata)
        state = files.load()
        start = 0 if state is None else int(state["step"])
        progress = _Progress(cls.hidden.unique_id, plan.name, s["steps"], start,
                             [] if state is None else list(state["losses"]),
                             [] if state is None else [tuple(v) for v in state.get("validation") or []])
        loss = lora.DiffusionLoss(lora.LOSSES[s["loss_function"]](), dtype, s["seed"], guidance=s["guidance"],
                                  options=_loss_options(s, train_data))
        validate = lora.Validation(loss, val_data, rows=VALIDATION_ROWS) if val_data else None
        latent_shape = tuple(lora.flatten_batch(train_data.collate([0])["latent"]["samples"]).shape)
        samples = None
        result = loop.TrainResult(step=start, losses=list(progress.losses))
        try:
            with compat.training_mode():
                while True:
                    stop_at = _next_stop(previews, start if state is None else int(state["step"]), s["steps"])
                    result = lora.train_lora(mp, train_data, lora_sd, loss, config, batch_size=s["batch_size"],
                                             workers=s["workers"], prefetch=s["prefetch"],
                                             checkpoint_depth=s["checkpoint_depth"] if s["gradient_checkpointing"]
                                             else 0, resume=state, on_step=progress, save=files.save,
                                             validate=validate, should_stop=lambda: progress.step >= stop_at,
                                             offloading=s["offloading"])
                    if validate is not None:
                        progress.validation = list(result.validation)
                    state = files.last
                    if previews.due(result.step, s["steps"]):
                        with compat.bypass_hooks(lora_sd.bypass, mp):
                            samples = previews.render(mp, latent_shape, result.step)
                        progress.samples(samples)
                    if result.step >= s["steps"] or not result.stopped:
                        break
        finally:
            progress.close()
        weights = result.weights if result.weights is not None else {k: v.detach() for k, v in lora_sd.items()}
        lora_out = {k: v.detach().to(ldtype) for k, v in weights.items()}
        text = _summary(plan, start, result, s["steps"], previews)
        show_text(cls.hidden.unique_id, text)
        plot = loss_plot(result.losses, validation=result.validation or None)
        ui: dict[str, Any] = {"text": [text]}
        if previews.saved:
            ui["images"] = [{"filename": os.path.basename(p), "subfolder": os.path.relpath(
                os.path.dirname(p), output_folder()), "type": "output"} for p in previews.saved[-len(previews.positive):]]
        return io.NodeOutput(compat.apply_lora(model, lora_out, bypass=s["bypass_mode"]), lora_out,
                             {"loss": list(result.losses)}, plot, result.step,
                             samples if samples is not None else torch.ones(1, 64, 64, 3), ui=ui)


def _next_stop(previews: Previews, step: int, steps: int) -> int:
    """The step the current chunk ends at: the next due preview, or the end."""
    every = previews.settings.every
    if not previews.settings.enabled or every <= 0:
        return steps
    return min(steps, (step // every + 1) * every)


def _summary(plan: runs.RunPlan, start: int, result: loop.TrainResult, steps: int, previews: Previews) -> str:
    lines = [plan.reason]
    if result.step > start:
        lines.append(f"trained {plan.name}: steps {start + 1}-{result.step} of {steps}, final loss "
                     f"{result.losses[-1]:.4f} -> {plan.lora_path}")
    else:
        lines.append(f"{plan.name}: already trained for {result.step} steps (raise steps to continue, or turn resume "
                     f"off for a new run) -> {plan.lora_path}")
    if result.validation:
        lines.append(f"validation loss {result.validation[-1][1]:.4f} at step {result.validation[-1][0]}")
    if result.overflow_steps:
        lines.append(f"fp16: {result.overflow_steps} steps skipped by the gradient scaler (gradients overflowed)")
    if result.ema_weights:
        lines.append(f"EMA weights -> {plan.ema_path}")
    if previews.saved:
        lines.append(f"{len(previews.saved)} sample images in {previews.folder}")
    return "\n".join(lines)


def _loss_options(s: dict[str, Any], dataset: DatasetHandle) -> lora.LossOptions:
    empty = _empty_caption(dataset) if s["caption_dropout"] > 0 else None
    return lora.LossOptions(
        timestep_sampling=s["timestep_sampling"], timestep_shift=s["timestep_shift"],
        timestep_scale=s["timestep_scale"],
        space="native" if s["loss_weighting"] == "native" else "x0",
        min_snr_gamma=s["min_snr_gamma"] if s["loss_weighting"] == "min_snr" else 0.0,
        noise_offset=s["noise_offset"], masked=s["masked_loss"], caption_dropout=s["caption_dropout"],
        empty_caption=empty)


def _empty_caption(dataset: DatasetHandle) -> Any:
    """The conditioning of the empty caption that Encode Dataset stores beside the dataset (for dropout)."""
    for cache in dataset.caches:
        try:
            handle = DatasetHandle.from_cache(cache, EMPTY_CAPTION)
        except KeyError:  # a cache without it (made by an older version or the Python API)
            continue
        if len(handle):
            return handle[0].materialize()["cond"]
    raise ValueError("caption_dropout needs the empty caption's conditioning, which this cache does not have: run "
                     "Encode Dataset on it again (it adds it without re-encoding anything else), or set "
                     "caption_dropout to 0")


def _validation_data(dataset: DatasetHandle, extra: DatasetHandle | None,
                     fraction: float) -> tuple[DatasetHandle, DatasetHandle | None]:
    if extra is not None:
        _check_dataset(extra)
        return dataset, extra
    if fraction <= 0:
        return dataset, None
    train, val = holdout.split(dataset, fraction)
    if len(val) == 0:
        raise ValueError("validation_split needs at least two images in the dataset; set it to 0")
    return train, val


def _check_dataset(dataset: DatasetHandle) -> None:
    if len(dataset) == 0:
        raise ValueError("the dataset is empty; encode some images first")
    missing = {"cond", "latent"} - set(dataset.columns)
    unknown = set(dataset.columns) - {"cond", "latent", "ref", "mask"}
    if missing or unknown:
        raise ValueError(f"the dataset has columns {dataset.columns}; training needs latent and cond (optionally "
                         "ref and mask): use one made by Encode Dataset")
