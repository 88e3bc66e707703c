"""LoRA files in ComfyUI's, kohya's and diffusers' key formats, read by real ComfyUI and by diffusers.

Per installation one child process (``helpers/formats_scenario.py``) trains a tiny SD1.x LoRA with Train LoRA,
queues it again with ``lora_format`` kohya (the same run continues), makes LoRAs in ComfyUI's layout for tiny SDXL
and Flux models, converts each with the converter's own function to kohya's and diffusers' formats and back to
ComfyUI's (the reference: ComfyUI's format without the norm and bias offsets the other formats leave out), and
loads every file with LoraLoaderModelOnly: the keys ComfyUI logs as not loaded, the weights it patches, the deltas
it computes and one sampling step's output.

Then, in this process, diffusers' own ``load_lora_weights`` reads each kohya and diffusers file into a tiny
diffusers model of the same family and architecture (``helpers/diffusers_models.py``) with zero weights, fuses it,
and the deltas it applied are compared with those ComfyUI applied from the same file, under the parameter names
ComfyUI's own ``unet_to_diffusers`` / ``flux_to_diffusers`` give, through random probes (``helpers/lora_probes.py``).
diffusers and peft come with the test extra; without them these tests skip visibly, and fail in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from helpers.installs import HELPERS, SCRIPTS, in_ci, require_comfyui, scenario_once, subprocess_env
from helpers.lora_probes import probe

FAMILIES = ("sd15", "sdxl", "flux_dev")
DIFFUSERS_PREFIX = {"sd15": "unet.", "sdxl": "unet.", "flux_dev": "transformer."}
BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


@pytest.fixture
def result(comfyui, tmp_path_factory):
    return scenario_once(require_comfyui(comfyui), "formats_scenario.py", tmp_path_factory)


@pytest.fixture(scope="module")
def diffusers_models():
    missing = [m for m in ("diffusers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        message = f"needs {' and '.join(missing)} (python -m pip install -e '.[test]')"
        if in_ci():
            pytest.fail(f"CI runs the diffusers checks; {message}")
        pytest.skip(message)
    from helpers import diffusers_models

    return diffusers_models


def test_train_lora_saves_the_format_asked_and_a_new_format_continues_the_same_run(result):
    sd15 = result["families"]["sd15"]
    assert sd15["first"]["ok"], sd15["first"]["error"]
    again = sd15["again"]
    assert again["ok"], again["error"]
    assert "resuming fmt_sd15: same dataset and settings" in again["train"], again["train"]
    assert "trained fmt_sd15: step 3 of 3" in again["train"], "lora_format is not part of the run: it continued"
    assert "saved in the kohya format; 78 offsets of norms and biases left out" in again["train"], again["train"]
    run = sd15["kohya_run"]
    assert run["step"] == 3 and run["metadata"]["streaming_cache_lora_format"] == "kohya"
    assert run["keys"] and all(k.startswith("lora_unet_") for k in run["keys"])
    assert run["same_as_state"], "the kohya file holds exactly the trained LoRA matrices of step 3"


def test_queueing_a_trained_run_again_with_another_format_converts_its_file(result):
    converted = result["families"]["sd15"]["converted"]
    assert converted["ok"], converted["error"]
    assert "fmt_sd15: already trained for 3 steps" in converted["train"], converted["train"]
    assert "saved in the diffusers format; 78 offsets of norms and biases left out" in converted["train"]
    assert converted["metadata"]["streaming_cache_lora_format"] == "diffusers" and converted["metadata"]["ss_steps"] == "3"
    assert converted["keys"] and all(k.startswith("unet.") for k in converted["keys"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_format_loads_in_comfyui_with_every_key_applied_and_the_same_output(result, family):
    res = result["families"][family]
    assert res["not_loaded"] == {fmt: [] for fmt in res["not_loaded"]}, "ComfyUI logged keys it did not load"
    assert len(res["not_loaded"]) >= 3
    assert res["patched"]["kohya"] == res["patched"]["diffusers"] == res["patched"]["reference"] > 0
    keys = res["keys"]
    assert all(k.startswith("lora_unet_") for k in keys["kohya"])
    assert all(k.startswith(DIFFUSERS_PREFIX[family]) for k in keys["diffusers"])
    assert not any(k.endswith(".alpha") for k in keys["diffusers"]), "PEFT files carry the scale in lora_B"
    assert all(k.startswith("diffusion_model.") for k in keys["reference"] + keys["comfyui"])
    assert res["metadata_format"] == {"comfyui": res["metadata_format"]["comfyui"], "kohya": "kohya",
                                      "diffusers": "diffusers", "reference": "comfyui"}
    for fmt in ("kohya", "diffusers"):
        diff = res["vs_reference"][fmt]
        assert diff["only_reference"] == [] and diff["only_other"] == [], diff
        assert diff["delta_difference"] <= 1e-6, (fmt, diff)
        assert diff["output_difference"] <= 1e-4 * res["lora_change"], (fmt, diff)
    assert res["lora_change"] > 1e-3, "the LoRA changes the output, so equal outputs mean something"


def test_comfyui_format_keeps_the_offsets_the_other_formats_leave_out(result):
    """The trained file in ComfyUI's format patches the LoRA weights exactly as the others, plus one weight or
    bias per offset the conversions reported as left out."""
    res = result["families"]["sd15"]
    diff = res["vs_reference"]["comfyui"]
    left_out = res["reports"]["kohya"]["left_out"]
    assert left_out == res["reports"]["diffusers"]["left_out"] and len(left_out) == 78
    assert diff["only_reference"] == [] and len(diff["only_other"]) == len(left_out)
    assert all(k.endswith((".bias", "norm.weight", "norm1.weight", "norm2.weight", "norm3.weight", ".0.weight"))
               for k in diff["only_other"]), diff["only_other"]
    assert diff["delta_difference"] == 0.0
    assert res["offsets_change"] > 0, "the offsets change the output: leaving them out is a real difference"


def test_train_lora_continues_a_kohya_file(result):
    """existing_lora in kohya's format: the adapters start from its matrices (one step at learning rate 1e-7 later,
    within 1e-5 of them), conv layers included (kohya's 4-D matrices become ComfyUI's 2-D ones)."""
    continued = result["families"]["sd15"]["continued"]
    assert continued["ok"], continued["error"]
    assert continued["matrices"] == 108 and continued["missing"] == []
    assert continued["difference"] <= 1e-5 < continued["largest"], continued


def test_alpha_is_trained_saved_and_applied_by_loraloader_as_training_applied_it(result):
    """The SD1.x run trains at rank 4 with alpha 2: every LoRA layer of its file holds alpha 2 (and its metadata
    says so), and LoraLoaderModelOnly with the file gives the output the training's own adapters give, which the
    same matrices at alpha 1 (the scale earlier releases trained at) do not."""
    alpha = result["families"]["sd15"]["alpha"]
    assert alpha["alphas"] == alpha["adapter_alphas"] == [2.0] and alpha["metadata_alpha"] == "2.0"
    assert alpha["alpha_keys"] == alpha["up_keys"] > 0
    assert alpha["lora_change"] > 1e-3
    assert alpha["loaded_vs_training"] < 1e-2 * alpha["lora_change"]
    assert alpha["alpha_1_vs_training"] > 0.1 * alpha["lora_change"]


def test_converter_reports_what_it_read_and_wrote(result):
    for family in FAMILIES:
        reports = result["families"][family]["reports"]
        assert reports["kohya"]["from"] == reports["diffusers"]["from"] == "comfyui"
        assert reports["reference"]["from"] == "kohya" and reports["reference"]["left_out"] == []
        assert reports["kohya"]["keys_out"] == reports["reference"]["keys_out"], "3 keys per LoRA module either way"


def _check_diffusers(models, res: dict, family: str, fmt: str, *, only_blocks: bool = False) -> None:
    """diffusers' ``load_lora_weights`` on the ``fmt`` file changes the weights ComfyUI changes, by the same deltas.
    ``only_blocks``: diffusers leaves the layers outside the transformer blocks alone (see the Flux kohya test)."""
    path = res["diffusers_files"][fmt]
    got, names = models.deltas_applied(family, path, res.get("hidden_size"))
    comfy = load_file(path[:-len(".safetensors")] + ".probes.safetensors")
    expected = {n for n in comfy if n in names}
    covered = {res["diffusers_names"][n] for n in expected}
    assert covered == set(res["diffusers_names"].values()), "every weight ComfyUI patched has a diffusers name"
    if only_blocks:
        assert set(got) <= expected and {n for n in expected if n.startswith(BLOCKS)} <= set(got)
    else:
        assert set(got) == expected, (sorted(set(got) ^ expected)[:10])
    for name, delta in got.items():
        ours, theirs = probe(name, delta), comfy[name]
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max())), name


@pytest.mark.parametrize("family", FAMILIES)
def test_diffusers_applies_the_diffusers_file_as_comfyui_does(result, diffusers_models, family):
    _check_diffusers(diffusers_models, result["families"][family], family, "diffusers")


@pytest.mark.parametrize("family", ("sd15", "sdxl"))
def test_diffusers_reads_the_kohya_file_as_comfyui_does(result, diffusers_models, family):
    _check_diffusers(diffusers_models, result["families"][family], family, "kohya")


def test_diffusers_reads_the_kohya_flux_file_blocks_as_comfyui_does(result, diffusers_models):
    """diffusers' kohya Flux reader (0.42) hard-codes Flux.1's width: it refuses the 128-wide tiny Flux newer
    ComfyUI detects, and reads the 3072-wide one v0.3.x detects; there it applies the transformer blocks and drops
    the embedders and the final layer (it names them without the ``transformer.`` prefix it then loads by). Those
    reach diffusers in the diffusers format, checked above."""
    res = result["families"]["flux_dev"]
    if res["hidden_size"] != 3072:
        with pytest.raises(AssertionError):
            diffusers_models.deltas_applied("flux_dev", res["diffusers_files"]["kohya"], res["hidden_size"])
        return
    _check_diffusers(diffusers_models, res, "flux_dev", "kohya", only_blocks=True)


def test_converter_refuses_a_lora_made_for_another_model(result):
    refused = result["families"]["sd15"]["wrong_model"]
    assert "keys of the LoRA name no module ComfyUI knows in this Flux model" in refused["error"], refused
    assert refused["error"].startswith(refused["input"]) and "Give the model the LoRA was made for" in refused["error"]
    assert not refused["written"]


def test_converter_command_line_converts_and_refuses_with_what_to_do(comfyui, result, tmp_path):
    """The command line: a conversion with its report, then an existing output and a missing file, each refused
    with the file and the remedy (exit status 1)."""
    comfyui = require_comfyui(comfyui)
    kohya = result["families"]["sd15"]["diffusers_files"]["kohya"]
    ckpt = os.path.join(os.path.dirname(os.path.dirname(kohya)), "models", "checkpoints", "tiny_sd15.safetensors")
    out = str(tmp_path / "out.safetensors")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([comfyui.python, os.path.join(SCRIPTS, "convert_lora.py"), *args, "--comfyui",
                               comfyui.path], capture_output=True, text=True, timeout=300, env=subprocess_env(),
                              check=False, cwd=HELPERS)

    done = cli(kohya, out, "--to", "diffusers", "--model", ckpt)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{out}: 108 keys in the diffusers format (read as kohya, 162 keys; SD15 model)" in done.stdout
    assert load_file(out).keys() == load_file(result["families"]["sd15"]["diffusers_files"]["diffusers"]).keys()
    again = cli(kohya, out, "--to", "comfyui", "--model", ckpt)
    assert again.returncode == 1 and f"{out} exists; give another output file, or --force" in again.stderr
    missing = cli(str(tmp_path / "none.safetensors"), out, "--to", "kohya", "--model", ckpt)
    assert missing.returncode == 1 and "none.safetensors: no such file; give the LoRA file's path" in missing.stderr


def test_a_dora_lora_loads_in_comfyui_as_it_trained_and_its_magnitudes_count(result):
    """Train LoRA with dora (kohya format): every LoRA layer of the file has a magnitude, one per input column;
    LoraLoaderModelOnly with the file gives the output of the training's own DoRA layers (continued from the same
    file), which moves the output, and the file without its magnitudes (a plain LoRA) gives another one."""
    res = result["families"]["sd15"]["dora"]
    assert res["ok"], res["error"]
    assert res["ups"] > 0 and res["magnitudes"] == res["ups"] == res["dora_layers"], res
    assert all(shape.startswith("[1, ") for shape in res["magnitude_shapes"]), res["magnitude_shapes"]
    assert json.loads(res["network_args"]) == {"dora_wd": "True", "wd_on_out": "False"}
    assert res["lora_change"] > 1e-3, res
    assert res["loaded_vs_training"] < 1e-4 * res["lora_change"], res
    assert res["plain_vs_training"] > 100 * res["loaded_vs_training"] and res["plain_vs_training"] > 1e-5, res
