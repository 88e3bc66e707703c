"""The pack in the frontend each supported ComfyUI ships, and in newer frontends, in headless Chromium.

The pack is installed as users install it (a folder in ``custom_nodes``) into a real ComfyUI server; see
``helpers/frontend_check.py`` for what is checked. Every ComfyUI in ``COMFYUI_PATH`` is checked with the
frontend it ships; the newest (the last one named) is also checked with each frontend named in
``STREAMING_CACHE_FRONTENDS`` (``VERSION=STATIC_DIR``, several joined with ``:``; ``.ci/run`` adds the newest
frontend on the package registry), and then, as the ends of the range suffice, not with its own unless
``STREAMING_CACHE_MATRIX=all``. Screenshots are saved as test artifacts in ``$STREAMING_CACHE_ARTIFACTS``
(default ``test-artifacts/`` in the checkout). Needs Debian's ``chromium``; without it (or without a ComfyUI)
the tests are skipped visibly, and fail in CI.

One server and one browser per ComfyUI and frontend: the module fixture runs the check once, and every test reads
its part of the result. A part of the check that fails fails the tests that read it, with its message (and a
screenshot, ``failed_PART.png``); the others still pass or fail on their own.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

import headless
from helpers.installs import NODE_TYPES, ROOT, ScenarioFailed, in_ci, require_comfyui, run_scenario

EXAMPLES = sorted(headless.EXAMPLES)


def artifacts_dir(label: str) -> str:
    return os.path.join(os.environ.get("STREAMING_CACHE_ARTIFACTS", os.path.join(ROOT, "test-artifacts")),
                        f"frontend-comfyui-{label}")


def part(frontend: dict, name: str) -> dict:
    """The result of one part of the check (see ``check_examples`` in ``helpers/frontend_check.py``); the test
    fails with the part's own error when that part did not finish."""
    failed = frontend["failed"].get(name)
    if failed:
        pytest.fail(f"the frontend check's part {name!r} failed (screenshot failed_{name}.png in "
                    f"{frontend['artifacts']}): {failed}", pytrace=False)
    return frontend[name]


@pytest.fixture(scope="module")
def frontend(frontend_target, tmp_path_factory):
    comfyui, root, label = frontend_target
    comfyui = require_comfyui(comfyui)
    if not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")):
        message = "needs headless Chromium (Debian: apt-get install chromium)"
        if in_ci():
            pytest.fail(f"CI runs the frontend tests; {message}")
        pytest.skip(message)
    work = str(tmp_path_factory.mktemp("frontend"))
    artifacts = artifacts_dir(label)
    shutil.rmtree(artifacts, ignore_errors=True)
    try:
        result = run_scenario(comfyui, "frontend_check.py", work, artifacts, *([root] if root else []))
    except ScenarioFailed as exc:
        pytest.fail(f"frontend check failed: {exc}")
    result["artifacts"] = artifacts
    return result


def test_the_frontend_checked_is_the_one_named(frontend, frontend_target):
    _, root, label = frontend_target
    version = part(frontend, "loads")["frontend_version"]
    if root:  # a frontend given by version: the page must be that version, not the one ComfyUI ships
        assert version == label.rsplit("frontend-", 1)[1], version
    else:
        assert version, "the page reports its frontend's version"


def test_pack_installed_in_custom_nodes_imports_and_registers(frontend):
    assert not frontend["import_failed"], "ComfyUI logged IMPORT FAILED"
    assert frontend["imported"], "the pack is missing from ComfyUI's import times"
    assert frontend["registered"] == NODE_TYPES


def too_old_for(frontend: dict, name: str) -> bool:
    """Whether the ComfyUI checked is older than the one example ``name`` needs (``headless.NEEDS_NEWER_COMFYUI``)."""
    needs = headless.NEEDS_NEWER_COMFYUI.get(name)
    version = tuple(int(p) for p in re.findall(r"\d+", frontend["comfyui_version"])[:3])
    return needs is not None and version < needs[0]


