"""TrainLoRA: trains a LoRA from a streaming dataset through ComfyUI's own model and sampling machinery.

The node validates its inputs, decides where the LoRA and its resume state go, and reports progress; the
training itself is ``lora.train_lora`` (ComfyUI side) around ``streaming_cache.train.loop`` (ComfyUI-free).
"""

from __future__ import annotations

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
from ..streaming_cache.train import checkpoint, loop, optim
from ..streaming_cache.train.paths import plain_name
from ..streaming_cache.train.plot import loss_plot
from . import compat, lora
from .folders import loras_folder, state_folder
from .ui import StreamingDataset, node_schema, log, show_text


class _Progress:
    """ComfyUI's progress bar (which also checks the Cancel button), the terminal bar and the loss as node text."""

    def __init__(self, node_id: str | None, name: str, steps: int, start: int):
        self.node_id, self.steps = node_id, steps
        self.pbar = comfy.utils.ProgressBar(steps, node_id=node_id)
        self.bar = tqdm.tqdm(total=steps, initial=start, desc=f"Training {name}",
                             disable=not comfy.utils.PROGRESS_BAR_ENABLED)
        self.last_text = 0.0

    def __call__(self, step: int, loss: float) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        self.pbar.update_absolute(step, self.steps)
        now = time.monotonic()
        if now - self.last_text > 0.25 or step == self.steps:
            self.last_text = now
            show_text(self.node_id, f"step {step}/{self.steps}  loss {loss:.4f}", log_it=False)
        comfy.model_management.throw_exception_if_processing_interrupted()

    def close(self) -> None:
        self.bar.close()


class _Files:
    """Where a LoRA called ``name`` and its resume state live, and how they are written."""

    def __init__(self, name: str, dtype: torch.dtype, metadata: dict[str, str], save_every: int):
        self.name, self.dtype, self.metadata, self.save_every = name, dtype, metadata, save_every
        self.lora = os.path.join(loras_folder(), f"{name}.safetensors")
        self.state = os.path.join(state_folder(), f"{name}.state.pt")
        if os.path.exists(self.lora) and not os.path.exists(self.state):
            raise FileExistsError(f"{self.lora} already exists and was not trained by this node (no training "
                                  f"state in {state_folder()}); choose another lora_name so it is not overwritten")

    def resume_state(self, resume: bool, dataset: str) -> dict[str, Any] | None:
        if not (resume and os.path.exists(self.state)):
            return None
        state = checkpoint.load_checkpoint(self.state)
        if state.get("dataset") != dataset:
            raise ValueError(f"the saved training state {self.state} was made with a different dataset; turn "
                             "'resume' off to start over, or use another lora_name")
        log.info("resuming %s from step %d", self.name, state["step"])
        return state

    def save(self, state: dict[str, Any], final: bool) -> None:
        checkpoint.save_checkpoint(self.state, state)
        weights = {k: v.to(self.dtype) for k, v in state["params"].items()}
        meta = dict(self.metadata, ss_steps=str(state["step"]))
        checkpoint.save_lora(self.lora, weights, meta)
        if not final and self.save_every and state["step"] % self.save_every == 0:
            checkpoint.save_lora(os.path.join(loras_folder(), f"{self.name}_step{state['step']}.safetensors"),
                                 weights, meta)
        log.info("saved %s at step %d", self.lora, state["step"])


DESCRIPTION = ("Trains a LoRA on a streaming dataset. Batches are read from disk in the background, so "
               "the dataset never has to fit in RAM. Saves to models/loras/<lora_name>.safetensors "
               "(usable by Load LoRA); cancel saves what was trained so far, and the next run resumes.")


def _inputs() -> list:
    loras = compat.lora_names()
    return [
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
        io.Combo.Input("lr_schedule", options=list(optim.SCHEDULES), default="constant",
                       tooltip="How the learning rate changes over the steps (after warm-up)."),
        io.Int.Input("warmup_steps", default=0, min=0, max=100_000,
                     tooltip="Steps over which the learning rate ramps up linearly from zero."),
        io.Int.Input("rank", default=16, min=1, max=256, tooltip="Rank of the LoRA layers."),
        io.Combo.Input("optimizer", options=list(optim.OPTIMIZERS), default="AdamW",
                       tooltip="The optimizer."),
        io.Combo.Input("loss_function", options=list(lora.LOSSES), default="MSE", tooltip="The loss function."),
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
    ]


