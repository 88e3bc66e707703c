"""One queued LoRA training, from a :class:`~streaming_cache.train.spec.TrainSpec` to the node's outputs: which
run it continues and where its files go (``streaming_cache.train.runs``), progress with the live loss plot and
sample previews, Cancel, and the summary the node keeps.

Training runs in chunks that end where sample previews are due: each chunk is one pass of ComfyUI's guider, so
previews are drawn between chunks by ComfyUI's ordinary sampling path, never inside a running training pass.
Chunks continue each other from the in-memory checkpoint, exactly as a resume from disk would.

Cancel saves the steps done (the loop saves on any exception), and the node still returns: its outputs and its
summary ("cancelled at step 12 of 20: saved ...; queue again to continue") reach the node and the prompt's
history, and the executor is asked to stop the rest of the prompt, as Cancel means. A cancelled node's
fingerprint changes, so queueing again runs it again and resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import tqdm
from comfy_api.latest import io

from ..streaming_cache.dataset import DatasetHandle
from ..streaming_cache.errors import CacheError
from ..streaming_cache.group import Group
from ..streaming_cache.mix import DatasetMix, as_mix
from ..streaming_cache.train import checkpoint, holdout, lora_formats, optim, runs
from ..streaming_cache.train.backend import train_with
from ..streaming_cache.train.chart import EVENT as CHART_EVENT
from ..streaming_cache.train.chart import StepTimes, chart_series
from ..streaming_cache.train.loop import TrainHooks, TrainResult
from ..streaming_cache.train.metadata import lora_metadata
from ..streaming_cache.train.paths import plain_name
from ..streaming_cache.train.plot import loss_plot, status_line
from ..streaming_cache.train.spec import TrainSpec
from .backend import compat, families, memory_fit
from .backend.training import ComfyBackend
from .folders import EMPTY_CAPTION, loras_folder, output_folder, state_folder
from .previews import LivePreview, Previews
from .ui import cancels, log, new_run, note_cancel, show_text

VALIDATION_ROWS = 16  # validation samples scored at every validation (fixed timesteps, fixed noise)
CHART_INTERVAL = 2.0  # seconds between the curves sent to the browser while training
REPORT_SECONDS = 0.5
"""How often the progress, the node's text and the chart catch up with the steps: where the optimizer step is
fused (AdamW on a GPU), the loop reads the steps' losses together at most this often (``TrainHooks``)."""


