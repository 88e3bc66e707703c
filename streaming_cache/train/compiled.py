"""The model's blocks compiled with ``torch.compile`` while a LoRA trains, with the adapters in place.

On a fast GPU a model of a thousand small layers spends most of a training step issuing kernels from Python (SDXL
at 1024 px: a few tenths of a second of kernels in a step of a second). Compiling each checkpointed block fuses its
element-wise work and replaces its per-layer Python with one call per block; the adapters' parameters are inputs of
the compiled graph, so training them needs no recompilation. Blocks of the same structure share their code;
ComfyUI passes each block its own position in ``transformer_options``, so every block position compiles once
(the limit on recompilations is raised to the number of blocks for the run).

This is opt-in (``STREAMING_CACHE_COMPILE``), for measuring: the first step of a run pays the compilation, a model
whose code dynamo cannot trace runs eagerly where it cannot (graph breaks), and SDXL's compiled step is slower than
its eager one, not faster (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..fallbacks import COMPILED_BLOCKS, Fallbacks, describe
from .forwards import replaced_forwards

MODES = ("off", "blocks")


def compile_mode() -> str:
    """``off`` unless ``STREAMING_CACHE_COMPILE`` says ``blocks`` (or ``1``)."""
    value = os.environ.get("STREAMING_CACHE_COMPILE", "off").strip().lower()
    value = {"1": "blocks", "on": "blocks", "true": "blocks", "0": "off", "false": "off", "no": "off"}.get(value,
                                                                                                           value)
    if value not in MODES:
        raise ValueError(f"STREAMING_CACHE_COMPILE={value!r}: use blocks (1) or off (0)")
    return value


COMPILE_ERRORS = (RuntimeError, TypeError, ValueError, AssertionError, NotImplementedError)
"""What a compiled block may raise and the run survive on the plain forward (dynamo's and inductor's errors are
RuntimeErrors; a cancel or an interrupt is not among them)."""


def is_compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.compile's (tracing, code generation, a compiler that failed), wherever it surfaced: a
    block's backward pass is compiled at its first backward pass, so its failure reaches the training loop."""
    dynamo = getattr(getattr(torch, "_dynamo", None), "exc", None)
    base = getattr(dynamo, "TorchDynamoException", None)
    return base is not None and isinstance(exc, base)


def _falling_back(module: torch.nn.Module, compiled: Callable[..., Any], off: list[bool],
                  fallbacks: Fallbacks) -> Callable[..., Any]:
    """``module``'s compiled forward, or its plain one once any compiled block failed (``off[0]``)."""
    plain = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if off[0]:
            return plain(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except COMPILE_ERRORS as e:
            off[0] = True
            fallbacks.note(COMPILED_BLOCKS, f"a compiled block failed ({describe(e)})")
            return plain(*args, **kwargs)

    return forward


@contextlib.contextmanager
def compiled_blocks(modules: list[torch.nn.Module], mode: str = "blocks",
                    backend: str | Callable[..., Any] = "inductor",
                    fallbacks: Fallbacks | None = None) -> Iterator[int]:
    """Each of ``modules`` runs its forward compiled while the block runs; yields how many. Install before
    gradient checkpointing wraps the same modules (the checkpoint then recomputes through the compiled forward)
    and after the fused layers are in place (they are traced into the block). Removed on exit, also on errors.
    ``backend`` is ``torch.compile``'s (tests use ``aot_eager``, which traces the same graphs without code
    generation).

    A block whose compiled forward raises runs its plain forward instead, and so does every block for the rest of
    the run, noted in ``fallbacks`` (a run that noted it before compiles nothing). A failure in a compiled backward
    pass reaches the caller (the trainer retries the pass without compiling before the first optimizer step:
    :func:`is_compile_error`)."""
    if mode not in MODES:
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {', '.join(MODES)}")
    fallbacks = fallbacks if fallbacks is not None else Fallbacks()
    if fallbacks.reason(COMPILED_BLOCKS) is not None:
        mode = "off"
    limits: dict[str, int] = {}
    if mode != "off":
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(config, name):
                limits[name] = getattr(config, name)
                setattr(config, name, max(getattr(config, name), 4 * len(modules) + 8))
    off = [False]
    try:
        with replaced_forwards(modules if mode != "off" else [], lambda m: _falling_back(
                m, torch.compile(m.forward, backend=backend, dynamic=False), off, fallbacks)) as count:
            yield count
    finally:
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