def _outputs() -> list:
    return [
        io.Model.Output("model_with_lora", display_name="model_with_lora",
                        tooltip="The model with the trained LoRA applied."),
        io.LoraModel.Output("lora", display_name="lora",
                            tooltip="The LoRA weights (for Save LoRA / Load LoRA Model)."),
        io.LossMap.Output("loss", display_name="loss", tooltip="Loss per step."),
        io.Image.Output("loss_plot", display_name="loss_plot",
                        tooltip="Loss per step (light) and its moving average (dark)."),
        io.Int.Output("steps_trained", display_name="steps_trained", tooltip="Steps trained in total."),
    ]


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema("StreamingCacheTrainLoRA", "Train LoRA (streaming cache)", DESCRIPTION,
                           _inputs(), _outputs(), output_node=True)

    @classmethod
    def execute(cls, model, dataset, lora_name, steps, batch_size, grad_accumulation_steps, learning_rate,
                lr_schedule, warmup_steps, rank, optimizer, loss_function, seed, training_dtype, lora_dtype,
                algorithm, gradient_checkpointing, existing_lora, save_every, resume, prefetch, workers
                ) -> io.NodeOutput:
        name = plain_name(lora_name, what="lora_name")
        _check_dataset(dataset)
        config = loop.TrainConfig(steps=steps, learning_rate=learning_rate, optimizer=optimizer, schedule=lr_schedule,
                                  warmup_steps=warmup_steps, grad_accumulation=grad_accumulation_steps, seed=seed,
                                  save_every=save_every)
        fingerprint = dataset.fingerprint()
        ldtype = node_helpers.string_to_torch_dtype(lora_dtype)
        files = _Files(name, ldtype, {"ss_network_dim": str(rank), "ss_network_alpha": "1.0",
                                      "ss_network_module": algorithm, "ss_learning_rate": str(learning_rate),
                                      "streaming_cache_dataset": fingerprint}, save_every)
        state = files.resume_state(resume, fingerprint)
        start = 0 if state is None else int(state["step"])
        dtype = node_helpers.string_to_torch_dtype(training_dtype)
        mp = compat.training_clone(model)
        mp.set_model_compute_dtype(dtype)
        progress = _Progress(cls.hidden.unique_id, name, steps, start)

        def save(ckpt: dict[str, Any], final: bool) -> None:
            files.save(dict(ckpt, dataset=fingerprint), final)

        try:
            with compat.training_mode():
                existing = {} if existing_lora == "[None]" else \
                    comfy.utils.load_torch_file(compat.existing_lora_path(existing_lora))
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    lora_sd = lora.create_adapters(mp, rank, algorithm, ldtype, existing)
                if not lora_sd:
                    raise ValueError("this model has no layers ComfyUI can train a LoRA on")
                loss = lora.DiffusionLoss(lora.LOSSES[loss_function](), dtype, seed)
                result = lora.train_lora(mp, dataset, lora_sd, loss, config, batch_size=batch_size, workers=workers,
                                         prefetch=prefetch, checkpoint_depth=1 if gradient_checkpointing else 0,
                                         resume=state, on_step=progress, save=save)
                lora_out = {k: v.detach().to(ldtype) for k, v in lora_sd.items()}
        finally:
            progress.close()
        if result.step > start:
            text = f"trained {name}: steps {start + 1}-{result.step} of {steps}, final loss " \
                   f"{result.losses[-1]:.4f} -> {files.lora}"
        else:
            text = f"{name}: already trained for {result.step} steps (raise steps to continue, or turn resume off " \
                   f"to start over) -> {files.lora}"
        show_text(cls.hidden.unique_id, text)
        return io.NodeOutput(compat.apply_lora(model, lora_out), lora_out, {"loss": list(result.losses)},
                             loss_plot(result.losses), result.step, ui={"text": [text]})


def _check_dataset(dataset: DatasetHandle) -> None:
    if len(dataset) == 0:
        raise ValueError("the dataset is empty; encode some images first")
    missing = {"cond", "latent"} - set(dataset.columns)
    unknown = set(dataset.columns) - {"cond", "latent", "ref", "mask"}
    if missing or unknown:
        raise ValueError(f"the dataset has columns {dataset.columns}; training needs latent and cond (optionally "
                         "ref and mask): use one made by Encode Dataset")