class _Progress:
    """ComfyUI's progress bar (which also checks the Cancel button), the terminal bar, the step as node text (step,
    loss, speed and time left), the browser's loss chart and the live sample images; on a rank other than 0 of a
    process group (``shown`` False) only the counts. Cancel is noted (:attr:`cancelled`) rather than raised, so
    the loop stops after the step, on every rank at the same one."""

    def __init__(self, node_id: str | None, name: str, spec: TrainSpec, start: int, losses: list[float],
                 validation: list[tuple[int, float]], *, shown: bool = True):
        self.node_id, self.steps, self.step, self.start, self.shown = node_id, spec.steps, start, start, shown
        self.losses, self.validation = list(losses), list(validation)
        self.datasets: dict[str, list[tuple[int, float]]] = {}  # a mix: each dataset's loss, as far as known
        self.pbar = compat.progress_bar(spec.steps, node_id)
        self.live = LivePreview(self.pbar)
        self.spec = spec
        self.started = time.perf_counter()
        self.last_chart = 0.0
        self.bar = tqdm.tqdm(total=spec.steps, initial=start, desc=f"Training {name}",
                             disable=not (shown and compat.terminal_progress_enabled()))
        self.times = StepTimes(self.started)
        self.last_text = 0.0
        self.cancelled = False

    def wants_stop(self) -> bool:
        """Whether Cancel was pressed (asked before every step)."""
        self.cancelled = self.cancelled or compat.interrupt_requested()
        return self.cancelled

    def seconds_per_step(self) -> float | None:
        return self.times.seconds_per_step()

    def status(self) -> str:
        return status_line(self.step, self.steps, self.seconds_per_step(), self.steps - self.step)

    def __call__(self, step: int, loss: float) -> None:
        """A step whose loss was read (the loop reads several at once); what is shown follows in :meth:`show`."""
        self.step = step
        self.times.add(time.perf_counter())
        self.losses.append(loss)

    def show(self) -> None:
        """Show the steps read since the last call (the loop's ``on_read``): the bar, the node's text, the progress
        (which also sees Cancel) and the chart, once for all of them."""
        read = self.times.end_report()
        if not self.shown or not read:
            return
        step, loss = self.step, self.losses[-1]
        self.bar.update(read)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        now = time.monotonic()
        if now - self.last_text > 0.25 or step == self.steps:  # before the progress, which shows it
            self.last_text = now
            show_text(self.node_id, self.step_text(loss), log_it=False)
        try:
            self.pbar.update_absolute(step, self.steps)
        except compat.InterruptProcessingException:  # the progress hook saw Cancel: stop after this step
            self.cancelled = True
        if now - self.last_chart > CHART_INTERVAL or step == self.steps:
            self.send_chart()

    def step_text(self, loss: float) -> str:
        """``step 12/20  loss 0.1234  validation 0.1300  2.1 it/s  4s left``"""
        val = f"  validation {self.validation[-1][1]:.4f}" if self.validation else ""
        speed = self.status().partition("  ")[2]
        return f"step {self.step}/{self.steps}  loss {loss:.4f}{val}" + (f"  {speed}" if speed else "")

    def chart(self) -> dict[str, Any]:
        """The curves for the browser's chart (``streaming_cache.train.chart``), this run's steps timed."""
        times = [t - self.started for t in self.times.times]
        return chart_series(self.losses, total=self.steps, validation=self.validation,
                            learning_rates=self.spec.learning_rates,
                            times=[None] * (len(self.losses) - len(times)) + times if len(times) <= len(self.losses)
                            else None, datasets=self.datasets,
                            log_scale=self.spec.previews.plot_scale == "log")

    def send_chart(self) -> None:
        if self.shown:
            self.last_chart = time.monotonic()
            compat.send_to_browser(CHART_EVENT, {"node": self.node_id, "chart": self.chart()})

    def samples(self, image: torch.Tensor) -> None:
        """New sample images: shown on the node now, with the chart as far as it goes."""
        if self.shown:
            self.send_chart()
            with contextlib.suppress(compat.InterruptProcessingException):  # Cancel pressed again: stops after
                self.live.show(self.step, self.steps, image)

    def close(self) -> None:
        self.bar.close()


class RunFiles:
    """The files of one run (``runs.RunPlan``): resume state with its identity, the LoRA with its metadata, the
    EMA copy and periodic snapshots. Every write is atomic; ``last`` is the state saved last; ``written`` what the
    LoRA file got the last time it was written (in the spec's ``lora_format``, with what that left out). With
    ``writes`` False (a rank other than 0) nothing is written, only ``last`` kept."""

    def __init__(self, plan: runs.RunPlan, identity: str, backend: ComfyBackend, save_every: int, metadata: Any,
                 *, writes: bool = True, keep_step_saves: int = 0):
        self.plan, self.identity, self.backend, self.save_every, self.metadata = (plan, identity, backend,
                                                                                  save_every, metadata)
        self.writes, self.keep_step_saves = writes, keep_step_saves
        self.last: dict[str, Any] | None = None
        self.written: lora_formats.Converted | None = None

    def load(self) -> dict[str, Any] | None:
        return checkpoint.load_checkpoint(self.plan.resume_state_path) if self.plan.resume_state_path else None

    def save(self, state: dict[str, Any], final: bool) -> None:
        self.last = state
        if not self.writes:
            return
        checkpoint.save_checkpoint(self.plan.state_path, state)
        runs.write_run_identity(self.plan.state_path, self.identity)
        meta = self._write_loras(state)
        if not final and self.save_every and state["step"] % self.save_every == 0:
            assert self.written is not None
            checkpoint.save_lora(self.plan.step_path(state["step"]), self.written.tensors, meta)
            for path in runs.prune_step_saves(self.plan, self.keep_step_saves):
                log.info("removed %s (keep_step_saves %d)", path, self.keep_step_saves)
        log.info("saved %s at step %d", self.plan.lora_path, state["step"])

    def convert(self, state: dict[str, Any] | None) -> None:
        """For a run that trains no step this time: when its LoRA file is in another format than the spec asks,
        the LoRA and its EMA copy are written again in that format from the saved ``state`` (queueing again with
        another ``lora_format`` converts the file; the resume state is unchanged)."""
        asked = self.backend.spec.adapter.lora_format
        if self.writes and state is not None and lora_formats.file_format(self.plan.lora_path) != asked:
            self._write_loras(state)
            log.info("saved %s in the %s format", self.plan.lora_path, asked)

    def _write_loras(self, state: dict[str, Any]) -> dict[str, str]:
        meta = self.metadata(state["step"])
        self.written = self.backend.lora_file(self.backend.lora(state.get("weights") or state["params"]))
        checkpoint.save_lora(self.plan.lora_path, self.written.tensors, meta)
        if state.get("ema_weights"):
            ema = self.backend.lora_file(self.backend.lora(state["ema_weights"]))
            checkpoint.save_lora(self.plan.ema_path, ema.tensors, dict(meta, streaming_cache_ema="true"))
        return meta


