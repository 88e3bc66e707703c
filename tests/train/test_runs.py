"""Queueing a training again: the same run resumes, anything else starts a numbered new run, and no trained LoRA
is ever overwritten."""

from __future__ import annotations

import json
import os

import pytest

from streaming_cache.train import runs

SETTINGS = {"seed": 0, "rank": 16, "learning_rate": 1e-4, "optimizer": "AdamW"}


@pytest.fixture
def dirs(tmp_path):
    loras, states = tmp_path / "loras", tmp_path / "states"
    loras.mkdir(), states.mkdir()
    return str(loras), str(states)


def train(dirs, name, identity, resume=True, *, complete=True):
    """What the node does: plan, then write the LoRA, the state and its identity."""
    plan = runs.plan_run(*dirs, name, identity, resume)
    with open(plan.lora_path, "wb") as f:
        f.write(b"lora of " + identity.encode())
    if complete:
        with open(plan.state_path, "wb") as f:
            f.write(b"state")
        runs.write_run_identity(plan.state_path, identity)
    return plan


def content(path):
    with open(path, "rb") as f:
        return f.read()


def test_identity_is_a_hash_of_the_dataset_and_every_setting_given():
    base = runs.run_identity("data", SETTINGS)
    assert len(base) == 32 and base == runs.run_identity("data", dict(reversed(list(SETTINGS.items()))))
    for change in ({"seed": 1}, {"rank": 8}, {"learning_rate": 2e-4}, {"optimizer": "Prodigy"}, {"ema_decay": 0.9}):
        assert runs.run_identity("data", {**SETTINGS, **change}) != base, change
    assert runs.run_identity("more data", SETTINGS) != base
    assert runs.run_identity("data", {**SETTINGS, "flag": True}) != runs.run_identity("data", {**SETTINGS, "flag": 1})


def test_first_run_then_same_run_resumes(dirs):
    ident = runs.run_identity("d1", SETTINGS)
    first = train(dirs, "my_lora", ident)
    assert first.name == "my_lora" and not first.resumes and first.reason == "new run my_lora"
    assert first.lora_path == os.path.join(dirs[0], "my_lora.safetensors")
    assert first.ema_path == os.path.join(dirs[0], "my_lora_ema.safetensors")
    assert first.step_path(100) == os.path.join(dirs[0], "my_lora_step100.safetensors")
    again = runs.plan_run(*dirs, "my_lora", ident, True)
    assert again.resumes and again.resume_state_path == first.state_path and again.lora_path == first.lora_path
    assert "resuming my_lora" in again.reason
    legacy = runs.plan_run(*dirs, "my_lora", runs.run_identity("d1", {**SETTINGS, "seed": 9}), True,
                           also_accepted=(ident,))
    assert legacy.resumes and legacy.name == "my_lora", "an identity an earlier release recorded is continued"


def test_changed_seed_starts_a_numbered_run_and_keeps_the_old_one(dirs):
    a = runs.run_identity("d1", SETTINGS)
    b = runs.run_identity("d1", {**SETTINGS, "seed": 1})
    train(dirs, "my_lora", a)
    plan = train(dirs, "my_lora", b)
    assert plan.name == "my_lora_00002_" and not plan.resumes
    assert plan.lora_path == os.path.join(dirs[0], "my_lora_00002_.safetensors")
    assert "other settings" in plan.reason and "kept" in plan.reason
    assert content(os.path.join(dirs[0], "my_lora.safetensors")) == b"lora of " + a.encode(), "untouched"
    # each run resumes itself: the numbered one, and the first one again
    assert runs.plan_run(*dirs, "my_lora", b, True).name == "my_lora_00002_"
    assert runs.plan_run(*dirs, "my_lora", b, True).resumes
    assert runs.plan_run(*dirs, "my_lora", a, True).name == "my_lora"
    c = runs.run_identity("d1", {**SETTINGS, "seed": 2})
    assert train(dirs, "my_lora", c).name == "my_lora_00003_"


def test_added_images_start_a_new_run(dirs):
    train(dirs, "style", runs.run_identity("fingerprint-of-10-images", SETTINGS))
    plan = runs.plan_run(*dirs, "style", runs.run_identity("fingerprint-of-12-images", SETTINGS), True)
    assert plan.name == "style_00002_" and not plan.resumes and "another dataset" in plan.reason


def test_resume_off_never_overwrites(dirs):
    ident = runs.run_identity("d", SETTINGS)
    assert runs.plan_run(*dirs, "x", ident, False).name == "x", "nothing to overwrite yet"
    train(dirs, "x", ident, resume=False)
    plan = train(dirs, "x", ident, resume=False)
    assert plan.name == "x_00002_" and not plan.resumes and "resume is off" in plan.reason
    assert train(dirs, "x", ident, resume=False).name == "x_00003_"
    assert content(os.path.join(dirs[0], "x.safetensors")).startswith(b"lora of")


def test_a_lora_not_made_by_the_trainer_is_kept(dirs):
    foreign = os.path.join(dirs[0], "downloaded.safetensors")
    with open(foreign, "wb") as f:
        f.write(b"someone else's")
    plan = runs.plan_run(*dirs, "downloaded", runs.run_identity("d", SETTINGS), True)
    assert plan.name == "downloaded_00002_" and "not trained by this trainer" in plan.reason
    assert content(foreign) == b"someone else's"


