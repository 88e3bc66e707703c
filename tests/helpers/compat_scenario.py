"""Workflows and API prompts saved with earlier releases, run on today's nodes inside real ComfyUI (see
tests/comfy/test_compat.py); prints one JSON line of results.

    python compat_scenario.py COMFYUI_PATH WORKDIR [RELEASES [API_RELEASES]]

For every release in ``tests/fixtures/releases`` and every example workflow it shipped, both forms a user may
have saved run through ComfyUI's validation and executor: the UI file (converted by the headless runner, which
fills widgets the file lacks with their defaults and says which) and the API prompt that release's own runner
exported for POST /prompt. Only what names this machine's files and keeps the run short is changed: the
checkpoint (a tiny random-weight one), the number of training and sampling steps (one each), the encoding
resolution, the training precision (fp32: a CPU takes five to eight times as long in bf16; every precision through
every Train LoRA id is the family sweep's, tests/comfy/test_families.py) and the LoRA name. RELEASES (``all`` by default, or versions joined with ``,``, or ``none``): whose
UI files are executed; the others' UI files are converted and validated as the server validates a prompt before
running it (their execution is the API prompt's: the same nodes and values, up to the defaults the conversion
fills in). API_RELEASES (the same forms; ``all`` by default): whose API prompts are executed; the others' are
validated.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import time

from comfy_scenario import run_scenario_main, ui_text
from demo_assets import CKPT, write_dataset

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

PACK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELEASES = os.path.join(PACK, "tests", "fixtures", "releases")
ENCODERS = ("StreamingCacheEncodeDataset", "StreamingCacheEncode")
TRAINERS = ("StreamingCacheTrainLoRA", "StreamingCacheTrain")
# read before ComfyUI's start-up parses the command line
EXECUTE = {"ui": sys.argv[3] if len(sys.argv) > 3 else "all", "api": sys.argv[4] if len(sys.argv) > 4 else "all"}


def _executes(version: str, form: str) -> bool:
    return EXECUTE[form] == "all" or version in EXECUTE[form].split(",")


FP32 = {"training_dtype": "fp32", "lora_dtype": "fp32"}
OPTIONS_CHAIN = re.compile(r"^StreamingCache(Train|.*Options)$")


def _shortened(prompt: dict, tag: str) -> dict:
    """The prompt with this machine's checkpoint, a short run in fp32 and its own LoRA name; nothing else changed.
    The precision is set where the release kept it: on the trainer (earlier releases) or on a Memory & Precision
    options node, which is added at the head of the trainer's option chain (as a user wires one in) when the
    prompt has none."""
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = CKPT
        elif node["class_type"] in ENCODERS:
            inputs.update(resolution=64, batch_size=2)
        elif node["class_type"] in TRAINERS:
            inputs.update(steps=1, lora_name=f"compat_{tag}")
        if "training_dtype" in inputs:
            inputs.update(FP32)
        if "sample_steps" in inputs:  # the trainer's own (earlier releases) or Preview Options'
            inputs["sample_steps"] = 1
    chain = [n for n in prompt.values() if OPTIONS_CHAIN.match(n["class_type"])]
    heads = [n for n in chain if "options" not in n["inputs"] and n["class_type"] != TRAINERS[0]]
    heads += [n for n in chain if "options" not in n["inputs"] and n["class_type"] == TRAINERS[0]]
    if chain and not any("training_dtype" in n["inputs"] for n in prompt.values()) and heads:
        prompt["fp32"] = {"class_type": "StreamingCacheMemoryOptions",
                          "inputs": dict(headless.node_defaults("StreamingCacheMemoryOptions"), **FP32)}
        heads[0]["inputs"]["options"] = ["fp32", 0]
    return prompt


def _kept(exported: dict, converted: dict) -> dict:
    """Inputs of the release's own API prompt whose value the conversion today loses or changes, by node."""
    lost = {}
    for nid, node in exported.items():
        inputs = converted.get(nid, {}).get("inputs", {})
        changed = sorted(k for k, v in node["inputs"].items() if inputs.get(k) != v)
        if changed or converted.get(nid, {}).get("class_type") != node["class_type"]:
            lost[nid] = changed
    return lost


def scenario(server) -> dict:
    import folder_paths

    import nodes

    write_dataset(os.path.join(folder_paths.get_input_directory(), "dataset"))
    write_dataset(os.path.join(folder_paths.get_input_directory(), "regularization"))  # the regularisation example (0.5.0)
    out: dict = {}
    for version in sorted(os.listdir(RELEASES)):
        folder = os.path.join(RELEASES, version)
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            continue
        with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        for entry in manifest["files"]:  # the folder example first: it builds the cache the others read
            name = entry["workflow"][:-5]
            with open(os.path.join(folder, entry["api_prompt"]), encoding="utf-8") as f:
                exported = json.load(f)["prompt"]
            notes: list[str] = []
            converted = headless.load_workflow(os.path.join(folder, entry["workflow"]), nodes.NODE_CLASS_MAPPINGS,
                                               notes)
            for form, prompt in (("ui", converted), ("api", exported)):
                tag = f"{version.replace('.', '_')}_{name}_{form}"
                started = time.perf_counter()
                if not _executes(version, form):
                    _, error = headless.validate(_shortened(prompt, tag), server)
                    ok, result = not error, {}
                else:
                    ok, result, error = headless.run(_shortened(prompt, tag), server)
                trainer = next((k for k, v in prompt.items() if v["class_type"] in TRAINERS), None)
                out[f"{version}/{name}/{form}"] = {
                    "ok": ok, "error": error, "train": ui_text(result, trainer) if trainer else "",
                    "seconds": round(time.perf_counter() - started, 1), "executed": _executes(version, form),
                    **({"lost": _kept(exported, converted), "notes": notes} if form == "ui" else {})}
    return out


if __name__ == "__main__":
    run_scenario_main(scenario)
