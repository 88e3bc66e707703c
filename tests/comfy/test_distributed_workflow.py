"""More than one process through real ComfyUI: the demo workflow (encode a folder, train a LoRA) under torchrun on
two processes (gloo on CPU) gives the LoRA and the cache of one process with twice the batch size
(``helpers/ddp_scenario.py``); so does Train LoRA's ``devices`` input run from the executor, with a worker
process beside ComfyUI's own (``helpers/devices_scenario.py``); and so do two nodes launched as on two machines,
each its own torchrun with a c10d rendezvous, which also resume after one of them is killed
(``helpers/multinode_scenario.py``; with the newest ComfyUI only: it checks the launch, not ComfyUI)."""

from __future__ import annotations

import pytest

from helpers.installs import comfyui_installs, require_comfyui, run_scenario


@pytest.fixture(scope="module")
def scenario(comfyui, tmp_path_factory):
    return run_scenario(require_comfyui(comfyui), "ddp_scenario.py", str(tmp_path_factory.mktemp("ddp")))


def test_both_runs_finish(scenario):
    assert scenario["one_ok"] and scenario["two_ok"], scenario.get("errors")


def test_two_processes_with_batch_1_train_the_lora_of_one_process_with_batch_2(scenario):
    """fp32: the two runs differ by the order of the gradient sums alone, which AdamW's normalised steps carry to
    about 0.2 % of what training moved (measured 1.2e-6 of 5.9e-4); a second process that trains on the wrong
    samples makes them differ by about all of it."""
    lora = scenario["lora"]
    assert lora["same_keys"] and lora["moved"] > 0, lora
    assert lora["max_difference"] <= 1e-2 * lora["moved"], lora


def test_two_processes_encode_the_cache_one_process_encodes(scenario):
    assert scenario["cache_rows_equal"] and scenario["cache_keys_equal"]
    assert 0 <= scenario["cache_largest_difference"] < 1e-5
    assert scenario["parts_left"] == [], "the ranks' parts are merged and removed"


def test_rank_0_speaks_for_the_processes(scenario):
    """Under torchrun the first process reports, once; the others print only their errors."""
    said = scenario["summaries_two"]
    assert not scenario["rank1_said"], said
    assert sum("by 2 processes" in line for line in said) == 1, said
    assert sum("trained demo_lora: steps 1-6 of 6" in line for line in said) == 1, said


@pytest.fixture(scope="module")
def devices(comfyui, tmp_path_factory):
    comfyui = require_comfyui(comfyui)
    return comfyui, run_scenario(comfyui, "devices_scenario.py", str(tmp_path_factory.mktemp("devices")))


def test_devices_2_with_batch_1_trains_the_lora_of_one_device_with_batch_2(devices):
    comfyui, result = devices
    assert result["one"]["ok"], result["one"]
    if comfyui.version.startswith("0.3."):  # its loaders do not record their files
        assert not result["two"]["ok"] and "does not record its file" in result["two"]["error"], result["two"]
        return
    assert result["two"]["ok"], result["two"]
    assert "trained two: steps 1-4 of 4" in result["two"]["text"] and "2 processes" in result["two"]["text"]
    lora = result["lora"]
    assert lora["same_keys"] and lora["moved"] > 0 and lora["max_difference"] <= 1e-2 * lora["moved"], lora
    assert "already trained for 4 steps" in result["again"]["text"], "queued again: the same run, continued"
    assert result["loras"] == ["two.safetensors"], "only rank 0 wrote files"


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    installs = comfyui_installs()
    newest = require_comfyui(installs[-1] if installs else None)
    return run_scenario(newest, "multinode_scenario.py", str(tmp_path_factory.mktemp("multinode")), timeout=2400)


def test_two_nodes_train_the_lora_of_one_process_with_twice_the_batch(multinode):
    """``torchrun --nnodes 2 --nproc-per-node 1`` twice, a c10d rendezvous, separate working folders, one base
    directory both see; bounded as the two-process run above."""
    assert multinode["one_ok"] and multinode["nodes_codes"] == [0, 0], multinode["errors"]
    lora = multinode["lora"]
    assert lora["same_keys"] and lora["moved"] > 0 and lora["max_difference"] <= 1e-2 * lora["moved"], lora
    said = multinode["nodes_said"]
    assert sum("trained demo_lora: steps 1-24 of 24" in line for line in said) == 1, said
    assert not any("rank 1 of 2" in line for line in said), said


def test_two_nodes_encode_the_cache_one_process_encodes(multinode):
    assert multinode["cache_rows_equal"] and multinode["cache_keys_equal"], multinode
    assert 0 <= multinode["cache_largest_difference"] < 1e-5
    assert multinode["parts_left"] == [], "the nodes' parts are merged and removed"


def test_two_nodes_resume_after_one_is_killed(multinode):
    """The second node (launcher and worker) is killed once the first save is on disk: the first node's launcher
    ends with an error, and both launched again resume from the save and end with the LoRA of the run that was
    never stopped."""
    assert multinode["killed_after_a_save"], multinode["killed_said"]
    assert multinode["killed_codes"][0] != 0 and multinode["killed_codes"][1] != 0, multinode
    assert multinode["resumed_codes"] == [0, 0], multinode["errors"]
    said = multinode["resumed_said"]
    assert any("resuming demo_lora" in line for line in said), said
    trained = [line for line in said if "trained demo_lora: steps " in line]
    assert len(trained) == 1 and not trained[0].split("trained demo_lora: steps ")[1].startswith("1-"), said
    lora = multinode["resumed_lora"]
    assert lora["same_keys"] and lora["max_difference"] <= 1e-2 * lora["moved"], lora