def test_example_workflows_load_without_errors(frontend):
    """Every example this ComfyUI is recent enough for (the next test checks the others)."""
    for name in EXAMPLES:
        if too_old_for(frontend, name):
            continue
        loaded = part(frontend, "loads")[name]
        assert loaded["unknown_types"] == [], f"{name}: node types the frontend does not know"
        assert loaded["node_errors"] == [], name
        assert not [d for d in loaded["dialogs"] if "node types were not found" in d or "Nodes Are Missing" in d]
        assert loaded["widgets_kept"] and all(loaded["widgets_kept"].values()), (name, loaded["widgets_kept"])
        assert loaded["same_prompt_as_headless"], f"{name}: the frontend's API prompt differs from the headless one"
        assert loaded["errors_while_loading"] == [], name
        assert os.path.getsize(os.path.join(frontend["artifacts"], f"{name}.png")) > 10_000


def test_an_example_of_a_family_newer_than_this_comfyui_shows_just_its_nodes_missing(frontend):
    """LTX-2 came after v0.3.64: on a ComfyUI older than the version ``headless.NEEDS_NEWER_COMFYUI`` names, its
    example loads with exactly the family's node types that ComfyUI lacks unknown to the frontend, which shows
    its missing-node dialog, and the headless runner says which ComfyUI has them; on one that is recent enough,
    it has every one of them (the version in the table is not too old) and the test above loaded it."""
    assert headless.NEEDS_NEWER_COMFYUI, "the table this test reads"
    for name, (version, types) in headless.NEEDS_NEWER_COMFYUI.items():
        loaded = part(frontend, "loads")[name]
        if not too_old_for(frontend, name):
            assert loaded["missing_here"] == [], f"{name}: ComfyUI {frontend['comfyui_version']} lacks them"
            continue
        assert loaded["missing_here"] and set(loaded["missing_here"]) <= set(types), loaded
        assert sorted(loaded["unknown_types"]) == loaded["missing_here"], (name, loaded["unknown_types"])
        assert [d for d in loaded["dialogs"] if any(t in d for t in loaded["missing_here"])], loaded["dialogs"]
        assert f"in v{'.'.join(map(str, version))} and newer: update ComfyUI" in loaded["headless_error"], loaded
        assert loaded["errors_while_loading"] == [], name


def test_the_check_sees_a_missing_node(frontend):
    """A control: the same workflow with a node type nobody provides is reported."""
    assert part(frontend, "loads")["control_missing_node"]["unknown_types"] == ["StreamingCacheNoSuchNode"]


def test_workflows_saved_with_earlier_releases_load_with_their_values(frontend):
    """Every example workflow of every earlier release (tests/fixtures/releases): node types known, and the
    prompt the frontend makes of it holds every input that release's own runner exported (a release whose
    widget order differs is mapped by name), the same prompt the headless runner makes."""
    releases = part(frontend, "loads")["releases"]
    assert len(releases) >= 8 and {n.split("/")[0] for n in releases} >= {"0.1.0", "0.2.0", "0.3.0"}
    for name, loaded in releases.items():
        assert loaded["unknown_types"] == [] and loaded["errors_while_loading"] == [], (name, loaded)
        lost = {nid: [k for k, kept in inputs.items() if not kept]
                for nid, inputs in loaded["exported_inputs_kept"].items() if not all(inputs.values())}
        assert lost == {}, f"{name}: inputs whose value the frontend lost: {lost}"
        assert loaded["same_prompt_as_headless"], name


def test_a_new_train_lora_node_starts_with_preset_auto_and_saved_ones_keep_none(frontend):
    """A Train LoRA node added in the UI has preset auto (web/widget_layouts.json's ``created``); the workflows of
    earlier releases, which have no preset, load with none (``absent``), as the headless runner reads them (the
    test above compares the two prompts) and as an API prompt without it runs."""
    loads = part(frontend, "loads")
    assert loads["new_train_widgets"].get("preset") == "auto", loads["new_train_widgets"]
    assert loads["new_train_widgets"].get("lora_name") == "my_lora"
    saved = [p for loaded in loads["releases"].values() for p in loaded["train_presets"]]
    assert saved and set(saved) == {"none"}, saved


def test_each_node_fits_a_screen_at_the_default_zoom(frontend):
    fit = part(frontend, "fit")
    assert sorted(fit) == sorted(t for t in NODE_TYPES if t not in ("StreamingCacheEncodeDataset",
                                                                     "StreamingCacheTrainLoRA"))
    too_tall = {t: v["screen_height"] for t, v in fit.items() if v["screen_height"] > v["limit"] * 0.8}
    assert too_tall == {}, "a new node leaves room for the menus on a 1000 px screen"


