"""More than one process through real ComfyUI: the demo workflow (encode a folder, train a LoRA) under torchrun on
two processes (gloo on CPU) gives the LoRA and the cache of one process with twice the batch size
(``helpers/ddp_scenario.py``); so does Train LoRA's ``devices`` input run from the executor, with a worker
process beside ComfyUI's own (``helpers/devices_scenario.py``)."""

from __future__ import annotations

import pytest

from helpers.installs import require_comfyui, run_scenario


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
