"""A training micro-step on ComfyUI's own SDXL, Flux dev and Wan 2.1 classes (their published block counts at a tiny
width) makes the host wait for the device nowhere but where it is known to, in real ComfyUI
(tests/helpers/host_waits_scenario.py): ``ComfyBackend.loss`` and the backward pass of its loss, over a batch
marked and copied as the loader delivers it, in batches of 1 and of 4, with captions dropped, in fp16 scaled by a
gradient scaler (Flux and Wan's batches of 4), and a batch split into two model calls (SDXL's, whose samples differ
in size).

``graph_devices.HostWaits`` counts each read of a device value on the host, copy to the host and copy from the host.
After a warm-up micro-step each of these must be 0 per micro-step, except:

* the step's noise, noise levels and loss weights, drawn on the host and copied up by ``conditioning.upload``
  (on a GPU from pinned memory, without making the host wait): exactly these three, and for SDXL one more per
  model call: its ``y``, which ComfyUI's ``model_base.SDXL.encode_adm`` joins on the host from the size embedding
  (made by the legacy ``torch.Tensor([...])``, which HostWaits watches) and the pooled output. The step hands it
  the pooled output's host copy (``conditioning.keep_on_host``), so nothing is copied from the device, and
  ``compat.host_conds_uploaded`` copies ``y`` up;
* ComfyUI's Wan model, whose timestep embedding copies a host ``torch.arange`` to the device at every call
  (``comfy/ldm/wan/model.py``, ``sinusoidal_embedding_1d``): ComfyUI's code, not the pack's.

SDXL's noise levels as sigmas (``ComfyBackend._sigmas``: ComfyUI's ``percent_to_sigma`` per sample) run on the host
copy of the model sampling's tables, which moves its value to ``log_sigmas.device`` and reads it back: host work,
not counted (HostWaits knows a device read from a host tensor for the host).

A new wait anywhere in the step fails the test, with its stack.
"""

from __future__ import annotations

import math

import pytest

from helpers.installs import require_comfyui, scenario_once

pytestmark = pytest.mark.newest_comfyui  # every installation with STREAMING_CACHE_MATRIX=all

FAMILIES = {"sdxl": "SDXL", "flux": "Flux", "wan": "WAN21_T2V"}
CASES = ("batch 1", "batch 4")
FROM_HOST = "to copies from the host"
PER_CALL = {"wan": [(FROM_HOST, "wan/model.py sinusoidal_embedding_1d")]}
"""The waits of ComfyUI's own model code, per model call: family -> (call, where)."""
UPLOAD = "train/conditioning.py upload"
UPLOADS = 3
"""The step's noise, noise levels and loss weights (``ComfyBackend.loss``)."""
UPLOADS_PER_CALL = {"sdxl": 1}
"""The model conditions ComfyUI made on the host, copied up per model call: SDXL's ``y``."""
FIRST_CALL = (FROM_HOST, "train/conditioning.py to_device")
"""The one wait of a run's first step that drops a caption: the empty caption copied to the device, once."""


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "host_waits_scenario.py", tmp_path_factory, timeout=600)


def described(calls: list[dict]) -> str:
    return "\n".join(f"{c['call']}: {' <- '.join(reversed(c['stack']))}" for c in calls)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_steady_micro_step_makes_the_host_wait_only_where_known(result, family, case):
    run = result[family]["cases"][case]
    model_calls = len(run["groups"])
    known = sorted(PER_CALL.get(family, []) * model_calls)
    assert len(run["steps"]) == 2, run
    for step, uploads in zip(run["steps"], run["uploads"]):
        assert sorted((c["call"], c["where"]) for c in step) == known, described(step)
        assert uploads == [UPLOAD] * (UPLOADS + UPLOADS_PER_CALL.get(family, 0) * model_calls), uploads


def test_a_preserved_batch_runs_the_base_model_without_a_wait_and_finds_the_adapters_once(result):
    """A preserved dataset's batch (SDXL, a batch of 1): the model's second call, with the adapters off, adds no
    wait (it takes the step's conditioning, ``y`` included, as it is), and the trained wrappers it takes off are
    found once in the run (``compat.AdaptersOff``), not at every batch."""
    run = result["sdxl"]["cases"]["preserved"]
    assert len(run["steps"]) == 2, run
    for step, uploads in zip(run["steps"], run["uploads"]):
        assert step == [], described(step)
        assert uploads == [UPLOAD] * (UPLOADS + UPLOADS_PER_CALL["sdxl"]), uploads
    assert run["adapter_searches"] == 1 and result["sdxl"]["cases"]["batch 1"]["adapter_searches"] == 0
    assert 0.0 <= run["loss"] < result["sdxl"]["cases"]["batch 1"]["loss"], "a new LoRA has not moved the model yet"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_warm_up_adds_only_the_empty_captions_copy(result, family, case):
    """What the first micro-step waits for beyond a steady one: copying the empty caption to the device (its
    tokens, and its pooled output where the family has one), once per run."""
    run = result[family]["cases"][case]
    (warmup,) = run["warmup"]
    steady = sorted((c["call"], c["where"]) for c in run["steps"][0])
    extra = sorted((c["call"], c["where"]) for c in warmup
                   if not c["where"].endswith(" upload"))
    for known in steady:
        extra.remove(known)
    assert extra and set(extra) == {FIRST_CALL}, described(warmup)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cases_cover_what_they_name(result, family):
    """ComfyUI's class of the family at its published depth, captions both dropped and kept in each counted step
    of 4, finite losses, SDXL's batch of two sizes split into two model calls (the others' in one), and Flux's and
    Wan's batches of 4 in fp16 with the gradient scaler."""
    res = result[family]
    assert res["model"] == FAMILIES[family]
    depth = {"sdxl": {"input_blocks": 9, "output_blocks": 9}, "flux": {"double_blocks": 19, "single_blocks": 38},
             "wan": {"blocks": 40}}[family]
    assert {k: res["blocks"].get(k) for k in depth} == depth, res["blocks"]
    batch = res["cases"]["batch 4"]
    assert batch["groups"] == ([[0, 2], [1, 3]] if family == "sdxl" else [[0, 1, 2, 3]])
    assert batch["scaled"] == (family != "sdxl") == (batch["dtype"] == "fp16")
    assert all(any(d) and not all(d) for d in batch["dropped"]), batch["dropped"]
    assert any(d == [True] for d in res["cases"]["batch 1"]["dropped"][1:])
    assert all(math.isfinite(c["loss"]) for c in res["cases"].values())