def run_fingerprint(lora_name: str) -> tuple:
    """What decides whether a queued Train LoRA with these inputs must run again although its inputs are
    unchanged: the saved runs of ``lora_name`` (their states' size and time) and the cancels so far."""
    found = []
    try:
        name = plain_name(lora_name, what="lora_name")
        folder = state_folder()
        for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if entry.startswith(name) and entry.endswith(".state.pt"):
                st = os.stat(os.path.join(folder, entry))
                found.append((entry, st.st_size, st.st_mtime_ns))
    except (OSError, ValueError) as exc:  # the node reports bad names itself
        found.append(repr(exc))
    return tuple(found), cancels()


def check_dataset(dataset: DatasetHandle | DatasetMix, model: Any) -> None:
    """A dataset (or each dataset of a mix) ``model`` (a ModelPatcher) can train on: latent and cond, and only
    columns its family reads."""
    optional = ("mask", *families.dataset_columns(model.model))
    for part in as_mix(dataset).parts:
        handle, where = part.handle, f" ({part.name})" if isinstance(dataset, DatasetMix) else ""
        if len(handle) == 0:
            raise ValueError(f"the dataset{where} is empty; encode some images first")
        columns = handle.columns or ()
        missing = {"cond", "latent"} - set(columns)
        unknown = set(columns) - {"cond", "latent", *optional}
        if missing or unknown:
            raise ValueError(f"the dataset{where} has columns {handle.columns}; training {type(model.model).__name__} "
                             f"needs latent and cond (optionally {', '.join(optional)}): use one made by Encode "
                             "Dataset")


def _validation_data(dataset: DatasetHandle | DatasetMix, extra: DatasetHandle | None, fraction: float,
                     model: Any) -> tuple[DatasetHandle | DatasetMix, DatasetHandle | None]:
    """The training rows and the validation set: ``extra`` if given, else about ``fraction`` of the images held
    out (of each dataset of a mix)."""
    if extra is not None:
        check_dataset(extra, model)
        return dataset, extra
    if fraction <= 0:
        return dataset, None
    splits = [holdout.split(part.handle, fraction) for part in as_mix(dataset).parts]
    if any(len(val) == 0 for _, val in splits):
        raise ValueError("validation_split needs at least two images in each dataset; set it to 0, or give a "
                         "validation_dataset")
    try:
        held = DatasetHandle.concat([val for _, val in splits])
    except CacheError as exc:
        raise ValueError("validation_split on a mix of datasets with different columns (e.g. masks in one): give "
                         "a validation_dataset instead") from exc
    if isinstance(dataset, DatasetHandle):
        return splits[0][0], held
    kept = iter([train for train, _ in splits])
    return dataset.map_parts(lambda part: next(kept)), held


