"""The node side's CUDA-only paths, executed on the CPU inside real ComfyUI (see tests/comfy/test_device_paths.py);
prints one JSON line of results.

    python device_paths_scenario.py COMFYUI_PATH WORKDIR

* ``training_clone``: newer ComfyUI loads models on CUDA into dynamic-VRAM patchers (``ModelPatcherDynamic``,
  whose ``is_dynamic()`` is True; on the CPU it makes plain ones), which training clones as plain patchers
  (``clone(disable_dynamic=True)``). Here a stand-in patcher records what it was asked, and the tiny checkpoint's
  real patcher is made to report itself dynamic (a subclass whose ``is_dynamic()`` is True), so ComfyUI's own
  ``clone(disable_dynamic=True)`` runs: it reloads the model through the loader's ``cached_patcher_init``.
* ``ComfyBackend._sigmas`` / ``_on_host``: on a GPU a discrete schedule's tables (``sigmas``, ``log_sigmas``) are
  GPU tensors, and the backend computes noise levels from a CPU copy. The meta device cannot stand in (a meta
  tensor has no values to copy to the CPU), so ComfyUI's own ``ModelSamplingDiscrete`` is subclassed to report its
  tables' device as ``cuda:0`` (what ``_on_host`` reads) and to note which object ``percent_to_sigma`` ran on.
* The Train LoRA node's worker GPUs (``nodes/workers.py``) on a fake machine with four GPUs, ComfyUI on the third.
"""

from __future__ import annotations

import copy
import types

from comfy_scenario import CKPT, run_scenario_main
from fake_cuda import FakeCuda

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

LEVELS = [0.0, 0.001, 0.1, 0.25, 0.5, 0.75, 0.999, 1.0]


class StandInPatcher:
    """A patcher that says whether it is dynamic (``dynamic`` None: it has no ``is_dynamic``, as ComfyUI v0.3
    patchers) and records the arguments of each ``clone``."""

    def __init__(self, dynamic: bool | None) -> None:
        self.clones: list[dict] = []
        if dynamic is not None:
            self.is_dynamic = lambda: dynamic

    def clone(self, **kwargs):
        self.clones.append(kwargs)
        return StandInPatcher(None)


def training_clone(compat) -> dict:
    import comfy.model_patcher
    import torch

    import nodes

    out: dict = {"stand_in": {}}
    for name, dynamic in (("dynamic", True), ("static", False), ("without_is_dynamic", None)):
        patcher = StandInPatcher(dynamic)
        compat.training_clone(patcher)
        out["stand_in"][name] = patcher.clones
    dynamic_class = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    out["comfyui_has_dynamic_patchers"] = dynamic_class is not None
    if dynamic_class is not None:
        out["comfyui_dynamic_is_dynamic"] = dynamic_class.is_dynamic(None)
    with torch.inference_mode():
        patcher = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[0]
    out["loaded_class"] = type(patcher).__name__
    out["loaded_has_is_dynamic"] = hasattr(patcher, "is_dynamic")
    if out["loaded_has_is_dynamic"]:  # as ComfyUI's patcher on CUDA reports itself
        patcher.__class__ = type("DynamicOnCuda", (type(patcher),), {"is_dynamic": lambda self: True})
    clone = compat.training_clone(patcher)
    out["clone"] = {"class": type(clone).__name__, "is_plain_model_patcher": type(clone) is comfy.model_patcher.ModelPatcher,
                    "is_dynamic": bool(getattr(clone, "is_dynamic", lambda: False)()),
                    "same_model_object": clone.model is patcher.model}
    ours, theirs = clone.model.state_dict(), patcher.model.state_dict()
    out["clone"]["same_weights"] = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k])
                                                                        for k in ours)
    return out


def host_tables(training) -> dict:
    import comfy.model_sampling
    import torch

    reads: list[int] = []

    class TablesOnGpu(comfy.model_sampling.ModelSamplingDiscrete):
        """ComfyUI's discrete schedule whose tables report a CUDA device, as they do once the model is on a GPU
        (their values stay on this machine's CPU); notes the object each ``percent_to_sigma`` runs on."""

        def buffers(self, recurse: bool = True):
            for _ in super().buffers(recurse):
                yield types.SimpleNamespace(device=torch.device("cuda", 0))

        def percent_to_sigma(self, percent):
            reads.append(id(self))
            return super().percent_to_sigma(percent)

    def expected(reference) -> list[float]:  # ComfyUI's own computation on the CPU
        return [float(torch.tensor(reference.percent_to_sigma(1.0 - float(v)), dtype=torch.float32))
                for v in torch.tensor(LEVELS)]

    backend = training.ComfyBackend.__new__(training.ComfyBackend)  # the two methods need only these
    backend._host_sampling = None
    backend.spec = types.SimpleNamespace(objective=types.SimpleNamespace(timestep_sampling="uniform"))
    t = torch.tensor(LEVELS)
    first, other = TablesOnGpu(), TablesOnGpu(zsnr=True)
    out: dict = {"runs": []}
    copies: list = []  # every host copy made, kept alive so that ids name one object each
    for ms in (first, first, other, other, first):
        backend.inner = types.SimpleNamespace(model_sampling=ms)
        reads.clear()
        sigmas = backend._sigmas(t)
        host = backend._host_sampling[1] if backend._host_sampling is not None else None
        if not any(host is c for c in copies):
            copies.append(host)
        out["runs"].append({"sampling": "first" if ms is first else "other",
                            "host_copy": next(i for i, c in enumerate(copies) if c is host),
                            "is_the_original": host is ms, "read_on": sorted({"original" if r == id(ms) else
                                                                               "host copy" if r == id(host) else
                                                                               "elsewhere" for r in reads}),
                            "tables_on": sorted({b.device.type for b in host._buffers.values()}) if host else [],
                            "sigmas": sigmas.tolist(), "dtype": str(sigmas.dtype)})
    out["expected"] = {"first": expected(comfy.model_sampling.ModelSamplingDiscrete()),
                       "other": expected(comfy.model_sampling.ModelSamplingDiscrete(zsnr=True))}
    on_cpu = comfy.model_sampling.ModelSamplingDiscrete()
    backend.inner = types.SimpleNamespace(model_sampling=on_cpu)
    out["cpu_tables_used_as_they_are"] = backend._on_host(on_cpu) is on_cpu
    meta = copy.deepcopy(on_cpu).to("meta")
    try:
        copy.deepcopy(meta).to("cpu")
        out["meta_copies_to_cpu"] = True
    except NotImplementedError:
        out["meta_copies_to_cpu"] = False
    return out


def worker_gpus(compat, workers) -> dict:
    original = compat.device_index
    compat.device_index = lambda: 2
    try:
        with FakeCuda(4, current=2):
            out: dict = {"three_devices": workers.worker_devices(3), "four_devices": workers.worker_devices(4)}
            try:
                workers.worker_devices(5)
            except ValueError as exc:
                out["five_devices"] = str(exc)
    finally:
        compat.device_index = original
    return out


def scenario(server: headless._Server) -> dict:
    compat = headless.pack_module("backend.compat")
    return {"version": compat.comfyui_version(), "training_clone": training_clone(compat),
            "host_tables": host_tables(headless.pack_module("backend.training")),
            "workers": worker_gpus(compat, headless.pack_module("workers"))}


if __name__ == "__main__":
    run_scenario_main(scenario)