def test_template_browser_lists_the_examples_with_thumbnails(frontend):
    templates = part(frontend, "templates")
    assert sorted(templates["served"]) == EXAMPLES
    assert sorted(templates["listed_in_browser"]) == EXAMPLES
    assert templates["errors"] == [], "no request of the pack's templates fails (thumbnails included)"
    assert sorted(templates["thumbnails"]) == EXAMPLES and all(templates["thumbnails"].values()), templates
    assert os.path.isfile(os.path.join(frontend["artifacts"], "template_browser.png"))


def test_example_runs_from_the_run_button_to_the_end(frontend):
    run = part(frontend, "run")
    assert run["finished"] and run["status"] == "success", run
    texts = "\n".join(t for v in run["texts"].values() for t in v)
    assert "encoded 10, reused 0, failed 0" in texts
    assert "trained frontend_encode_and_train: steps 1-3 of 3" in texts
    assert run["errors_while_running"] == [], "no console error from the Run button to the end"
    assert os.path.isfile(os.path.join(frontend["artifacts"], "run_encode_and_train.png"))


def test_encode_dataset_shows_its_dataset_preview_in_the_browser(frontend):
    """After the run the Encode Dataset node shows the dataset preview page in its pager (one image, as wide as a
    page of tiles; ComfyUI draws no second copy), and its summary gives the page and the bucket counts."""
    run = part(frontend, "run")
    shown = run["encode_preview"]
    assert shown and (shown["page"], shown["pages"]) == (1, 1) and shown["width"] >= 480, shown
    assert shown["label"] == "page 1 of 1" and shown["error"] is None and shown["node_images"] == 0, shown
    assert "preview page 1 of 1 (7 samples an epoch" in (run["summaries"]["StreamingCacheEncode"] or ""), run


def test_the_dataset_preview_pages_in_the_browser_and_comes_back_after_a_reload(frontend):
    """Load Streaming Cache on a cache of 30 samples (two pages): a mouse click on the arrow drawn on the node turns
    to page 2 (another image, from the pack's route) while the graph's prompt stays the same and nothing is queued;
    after a page reload page 1 is back from the prompt's history, a click on the arrow once it shows turns the page,
    a restore from history answered after that click leaves it turned, and the other arrow turns back. Each click
    lands on the arrow itself (what the browser finds on top at that point)."""
    paging = part(frontend, "paging")
    for arrow in ("arrow", "arrow_after_reload", "back_arrow"):  # what the clicks landed on: the arrow itself
        assert paging[arrow]["on_top"] and not paging[arrow]["disabled"], (arrow, paging[arrow])
    assert (paging["arrow"]["text"], paging["back_arrow"]["text"]) == ("\u25b6", "\u25c0"), paging
    first, turned = paging["first"], paging["turned"]
    assert (first["page"], first["pages"], first["label"]) == (1, 2, "page 1 of 2"), first
    assert (turned["page"], turned["pages"], turned["label"]) == (2, 2, "page 2 of 2"), turned
    assert turned["src"].startswith("data:image/png") and not first["src"].startswith("data:"), (first, turned)
    assert first["node_images"] == turned["node_images"] == 0, "the page shows once, in the pager"
    assert paging["prompt_unchanged"], "turning a page changes no input of the graph"
    assert paging["queued_by_paging"] == 0 and paging["queue_after_paging"] == 0, paging
    reloaded = paging["after_reload"]
    assert (reloaded["page"], reloaded["pages"]) == (1, 2) and reloaded["width"] == first["width"], reloaded
    assert paging["turned_after_reload"]["page"] == 2, paging["turned_after_reload"]
    assert paging["late_restore_answered"], "the page asked the history again and had its answer"
    late = paging["after_late_restore"]
    assert (late["page"], late["label"]) == (2, "page 2 of 2") and late["src"].startswith("data:image/png"), late
    assert (paging["turned_back"]["page"], paging["turned_back"]["label"]) == (1, "page 1 of 2"), paging
    assert paging["errors"] == [], "no error in the pack's script while paging and reloading"
    assert os.path.isfile(os.path.join(frontend["artifacts"], "dataset_preview_after_reload.png"))


