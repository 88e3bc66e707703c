"""The device memory a training step needs, counted without the device: tensors on ``meta`` have shapes and dtypes
but no data, so a full-size model's forward and backward pass runs on a CPU in seconds while every tensor it
would allocate is still made, kept and freed as on the GPU.

:class:`LiveStorages` is the counter: a dispatch mode that sees every tensor an operation returns (autograd's
saved activations and the adapters' gradients included: they are made by operations too, in the thread that runs
the backward pass, which inherits the mode) and adds its storage's bytes while that storage lives. A storage is
counted once however many views share it, and leaves the count when it is freed (a ``weakref.finalize`` on the
storage object, which PyTorch keeps as long as the storage itself). Storages that existed before the count began
(the frozen weights, the adapters) are passed in, or found when an operation first reads them: they were live from
the start, so they are added to the start, the current count and the peak alike.

The peak is the largest sum of live storages after any operation, which is what ``torch.cuda.max_memory_allocated``
measures less the caching allocator's rounding (blocks of 512 bytes) and a kernel's own workspace (cuBLAS's,
a few MiB); the CUDA context and what the allocator reserves beyond that are not tensors and are not counted.

:class:`FusedAttention` makes attention count as a GPU runs it: on ``meta`` (and on a CPU)
``torch.nn.functional.scaled_dot_product_attention`` takes its math path, which makes the whole ``L x S`` score
matrix and keeps it (and its softmax) for the backward pass; flash and memory-efficient attention on a GPU keep
the output and one log-sum-exp row per query instead. While it is active, the function is routed to ATen's flash
kernel (fp16 / bf16, no mask, head width up to 256) or memory-efficient kernel (a mask, or fp32), whose meta
kernels return what those kernels return and whose derivatives are those kernels' backward passes; a call that
neither kernel takes (grouped-query attention with fewer key heads, dropout, mixed dtypes) stays on the math
path, and each kind of call is counted so a caller can say which attention was counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .launches import Launches

ATTENTION = ("flash", "math")
"""How :func:`counting` counts attention: ``flash`` as the fused GPU kernels run it (:class:`FusedAttention`),
``math`` as ``scaled_dot_product_attention``'s math path runs on ``meta`` (whole score matrices kept)."""

FLASH_MAX_HEAD = 256  # the widest head flash attention takes (PyTorch's CUDA kernels)


@dataclasses.dataclass(frozen=True)
class Count:
    """Bytes of live storages on the counted device: at the start, at the peak, at the end; ``found``: of the start,
    those first seen as an operation's input rather than passed in; ``allocated``: all bytes made while counting."""

    start: int
    peak: int
    end: int
    found: int
    allocated: int

    @property
    def transient(self) -> int:
        """The peak above the start: what the step itself (activations, gradients, temporaries) adds."""
        return self.peak - self.start


