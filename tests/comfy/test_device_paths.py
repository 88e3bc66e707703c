"""The node side's CUDA-only paths, executed on the CPU in real ComfyUI (``helpers/device_paths_scenario.py``): a
dynamic-VRAM patcher (newer ComfyUI on CUDA) is cloned as a plain one for training, noise levels are computed from
a CPU copy of sampling tables that live on the GPU, and the Train LoRA node gives each worker another GPU. The
engine's CUDA decisions are in ``tests/train/test_device_decisions.py``."""

from __future__ import annotations

import pytest

from helpers.installs import require_comfyui, scenario_once


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "device_paths_scenario.py", tmp_path_factory, timeout=600)


def test_a_dynamic_patcher_is_cloned_as_a_plain_one_and_others_as_they_are(result):
    asked = result["training_clone"]["stand_in"]
    assert asked == {"dynamic": [{"disable_dynamic": True}], "static": [{}], "without_is_dynamic": [{}]}


def test_comfyuis_dynamic_patcher_becomes_a_plain_patcher_of_the_same_weights(result):
    """Newer ComfyUI: its real ``clone(disable_dynamic=True)`` reloads the model for a plain ``ModelPatcher``
    (ComfyUI's ``ModelPatcherDynamic`` reports ``is_dynamic()`` True, as the patcher here is made to); v0.3,
    without dynamic patchers, clones as before, sharing the model."""
    found = result["training_clone"]
    clone = found["clone"]
    assert clone["is_plain_model_patcher"] and not clone["is_dynamic"] and clone["same_weights"], clone
    if found["comfyui_has_dynamic_patchers"]:
        assert found["comfyui_dynamic_is_dynamic"] and found["loaded_has_is_dynamic"]
        assert not clone["same_model_object"], "the plain patcher has a model of its own"
    else:
        assert not found["loaded_has_is_dynamic"] and clone["same_model_object"]


def test_noise_levels_come_from_one_cpu_copy_of_the_tables_per_sampling_object(result):
    tables = result["host_tables"]
    runs = tables["runs"]
    assert [r["sampling"] for r in runs] == ["first", "first", "other", "other", "first"]
    assert [r["host_copy"] for r in runs] == [0, 0, 1, 1, 2], "made once per object, reused, made again"
    for r in runs:
        assert not r["is_the_original"] and r["tables_on"] == ["cpu"], r
        assert r["read_on"] == ["host copy"], "the tables on the GPU are never read"
        assert r["dtype"] == "torch.float32"
        assert r["sigmas"] == tables["expected"][r["sampling"]], "ComfyUI's own values, computed on the CPU"
    assert tables["expected"]["first"] != tables["expected"]["other"]
    assert tables["cpu_tables_used_as_they_are"]
    assert not tables["meta_copies_to_cpu"], "why a stand-in reports the GPU here rather than the meta device"


def test_the_node_gives_each_worker_another_gpu_than_comfyuis(result):
    workers = result["workers"]
    assert workers["three_devices"] == [0, 1] and workers["four_devices"] == [0, 1, 3]
    assert workers["five_devices"] == ("devices is 5 but this machine has 4 GPU(s) visible to ComfyUI; lower "
                                       "devices (or start ComfyUI without --cuda-device)")
