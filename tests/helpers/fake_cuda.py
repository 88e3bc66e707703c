"""A machine with CUDA GPUs, as the code under test sees it, on a machine without one.

:class:`FakeCuda` replaces the few ``torch.cuda`` functions the pack's device decisions ask (``is_available``,
``device_count``, ``current_device``, ``set_device``) and ``torch.version.cuda`` / ``torch.version.hip`` (PyTorch's
ROCm build reports its AMD GPUs as "cuda" devices and sets ``hip``), and records what it was asked to do
(:attr:`FakeCuda.set_devices`). It makes no tensors and stands in for no kernel: a function that must make a
tensor on the GPU takes where it makes it through a seam of its own (a parameter, or one module-level function a
test replaces), and the test checks what that seam was asked for.

In a test, the ``fake_cuda`` fixture (import ``fake_cuda_fixture`` into the test module): ``fake_cuda(4)`` is a machine with four GPUs, ``fake_cuda(2,
rocm=True, current=1)`` one with two AMD GPUs whose current device is 1; everything is put back after the test.
Elsewhere (a ComfyUI scenario, whose Python has no pytest) ``with FakeCuda(2): ...``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

CUDA_VERSION = "12.8"
HIP_VERSION = "6.4.43482"


class FakeCuda:
    """``gpus`` CUDA devices (0 = a CUDA build on a machine without a GPU), the current one ``current``;
    ``rocm``: PyTorch's ROCm build. :meth:`install` puts it in place, :meth:`uninstall` puts torch back."""

    def __init__(self, gpus: int, *, rocm: bool = False, current: int = 0) -> None:
        self.gpus, self.rocm, self.current = gpus, rocm, current
        self.set_devices: list[int] = []  # every index set_device was given, in order
        self._saved: list[tuple[Any, str, Any]] = []

    def is_available(self) -> bool:
        return self.gpus > 0

    def device_count(self) -> int:
        return self.gpus

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: int | str | torch.device) -> None:
        """As torch's: an index, ``"cuda:N"`` or a device; an index this machine lacks raises as CUDA does."""
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            index = device.index if device.index is not None else self.current
        if not 0 <= index < self.gpus:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.set_devices.append(index)
        self.current = index

    def install(self) -> FakeCuda:
        if self._saved:
            raise RuntimeError("this FakeCuda is installed already")
        replaced = [(torch.cuda, "is_available", self.is_available), (torch.cuda, "device_count", self.device_count),
                    (torch.cuda, "current_device", self.current_device), (torch.cuda, "set_device", self.set_device),
                    (torch.version, "cuda", None if self.rocm else CUDA_VERSION),
                    (torch.version, "hip", HIP_VERSION if self.rocm else None)]
        for owner, name, value in replaced:
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        return self

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def __enter__(self) -> FakeCuda:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


try:
    import pytest
except ImportError:  # a ComfyUI scenario's Python: the class alone
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    @pytest.fixture(name="fake_cuda")
    def fake_cuda_fixture() -> Iterator[Callable[..., FakeCuda]]:
        """``fake_cuda(gpus, rocm=False, current=0)``: that machine for the rest of the test (a later call
        replaces an earlier one), put back after it. Returns the :class:`FakeCuda`, to read what it was asked."""
        installed: list[FakeCuda] = []

        def make(gpus: int, *, rocm: bool = False, current: int = 0) -> FakeCuda:
            while installed:
                installed.pop().uninstall()
            installed.append(FakeCuda(gpus, rocm=rocm, current=current).install())
            return installed[-1]

        yield make
        while installed:
            installed.pop().uninstall()
