"""The names the presets table (``streaming_cache.train.presets``) reads ComfyUI by are ComfyUI's own: every model
config of a row is in the newest ComfyUI's ``supported_models``, every tokenizer class of ``TOKENIZERS`` is defined
in its text encoders, and the classes a version has are the ones its CLIPs carry."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers.installs import require_comfyui, subprocess_env
from streaming_cache.train import presets

PROBE = """
import importlib, json, pkgutil, sys
sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.supported_models as sm
import comfy.text_encoders
names = set()
for module in ["comfy.sd1_clip", "comfy.sdxl_clip"] + [f"comfy.text_encoders.{m.name}"
                                                      for m in pkgutil.iter_modules(comfy.text_encoders.__path__)]:
    try:
        names.update(n for n, v in vars(importlib.import_module(module)).items() if isinstance(v, type))
    except Exception:
        pass
print("RESULT " + json.dumps({"configs": [c.__name__ for c in sm.models], "classes": sorted(names)}))
"""


@pytest.fixture(scope="module")
def names(comfyui) -> dict:
    install = require_comfyui(comfyui)
    proc = subprocess.run([install.python, "-c", PROBE], cwd=install.path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_presets_name_comfyui_s_own_model_configs_and_tokenizers(names):
    configs, classes = set(names["configs"]), set(names["classes"])
    rows = {c for p in presets.PRESETS for c in p.configs}
    if "Flux2" in configs:  # a ComfyUI with every family the table has
        assert rows <= configs, f"model configs no ComfyUI class has: {sorted(rows - configs)}"
        assert set(presets.TOKENIZERS) <= classes, sorted(set(presets.TOKENIZERS) - classes)
    else:  # an older one (v0.3.64) has fewer families; those it has are named alike
        assert {"SD15", "SDXL", "SD3", "Flux", "QwenImage", "WAN21_T2V", "HunyuanVideo"} <= rows & configs
        assert {"SD1Tokenizer", "SDXLTokenizer", "FluxTokenizer", "QwenImageTokenizer"} <= classes
    assert set(presets.TOKENIZERS.values()) <= rows
