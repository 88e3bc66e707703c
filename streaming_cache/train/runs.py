"""Which run a training request continues, and where a new run writes, so a trained LoRA is never lost.

A *run* is one training of one LoRA: its file ``<loras>/<name>.safetensors``, its resume state
``<states>/<name>.state.pt`` and, next to the state, ``<name>.run.json`` holding the run's identity (a hash of
the dataset fingerprint and of every setting an exact resume depends on: :func:`run_identity`; which settings
those are, the training spec says: ``spec.TrainSpec.identity_settings``).

Queueing a training again (:func:`plan_run`) resumes only the same run: an existing run of that name, or of
one of its numbered names, whose identity matches. Anything else (another dataset, another seed, a changed
setting, resume turned off, a LoRA of that name not made by this trainer) starts a new run under the first free
numbered name, ComfyUI's convention for saved files (``<name>_00002_``, ``<name>_00003_``, ...), and never
touches the files of another run. The plan says which happened and why.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from .. import layout
from ..errors import CacheError
from .checkpoint import write_atomically

RUN_FILE_VERSION = 1
NUMBER_DIGITS = 5
MAX_NUMBER = 10 ** NUMBER_DIGITS - 1
_MAX_RUN_FILE = 64 * 1024
_IDENTITY = re.compile(r"[0-9a-f]{32}")


def run_identity(dataset_fingerprint: str, settings: Mapping[str, Any]) -> str:
    """A 32-hex-digit hash of the dataset fingerprint and of ``settings`` (key order does not matter; values are
    compared as JSON, anything else by ``repr``)."""
    kept = {str(k): v for k, v in settings.items()}
    text = json.dumps({"dataset": dataset_fingerprint, "settings": kept}, sort_keys=True, default=repr,
                      separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def lora_path(lora_dir: str, name: str) -> str:
    return os.path.join(lora_dir, f"{name}.safetensors")


def state_path(state_dir: str, name: str) -> str:
    return os.path.join(state_dir, f"{name}.state.pt")


def run_file_path(state_path_: str) -> str:
    """The identity file next to a state file: ``x.state.pt`` -> ``x.run.json``."""
    base = state_path_.removesuffix(".state.pt")
    return base + ".run.json"


def write_run_identity(state_path_: str, identity: str) -> None:
    """Record the identity of the run whose state is ``state_path_`` (atomically; call it whenever the state is
    saved)."""
    if not _IDENTITY.fullmatch(identity):
        raise ValueError(f"not a run identity: {identity!r}")
    data = json.dumps({"version": RUN_FILE_VERSION, "identity": identity}).encode("utf-8")
    write_atomically(run_file_path(state_path_), lambda f: f.write(data))


def read_run_identity(state_path_: str) -> str | None:
    """The identity recorded for the state ``state_path_``, or None when there is none or it cannot be trusted
    (missing, not a regular file, too large, not the expected JSON): such a run is never resumed."""
    path = run_file_path(state_path_)
    try:
        with layout.open_reader(path, "run identity file") as f:
            data = f.read(_MAX_RUN_FILE + 1)
    except (OSError, CacheError):
        return None
    if len(data) > _MAX_RUN_FILE:
        return None
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("version") != RUN_FILE_VERSION:
        return None
    identity = value.get("identity")
    return identity if isinstance(identity, str) and _IDENTITY.fullmatch(identity) else None


@dataclass(frozen=True)
class RunPlan:
    name: str  # the run's file name: ``name`` or a numbered ``name_0000N_``
    lora_path: str  # where the LoRA is written
    state_path: str  # where the resume state is written (its identity file beside it: run_file_path)
    resume_state_path: str | None  # the state to resume from (== state_path), or None for a new run
    reason: str  # one sentence for the user: which run and why

    @property
    def resumes(self) -> bool:
        return self.resume_state_path is not None

    @property
    def ema_path(self) -> str:
        """Where the EMA copy of the LoRA goes: ``<name>_ema.safetensors`` beside the LoRA."""
        return self.lora_path[:-len(".safetensors")] + "_ema.safetensors"

    def step_path(self, step: int) -> str:
        """Where a periodic snapshot of the LoRA goes: ``<name>_step<step>.safetensors`` beside the LoRA."""
        return self.lora_path[:-len(".safetensors")] + f"_step{step}.safetensors"


def prune_step_saves(plan: RunPlan, keep: int) -> list[str]:
    """Delete the periodic snapshots of ``plan``'s run (:meth:`RunPlan.step_path`) but the ``keep`` of the highest
    steps (0 keeps them all); returns the paths deleted. Only files named exactly ``<name>_step<N>.safetensors``
    beside the LoRA are touched: another run's, an EMA copy or a file named otherwise are not."""
    if keep <= 0:
        return []
    folder, base = os.path.split(plan.lora_path[:-len(".safetensors")])
    pattern = re.compile(re.escape(base) + r"_step([0-9]+)\.safetensors")
    steps = sorted((int(m.group(1)), entry) for entry in _entries(folder) if (m := pattern.fullmatch(entry)))
    deleted = []
    for _, entry in steps[:-keep]:
        path = os.path.join(folder, entry)
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        deleted.append(path)
    return deleted


