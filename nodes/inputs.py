"""Every training setting as a node input (widget, tooltip, range), defined once.

The compact Train LoRA node, its option nodes and the legacy Train LoRA node (kept so workflows saved with
earlier releases run) all take their widgets from :func:`setting_input`; each widget's default is the training
spec's (``streaming_cache.train.spec``), so a setting left out of a saved prompt means what it meant when the
prompt was saved.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from comfy_api.latest import io

from ..streaming_cache.train import layers, lora_formats, memory_plan, optim, spec, timesteps
from .backend import compat

# Inputs marked advanced are folded away until the user opens them (ComfyUI 0.33+, Nodes 2.0 mode; older versions
# show every input).
ADVANCED: dict[str, bool] = {"advanced": True} if "advanced" in inspect.signature(io.Int.Input.__init__).parameters \
    else {}
MAX_SEED = 0xFFFFFFFFFFFFFFFF


def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(spec.TrainSpec):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    for part in spec.PARTS:
        out.update(spec.defaults(part))
    return out


DEFAULTS = _defaults()


def _int(name: str, lo: int, hi: int, tooltip: str, **kw: Any) -> Callable[..., io.Input]:
    return lambda **o: io.Int.Input(name, default=DEFAULTS[name], min=lo, max=hi, tooltip=tooltip, **kw, **o)


def _float(name: str, lo: float, hi: float, step: float, tooltip: str) -> Callable[..., io.Input]:
    return lambda **o: io.Float.Input(name, default=DEFAULTS[name], min=lo, max=hi, step=step, tooltip=tooltip, **o)


def _bool(name: str, tooltip: str) -> Callable[..., io.Input]:
    return lambda **o: io.Boolean.Input(name, default=DEFAULTS[name], tooltip=tooltip, **o)


def _combo(name: str, options: Callable[[], list[str]], tooltip: str) -> Callable[..., io.Input]:
    return lambda **o: io.Combo.Input(name, options=options(), default=DEFAULTS[name], tooltip=tooltip, **o)


def _text(name: str, tooltip: str, *, multiline: bool = False) -> Callable[..., io.Input]:
    default = DEFAULTS[name]
    default = "\n".join(default) if isinstance(default, (tuple, list)) else default
    return lambda **o: io.String.Input(name, default=default, multiline=multiline, tooltip=tooltip, **o)


SETTINGS: dict[str, Callable[..., io.Input]] = {
    # ---- main
    "lora_name": _text("lora_name", "File name of the LoRA in models/loras (without extension). A different dataset "
                       "or settings under the same name train a new numbered file (my_lora_00002_) and keep the "
                       "old one."),
    "steps": _int("steps", 1, 1_000_000, "Optimizer steps to train in total (a continued run counts the steps "
                  "already done)."),
    "learning_rate": _float("learning_rate", 1e-7, 10.0, 1e-6, "Peak learning rate (1e-4 suits most LoRAs; "
                            "Prodigy: 1.0, it adapts the step size itself)."),
    "rank": _int("rank", 1, 256, "Rank of the LoRA layers: 4-16 for a style or a face, 32-64 for more detail."),
    "batch_size": _int("batch_size", 1, 256, "Samples per step. Batches only mix images of the same bucket (size)."),
    "seed": _int("seed", 0, MAX_SEED, "Seeds LoRA initialisation, the data order, the noise and caption dropout.",
                 control_after_generate=False),
    "resume": _bool("resume", "Continue the saved run of this lora_name when dataset and settings are the same "
                    "(weights, optimizer, schedule and data position). Off: always a new run; the old LoRA is kept."),
    "save_every": _int("save_every", 0, 1_000_000, "Also save <lora_name>_stepN.safetensors and the resume state "
                       "every N steps (0: only at the end and on cancel)."),
    "devices": _int("devices", 1, 64, "GPUs of this machine to train on, one process each (data-parallel: every GPU "
                    "trains batch_size samples per step, so a step sees batch_size x devices). The other GPUs load "
                    "the model themselves from its file; ComfyUI's own copy trains on its GPU. Needs a model from a "
                    "core loader (Load Checkpoint, Load Diffusion Model). Ignored under torchrun, where the "
                    "launcher decides."),
    "keep_step_saves": _int("keep_step_saves", 0, 10_000, "Keep only the last N step saves of this run "
                            "(<lora_name>_stepN.safetensors, written every save_every steps), deleting older ones as "
                            "new ones are written; 0 keeps them all. The LoRA itself and the resume state are "
                            "always kept."),
    # ---- optimizer and schedule
    "optimizer": _combo("optimizer", lambda: list(optim.OPTIMIZERS), "The optimizer. Prodigy, AdamWScheduleFree, "
                        "Lion and CAME need their pip packages (prodigyopt, schedulefree, lion-pytorch, "
                        "came-pytorch); AdamW8bit needs bitsandbytes and a CUDA GPU. Lion wants a learning rate 3-10x "
                        "below AdamW's."),
    "lr_schedule": _combo("lr_schedule", lambda: list(optim.SCHEDULES), "How the learning rate changes over the "
                          "steps (after warm-up): constant, or a decay to min_lr_ratio x the rate by cosine, linear, "
                          "polynomial (power lr_power) or cosine_with_restarts (lr_cycles times)."),
    "warmup_steps": _int("warmup_steps", 0, 100_000, "Steps over which the learning rate ramps up linearly from "
                         "zero."),
    "lr_cycles": _int("lr_cycles", 1, 100, "Restarts of the cosine_with_restarts schedule."),
    "grad_accumulation_steps": _int("grad_accumulation_steps", 1, 1024, "Batches whose gradients are summed before "
                                    "each optimizer step (a larger batch without the memory)."),
    "max_grad_norm": _float("max_grad_norm", 0.0, 1000.0, 0.1, "Clip the gradient norm to this (0: no clipping)."),
    "lora_plus_ratio": _float("lora_plus_ratio", 1.0, 64.0, 1.0, "LoRA+: learning-rate multiplier of the LoRA up "
                              "matrices (16 is the paper's choice; 1 = off)."),
    "ema_decay": _float("ema_decay", 0.0, 0.99999, 0.0001, "Keep an exponential moving average of the LoRA weights, "
                        "saved as <lora_name>_ema.safetensors (0.999 typical; 0 = off)."),
    "weight_decay": _float("weight_decay", 0.0, 1.0, 0.001, "Shrink the trained weights a little every step (AdamW: "
                           "by learning rate x weight_decay). 0.01 as AdamW, sd-scripts and OneTrainer default to; 0 "
                           "= off, as earlier releases trained."),
    "lr_power": _float("lr_power", 0.1, 10.0, 0.1, "The power of the polynomial schedule: (1 - progress)^power, as "
                       "sd-scripts' --lr_scheduler_power. 1 is linear; above 1 falls fast early, below 1 late."),
    "min_lr_ratio": _float("min_lr_ratio", 0.0, 1.0, 0.01, "The learning rate a decaying schedule (cosine, linear, "
                           "polynomial, cosine_with_restarts) ends at, as a share of learning_rate: 0.1 keeps a "
                           "tenth. 0: it decays to zero, as earlier releases did."),
    "optimizer_args": _text("optimizer_args", "More arguments for the optimizer, name=value separated by spaces, "
                            "as sd-scripts' --optimizer_args: 'betas=0.9,0.99 eps=1e-8'. Values are read as Python "
                            "literals (numbers, tuples, True/False), nothing runs. learning_rate and weight_decay "
                            "have inputs of their own."),
    # ---- timesteps and loss
    "loss_function": _combo("loss_function", lambda: list(spec.LOSS_FUNCTIONS), "The loss function."),
    "loss_weighting": _combo("loss_weighting", lambda: list(spec.LOSS_WEIGHTINGS), "x0: compare the predicted clean "
                             "latent (as ComfyUI's trainer); native: the model's own objective (noise, v or "
                             "velocity); min_snr: min-SNR-gamma weighting; debiased: debiased estimation (the noise "
                             "loss over sqrt(SNR), as sd-scripts' --debiased_estimation_loss: less weight on the "
                             "noisiest steps' loss)."),
    "min_snr_gamma": _float("min_snr_gamma", 0.1, 100.0, 0.1, "Gamma of min_snr weighting (5 is the paper's "
                            "choice)."),
    "timestep_sampling": _combo("timestep_sampling", lambda: list(timesteps.TIMESTEP_SAMPLING), "How noise levels "
                                "are drawn: uniform (the model's own schedule, with the shift its family uses), "
                                "logit_normal (SD3: more mid-range noise), sigmoid (kohya/musubi), shifted (flow "
                                "models: timestep_shift overrides the family's shift)."),
    "timestep_shift": _float("timestep_shift", 0.1, 20.0, 0.1, "The shift of 'shifted' sampling (Flux/SD3 use about "
                             "3)."),
    "timestep_scale": _float("timestep_scale", 0.1, 10.0, 0.1, "Spread of logit_normal / sigmoid sampling."),
    "noise_offset": _float("noise_offset", 0.0, 1.0, 0.01, "Noise offset (0.05-0.1 helps very dark/bright images on "
                           "eps models; 0 = off)."),
    "masked_loss": _bool("masked_loss", "Where the dataset has loss masks (name_mask.png or alpha), only the masked "
                         "area counts."),
    "min_timestep": _int("min_timestep", 0, 999, "Train only at noise levels from this timestep up (of 1000; 0 = "
                         "the least noise), as sd-scripts' --min_timestep. The levels keep the distribution "
                         "timestep_sampling gives inside the range."),
    "max_timestep": _int("max_timestep", 1, 1000, "Train only at noise levels up to this timestep (of 1000; 1000 = "
                         "pure noise), as sd-scripts' --max_timestep. A shifted draw's range is after its shift."),
    "input_perturbation": _float("input_perturbation", 0.0, 1.0, 0.01, "Input perturbation: the model sees the latent "
                                 "noised with slightly more noise than it is asked to remove, which trains it to "
                                 "correct its own errors while sampling (Ning et al. 2023; sd-scripts' "
                                 "--ip_noise_gamma; 0.1 typical; 0 = off)."),
    "guidance": _float("guidance", 0.0, 30.0, 0.1, "Guidance value given to guidance-distilled models (Flux dev, "
                       "Kontext, HunyuanVideo) while training; 1.0 as kohya and ai-toolkit train Flux."),
    # ---- sample previews and validation
    "sample_prompts": _text("sample_prompts", "Prompts for sample images during training, one per line (empty: no "
                            "samples). Needs clip and vae. Shown live on Train LoRA and saved in "
                            "output/lora_training/<lora_name>_samples.", multiline=True),
    "sample_every": _int("sample_every", 0, 1_000_000, "Sample the prompts every N steps (0: only at the end)."),
    "sample_steps": _int("sample_steps", 1, 200, "Sampling steps per preview image."),
    "sample_cfg": _float("sample_cfg", 0.0, 30.0, 0.1, "CFG of the previews (1.0 for guidance-distilled models such "
                         "as Flux)."),
    "sample_seed": _int("sample_seed", 0, MAX_SEED, "Seed of the previews: the same for every preview, so they show "
                        "what training changed.", control_after_generate=False),
    "validation_split": _float("validation_split", 0.0, 0.5, 0.01, "Share of the images held out for a validation "
                               "loss (0: none, unless a validation dataset is connected). The same images stay held "
                               "out as the dataset grows."),
    "validate_every": _int("validate_every", 1, 1_000_000, "Score the validation images every N steps, with fixed "
                           "timesteps and noise, so the values compare across steps and runs."),
    "plot_scale": _combo("plot_scale", lambda: list(spec.PLOT_SCALES), "The loss plot's loss axis: linear, or log "
                         "(reads long runs whose loss falls by orders of magnitude)."),
    # ---- memory and precision
    "training_dtype": _combo("training_dtype", lambda: list(spec.TRAINING_DTYPES), "The dtype the model computes in "
                             "while training. bf16 for current GPUs; fp16 for GPUs without bf16 (T4, V100, RTX "
                             "20xx), with a gradient scaler that skips the rare step whose gradients overflow; fp32 "
                             "is exact and slow."),
    "lora_dtype": _combo("lora_dtype", lambda: list(spec.LORA_DTYPES), "The dtype of the LoRA weights."),
    "gradient_checkpointing": _bool("gradient_checkpointing", "Recompute activations in the backward pass: much less "
                                    "memory, up to one more forward pass of work a step."),
    "checkpoint_depth": _int("checkpoint_depth", 1, 5, "With gradient_checkpointing: which level of blocks is "
                             "recomputed in the backward pass. 1: the model's top-level blocks (least memory); 2 and "
                             "more: smaller pieces inside them, which keep more activations. (ComfyUI's own trainer "
                             "counts the whole model as depth 1: its depth 2 is this depth 1.)"),
    "offloading": _bool("offloading", "Keep only part of the frozen model on the GPU and stream the rest from RAM "
                        "layer by layer: trains models larger than the GPU's memory, more slowly. Needs a ComfyUI "
                        "newer than v0.3.64."),
    "bypass_mode": _bool("bypass_mode", "Run the LoRA as a branch beside each layer instead of adding it to the "
                         "layer's weight: the base weights stay untouched, so fp8 and other quantized models train, "
                         "and big models use less memory. The saved LoRA is the same. Needs a ComfyUI newer than "
                         "v0.3.64."),
    "cuda_graphs": _bool("cuda_graphs", "On a CUDA GPU, record the model's forward and backward pass once and "
                         "replay them each step instead of issuing thousands of kernels from Python (SDXL on an "
                         "H200, code of commit 14daaef: 0.30 s a step, 1.61 s without). The first replay is checked "
                         "against a plain step. Not used with offloading, bypass mode, several GPUs or on AMD GPUs; "
                         "a model that cannot be recorded, or a replay that fails or disagrees, trains as before, "
                         "and the node says why."),
    "checkpoint_share": _float("checkpoint_share", 0.0, 1.0, 0.05, "With gradient_checkpointing: the share of the "
                               "blocks at checkpoint_depth recomputed in the backward pass, spread evenly over the "
                               "model. 1: all (least memory). Lower: the other blocks keep their activations "
                               "instead, more memory and less work (0 saves up to a third of a step): use the GPU "
                               "memory that is left. Same LoRA at any share."),
    "plan": _combo("plan", lambda: list(memory_plan.PLANS), "auto: before the first step, estimate this model's "
                   "training step at this resolution and batch size and choose the fastest memory settings that fit "
                   "the GPU's free memory (no checkpointing, half of the blocks recomputed, checkpointing, graphs off, "
                   "offloading), changing only the settings left at their defaults; the summary says what it chose. "
                   "manual: the settings as set, with a warning when they will not fit."),
    # ---- captions and data
    "caption_dropout": _float("caption_dropout", 0.0, 1.0, 0.01, "Share of samples trained with the empty caption "
                              "(helps the LoRA work without its trigger words and with CFG; 0.05-0.1 typical)."),
    "workers": _int("workers", 0, 64, "Reader threads (clamped to the CPU count; 0 reads in the training thread)."),
    "prefetch": _int("prefetch", 1, 64, "Batches read ahead in the background."),
    # ---- adapter
    "algorithm": _combo("algorithm", lambda: compat.ALGORITHMS, "The adapter type (LoRA, LoHa, LoKr, OFT, ...)."),
    "existing_lora": _combo("existing_lora", lambda: [spec.NO_LORA] + compat.lora_names(), "Continue training the "
                            "weights of an existing LoRA (its layout is kept; a file in kohya's or diffusers' format "
                            "is read too)."),
    "lora_format": _combo("lora_format", lambda: list(lora_formats.FORMATS), "Key format of the saved file, and so "
                          "which tools load it. comfyui (default): ComfyUI, with everything trained. kohya: A1111, "
                          "Forge, SD.Next, Civitai, kohya's scripts and ComfyUI. diffusers: diffusers' "
                          "load_lora_weights (SD 1.x/2.x, SDXL, SD3, Flux) and ComfyUI. kohya and diffusers leave "
                          "out the offsets of norms and biases, which only ComfyUI reads (target_layers 'matrices' "
                          "trains none). Changing it continues the same run; the lora output stays in ComfyUI's "
                          "keys."),
    "alpha": _float("alpha", 0.01, 1024.0, 0.5, "The LoRA's alpha: its layers are scaled by alpha / rank (saved in "
                    "the file; the loaders apply it). 1, as earlier releases trained, gives 1 / rank, so a higher "
                    "rank learns more slowly at the same learning rate; alpha = rank gives scale 1, as ai-toolkit's "
                    "configs do. LoHa and LoKr scale alike; OFT takes it as its constraint. A continued LoRA keeps "
                    "its file's alpha."),
    "target_layers": _combo("target_layers", lambda: list(layers.TARGET_LAYERS), "Which layers the LoRA trains. "
                            "all: every layer ComfyUI can patch, norm and bias offsets included (as ComfyUI's trainer; "
                            "only ComfyUI reads the offsets). matrices: every linear and convolution layer (what "
                            "kohya and diffusers files hold). attention_mlp: the attention and feed-forward layers. "
                            "attention: attention only (Flux's single blocks, attention and MLP in one matrix, "
                            "count as attention). Fewer layers: a smaller file that changes less of the model."),
    "layer_filter": _text("layer_filter", "Train only layers whose name holds one of these pieces, separated by "
                          "commas or new lines ('double_blocks, attn1'), or matches a regular expression written "
                          "after re: ('re:input_blocks\\.[4-8]\\.'). Names are ComfyUI's "
                          "(input_blocks.4.1.transformer_blocks.0.attn1.to_q, double_blocks.3.img_attn.qkv). "
                          "Applies after target_layers; empty: no filter.", multiline=True),
    "layer_ranks": _text("layer_ranks", "A rank per block group: pattern=rank items, separated by commas or new "
                         "lines ('single_blocks=8, re:output_blocks\\.[0-2]\\.=32'), the pattern as in "
                         "layer_filter. The first item that matches a layer gives its rank; 0 leaves the layer "
                         "out; other layers take rank.", multiline=True),
    "dora": _bool("dora", "DoRA: each LoRA layer also learns the norm of the weight's columns, apart from its "
                  "direction (Liu et al. 2024; OneTrainer's lora_decompose, LyCORIS' dora_wd). Often closer to full "
                  "fine-tuning at the same rank, slower per step. Saved as dora_scale, which ComfyUI, A1111 and "
                  "Forge read (kohya and comfyui formats). LoRA algorithm only; not in bypass mode."),
}


def setting_input(name: str, **options: Any) -> io.Input:
    """The node input of training setting ``name`` (``options``: ``optional=True``, ``**ADVANCED``, ...)."""
    return SETTINGS[name](**options)


def settings_from(values: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The settings ``names`` from a node's input values, each missing one at its default (an input added in a
    later release is absent from prompts saved before it)."""
    return {n: values.get(n, DEFAULTS[n]) for n in names}
