"""Device memory of the first steps of a training run with CUDA graphs, counted on the CPU: ComfyUI's model of a
family at its published full size on ``meta``, trained as ``memory_estimate.count_step`` trains it (this pack's
adapters, fused layers, gradient checkpointing, Train LoRA's pass contexts), with the diffusion model run through
``streaming_cache.train.graphs`` as Train LoRA's pass runs it on CUDA (``graphed_forward`` at its defaults: the
warm-up passes, the recording, its check, replays), on the graph device of ``meta``
(``streaming_cache.train.meta_graphs``: the recording's memory pool counted as a CUDA pool holds it).

:func:`count_graphed_steps` runs a few optimizer steps (PyTorch's AdamW: its state is made at the first step and
kept, as a real run's) and says what they held: the peak of live device memory, the pool counted; the pool's
size; the most that lived beside the pool while it was held; the live bytes at each step's marks. Run with
``graphs_on=False`` it gives the same figures for the eager steps, which the graphs' run is held to
(``docs/benchmarks.md``: the first two steps of a graphs run fit one eager step plus one recording).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import comfy.model_patcher
import torch
import torch.nn.functional as F

from ...streaming_cache.fallbacks import Fallbacks
from ...streaming_cache.train import graphs, memory_count, recompute
from ...streaming_cache.train.meta_graphs import MetaGraphDevice, PooledStorages
from . import compat, fused
from . import memory_estimate as estimate
from .training import LORA_DTYPES, TRAINING_DTYPES, create_adapters


@dataclasses.dataclass(frozen=True)
class GraphedSteps:
    """What :func:`count_graphed_steps` counted, in bytes: ``peak`` (live device memory, the pools counted, over
    every step), ``start`` (live before the first step: weights, adapters, inputs), ``pool`` (the largest size of
    the graphs' pool; 0 without graphs), ``beside`` (the most that lived outside the pool while it was held),
    ``marks`` (``step N forward`` / ``backward`` / ``optimizer``: live bytes at the mark, peak since the previous
    one), ``trained`` (the adapters' bytes); what the graphs did (``graphs``: ``graphs.last_run`` and the
    summary's line, ``eager_beside``: calls of the model's first layer run eagerly while the pool was held,
    :func:`_first_layer`); ``seconds``; ``launches``: the kernel launches of each mark's span (``step N forward``,
    ...: ``streaming_cache.train.launches``, a graph's replay one launch)."""

    family: str
    resolution: int
    steps: int
    graphed: bool
    peak: int
    start: int
    pool: int
    beside: int
    marks: dict[str, tuple[int, int]]
    trained: int
    graphs: dict[str, Any]
    eager_beside: int
    attention: dict[str, int]
    seconds: float
    launches: dict[str, int] = dataclasses.field(default_factory=dict)

    def step_peak(self, step: int) -> int:
        """The peak of step ``step`` (1-based): its forward and backward passes and its optimizer step."""
        return max(self.marks[f"step {step} {part}"][1] for part in ("forward", "backward", "optimizer"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _first_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The first layer with weights of its own in ``module`` (SDXL: its time embedding's first linear layer): called
    once in every pass of the model (and again where its block is recomputed)."""
    return next(m for m in module.modules() if not any(True for _ in m.children())
                and any(True for _ in m.parameters(recurse=False)))


@estimate._trainable
def count_graphed_steps(family: str = "sdxl", resolution: int = 1024, *, steps: int = 2, graphs_on: bool = True,
                        rank: int = 16, batch: int = 1, dtype: str = "bf16", checkpointing: bool = True,
                        attention: str = "flash") -> GraphedSteps:
    """``steps`` optimizer steps of ``family`` (a key of ``memory_estimate.FAMILIES`` whose latent is one tensor)
    at ``resolution`` pixels square, ``batch`` samples, LoRA ``rank`` on every layer ComfyUI patches, model and
    LoRA in ``dtype``, gradient checkpointing at depth 1 (every block) or none, counted on ``meta``; with
    ``graphs_on`` the diffusion model runs through ``graphs.graphed_forward`` on :class:`MetaGraphDevice` (its
    defaults: what Train LoRA's pass gives it on CUDA, the budget aside, which a single recording ignores)."""
    spec = estimate.FAMILIES[family]
    began = time.perf_counter()
    x_shape = spec.latent(batch, resolution, resolution, None)
    if not isinstance(x_shape, tuple):
        raise ValueError(f"{spec.name}'s latent is several streams; count a family of one latent")
    settings = estimate.StepSettings(rank=rank, dtype=dtype, lora_dtype=dtype, depth=1 if checkpointing else 0,
                                     attention=attention)
    model = estimate.build(spec, TRAINING_DTYPES[dtype])
    mp = comfy.model_patcher.ModelPatcher(model, load_device=estimate.META, offload_device=estimate.META)
    with estimate._MetaFactories():
        adapters = create_adapters(mp, settings.rank, settings.algorithm, LORA_DTYPES[settings.lora_dtype], {},
                                   None, choice=settings.choice)
    trained = list(adapters.values())
    dm = model.diffusion_model
    model.requires_grad_(False)
    x_shape, constants = estimate.packed(x_shape)
    conditioning = spec.inputs(batch, x_shape)
    constants.update({k: v for k, v in conditioning.items() if not isinstance(v, tuple)})
    inputs = {k: torch.empty(v, device=estimate.META) for k, v in conditioning.items() if k not in constants}
    latent, noise = torch.empty(x_shape, device=estimate.META), torch.empty(x_shape, device=estimate.META)
    sigma = torch.empty(x_shape[0], device=estimate.META)
    existing = [*memory_count.module_tensors(model), *trained, latent, noise, sigma, *inputs.values()]
    blocks = recompute.spread(compat.modules_at_depth(dm, 1), 1.0) if checkpointing else []
    options = {"optimized_attention_override": estimate._pytorch_attention}
    # the state a CUDA run's fused AdamW keeps (two moments per trained tensor); on meta its step runs tensor by
    # tensor, one trained tensor's temporaries at a time
    optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=False)
    pool, beside, eager_beside, report = 0, 0, 0, ""
    estimate._wrap(mp)
    try:
        with compat.training_mode(), fused.fused_layers(dm, "auto"), \
                compat.gradient_checkpointing(blocks, False, preserve_rng_state=not graphs_on), \
                recompute.inputs_kept([]), estimate._hooks_on_meta(None, mp), compat.differentiable_kernels(), \
                memory_count.counting(*existing, attention=attention, counter=PooledStorages) as c:
            storages: PooledStorages = c.storages  # type: ignore[assignment]
            device = MetaGraphDevice(storages, c.launches)
            watch = device.watch(_first_layer(dm))
            try:
                with graphs.graphed_forward(dm, trained, graphs_on, device=device, fallbacks=Fallbacks(),
                                            memory_budget=device.budget()) as graphed:
                    for step in range(1, steps + 1):
                        if graphed is not None:
                            graphed.begin_step()
                        xt = model.model_sampling.noise_scaling(sigma, noise, latent, False)
                        pred = model.apply_model(xt, sigma, transformer_options=options, **inputs, **constants)
                        loss = F.mse_loss(pred.float(), latent.float())
                        del pred, xt
                        storages.mark(f"step {step} forward")
                        c.launches.mark(f"step {step} forward")
                        loss.backward()
                        del loss
                        storages.mark(f"step {step} backward")
                        c.launches.mark(f"step {step} backward")
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        storages.mark(f"step {step} optimizer")
                        c.launches.mark(f"step {step} optimizer")
                    pool = max((p.largest for p in storages.pools), default=0)
                    beside = storages.beside
                    report = graphed.report() if graphed is not None else "graphs off"
            finally:
                watch.remove()
            eager_beside = device.eager_beside
    finally:
        estimate._unwrap(mp)
    count = storages.count()
    return GraphedSteps(
        family=spec.name, resolution=resolution, steps=steps, graphed=graphs_on, peak=count.peak, start=count.start,
        pool=pool, beside=beside, marks=dict(storages.marks), trained=estimate._bytes_of(trained),
        graphs={**(dict(graphs.last_run) if graphs_on else {}), "report": report}, eager_beside=eager_beside,
        attention=c.attention_calls(), seconds=time.perf_counter() - began, launches=dict(c.launches.marks))