def numbered_name(name: str, number: int) -> str:
    """ComfyUI's numbered file name: ``name_00002_``."""
    return f"{name}_{number:0{NUMBER_DIGITS}d}_"


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def _entries(*folders: str) -> list[str]:
    names: set[str] = set()
    for folder in folders:
        try:
            names.update(os.listdir(folder))
        except OSError:
            continue
    return sorted(names)


def _taken(entries: list[str], name: str) -> bool:
    """Whether any file of a run called ``name`` is among ``entries`` (its LoRA, state, identity file, step
    snapshots or EMA copy): such a name is never given to a new run."""
    prefixes = (f"{name}.", f"{name}_step", f"{name}_ema")
    return any(e.startswith(prefixes) for e in entries)


def _numbers(state_dir: str, name: str) -> list[int]:
    """Numbers of existing numbered runs of ``name`` (those with a state file), highest first."""
    pattern = re.compile(re.escape(name) + rf"_(\d{{{NUMBER_DIGITS}}})_\.state\.pt")
    try:
        entries = os.listdir(state_dir)
    except OSError:
        return []
    return sorted({int(m.group(1)) for e in entries if (m := pattern.fullmatch(e))}, reverse=True)


def plan_run(lora_dir: str, state_dir: str, name: str, identity: str, resume: bool, *,
             also_accepted: tuple[str, ...] = ()) -> RunPlan:
    """Where a training of LoRA ``name`` with run identity ``identity`` goes.

    With ``resume``: the run ``name``, then the numbered runs of ``name`` newest (highest number) first; the
    first whose state exists and whose recorded identity equals ``identity`` (or one of ``also_accepted``: the
    same settings as an earlier release wrote them) is resumed. Otherwise, and always
    without ``resume``: a new run, under ``name`` if no file of that name exists, else under the first numbered
    name (from ``name_00002_``) with no file at all. Existing files are never chosen for a new run."""
    plain = (lora_path(lora_dir, name), state_path(state_dir, name))
    if resume:
        for candidate in [name] + [numbered_name(name, n) for n in _numbers(state_dir, name)]:
            state = state_path(state_dir, candidate)
            same = os.path.isfile(state) and not os.path.islink(state) \
                and read_run_identity(state) in (identity, *also_accepted)
            if same:
                return RunPlan(candidate, lora_path(lora_dir, candidate), state, state,
                               f"resuming {candidate}: same dataset and settings as its saved training state")
    entries = _entries(lora_dir, state_dir)
    if not _taken(entries, name):
        return RunPlan(name, plain[0], plain[1], None, f"new run {name}")
    for number in range(2, MAX_NUMBER + 1):
        candidate = numbered_name(name, number)
        if not _taken(entries, candidate):
            break
    else:
        raise FileExistsError(f"every numbered name of {name} is taken in {lora_dir}; choose another lora_name")
    if not resume:
        why = f"resume is off, and {name} already exists (kept as it is)"
    elif _exists(plain[1]) or _exists(run_file_path(plain[1])):
        why = (f"the saved training of {name} used another dataset or other settings (or its state cannot be "
               f"read), so it is kept as it is")
    else:
        why = f"{name} already exists and was not trained by this trainer (no training state), so it is kept"
    return RunPlan(candidate, lora_path(lora_dir, candidate), state_path(state_dir, candidate), None,
                   f"new run {candidate}: {why}")
