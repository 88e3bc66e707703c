"""What the Comfy Registry and ComfyUI-Manager show of the pack, read from pyproject.toml by ComfyUI's own parser
(``comfy_config``, the schema comfy-cli publishes with)."""

from __future__ import annotations

import json
import os
import subprocess

import install
import tomllib

from helpers.installs import ROOT, require_comfyui, subprocess_env

RAW = "https://raw.githubusercontent.com/streaming-cache/comfyui-streaming-cache/main/"


def test_the_registry_reads_a_complete_listing(comfyui):
    comfyui = require_comfyui(comfyui)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from comfy_config import config_parser; "
            "print(json.dumps(config_parser.extract_node_configuration(sys.argv[2]).model_dump(by_alias=False)))")
    proc = subprocess.run([comfyui.python, "-c", code, comfyui.path, ROOT], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listing = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert listing["project"]["name"] == project["name"] and listing["project"]["version"] == project["version"]
    assert listing["project"]["description"] and listing["project"]["license"]["file"] == "LICENSE"
    urls = listing["project"]["urls"]
    assert all(urls[k].startswith("https://github.com/streaming-cache/") for k in ("repository", "documentation",
                                                                                  "issues")), urls
    assert listing["project"]["supported_os"] == ["OS Independent"]
    assert listing["project"]["supported_accelerators"] == ["GPU :: NVIDIA CUDA"], "an unknown classifier drops all"
    oldest = ".".join(str(p) for p in install.OLDEST_SUPPORTED)
    assert listing["project"]["supported_comfyui_version"] == f">={oldest}", "the installer and the listing agree"
    comfy = listing["tool_comfy"]
    assert comfy["publisher_id"] and comfy["display_name"]
    for field, name in (("icon", "assets/icon.svg"), ("banner_url", "assets/banner.svg")):
        assert comfy[field] == RAW + name and os.path.isfile(os.path.join(ROOT, name)), (field, comfy[field])
    assert comfy["web"] == "web" and os.path.isfile(os.path.join(ROOT, "web", "streaming_cache.js"))