def _dropout_anywhere(spec: TrainSpec, dataset: DatasetHandle | DatasetMix) -> bool:
    """Whether any sample may train on the empty caption (the training's rate, or a dataset's own)."""
    return spec.data.caption_dropout > 0 or any(p.caption_dropout for p in as_mix(dataset).parts)


def _empty_caption(dataset: DatasetHandle | DatasetMix) -> Any:
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


def _summary(plan: runs.RunPlan, start: int, result: TrainResult, spec: TrainSpec, previews: Previews,
             cancelled: bool, seconds_per_step: float | None, written: lora_formats.Converted | None = None,
             graph_report: str | None = None, fallbacks: Sequence[str] = (), notes: Sequence[str] = ()) -> str:
    lines = [plan.reason, *notes]
    speed = f", {seconds_per_step:.2f} s/step" if seconds_per_step else ""
    if cancelled:
        lines.append(f"cancelled at step {result.step} of {spec.steps}: {plan.name} saved with the steps done "
                     f"(-> {plan.lora_path}) and its resume state; queue again to continue")
    elif result.step > start:
        done = f"steps {start + 1}-{result.step}" if result.step > start + 1 else f"step {result.step}"
        lines.append(f"trained {plan.name}: {done} of {spec.steps}, final loss "
                     f"{result.losses[-1]:.4f}{speed} -> {plan.lora_path}")
    else:
        lines.append(f"{plan.name}: already trained for {result.step} steps (raise steps to continue, or turn resume "
                     f"off for a new run) -> {plan.lora_path}")
    if written is not None and spec.adapter.lora_format != lora_formats.DEFAULT_FORMAT:
        lines.append(f"saved in the {spec.adapter.lora_format} format" + (
            f"; {len(written.left_out)} offsets of norms and biases left out (only ComfyUI's format holds them; the "
            "lora output has them)" if written.left_out else ""))
    if result.validation:
        lines.append(f"validation loss {result.validation[-1][1]:.4f} at step {result.validation[-1][0]}")
    if result.dataset_losses:
        lines.append("per dataset: " + ", ".join(
            f"{name} {len(values)} steps, last loss {values[-1][1]:.4f}" if values else f"{name} no steps yet"
            for name, values in result.dataset_losses.items()))
    if graph_report and result.step > start:
        lines.append(graph_report)
    lines.extend(fallbacks)
    if result.overflow_steps:
        lines.append(f"fp16: {result.overflow_steps} steps skipped by the gradient scaler (gradients overflowed)")
    if result.ema_weights or os.path.exists(plan.ema_path):
        lines.append(f"EMA weights -> {plan.ema_path}")
    if previews.saved:
        lines.append(f"{len(previews.saved)} sample images in {previews.folder}")
    return "\n".join(lines)


def _result_of(state: dict[str, Any]) -> TrainResult:
    """What a run that was left by an exception had done, from the state it saved on the way out."""
    return TrainResult(step=int(state["step"]), losses=list(state["losses"]),
                       validation=[(int(s), float(v)) for s, v in state.get("validation") or []],
                       weights=state.get("weights") or state["params"], ema_weights=state.get("ema_weights"),
                       overflow_steps=int(state.get("overflow_steps") or 0),
                       dataset_losses={n: [(int(s), float(v)) for s, v in values]
                                       for n, values in (state.get("dataset_losses") or {}).items()})


@dataclasses.dataclass
class _Run:
    """One Train LoRA run as :func:`_prepare` set it up: the data, the backend, which run it continues and where
    its files go, the state it resumes from and its progress display."""

    spec: TrainSpec
    group: Group | None
    train_data: DatasetHandle | DatasetMix
    val_data: DatasetHandle | None
    previews: Previews
    backend: ComfyBackend
    plan: runs.RunPlan
    files: RunFiles
    state: dict[str, Any] | None
    progress: _Progress
    notes: Sequence[str] = ()  # lines the node adds to the summary (what preset auto chose)

    @property
    def main(self) -> bool:
        return self.group is None or self.group.is_main

    @property
    def world(self) -> int:
        return self.group.world_size if self.group else 1


