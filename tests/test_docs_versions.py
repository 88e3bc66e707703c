"""The docs name only versions of the pack that exist: ``pyproject.toml``'s, or a release (a ``## X.Y.Z (date)``
heading of the CHANGELOG, or a folder of ``tests/fixtures/releases/``). A version of the pack is a MAJOR.MINOR.PATCH
number right after a word that dates something of the pack ("since 0.5.0", "release 0.4.0", "releases up to
0.3.0", "saved with 0.1.0, 0.2.0 and 0.3.0"); versions of other projects are written after their name or with a
``v`` ("ComfyUI v0.3.64", "ComfyUI 0.33.0", "PyTorch 2.5.1", "frontend 1.58.1") and are not the pack's."""

from __future__ import annotations

import glob
import os
import re

import pytest
import release_fixtures

from helpers.installs import ROOT

RELEASES = os.path.join(ROOT, "tests", "fixtures", "releases")
NUMBER = r"(?<![\w.])\d+\.\d+\.\d+(?!\.?\d)"  # not v0.3.64, not part of 127.0.0.1
# the word before a version of the pack; "version" only where no other project's name comes right before it
CUE = (r"(?<![\w-])(?:since|before|after|until|up to|added in|in|with|by|of|from|"
       r"releases?|(?<!ComfyUI )(?<!PyTorch )(?<!Python )(?<!frontend )versions?|pack(?:'s)?)")
PACK_VERSION = re.compile(rf"{CUE}:?\s+(?:releases?\s+)?(?:up to\s+)?(?P<first>{NUMBER})"
                          rf"(?P<more>(?:(?:,\s*(?:and\s+|or\s+)?|\s+(?:and|or|to)\s+){NUMBER})*)", re.I)
CHANGELOG_RELEASE = re.compile(r"^## (\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)$", re.M)


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def pack_versions(text: str) -> list[str]:
    """Every version of the pack the text names, in order."""
    found = []
    for m in PACK_VERSION.finditer(text):
        found.append(m.group("first"))
        found += re.findall(NUMBER, m.group("more"))
    return found


def changelog_releases() -> list[str]:
    return [v for v, _ in CHANGELOG_RELEASE.findall(_read("CHANGELOG.md"))]


def known_versions() -> set[str]:
    folders = {n for n in os.listdir(RELEASES) if os.path.isdir(os.path.join(RELEASES, n))}
    return {release_fixtures.pyproject_version(), *changelog_releases(), *folders}


def unknown_pack_versions(text: str, known: set[str]) -> list[str]:
    return [v for v in pack_versions(text) if v not in known]


DOCS = ["README.md", "CHANGELOG.md", os.path.join("tests", "fixtures", "releases", "README.md"),
        *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
        *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "nodes", "**", "*.py"),
                                                            recursive=True))]


@pytest.mark.parametrize("path", DOCS)
def test_every_version_of_the_pack_a_doc_names_exists(path):
    known = known_versions()
    assert not unknown_pack_versions(_read(path), known), \
        f"{path} names versions of the pack that are neither pyproject.toml's nor released ({sorted(known)})"


def test_the_check_reads_the_phrases_the_docs_use():
    """Without matches in the docs, the check above would pass on anything."""
    named = [v for path in DOCS for v in pack_versions(_read(path))]
    assert len(named) >= 10 and "0.1.0" in named, named


def test_a_version_of_the_pack_that_does_not_exist_is_caught():
    known = {"0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"}
    for text, wrong in [
        ("Caches written since 0.6.0 hold a digest.", ["0.6.0"]),
        ("The Train LoRA node of release 0.7.0, kept so saved workflows run.", ["0.7.0"]),
        ("Workflows saved with 0.1.0, 0.2.0 and 0.9.0 run unchanged.", ["0.9.0"]),
        ("The all-in-one nodes of releases up to 1.0.0 keep their ids.", ["1.0.0"]),
        ("Releases 0.1.0 to 0.6.0 wrote it.", ["0.6.0"]),
        ("inputs.append(x)  # added in 0.6.0: optional, last", ["0.6.0"]),
        ("this pack's 0.6.0 and TrainLoraNode", ["0.6.0"]),
        ("Version 0.6.0 of the pack", ["0.6.0"]),
    ]:
        assert unknown_pack_versions(text, known) == wrong, text
    assert unknown_pack_versions("since 0.5.0; before 0.5.0; up to 0.4.0; releases 0.1.0 to 0.3.0", known) == []


def test_versions_of_other_projects_are_not_the_packs():
    for text in [
        "Supported: ComfyUI v0.3.64 (October 2025) to 0.33.0 (master of 2026-08-22)",
        "exported with ComfyUI 0.33.0; exporting them with v0.3.64 gives the same bytes",
        "it fails on 13 of 80 on 0.33.0 and on 4 of 47 on 0.3.64",
        "Load Diffusion Model of ComfyUI 0.4 and newer",
        "PyTorch 2.5 to 2.13; CI runs the engine's tests on PyTorch 2.5.1",
        "installs torch==2.13.0 first",
        "CI adds the newest release on the package registry, 1.58.1",
        "the newest frontend 1.58.1 with ComfyUI version 0.33.0 and PyTorch version 2.5.1",
        "safetensors 0.4 and safetensors>=0.4",
        "listens on 127.0.0.1:8188",
        "| SD15 | UNet | trained | 0.33.0: trains; 0.3.64: trains |",
    ]:
        assert pack_versions(text) == [], text


def test_pyproject_names_the_newest_release_of_the_changelog():
    releases = changelog_releases()
    assert releases, "the CHANGELOG has release headings: ## X.Y.Z (YYYY-MM-DD)"
    newest = max(releases, key=lambda v: tuple(int(x) for x in v.split(".")))
    assert releases[0] == newest, "the CHANGELOG lists the newest release first"
    assert release_fixtures.pyproject_version() == newest
    first = re.search(r"^## (.+)$", _read("CHANGELOG.md"), re.M).group(1)
    assert first == "Unreleased" or first.startswith(newest + " "), first


def test_the_engine_says_the_version_pyproject_says():
    import streaming_cache

    assert streaming_cache.__version__ == release_fixtures.pyproject_version()
