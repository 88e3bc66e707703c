"""TrainLoRA: trains a LoRA from a streaming dataset through ComfyUI's own model and sampling machinery.

Like ComfyUI's TrainLoraNode, the model runs inside a guider's ``sample`` call (so conditioning is prepared by
ComfyUI for whatever architecture it is: SD1.x, SDXL, Flux-family, ...), but batches come from the streaming
loader (prefetched on threads, pinned, copied on a CUDA side stream) instead of living in RAM, each sample keeps
its own caption, progress and cancel work every step, and checkpoints resume exactly.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import tqdm

import comfy.model_management
import comfy.sampler_helpers
import comfy.samplers
import comfy.utils
import node_helpers
from comfy_api.latest import io

from ..streaming_cache import training
from ..streaming_cache.loader import BatchLoader
from ..streaming_cache.paths import plain_name
from ..streaming_cache.plot import loss_plot
from . import compat
from .common import StreamingDataset, log, show_text

LOSSES = {"MSE": torch.nn.MSELoss, "L1": torch.nn.L1Loss, "Huber": torch.nn.HuberLoss,
          "SmoothL1": torch.nn.SmoothL1Loss}


def state_folder() -> str:
    return os.path.join(compat.output_folder(), "lora_training")


def create_adapters(mp: Any, rank: int, algorithm: str, lora_dtype: torch.dtype,
                    existing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainable adapters on every weight ComfyUI can patch, as its TrainLoraNode creates them; returns the
    LORA_MODEL dict (keys ``diffusion_model.<module>.<param>``) whose tensors are the trainable parameters."""
    lora_sd: dict[str, torch.Tensor] = {}
    for n, m in mp.model.named_modules():
        if not hasattr(m, "weight_function"):
            continue
        if m.weight is not None:
            key = f"{n}.weight"
            if len(m.weight.shape) >= 2:
                alpha = float(existing.get(f"{key}.alpha", 1.0))
                found = None
                for adapter_cls in compat.WEIGHT_ADAPTERS:
                    found = adapter_cls.load(n, existing, alpha, existing.get(f"{key}.dora_scale"))
                    if found is not None:
                        break
                if found is not None:
                    adapter = found.to_train().to(lora_dtype)
                else:
                    adapter = compat.adapter_maps[algorithm].create_train(m.weight, rank=rank, alpha=1.0).to(lora_dtype)
                for name, parameter in adapter.named_parameters():
                    lora_sd[f"{n}.{name}"] = parameter
                mp.add_weight_wrapper(key, adapter)
            else:
                diff = torch.nn.Parameter(torch.zeros(m.weight.shape, dtype=lora_dtype, requires_grad=True))
                mp.add_weight_wrapper(key, compat.BiasDiff(diff))
                lora_sd[f"{n}.diff"] = diff
        if getattr(m, "bias", None) is not None:
            bias = torch.nn.Parameter(torch.zeros(m.bias.shape, dtype=lora_dtype, requires_grad=True))
            mp.add_weight_wrapper(f"{n}.bias", compat.BiasDiff(bias))
            lora_sd[f"{n}.diff_b"] = bias
    return lora_sd


def _flatten_batch(t: torch.Tensor) -> torch.Tensor:
    """Collated entries are stacked on a new first dim; ComfyUI values already carry a batch dim of 1."""
    return t.flatten(0, 1) if t.dim() >= 2 else t


def batch_conditioning(cond: Any) -> list:
    """A collated CONDITIONING (one list per entry, stacked) -> one CONDITIONING with batch = samples, so each
    sample keeps its own caption (ComfyUI's TrainLoraNode averages all captions of a batch instead)."""
    out = []
    for c, extra in cond:
        opts = {}
        for k, v in extra.items():
            if isinstance(v, torch.Tensor):
                opts[k] = _flatten_batch(v)
            elif isinstance(v, list) and v:
                opts[k] = v[0]  # per-sample scalars (e.g. guidance) are equal within a caption encoder
            else:
                opts[k] = v
        out.append([_flatten_batch(c), opts])
    return out