class LiveStorages(TorchDispatchMode):
    """A dispatch mode counting the bytes of live tensor storages on ``device`` (a device type: ``meta``,
    ``cuda``, ...), their peak and the storages that were live before it began (``existing``: tensors, e.g. a
    module's parameters and buffers, :func:`module_tensors`). Use it as a context manager; :meth:`count` gives the
    figures at any time. Marks (:meth:`mark`) keep the live bytes and the peak since the last mark under a name,
    e.g. to tell the forward pass's peak from the backward pass's."""

    def __init__(self, device: str = "meta", existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.device = torch.device(device).type
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self.start = self.live = self.peak = self.found = self.allocated = 0
        self._since_mark = 0
        self.marks: dict[str, tuple[int, int]] = {}
        for t in existing:
            self._existing(t, found=False)

    def _key(self, t: Any) -> tuple[int, torch.UntypedStorage] | None:
        if not isinstance(t, torch.Tensor) or t.device.type != self.device:
            return None
        storage = t.untyped_storage()
        return storage._cdata, storage

    def _existing(self, t: Any, found: bool) -> None:
        """A storage live from the start: part of the start, the current count and every peak so far."""
        key = self._key(t)
        if key is None or key[0] in self._sizes:
            return
        size = self._watch(*key)
        with self._lock:
            self.start += size
            self.live += size
            self.peak += size
            self._since_mark += size
            if found:
                self.found += size

    def _watch(self, cdata: int, storage: torch.UntypedStorage) -> int:
        size = storage.nbytes()
        with self._lock:
            self._sizes[cdata] = size
        self._finalizers[cdata] = weakref.finalize(storage, self._freed, cdata)
        return size

    def _freed(self, cdata: int) -> None:
        with self._lock:
            size = self._sizes.pop(cdata, 0)
            self.live -= size
        self._finalizers.pop(cdata, None)

    def _made(self, t: Any) -> None:
        key = self._key(t)
        if key is None:
            return
        cdata, storage = key
        known = self._sizes.get(cdata)
        if known is None:
            size = self._watch(cdata, storage)
            grown = size
        else:
            size = storage.nbytes()  # resized in place (``resize_``, ``set_``)
            grown = size - known
            with self._lock:
                self._sizes[cdata] = size
        if grown:
            with self._lock:
                self.live += grown
                self.allocated += max(grown, 0)
                self.peak = max(self.peak, self.live)
                self._since_mark = max(self._since_mark, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        for t in inputs:
            if isinstance(t, torch.Tensor) and self._key(t) is not None and \
                    t.untyped_storage()._cdata not in self._sizes:
                self._existing(t, found=True)
        out = func(*args, **kwargs)
        outputs, _ = tree_flatten(out)
        for t in outputs:
            self._made(t)
        return out

    def mark(self, name: str) -> None:
        """Keep (live bytes now, the peak since the previous mark) under ``name``; the next span starts now."""
        with self._lock:
            self.marks[name] = (self.live, self._since_mark)
            self._since_mark = self.live

    def count(self) -> Count:
        with self._lock:
            return Count(start=self.start, peak=self.peak, end=self.live, found=self.found, allocated=self.allocated)


def module_tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``modules`` (shared ones once): the storages live before a step."""
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            seen.setdefault(id(t), t)
    return list(seen.values())


def _fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                  dropout_p: float, enable_gqa: bool) -> str | None:
    """Which fused kernel takes this call on a GPU: ``flash``, ``efficient`` or None (the math path)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or dropout_p:
        return None
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:
        return None  # grouped-query attention: PyTorch's fused kernels take it only with equal heads
    if q.dtype != k.dtype or k.dtype != v.dtype or q.shape[-1] != k.shape[-1]:
        return None
    if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= FLASH_MAX_HEAD \
            and v.shape[-1] == q.shape[-1]:
        return "flash"
    if attn_mask is not None and attn_mask.dim() > 4:
        return None
    return "efficient"


class FusedAttention:
    """``torch.nn.functional.scaled_dot_product_attention`` routed to ATen's flash or memory-efficient attention
    while the block runs (module docstring); :attr:`calls` counts the calls each kernel took (``flash``,
    ``efficient``, ``math``).

    The function is replaced in ``torch.nn.functional`` for every thread, not intercepted by a torch-function
    mode: a mode is switched off while it handles a call, and ``Tensor.backward`` is such a call, so a gradient
    checkpoint's recomputation in the backward pass would run the math path and save other tensors than its
    forward pass (which PyTorch refuses). Code that looks the function up at each call (ComfyUI's attention
    does) is routed; a call that is not shows as no call counted."""

    def __init__(self) -> None:
        self.calls = {"flash": 0, "efficient": 0, "math": 0}
        self._original: Any = None

    def __enter__(self) -> FusedAttention:
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.attention  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention = self._original

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        kernel = _fused_kernel(q, k, v, attn_mask, dropout_p, enable_gqa)
        if kernel is not None and attn_mask is not None:
            if attn_mask.dtype == torch.bool:  # as PyTorch hands a boolean mask to its fused kernels
                attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
            attn_mask = attn_mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        self.calls[kernel or "math"] += 1
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False,
                                                                      scale=scale)[0]
        if kernel == "efficient":
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, q.requires_grad or k.requires_grad or v.requires_grad, 0.0, is_causal,
                scale=scale)[0]
        return self._original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa)


@dataclasses.dataclass
class Counting:
    """What :func:`counting` yields: the storage counter, the kernel launches (:class:`~.launches.Launches`) and,
    with fused attention, the attention mode (else None)."""

    storages: LiveStorages
    attention: FusedAttention | None
    launches: Launches

    def attention_calls(self) -> dict[str, int]:
        """Calls of ``scaled_dot_product_attention`` by the kernel that counted them (empty for ``math``)."""
        return dict(self.attention.calls) if self.attention is not None else {}


@contextlib.contextmanager
def counting(*existing: torch.nn.Module | torch.Tensor, device: str = "meta", attention: str = "flash",
             counter: type[LiveStorages] = LiveStorages) -> Iterator[Counting]:
    """Count live storages on ``device`` while the block runs, starting from ``existing`` (modules: their
    parameters and buffers; tensors), with attention counted as ``attention`` says (:data:`ATTENTION`), and the
    operations that would launch a kernel (``Counting.launches``).
    ``counter``: the counter's class (:class:`LiveStorages` or a subclass: ``meta_graphs.PooledStorages`` counts
    CUDA graphs' pools too)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}; got {attention!r}")
    tensors: list[torch.Tensor] = []
    for item in existing:
        tensors.extend(module_tensors(item) if isinstance(item, torch.nn.Module) else [item])
    storages = counter(device, tensors)
    fused = FusedAttention() if attention == "flash" else None
    launched = Launches()
    with contextlib.ExitStack() as stack:
        if fused is not None:
            stack.enter_context(fused)
        stack.enter_context(storages)
        stack.enter_context(launched)
        yield Counting(storages, fused, launched)


def tensor_bytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """The bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


GIB = 1024 ** 3
