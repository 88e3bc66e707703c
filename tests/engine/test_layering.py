"""The architecture as the imports show it: each module imports only modules of lower layers, no cycles, the
developer tools are imported by nothing, and the engine never imports ComfyUI."""

from __future__ import annotations

import ast
import os

import pytest

from helpers.installs import ROOT

# Lower number = lower layer. A module may import modules with a strictly lower number (its own package's
# ``__init__`` excepted); modules of one layer are independent of each other.
ENGINE_LAYERS = {
    "errors": 0, "environment": 0, "fallbacks": 0, "torch_build": 0, "layout": 1, "transfers": 1, "format": 2, "skeleton": 3, "records": 3, "lock": 4, "leases": 4, "manifest": 5, "collate": 6, "group": 6, "buffers": 6, "prepare": 6,
    "writer": 7, "reader": 7, "dataset": 8, "builder": 9, "clean": 9, "sampler": 9, "mix": 10, "loader": 11, "cli": 12,
    "train.optim": 20, "train.checkpoint": 20, "train.plot": 20, "train.buckets": 20, "train.fingerprint": 20,
    "train.paths": 20, "train.holdout": 20, "train.timesteps": 20, "train.captions": 20, "train.ema": 20,
    "train.conditioning": 20, "train.lora_formats": 20, "train.recompute": 20, "train.lowrank": 20,
    "train.compiled": 20, "train.inplace": 0, "train.launches": 0, "train.meta_graphs": 21, "train.graph_devices": 19, "train.graphs": 20, "train.chart": 21, "train.forwards": 15, "train.inference": 20, "train.layers": 20, "train.dora": 20, "train.presets": 20, "train.memory_count": 20, "train.memory_plan": 20, "train.draws": 21, "train.distributed": 21, "train.folder": 21, "train.loop": 21, "train.runs": 21, "train.spec": 22,
    "train.metadata": 23, "train.backend": 23, "dataset_view": 24, "preview_pages": 25, "__init__": 30, "__main__": 31,
    "devtools.toy": 40, "devtools.bench_read": 41, "devtools.bench_loader": 41, "devtools.bench_scaling": 41, "devtools.bench_scale": 41,
    "devtools.crashtest": 41,
    "devtools.fuzz": 41, "devtools.demo": 41, "train.__init__": 19, "devtools.__init__": 39,
}
NODE_LAYERS = {"backend.compat": 0, "backend.media": 0, "video": 0, "backend.__init__": 0, "backend.families": 1, "backend.fused": 1,
               "backend.training": 2, "backend.memory_estimate": 3, "backend.memory_fit": 4, "backend.graphs_estimate": 4, "ui": 1, "folders": 1,
               "encoders": 1, "inputs": 2, "previews": 2, "dataset_preview": 3, "load": 4, "mix": 2,
               "training_run": 5,
               "options": 3, "encode": 4, "workers": 6, "train": 7, "legacy": 8, "__init__": 9}
COMFYUI_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "nodes", "node_helpers",
                   "server", "execution", "comfyui_version"}


def modules(package: str) -> dict[str, str]:
    """Module name (relative to ``package``, dotted) -> file path, for every .py file below it."""
    base = os.path.join(ROOT, package)
    out = {}
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                out[rel] = os.path.join(dirpath, f)
    return out


def imports(path: str, module: str) -> list[tuple[str, int]]:
    """(import target resolved relative to the package root, line) for every import statement in the file,
    deferred imports inside functions included."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package_parts = module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [("abs:" + a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append(("abs:" + (node.module or ""), node.lineno))
                continue
            base = package_parts[:len(package_parts) - (node.level - 1)] if node.level > 1 else package_parts
            if node.level - 1 > len(package_parts):
                found.append(("outside:" + (node.module or ""), node.lineno))
                continue
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # from . import a, b
                found += [((target + "." if target else "") + a.name, node.lineno) for a in node.names]
            else:
                found.append((target, node.lineno))
    return found


def resolve(target: str, layers: dict[str, int]) -> str | None:
    """The module of ``layers`` a relative import names (``train`` alone means ``train.__init__``; in
    ``from . import name`` the name may be defined in the package's ``__init__``)."""
    for candidate in (target, target + ".__init__", target.rpartition(".")[0] + ".__init__"):
        if candidate in layers:
            return candidate
    return None


@pytest.mark.parametrize("package,layers", [("streaming_cache", ENGINE_LAYERS), ("nodes", NODE_LAYERS)])
def test_every_module_has_a_layer_and_imports_only_lower_layers(package, layers):
    found = modules(package)
    assert set(found) == set(layers), f"modules without a layer (add them here): {set(found) ^ set(layers)}"
    problems = []
    for name, path in found.items():
        for target, line in imports(path, name):
            if target.startswith(("abs:", "outside:")):
                continue
            dep = resolve(target, layers)
            if dep is None:
                problems.append(f"{name}:{line} imports unknown module {target}")
            elif dep != name and layers[dep] >= layers[name] and not (name.endswith("__init__") and
                                                                      dep.startswith(name[:-8])):
                problems.append(f"{name}:{line} imports {dep} (layer {layers[dep]} >= {layers[name]})")
    assert problems == []


def test_nothing_outside_devtools_imports_devtools():
    offenders = []
    for package in ("streaming_cache", "nodes"):
        for name, path in modules(package).items():
            if name.startswith("devtools"):
                continue
            offenders += [f"{package}.{name}:{line}" for target, line in imports(path, name)
                          if "devtools" in target.split(":")[-1].split(".")]
    assert offenders == []


def test_the_engine_never_imports_comfyui():
    offenders = []
    for name, path in modules("streaming_cache").items():
        for target, line in imports(path, name):
            if target.startswith("abs:") and target[4:].split(".")[0] in COMFYUI_MODULES:
                offenders.append(f"{name}:{line} imports {target[4:]}")
    assert offenders == []


def test_only_the_backend_package_reaches_comfyuis_internals():
    """Every node module uses ComfyUI's public node API (``comfy_api``) alone; ComfyUI's internals are reached
    through ``nodes/backend``, so a ComfyUI change lands there."""
    offenders = []
    for name, path in modules("nodes").items():
        if name.startswith("backend."):
            continue
        for target, line in imports(path, name):
            top = target[4:].split(".")[0] if target.startswith("abs:") else None
            if top in COMFYUI_MODULES - {"comfy_api"}:
                offenders.append(f"nodes.{name}:{line} imports {target[4:]}")
    assert offenders == []


def test_nodes_import_the_engine_relatively_never_as_a_top_level_package():
    """Inside ComfyUI the pack is a package; ``import streaming_cache`` would find another copy, or none."""
    offenders = []
    for name, path in modules("nodes").items():
        offenders += [f"{name}:{line}" for target, line in imports(path, name)
                      if target.split(":")[-1].split(".")[0] in ("streaming_cache", "scripts")
                      and target.startswith("abs:")]
    assert offenders == []
