"""The headless runner's workflow handling (UI -> API conversion, overrides), tested without ComfyUI."""

from __future__ import annotations

import json
import os

import headless
import pytest

from helpers.installs import ROOT


class Loader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"ckpt_name": (["a.safetensors", "b.safetensors"],)}}


class Sampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "seed": ("INT", {"default": 0}), "steps": ("INT", {"default": 20}),
                             "name": ("STRING", {"default": "x"}), "text": ("STRING", {"forceInput": True})},
                "optional": {"flag": ("BOOLEAN", {"default": True})}}


MAPPINGS = {"Loader": Loader, "Sampler": Sampler}


def node(nid, type_, widgets, inputs=(), mode=0):
    return {"id": nid, "type": type_, "mode": mode, "widgets_values": widgets,
            "inputs": [{"name": n, "type": "X", "link": l} for n, l in inputs]}


def test_ui_to_api_widgets_links_seed_control_reroute_primitive():
    wf = {"nodes": [node(1, "Loader", ["b.safetensors"]),
                    node(2, "Reroute", [], [("", 1)]),
                    node(3, "PrimitiveNode", ["hello"]),
                    node(4, "Sampler", [7, "randomize", 30, "name", False], [("model", 2), ("text", 3)]),
                    node(5, "Note", ["just a note"]),
                    node(6, "Sampler", [1, "fixed", 2, "n", True], [("model", None)], mode=2)],
          "links": [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 4, 0, "MODEL"], [3, 3, 0, 4, 1, "STRING"]]}
    prompt = headless.ui_to_api(wf, MAPPINGS)
    assert prompt == {
        "1": {"class_type": "Loader", "inputs": {"ckpt_name": "b.safetensors"}},
        "4": {"class_type": "Sampler", "inputs": {"model": ["1", 0], "seed": 7, "steps": 30, "name": "name",
                                                  "flag": False, "text": "hello"}},
    }, "reroutes followed, primitives inlined, the seed's control value skipped, notes and muted nodes dropped"


def test_ui_to_api_errors_are_clear():
    with pytest.raises(headless.WorkflowError, match="does not have: Mystery"):
        headless.ui_to_api({"nodes": [node(1, "Mystery", [])], "links": []}, MAPPINGS)
    wf = {"nodes": [node(1, "Loader", ["a.safetensors"], mode=4), node(2, "Sampler", [0, 1, "n"], [("model", 1)])],
          "links": [[1, 1, 0, 2, 0, "MODEL"]]}
    with pytest.raises(headless.WorkflowError, match="bypassed"):
        headless.ui_to_api(wf, MAPPINGS)
    with pytest.raises(headless.WorkflowError, match="broken link"):
        headless.ui_to_api({"nodes": [node(2, "Sampler", [0, 1, "n"], [("model", 9)])], "links": []}, MAPPINGS)


def test_load_workflow_formats_and_overrides(tmp_path):
    api = {"4": {"class_type": "Sampler", "inputs": {"steps": 1}}}
    for i, data in enumerate((api, {"prompt": api})):
        (tmp_path / f"w{i}.json").write_text(json.dumps(data))
        assert headless.load_workflow(str(tmp_path / f"w{i}.json"), MAPPINGS) == api
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(headless.WorkflowError, match="neither a UI-format workflow"):
        headless.load_workflow(str(tmp_path / "bad.json"), MAPPINGS)
    with pytest.raises(headless.WorkflowError, match="not a readable workflow"):
        headless.load_workflow(str(tmp_path / "missing.json"), MAPPINGS)
    prompt = json.loads(json.dumps(api))
    headless.apply_overrides(prompt, ["4.steps=12", "4.name=my lora", "4.flag=true"])
    assert prompt["4"]["inputs"] == {"steps": 12, "name": "my lora", "flag": True}
    with pytest.raises(headless.WorkflowError, match="NODE_ID.INPUT=VALUE"):
        headless.apply_overrides(prompt, ["9.steps=1"])


def test_example_workflows_are_ui_format_and_use_the_pack_nodes():
    folder = os.path.join(ROOT, "example_workflows")
    names = sorted(os.listdir(folder))
    assert names == ["encode_and_train.json", "train_from_cache.json", "train_with_previews.json"]
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            wf = json.load(f)
        types = {n["type"] for n in wf["nodes"]}
        assert "StreamingCacheTrainLoRA" in types and "PreviewImage" in types
        ids = {n["id"] for n in wf["nodes"]}
        for link_id, src, _, dst, _, _ in wf["links"]:
            assert src in ids and dst in ids, f"{name}: link {link_id} dangles"