def train_lora(node_id: str | None, model: Any, dataset: DatasetHandle | DatasetMix, spec: TrainSpec, *,
               clip: Any = None, vae: Any = None, validation_dataset: DatasetHandle | None = None,
               notes: Sequence[str] = ()) -> io.NodeOutput:
    """Train the LoRA ``spec`` describes on ``dataset``; the node's outputs, with its summary as ``ui`` text and
    the loss chart's curves as ``ui`` chart (the browser draws them; the loss plot is an output, not shown on the
    node).

    In a process group (torchrun, or the node's own ``devices`` workers) every rank runs this with the same
    inputs: rank 0 decides which run it continues and sends its state to the others, each rank trains on its
    slice of every global batch, and only rank 0 writes files, draws previews and shows progress. ``notes``: lines
    for the summary, after the run's first."""
    new_run()
    run = _prepare(node_id, model, dataset, spec, clip=clip, vae=vae, validation_dataset=validation_dataset)
    run.notes = (*notes, *run.notes)
    loaded, start = run.state, run.progress.start
    try:
        result, samples, cancelled = _train_in_chunks(run)
    finally:
        run.progress.close()
    if result.step == start and not cancelled:
        run.files.convert(loaded)
    return _outputs(node_id, model, run, result, samples, cancelled)


def _prepare(node_id: str | None, model: Any, dataset: DatasetHandle | DatasetMix, spec: TrainSpec, *, clip: Any,
             vae: Any, validation_dataset: DatasetHandle | None) -> _Run:
    """Inputs checked, the validation rows set apart, the sample prompts encoded, the model prepared, and the
    run to continue chosen (by rank 0, and sent to the other ranks with its state)."""
    group = Group.current()
    main = group is None or group.is_main
    name = plain_name(spec.lora_name, what="lora_name")
    check_dataset(dataset, model)
    compat.check_memory_options(offloading=spec.memory.offloading, bypass=spec.memory.bypass_mode)
    missing = optim.missing_package(spec.optimizer.optimizer)
    if missing:
        raise ValueError(f"the {spec.optimizer.optimizer} optimizer needs the {missing} package: install it into "
                         f"ComfyUI's Python (python -m pip install {missing}), or choose another optimizer")
    started = time.time()
    world = group.world_size if group else 1
    train_data, val_data = _validation_data(dataset, validation_dataset, spec.previews.validation_split, model)
    shown = spec.previews if main else dataclasses.replace(spec.previews, sample_prompts=())  # rank 0 draws them
    previews = Previews(shown, clip, vae, os.path.join(output_folder(), "lora_training", f"{name}_samples"), name)
    fingerprint = train_data.fingerprint()
    empty = _empty_caption(train_data) if _dropout_anywhere(spec, train_data) else None
    given, memory = spec, memory_fit.plan(model, spec, train_data)
    spec = dataclasses.replace(spec, memory=memory.memory)
    backend = ComfyBackend(model, spec, train_data, empty_caption=empty)
    identities = given.identities(fingerprint, model=backend.layout_digest(),
                                 validation=val_data.fingerprint() if val_data else None, world_size=world)
    plan = runs.plan_run(loras_folder(), state_folder(), name, identities[0], spec.resume,
                         also_accepted=identities[1:]) if main else None

    def metadata(step: int) -> dict[str, str]:
        assert plan is not None
        return lora_metadata(spec, dataset_fingerprint=fingerprint, steps_done=step, num_train_images=len(train_data),
                             validating=val_data is not None, model_config=backend.model_config,
                             v_prediction=backend.v_prediction, started_at=started, world_size=world,
                             extra={"ss_output_name": plan.name})

    state = RunFiles(plan, identities[0], backend, spec.save_every, metadata).load() if plan else None
    if group is not None:
        plan, state = group.broadcast((plan, state))
    assert plan is not None
    log.info("%s", plan.reason)
    files = RunFiles(plan, identities[0], backend, spec.save_every, metadata, writes=main,
                     keep_step_saves=spec.keep_step_saves)
    start = 0 if state is None else int(state["step"])
    progress = _Progress(node_id, plan.name, spec, start, [] if state is None else list(state["losses"]),
                         [] if state is None else [tuple(v) for v in state.get("validation") or []], shown=main)
    return _Run(spec, group, train_data, val_data, previews, backend, plan, files, state, progress,
                notes=(memory.summary(),))


