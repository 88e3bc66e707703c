"""The headless runner's workflow handling (UI -> API conversion, overrides), its console output, and how it finds
ComfyUI and the Python that runs it, tested without ComfyUI."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import install
import pytest

import headless
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
            "inputs": [{"name": n, "type": "X", "link": link} for n, link in inputs]}


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


def test_core_nodes_of_a_newer_comfyui_say_which_version_has_them_not_to_install_custom_nodes():
    """LTX-2's example on a ComfyUI before its family: the runner names the version, as the example's note does."""
    (version, types), = headless.NEEDS_NEWER_COMFYUI.values()
    wf = {"nodes": [node(1, types[0], []), node(2, "Loader", ["a.safetensors"])], "links": []}
    with pytest.raises(headless.WorkflowError, match=rf"{types[0]}; they are ComfyUI's own, in v0\.7\.0 and newer: "
                                                     "update ComfyUI"):
        headless.ui_to_api(wf, MAPPINGS)
    assert version == (0, 7, 0)
    with pytest.raises(headless.WorkflowError, match="install the custom nodes that provide them"):
        headless.ui_to_api({"nodes": [node(1, types[0], []), node(2, "Mystery", [])], "links": []}, MAPPINGS)
    example = os.path.join(ROOT, "example_workflows", "Train an LTX-2 LoRA from video clips.json")
    with open(example, encoding="utf-8") as f:
        note = next(n for n in json.load(f)["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
    assert "Needs ComfyUI v0.7.0 or newer" in note


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


def test_example_workflows_are_ui_format_use_the_pack_nodes_and_have_thumbnails():
    folder = os.path.join(ROOT, "example_workflows")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    assert names == sorted(f"{n}.json" for n in headless.EXAMPLES)
    assert sorted(os.listdir(folder)) == sorted(names + [n[:-5] + ".jpg" for n in names]), "a thumbnail for each"
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            wf = json.load(f)
        types = {n["type"] for n in wf["nodes"]}
        assert {"StreamingCacheTrain", "MarkdownNote"} <= types, name
        shown = {(link[1], link[2]) for link in wf["links"] if link[3] in {n["id"] for n in wf["nodes"]
                                                                            if n["type"] == "PreviewImage"}}
        trains = {n["id"] for n in wf["nodes"] if n["type"] == "StreamingCacheTrain"}
        assert not {(t, 3) for t in trains} & shown, f"{name}: the loss is the chart on Train LoRA, not shown again"
        assert not types & {"StreamingCacheTrainLoRA", "StreamingCacheEncodeDataset"}, "examples use today's nodes"
        ids = {n["id"] for n in wf["nodes"]}
        for link_id, src, _, dst, _, _ in wf["links"]:
            assert src in ids and dst in ids, f"{name}: link {link_id} dangles"


def test_earlier_example_names_still_find_the_examples_without_a_word(tmp_path, capsys):
    for old, new in headless.EXAMPLES_RENAMED.items():
        assert headless.example_path(f"example_workflows/{old}.json") == os.path.join(ROOT, "example_workflows",
                                                                                     f"{new}.json")
        assert headless.example_path(old) == headless.example_path(new)
    assert capsys.readouterr().out == "", "nothing a newcomer would have to act on"
    assert headless.DEMO_EXAMPLE in headless.EXAMPLES and headless.DEMO_EXAMPLE not in headless.EXAMPLES_RENAMED
    mine = tmp_path / "encode_and_train.json"
    mine.write_text("{}")
    assert headless.example_path(str(mine)) == str(mine), "a file that exists is the file meant"


class Encode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"folder": ("STRING", {"default": "dataset"}), "size": ("INT", {"default": 512})},
                "optional": {"frames": ("INT", {"default": 33}), "captions": ("STRING", {"default": ""})}}


def test_a_file_saved_with_an_earlier_widget_order_is_read_by_name_and_lacking_widgets_get_defaults(monkeypatch):
    monkeypatch.setattr(headless, "widget_layouts", lambda: {"Encode": {"0.1.0": ["folder", "size", "captions"]}})
    wf = {"nodes": [node(1, "Encode", ["mine", 256, "a caption"])], "links": []}
    notes: list[str] = []
    prompt = headless.ui_to_api(wf, {"Encode": Encode}, notes)
    assert prompt["1"]["inputs"] == {"folder": "mine", "size": 256, "captions": "a caption", "frames": 33}
    assert notes == ["node 1 (Encode): the file has no value for frames; using the defaults"]
    today = headless.ui_to_api({"nodes": [node(1, "Encode", ["x", 64, 9, "c"])], "links": []}, {"Encode": Encode})
    assert today["1"]["inputs"] == {"folder": "x", "size": 64, "frames": 9, "captions": "c"}
    prefix = headless.ui_to_api({"nodes": [node(1, "Encode", ["x", 64])], "links": []}, {"Encode": Encode})
    assert prefix["1"]["inputs"]["frames"] == 33, "an earlier order that is a prefix of today's needs no mapping"


class Train:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "dataset": ("STREAMING_DATASET",),
                             "steps": ("INT", {"default": 500}), "lora_name": ("STRING", {"default": "my_lora"})},
                "optional": {"options": ("STREAMING_TRAIN_OPTIONS",)}}


class OptimizerOptions:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "optional": {"options": ("STREAMING_TRAIN_OPTIONS",),
                                             "optimizer": (["AdamW", "SGD"],)}}


class MemoryOptions:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "optional": {"options": ("STREAMING_TRAIN_OPTIONS",),
                                             "training_dtype": (["bf16", "fp32"],)}}


TRAIN_MAPPINGS = {"StreamingCacheTrain": Train, "StreamingCacheOptimizerOptions": OptimizerOptions,
                  "StreamingCacheMemoryOptions": MemoryOptions}


def test_train_settings_given_flat_go_to_the_node_that_owns_each_chained_into_train_lora():
    built, main = headless.train_nodes(TRAIN_MAPPINGS, ["1", 0], ["2", 0],
                                       {"steps": 3, "optimizer": "SGD", "training_dtype": "fp32"}, prefix="7")
    assert main == "7" and built["7"]["inputs"] == {"model": ["1", 0], "dataset": ["2", 0], "steps": 3,
                                                    "lora_name": "my_lora", "options": ["7_options1", 0]}
    assert built["7_options0"] == {"class_type": "StreamingCacheMemoryOptions", "inputs": {"training_dtype": "fp32"}}
    assert built["7_options1"] == {"class_type": "StreamingCacheOptimizerOptions",
                                   "inputs": {"optimizer": "SGD", "options": ["7_options0", 0]}}
    alone, _ = headless.train_nodes(TRAIN_MAPPINGS, ["1", 0], ["2", 0], {"steps": 3})
    assert list(alone) == ["train"] and "options" not in alone["train"]["inputs"]
    with pytest.raises(headless.WorkflowError, match="no setting 'stepz'"):
        headless.train_nodes(TRAIN_MAPPINGS, ["1", 0], ["2", 0], {"stepz": 3})


def test_an_override_of_an_input_the_node_lacks_names_the_node_that_has_it():
    prompt = {"3": {"class_type": "StreamingCacheTrain", "inputs": {"steps": 1}}}
    headless.apply_overrides(prompt, ["3.steps=9"], TRAIN_MAPPINGS)
    assert prompt["3"]["inputs"]["steps"] == 9
    with pytest.raises(headless.WorkflowError, match="has no input 'optimizer'; it is an input of "
                                                     "StreamingCacheOptimizerOptions"):
        headless.apply_overrides(prompt, ["3.optimizer=SGD"], TRAIN_MAPPINGS)


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _train(console: headless.Console, steps: int) -> None:
    console.start("3", "StreamingCacheTrain")
    for step in range(1, steps + 1):
        console.text("3", f"step {step}/{steps}  loss {1 / step:.4f}")
        console.progress("3", step, steps)
    console.result("3", {"text": ["new run demo\ntrained demo: steps 1-%d" % steps]})


@pytest.mark.parametrize("steps,shown", [(10, 10), (1000, 11)])  # the first step, then a line at each tenth
def test_without_a_terminal_progress_is_a_line_a_tenth_of_the_way_whatever_the_steps(steps, shown):
    out = Stream(tty=False)
    console = headless.Console(out, every=3600.0)
    _train(console, steps)
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if line.startswith("[headless] node 3: ") and "/" in line.split(":")[1]]
    assert len(progress) == shown, lines
    assert progress[-1] == f"[headless] node 3: {steps}/{steps} (100%)  step {steps}/{steps}  loss {1 / steps:.4f}"
    assert lines[0] == "[headless] running node 3 (StreamingCacheTrain)"
    assert lines[-2:] == ["[headless] node 3: new run demo", f"[headless] node 3: trained demo: steps 1-{steps}"]


def test_on_a_terminal_progress_is_one_bar_redrawn_in_place():
    out = Stream(tty=True)
    console = headless.Console(out)
    _train(console, 50)
    text = out.getvalue()
    lines = text.split("\n")
    bar = lines[1]
    assert bar.count("\r") >= 50 and bar.rsplit("\r", 1)[1].startswith("[headless] node 3: 50/50 [") and "100%" in bar
    assert lines[2:] == ["[headless] node 3: new run demo", "[headless] node 3: trained demo: steps 1-50", ""]


def _throttled_train(console: headless.Console, steps: int, text_every: int) -> None:
    """A training whose step text is sent before its step's progress, but only every ``text_every`` steps (and at
    the last), as a training throttles its text and not its progress."""
    console.start("3", "StreamingCacheTrain")
    for step in range(1, steps + 1):
        if step % text_every == 1 or text_every == 1 or step == steps:
            console.text("3", f"step {step}/{steps}  loss {1 / step:.4f}")
        console.progress("3", step, steps)


def _agrees(line: str) -> bool:
    """Whether a progress line's count and the step in its text (if any) are the same step."""
    shown = line.split(": ", 1)[1]
    count = shown.split(" ", 1)[0].split("/")[0]
    return "step " not in shown or shown.split("step ", 1)[1].split("/")[0] == count


