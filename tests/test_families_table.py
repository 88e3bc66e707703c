"""The families table of docs/families.md is written from the sweep's reports: one row per family, a cell per version (trained
with its size and time, or the reason), the counts above it, and nothing outside its markers touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "families_table.py")


def report(version: str, families: dict, listed: list[str]) -> dict:
    return {"comfyui": version, "supported_models": listed, "families": families}


NEWEST = report("0.33.0", {
    "Flux dev": {"config": "Flux", "kind": "image DiT", "encoders": "T5-XXL [1,256,4096]", "trained": True,
                 "params": 1_600_000, "latent": [1, 16, 4, 4], "detect_seconds": 0.5, "build_seconds": 0.5,
                 "train_seconds": 2.0, "check_seconds": 1.0,
                 "comfy_trainer": {"ok": False, "error": "RuntimeError: boom", "version": "0.33.0"}},
    "Flux Kontext": {"config": "Flux", "kind": "edit / reference", "encoders": "", "trained": True,
                     "params": 1_600_000, "latent": [1, 16, 4, 4], "train_seconds": 3.0},
    "Mochi": {"config": "GenmoMochi", "kind": "video DiT", "trained": False,
              "reason": "needs 10.0 B parameters (the smallest model detection recognises)"},
    "SAM3": {"config": "SAM3", "kind": "not a diffusion model", "trained": False, "reason": "a segmenter"},
}, ["Flux", "GenmoMochi", "SAM3"])
OLDEST = report("0.3.64", {
    "Flux dev": {"config": "Flux", "kind": "image DiT", "trained": False, "ok": False, "error": "ValueError: x"},
}, ["Flux"])


def test_table_rows_cells_and_counts(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import families_table
    finally:
        sys.path.pop(0)
    text = families_table.table([NEWEST, OLDEST])
    lines = text.splitlines()
    assert "ComfyUI 0.33.0: **1 of 3** `supported_models` entries trained (1 of them are not diffusion models" \
        in lines[0], lines[0]
    assert "ComfyUI 0.3.64: **0 of 1**" in lines[1]
    flux = next(line for line in lines if line.startswith("| Flux dev |"))
    assert "trained (2 M, 4 s)" in flux and "**fails**: ValueError: x" in flux, flux
    assert "0.33.0: fails (RuntimeError: boom)" in flux and "| 16×4×4 |" in flux
    kontext = next(line for line in lines if line.startswith("| Flux Kontext |"))
    assert "not in this version" in kontext, "a family an older version lacks says so"
    assert "needs 10.0 B parameters" in next(line for line in lines if line.startswith("| Mochi |"))


def test_doc_block_is_replaced_and_the_rest_kept(tmp_path):
    doc = tmp_path / "families.md"
    doc.write_text("intro\n<!-- families:start -->\nold\n<!-- families:end -->\ntail\n", encoding="utf-8")
    paths = []
    for r in (NEWEST, OLDEST):
        path = tmp_path / f"families-comfyui-{r['comfyui']}.json"
        path.write_text(json.dumps(r), encoding="utf-8")
        paths.append(str(path))
    out = subprocess.run([sys.executable, SCRIPT, *paths, "--doc", str(doc)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("intro\n<!-- families:start -->\n- ComfyUI 0.33.0") and text.endswith(
        "<!-- families:end -->\ntail\n") and "old" not in text


def test_a_stopped_sweep_and_the_default_run_are_joined_per_version():
    """A full sweep stopped midway (its partial report has no total ``seconds``) and the default run's report of
    the same version: each family's row is the one that ran it, and the summary says how many were not run."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import families_table
    finally:
        sys.path.pop(0)
    not_run = {"trained": False, "reason": "not run by the default test run (STREAMING_CACHE_SWEEP=all runs it)"}
    stopped = report("0.33.0", {
        "Flux dev": {"config": "Flux", "kind": "image DiT", "trained": True, "params": 1_600_000,
                     "train_seconds": 2.0},
    }, ["Flux", "GenmoMochi", "SD3"])
    default = {**report("0.33.0", {
        "Flux dev": {"config": "Flux", "kind": "image DiT", **not_run},
        "Mochi": {"config": "GenmoMochi", "kind": "video DiT", "trained": True, "params": 2_000_000,
                  "train_seconds": 1.0},
        "SD3": {"config": "SD3", "kind": "image DiT", **not_run},
    }, ["Flux", "GenmoMochi", "SD3"]), "seconds": 30.0}
    text = families_table.table([stopped, default])
    lines = text.splitlines()
    assert lines[0].startswith("- ComfyUI 0.33.0: **2 of 3**") and "1 families not run in this stopped sweep" \
        in lines[0], lines[0]
    assert sum(line.startswith("- ComfyUI") for line in lines) == 1, "one summary per version"
    assert "| trained (2 M, 2 s) |" in next(line for line in lines if line.startswith("| Flux dev |"))
    assert "| trained (2 M, 1 s) |" in next(line for line in lines if line.startswith("| Mochi |"))
    assert "| not run |" in next(line for line in lines if line.startswith("| SD3 |"))


def test_the_families_doc_holds_the_block():
    """docs/families.md, where the script writes by default, holds the markers it replaces between."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import families_table
    finally:
        sys.path.pop(0)
    doc = os.path.join(ROOT, "docs", "families.md")
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    assert families_table.START in text and families_table.END in text
    assert families_table.replace_block(text, "x").count(families_table.START) == 1