def _train_in_chunks(run: _Run) -> tuple[TrainResult, torch.Tensor | None, bool]:
    """Train up to the spec's steps in chunks that end where sample previews are due, drawing them between
    chunks; returns the result, the last samples and whether Cancel stopped it."""
    spec, progress, files, backend = run.spec, run.progress, run.files, run.backend
    state = run.state
    samples = None
    result = TrainResult(step=progress.start, losses=list(progress.losses), validation=list(progress.validation))
    cancelled = False
    with compat.training_mode():
        try:
            while True:
                stop_at = spec.previews.next_preview(result.step, spec.steps)
                hooks = TrainHooks(on_step=progress, on_read=progress.show, save=files.save,
                                   should_stop=progress.wants_stop, stop_at=stop_at, report_seconds=REPORT_SECONDS)
                result = train_with(backend, run.train_data, spec, resume=state, hooks=hooks, validation=run.val_data,
                                    validation_rows=VALIDATION_ROWS, group=run.group,
                                    pin_budget=backend.pin_budget, fallbacks=backend.fallbacks)
                progress.validation = list(result.validation)
                progress.datasets = result.dataset_losses
                state = files.last
                if result.stopped and result.step < stop_at:  # stopped early: Cancel on some rank
                    cancelled = True
                    break
                if run.main and spec.previews.preview_due(result.step, spec.steps):
                    with backend.adapters_in_place():
                        samples = run.previews.render(backend.patcher, backend.latent_shape(), result.step)
                    progress.samples(samples)
                if result.step >= spec.steps or not result.stopped:
                    break
        except compat.InterruptProcessingException:  # Cancel while drawing previews
            if files.last is None:
                raise  # nothing was trained or saved: an ordinary cancel
            cancelled = True
            result = _result_of(files.last)
        if cancelled:
            compat.clear_interrupt()
            note_cancel()
        progress.datasets = result.dataset_losses
        progress.send_chart()
    return result, samples, cancelled


def _outputs(node_id: str | None, model: Any, run: _Run, result: TrainResult, samples: torch.Tensor | None,
             cancelled: bool) -> io.NodeOutput:
    """The node's outputs (model with the LoRA, the LoRA, the losses, the loss plot, the steps, the samples),
    its summary (shown, logged and kept as ``ui`` text) and the chart the browser draws again after a reload."""
    spec, plan, progress, backend = run.spec, run.plan, run.progress, run.backend
    lora_out = backend.lora(result.weights if result.weights is not None else backend.parameters())
    text = _summary(plan, progress.start, result, spec, run.previews, cancelled, progress.seconds_per_step(),
                    run.files.written, backend.graph_report, backend.fallbacks.lines(), run.notes)
    if run.group is not None:
        text += f"\n{run.world} processes, {spec.global_batch_size(run.world)} samples per step"
        if not run.main:
            text = f"rank {run.group.rank} of {run.world}: trained with the other ranks; rank 0 saved the LoRA\n" + text
    show_text(node_id, text, log_it=False)
    log.info("%s", "\n".join(line for line in text.splitlines() if line != plan.reason))  # logged at the start
    rates = spec.learning_rates(len(result.losses))
    plot = loss_plot(result.losses, validation=result.validation or None, datasets=result.dataset_losses or None,
                     log_scale=spec.previews.plot_scale == "log", learning_rates=rates)
    ui: dict[str, Any] = {"text": [text]}
    if run.main:  # the browser's chart after the job and after a reload (the prompt's history keeps it)
        ui["chart"] = [progress.chart()]
    if cancelled:
        compat.interrupt()  # the rest of the prompt stops, as Cancel asked
    return io.NodeOutput(backend.model_with_lora(model, lora_out), lora_out, {"loss": list(result.losses)}, plot,
                         result.step, samples if samples is not None else torch.ones(1, 64, 64, 3), ui=ui)