@pytest.mark.parametrize("steps,text_every", [(20, 2), (20, 3), (100, 7), (1000, 4)])
def test_without_a_terminal_a_progress_line_shows_the_text_of_its_own_step(steps, text_every):
    out = Stream(tty=False)
    _throttled_train(headless.Console(out, every=3600.0), steps, text_every)
    progress = [line for line in out.getvalue().splitlines() if line.startswith("[headless] node 3: ")]
    assert all(_agrees(line) for line in progress), progress
    with_text = sum("step " in line for line in progress)
    assert with_text >= min(9, steps // text_every), "the lines wait for their step's text: " + str(progress)
    assert progress[-1] == f"[headless] node 3: {steps}/{steps} (100%)  step {steps}/{steps}  loss {1 / steps:.4f}"


def test_on_a_terminal_the_bar_shows_the_text_of_its_own_step():
    out = Stream(tty=True)
    _throttled_train(headless.Console(out, hold=3600.0), 20, 3)
    bars = [bar for bar in out.getvalue().split("\n")[1].split("\r") if bar]
    assert bars and all(_agrees(bar) for bar in bars), bars
    assert bars[-1].startswith("[headless] node 3: 20/20 [") and bars[-1].endswith("step 20/20  loss 0.0500")


def test_a_text_sent_once_stays_off_later_counts_and_lines_still_come_each_tenth():
    out = Stream(tty=False)
    console = headless.Console(out, every=3600.0)
    console.start("2", "StreamingCacheEncode")
    console.text("2", "encoding 100 images")
    for done in range(1, 101):
        console.progress("2", done, 100)
    progress = [line for line in out.getvalue().splitlines() if line.startswith("[headless] node 2: ")]
    assert progress[0] == "[headless] node 2: 1/100 (1%)  encoding 100 images"
    assert all("encoding" not in line for line in progress[1:]) and len(progress) >= 9, progress
    assert progress[-1] == "[headless] node 2: 100/100 (100%)"


def test_a_result_reported_twice_is_printed_once():
    out = Stream(tty=False)
    console = headless.Console(out)
    console.result("2", {"text": ["encoded 10, reused 0"]})
    console.result("2", {"text": ["encoded 10, reused 0"]})
    console.result("5", {"images": []})
    assert out.getvalue() == "[headless] node 2: encoded 10, reused 0\n"


def test_the_log_shows_each_warning_once_and_info_only_when_verbose(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        headless.configure_logging(verbose=False)
        log = logging.getLogger("streaming_cache.test")
        for _ in range(20):
            log.warning("a setting the device does not support")
        log.info("model weight dtype torch.float32")
        headless.configure_logging(verbose=True)
        log.info("shown when verbose")
        headless.configure_logging(verbose=True, speaks=False)
        log.warning("a rank other than 0 keeps its warnings")
        log.error("and says its errors")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
        logging.captureWarnings(False)
    err = capsys.readouterr().err.splitlines()
    assert err == ["a setting the device does not support", "shown when verbose", "and says its errors"]


def _comfyui(folder, python: bool = False) -> str:
    """A folder that passes for a ComfyUI (``main.py`` and ``comfy/``), with a ``venv`` in it if ``python``."""
    (folder / "comfy").mkdir(parents=True)
    (folder / "main.py").write_text("")
    if python:
        (folder / "venv" / "bin").mkdir(parents=True)
        (folder / "venv" / "bin" / "python").write_text("")
    return str(folder)


def test_comfyui_is_found_from_the_option_the_variable_the_installers_record_then_custom_nodes(tmp_path):
    given, variable, recorded = (_comfyui(tmp_path / name) for name in ("given", "variable", "recorded"))
    parent = _comfyui(tmp_path / "parent", python=True)
    pack = tmp_path / "parent" / "custom_nodes" / "comfyui-streaming-cache"
    pack.mkdir(parents=True)
    record = str(tmp_path / "installs.json")
    python = str(tmp_path / "recorded" / "venv" / "bin" / "python")
    install.record_install(install.Recorded(recorded, python), pack_dir=str(pack), path=record)
    install.record_install(install.Recorded(given, "/another/clone/python"), pack_dir=str(tmp_path), path=record)

    def found(explicit=None, **environ):
        return headless.locate_comfyui(explicit, environ, str(pack), record)

    assert found(given, COMFYUI_PATH=variable) == headless.FoundComfyUI(given, None, False, "--comfyui")
    assert found(COMFYUI_PATH=variable).path == variable
    assert found(COMFYUI_PATH=str(tmp_path / "no-comfyui")) == \
        headless.FoundComfyUI(recorded, python, False, f"recorded by install.py in {record}"), \
        "the record of this clone, before the custom_nodes folder the pack is in"
    os.remove(record)
    assert found() == headless.FoundComfyUI(parent, os.path.join(parent, "venv", "bin", "python"), False,
                                            "custom_nodes")


def test_a_given_folder_that_is_no_comfyui_and_a_recorded_one_that_is_gone_are_said(tmp_path):
    with pytest.raises(SystemExit, match="--comfyui .*typo: not a ComfyUI folder"):
        headless.locate_comfyui(str(tmp_path / "typo"), {}, str(tmp_path / "pack"), str(tmp_path / "none.json"))
    record = str(tmp_path / "installs.json")
    install.record_install(install.Recorded(str(tmp_path / "removed" / "ComfyUI"), "/x/python"),
                           pack_dir=str(tmp_path / "pack"), path=record)
    with pytest.raises(SystemExit) as info:
        headless.locate_comfyui(None, {}, str(tmp_path / "pack"), record)
    text = str(info.value)
    assert f"recorded in {record} ({tmp_path / 'removed' / 'ComfyUI'}) is gone" in text
    assert "ComfyUI not found" in text and "install.py" in text


def test_a_python_without_torch_hands_the_run_to_the_python_of_that_comfyui(tmp_path):
    script = os.path.join(ROOT, "scripts", "headless.py")
    known = headless.FoundComfyUI("/inst/ComfyUI", "/inst/venv/bin/python", False, "recorded")
    assert headless.rerun_command(known, ["--demo", "/tmp/d"], "/usr/bin/python3", {}) == \
        ["/inst/venv/bin/python", script, "--demo", "/tmp/d"]
    portable = headless.FoundComfyUI("C:/P/ComfyUI", "C:/P/python_embeded/python.exe", True, "custom_nodes")
    assert headless.rerun_command(portable, ["w.json"], "python", {})[:3] == ["C:/P/python_embeded/python.exe", "-s",
                                                                              script]
    with pytest.raises(SystemExit, match="cannot import torch. Repair that installation"):
        headless.rerun_command(known, [], "/inst/venv/bin/python", {})  # it is that Python
    with pytest.raises(SystemExit, match="cannot import torch. Repair that installation"):
        headless.rerun_command(known, [], "/usr/bin/python3", {headless.RERUN: "/inst/venv/bin/python"})
    with pytest.raises(SystemExit, match="Run this script with that Python") as info:
        headless.rerun_command(headless.FoundComfyUI("/c", None, False, "--comfyui"), ["--demo", "my demo"], "py", {})
    assert f"<ComfyUI's python> {script} --demo 'my demo'" in str(info.value)


def _without_torch(config, **extra) -> dict[str, str]:
    """The environment of a system Python without torch (run with ``-S``): no variable of the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMFYUI_", "PYTHON", headless.RERUN))}
    return {**env, "XDG_CONFIG_HOME": str(config), **extra}


@pytest.mark.skipif(os.name == "nt", reason="the ComfyUI's Python stands in as a shell script")
def test_run_from_the_clone_by_a_python_without_torch_it_runs_as_the_installs_python(tmp_path):
    """The README's ``python3 scripts/headless.py --demo /tmp/demo`` after install.py: the system Python has no
    torch, so the run goes on as the recorded venv's Python, in this process, with every argument."""
    comfy = _comfyui(tmp_path / "inst" / "ComfyUI")
    python = tmp_path / "inst" / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    seen = tmp_path / "seen.txt"
    python.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$$\" \"$@\" \"${headless.RERUN}\" > '{seen}'\nexit 7\n")
    python.chmod(0o755)
    config = tmp_path / "config"
    record = install.record_path({"XDG_CONFIG_HOME": str(config)}, windows=False)
    install.record_install(install.Recorded(comfy, str(python)), pack_dir=ROOT, path=record)
    script = os.path.join(ROOT, "scripts", "headless.py")
    arguments = ["--demo", str(tmp_path / "demo"), "--", "--cpu"]
    runner = subprocess.Popen([sys.executable, "-S", script, *arguments], env=_without_torch(config),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = runner.communicate(timeout=120)
    assert runner.returncode == 7, out + err
    assert seen.read_text().splitlines() == [str(runner.pid), script, *arguments, str(python)], \
        "the same process, now the install's Python, with every argument"
    assert f"cannot import torch: running with {python}, which runs the ComfyUI in {comfy}" in out
    os.remove(record)  # no record, and a ComfyUI without a venv: the command to use is said
    os.remove(seen)
    bare = _comfyui(tmp_path / "bare")
    proc = subprocess.run([sys.executable, "-S", script, "--demo", "d", "--comfyui", bare], capture_output=True,
                          text=True, env=_without_torch(config), timeout=120)
    assert proc.returncode == 1 and f"<ComfyUI's python> {script} --demo d --comfyui {bare}" in proc.stderr
    assert not seen.exists()


def test_on_windows_the_run_is_a_child_whose_status_is_returned():
    assert headless.run_child([sys.executable, "-c", "raise SystemExit(3)"], os.environ) == 3


class Trainer:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"steps": ("INT", {"default": 500})},
                "optional": {"keep": ("INT", {"default": 0}), "preset": (["auto", "none"], {"default": "none"})}}