def test_nodes_show_what_they_did_after_the_run_and_after_an_unchanged_rerun(frontend):
    run = part(frontend, "run")
    summaries = run["summaries"]
    assert "encoded 10, reused 0, failed 0" in (summaries["StreamingCacheEncode"] or ""), summaries
    assert "trained frontend_encode_and_train: steps 1-3 of 3" in (summaries["StreamingCacheTrain"] or "")
    again = run["again"]
    assert again["status"] == "success", again
    assert "already trained for 3 steps" in (again["summaries"]["StreamingCacheTrain"] or ""), again
    assert "encoded 0, reused 10" in (again["summaries"]["StreamingCacheEncode"] or ""), again


def test_sample_previews_show_on_the_node_and_beside_it_and_the_loss_once(frontend):
    """The previews example run from the Run button: while it trains, the Train LoRA node shows the samples as a
    live preview (screenshot live_train_with_previews.png); at the end the template's Preview Image shows the
    samples, and the loss is drawn once, by the browser's chart: no image on the node is the loss plot (the
    first example, without sample prompts, shows none, and its node is that much shorter)."""
    run = part(frontend, "run_previews")
    assert run["finished"] and run["status"] == "success", run
    texts = "\n".join(t for v in run["texts"].values() for t in v)
    assert "4 sample images in" in texts and "validation loss" in texts, texts
    assert run["live_polls_with_preview"] > 0, "a live preview showed on the node while it trained"
    assert os.path.isfile(os.path.join(frontend["artifacts"], "live_train_with_previews.png"))
    samples = run["preview"]
    assert samples and len(samples) == 1, samples
    width, height = map(int, samples[0].split("x"))
    assert (width, height) != (1024, 512) and width >= 512, "the Preview Image beside the node shows the samples"
    assert all(size == [width, height] for size in run["train_node_images"]), (run["train_node_images"], samples)
    plain = part(frontend, "run")  # no sample prompts: nothing but the chart and the text below the widgets
    assert plain["train_node_images"] == [], plain["train_node_images"]
    assert plain["train_node_height"] < run["train_node_height"] - 100, (plain["train_node_height"],
                                                                         run["train_node_height"])


def test_the_servers_console_shows_each_result_once_and_no_warning_twice(frontend):
    """The console of the server the runs went through: each node's summary once, the per-step text (for the
    browser) not at all, and no warning repeated."""
    part(frontend, "run")  # the runs the console shows
    console = frontend["console"]
    assert console["encode_summary"] == 1 and console["train_summary"] == 1, console
    assert console["run_named"] == 1, "the run's name and reason shows when it starts, not again in its summary"
    assert console["step_texts"] == 0 and console["repeated_warnings"] == [], console


def test_the_loss_chart_is_drawn_by_the_browser_and_comes_back_after_a_reload(frontend):
    """Train LoRA's chart of the previews example (8 steps, validation every 4): the browser draws the curves the
    node sent, reads out the step under the pointer, switches to a log axis, zooms to a range of steps, and after a
    page reload shows the same chart and summary again, from the prompt's history."""
    run = part(frontend, "run_previews")
    live = run["chart_steps_while_running"]
    assert any(total == 8 and drawn <= 8 for drawn, total in live), ("the chart showed while the prompt ran", live)
    chart = run["chart"]
    after = chart["after_run"]
    sent = run["train_output"]["chart"][-1]
    assert after["steps"] == list(range(1, 9)) and after["total"] == 8, after
    assert after["loss"] == sent["loss"] and all(isinstance(v, float) for v in after["loss"])
    final = float(re.search(r"final loss ([0-9.]+)", after["summary"]).group(1))
    assert abs(after["loss"][-1] - final) < 5e-5, "the chart's last loss is the one the summary names"
    assert [s for s, _ in after["validation"]] == [4, 8] and len(after["lr"]) == 8
    hover = chart["hover"]
    assert hover["hover"] == 5, hover
    assert hover["readout"].startswith(f"step 5  loss {after['loss'][4]:#.4g}  "), hover["readout"]
    assert "validation" in hover["readout"] and "lr " in hover["readout"], hover["readout"]
    assert chart["scale"]["log"] is True
    assert chart["zoom"]["zoom"] and 1.5 < chart["zoom"]["zoom"][0] < 2.5 and 6.5 < chart["zoom"]["zoom"][1] < 7.5
    assert chart["reset"]["zoom"] is None
    reloaded = chart["after_reload"]
    assert reloaded and reloaded["loss"] == after["loss"] and reloaded["steps"] == after["steps"], reloaded
    assert reloaded["summary"] == after["summary"], "the summary comes back with the chart"
    assert chart["errors"] == [], "no error in the pack's script while the page reloads"