class _StreamingSampler(comfy.samplers.Sampler):
    """Runs the training loop where ComfyUI runs a sampler: model loaded, options and patches in place."""

    def __init__(self, run: Any):
        self.run = run
        self.result: training.TrainResult | None = None

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        self.result = self.run(model_wrap, extra_args, noise.device)
        return torch.zeros_like(latent_image)


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        loras = compat.lora_names()
        return io.Schema(
            node_id="StreamingCacheTrainLoRA",
            display_name="Train LoRA (streaming cache)",
            category="training/streaming cache",
            description="Trains a LoRA on a streaming dataset. Batches are read from disk in the background, so "
                        "the dataset never has to fit in RAM. Saves to models/loras/<lora_name>.safetensors "
                        "(usable by Load LoRA); cancel saves what was trained so far, and the next run resumes.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to train the LoRA on."),
                StreamingDataset.Input("dataset", tooltip="From Encode Dataset or Load Streaming Cache."),
                io.String.Input("lora_name", default="my_lora",
                                tooltip="File name of the LoRA in models/loras (without extension). The training "
                                        "state for resuming is kept in output/lora_training."),
                io.Int.Input("steps", default=500, min=1, max=1_000_000,
                             tooltip="Optimizer steps to train in total (a resumed run counts the steps already done)."),
                io.Int.Input("batch_size", default=1, min=1, max=256,
                             tooltip="Samples per step. Batches only mix images of the same bucket (size)."),
                io.Int.Input("grad_accumulation_steps", default=1, min=1, max=1024,
                             tooltip="Batches whose gradients are summed before each optimizer step."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1.0, step=1e-6,
                               tooltip="Peak learning rate."),
                io.Combo.Input("lr_schedule", options=list(training.SCHEDULES), default="constant",
                               tooltip="How the learning rate changes over the steps (after warm-up)."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100_000,
                             tooltip="Steps over which the learning rate ramps up linearly from zero."),
                io.Int.Input("rank", default=16, min=1, max=256, tooltip="Rank of the LoRA layers."),
                io.Combo.Input("optimizer", options=list(training.OPTIMIZERS), default="AdamW",
                               tooltip="The optimizer."),
                io.Combo.Input("loss_function", options=list(LOSSES), default="MSE", tooltip="The loss function."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=False,
                             tooltip="Seeds LoRA initialisation, the data order and the noise."),
                io.Combo.Input("training_dtype", options=["bf16", "fp32"], default="bf16",
                               tooltip="The dtype the model computes in while training."),
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
                                 tooltip="Continue from the saved training state of this lora_name if there is one "
                                         "(weights, optimizer, schedule and data position). Off: start over."),
                io.Int.Input("prefetch", default=2, min=1, max=64,
                             tooltip="Batches read ahead in the background."),
                io.Int.Input("workers", default=2, min=0, max=64,
                             tooltip="Reader threads (clamped to the CPU count; 0 reads in the training thread)."),
            ],
            outputs=[
                io.Model.Output("model_with_lora", display_name="model_with_lora",
                                tooltip="The model with the trained LoRA applied."),
                io.LoraModel.Output("lora", display_name="lora",
                                    tooltip="The LoRA weights (for Save LoRA / Load LoRA Model)."),
                io.LossMap.Output("loss", display_name="loss", tooltip="Loss per step."),
                io.Image.Output("loss_plot", display_name="loss_plot",
                                tooltip="Loss per step (light) and its moving average (dark)."),
                io.Int.Output("steps_trained", display_name="steps_trained", tooltip="Steps trained in total."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, dataset, lora_name, steps, batch_size, grad_accumulation_steps, learning_rate,
                lr_schedule, warmup_steps, rank, optimizer, loss_function, seed, training_dtype, lora_dtype,
                algorithm, gradient_checkpointing, existing_lora, save_every, resume, prefetch, workers
                ) -> io.NodeOutput:
        name = plain_name(lora_name, what="lora_name")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; encode some images first")
        if dataset.columns != ("cond", "latent"):
            raise ValueError(f"the dataset has columns {dataset.columns}, expected latent and cond: use one made "
                             "by Encode Dataset")
        config = training.TrainConfig(steps=steps, learning_rate=learning_rate, optimizer=optimizer,
                                      schedule=lr_schedule, warmup_steps=warmup_steps,
                                      grad_accumulation=grad_accumulation_steps, seed=seed, save_every=save_every)
        lora_path = os.path.join(compat.loras_folder(), f"{name}.safetensors")
        state_path = os.path.join(state_folder(), f"{name}.state.pt")
        if os.path.exists(lora_path) and not os.path.exists(state_path):
            raise FileExistsError(f"{lora_path} already exists and was not trained by this node (no training state "
                                  f"in {state_folder()}); choose another lora_name so it is not overwritten")
        data_fingerprint = dataset.fingerprint()
        state = None
        if resume and os.path.exists(state_path):
            state = training.load_checkpoint(state_path)
            if state.get("dataset") != data_fingerprint:
                raise ValueError(f"the saved training state {state_path} was made with a different dataset; turn "
                                 "'resume' off to start over, or use another lora_name")
            log.info("resuming %s from step %d", name, state["step"])

        dtype = node_helpers.string_to_torch_dtype(training_dtype)
        ldtype = node_helpers.string_to_torch_dtype(lora_dtype)
        mp = compat.training_clone(model)
        mp.set_model_compute_dtype(dtype)
        node_id = cls.hidden.unique_id
        with compat.training_mode():
            existing = {}
            if existing_lora != "[None]":
                existing = comfy.utils.load_torch_file(compat.existing_lora_path(existing_lora))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                lora_sd = create_adapters(mp, rank, algorithm, ldtype, existing)
            if not lora_sd:
                raise ValueError("this model has no layers ComfyUI can train a LoRA on")
            criterion = LOSSES[loss_function]()
            metadata = {"ss_network_dim": str(rank), "ss_network_alpha": "1.0", "ss_network_module": algorithm,
                        "ss_learning_rate": str(learning_rate), "streaming_cache_dataset": data_fingerprint}

            def save(checkpoint: dict[str, Any], final: bool) -> None:
                checkpoint["dataset"] = data_fingerprint
                os.makedirs(state_folder(), exist_ok=True)
                training.save_checkpoint(state_path, checkpoint)
                weights = {k: v.to(ldtype) for k, v in checkpoint["params"].items()}
                meta = dict(metadata, ss_steps=str(checkpoint["step"]))
                training.save_lora(lora_path, weights, meta)
                if not final and save_every and checkpoint["step"] % save_every == 0:
                    training.save_lora(os.path.join(compat.loras_folder(), f"{name}_step{checkpoint['step']}.safetensors"),
                                       weights, meta)
                log.info("saved %s at step %d", lora_path, checkpoint["step"])

            pbar = comfy.utils.ProgressBar(steps, node_id=node_id)
            bar = tqdm.tqdm(total=steps, initial=0 if state is None else int(state["step"]), desc=f"Training {name}",
                            disable=not comfy.utils.PROGRESS_BAR_ENABLED)
            last_text = [0.0]

            def on_step(step: int, loss: float) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
                pbar.update_absolute(step, steps)
                now = time.monotonic()
                if now - last_text[0] > 0.25 or step == steps:
                    last_text[0] = now
                    show_text(node_id, f"step {step}/{steps}  loss {loss:.4f}", log_it=False)
                comfy.model_management.throw_exception_if_processing_interrupted()

            def run(model_wrap: Any, extra_args: dict, device: torch.device) -> training.TrainResult:
                inner = model_wrap.inner_model
                cuda = device.type == "cuda"
                loader = BatchLoader(dataset, batch_size, seed=seed, workers=workers, prefetch=prefetch,
                                     device=device if cuda else None)

                def loss_fn(batch: Any, micro: int) -> torch.Tensor:
                    g = training.step_generator(seed, micro)
                    latent = inner.process_latent_in(_flatten_batch(batch["latent"]["samples"]).to(device))
                    n = latent.shape[0]
                    noise = torch.randn(latent.shape, generator=g).to(device, latent.dtype)
                    sigmas = torch.tensor([inner.model_sampling.percent_to_sigma(float(p))
                                           for p in torch.rand(n, generator=g)], device=device)
                    xt = inner.model_sampling.noise_scaling(sigmas, noise, latent, False)
                    x0 = inner.model_sampling.noise_scaling(torch.zeros_like(sigmas), torch.zeros_like(noise),
                                                            latent, False)
                    cond = [[c.to(device), {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                            for k, v in o.items()}] for c, o in batch_conditioning(batch["cond"])]
                    positive = {"positive": comfy.sampler_helpers.convert_cond(cond)}
                    model_wrap.conds = comfy.samplers.process_conds(inner, noise, positive, device,
                                                                    latent, None, seed)
                    with torch.autocast(device.type, dtype=dtype):
                        pred = model_wrap(xt, sigmas, **extra_args)
                        return criterion(pred.float(), x0.float())

                with contextlib.closing(loader):
                    return training.train(lora_sd, loader, loss_fn, config, resume=state, on_step=on_step,
                                          save=save)

            first = dataset[0].materialize()
            shape = _flatten_batch(first["latent"]["samples"]).shape
            modules = compat.modules_at_depth(mp.model.diffusion_model, 1) if gradient_checkpointing else []
            mp.model.requires_grad_(False)
            sampler = _StreamingSampler(run)
            guider = compat.training_guider(mp)
            guider.set_conds(batch_conditioning([[c[None], {k: (v[None] if isinstance(v, torch.Tensor) else [v])
                                                             for k, v in o.items()}] for c, o in first["cond"]]))
            dummy = torch.zeros((batch_size, *shape[1:]))
            try:
                with compat.gradient_checkpointing(modules):
                    compat.load_models_for_training(mp)
                    guider.sample(dummy, dummy, sampler, torch.ones(2), seed=seed)
            finally:
                bar.close()
            result = sampler.result
            assert result is not None
            for v in lora_sd.values():
                v.requires_grad_(False)
            lora_out = {k: v.detach().to(ldtype) for k, v in lora_sd.items()}
        losses = {"loss": list(result.losses)}
        start = 0 if state is None else int(state["step"])
        if result.step > start:
            text = f"trained {name}: steps {start + 1}-{result.step} of {steps}, final loss {result.losses[-1]:.4f} " \
                   f"-> {lora_path}"
        else:
            text = f"{name}: already trained for {result.step} steps (raise steps to continue, or turn resume off " \
                   f"to start over) -> {lora_path}"
        show_text(node_id, text)
        return io.NodeOutput(mp, lora_out, losses, loss_plot(result.losses), result.step, ui={"text": [text]})