def test_a_widget_a_file_lacks_takes_its_absent_value_and_a_new_node_its_created_value(monkeypatch):
    """A file saved before a widget existed reads ``absent``'s value for it (Train LoRA's preset: none), one saved
    with it its own value; web/widget_layouts.json gives Train LoRA's preset none there and auto on a node added in
    the UI (``created``: tests/comfy/test_frontend.py checks a new node in the browser)."""
    assert headless.absent_values()["StreamingCacheTrain"] == {"preset": "none"}
    assert headless.created_values()["StreamingCacheTrain"] == {"preset": "auto"}
    monkeypatch.setattr(headless, "widget_layouts", lambda: {})
    monkeypatch.setattr(headless, "absent_values", lambda: {"Trainer": {"preset": "none"}})
    old = headless.ui_to_api({"nodes": [node(1, "Trainer", [30])], "links": []}, {"Trainer": Trainer})
    assert old["1"]["inputs"] == {"steps": 30, "keep": 0, "preset": "none"}
    new = headless.ui_to_api({"nodes": [node(1, "Trainer", [30, 2, "auto"])], "links": []}, {"Trainer": Trainer})
    assert new["1"]["inputs"] == {"steps": 30, "keep": 2, "preset": "auto"}
    monkeypatch.setattr(headless, "absent_values", lambda: {})
    assert headless.ui_to_api({"nodes": [node(1, "Trainer", [30])], "links": []},
                              {"Trainer": Trainer})["1"]["inputs"]["preset"] == "none", "else the default"