def test_numbering_skips_every_taken_name(dirs):
    ident = runs.run_identity("d", SETTINGS)
    train(dirs, "n", runs.run_identity("other", SETTINGS))
    for leftover in ("n_00002_.safetensors", "n_00003__step100.safetensors", "n_00004_.safetensors"):
        with open(os.path.join(dirs[0], leftover), "wb") as f:
            f.write(b"keep")
    with open(os.path.join(dirs[1], "n_00005_.run.json"), "w") as f:
        f.write("{}")
    plan = runs.plan_run(*dirs, "n", ident, True)
    assert plan.name == "n_00006_"
    for existing in os.listdir(dirs[0]) + os.listdir(dirs[1]):
        assert not existing.startswith(plan.name)


def test_run_interrupted_before_its_identity_was_written_is_not_resumed(dirs):
    ident = runs.run_identity("d", SETTINGS)
    train(dirs, "k", ident, complete=False)  # LoRA written, no state yet
    plan = runs.plan_run(*dirs, "k", ident, True)
    assert plan.name == "k_00002_" and not plan.resumes


@pytest.mark.parametrize("sidecar", [
    b"", b"not json", b"[1, 2]", b'{"version": 1}', b'{"version": 2, "identity": "%s"}',
    b'{"version": 1, "identity": "../../etc"}', b'{"version": 1, "identity": 5}', b"\xff\xfe",
    b'{"version": 1, "identity": "%s", "x": "' + b"a" * 70_000 + b'"}', b"[" * 60_000,
])
def test_hostile_or_damaged_identity_files_mean_a_new_run(dirs, sidecar):
    ident = runs.run_identity("d", SETTINGS)
    train(dirs, "h", ident)
    with open(os.path.join(dirs[1], "h.run.json"), "wb") as f:
        f.write(sidecar.replace(b"%s", ident.encode()))
    plan = runs.plan_run(*dirs, "h", ident, True)
    assert not plan.resumes and plan.name == "h_00002_"


def test_identity_file_as_a_link_or_folder_is_not_trusted(dirs, tmp_path):
    ident = runs.run_identity("d", SETTINGS)
    train(dirs, "l", ident)
    sidecar = os.path.join(dirs[1], "l.run.json")
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(json.dumps({"version": 1, "identity": ident}))
    os.replace(sidecar, str(tmp_path / "moved"))
    os.symlink(elsewhere, sidecar)
    assert runs.read_run_identity(os.path.join(dirs[1], "l.state.pt")) is None
    os.remove(sidecar)
    os.mkdir(sidecar)
    assert not runs.plan_run(*dirs, "l", ident, True).resumes
    os.rmdir(sidecar)
    os.mkfifo(sidecar)  # reading it must not block
    assert runs.read_run_identity(os.path.join(dirs[1], "l.state.pt")) is None


def test_state_file_as_a_link_is_not_resumed(dirs, tmp_path):
    ident = runs.run_identity("d", SETTINGS)
    real = tmp_path / "elsewhere.state.pt"
    real.write_bytes(b"state")
    os.symlink(real, os.path.join(dirs[1], "s.state.pt"))
    runs.write_run_identity(os.path.join(dirs[1], "s.state.pt"), ident)
    plan = runs.plan_run(*dirs, "s", ident, True)
    assert not plan.resumes and plan.name == "s_00002_"


def test_identity_file_is_written_atomically_and_read_back(dirs):
    state = os.path.join(dirs[1], "w.state.pt")
    ident = runs.run_identity("d", SETTINGS)
    runs.write_run_identity(state, ident)
    assert runs.read_run_identity(state) == ident
    assert sorted(os.listdir(dirs[1])) == ["w.run.json"], "no temporary file left behind"
    with pytest.raises(ValueError):
        runs.write_run_identity(state, "not-an-identity")


def test_missing_folders_plan_a_plain_new_run(tmp_path):
    plan = runs.plan_run(str(tmp_path / "a"), str(tmp_path / "b"), "fresh", runs.run_identity("d", {}), True)
    assert plan.name == "fresh" and not plan.resumes


@pytest.mark.parametrize("keep", [0, 1, 2, 5])
def test_keeping_the_last_step_saves_deletes_only_the_older_snapshots_of_this_run(dirs, keep):
    """Snapshots at steps 5, 10, 50, 100 (numbers, not names: step10 comes after step5): the ``keep`` highest stay,
    0 keeps all; the LoRA, its EMA copy, another run's snapshots and files named otherwise are never touched."""
    plan = train(dirs, "my_lora", runs.run_identity("d1", SETTINGS))
    loras = dirs[0]
    steps = [5, 10, 50, 100]
    for step in steps:
        with open(plan.step_path(step), "wb") as f:
            f.write(b"snapshot")
    others = ["my_lora_ema.safetensors", "my_lora_00002__step1.safetensors", "my_lora_step7.safetensors.tmp",
              "my_lora_step8.txt", "my_lora_stepx.safetensors", "other_step1.safetensors"]
    for name in others:
        with open(os.path.join(loras, name), "wb") as f:
            f.write(b"other")
    deleted = runs.prune_step_saves(plan, keep)
    kept = steps[-keep:] if keep else steps
    assert sorted(deleted) == sorted(plan.step_path(s) for s in steps if s not in kept)
    assert sorted(os.listdir(loras)) == sorted(["my_lora.safetensors", *others,
                                                *(os.path.basename(plan.step_path(s)) for s in kept)])
    assert runs.prune_step_saves(plan, keep) == []
