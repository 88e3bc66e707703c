"""Fixtures shared by every test; shared code lives in ``helpers/``."""

from __future__ import annotations

import os

import pytest
from demo_assets import MODEL_STORE_ENV

from helpers.installs import comfyui_installs, extra_frontends


@pytest.fixture(scope="session", autouse=True)
def demo_model_store(tmp_path_factory):
    """One folder per test run where the tiny demo checkpoint is built once per ComfyUI installation: the
    scenarios' ComfyUI homes hard-link it instead of each writing its own 0.5 GB (twenty of them filled the
    disk of a CI machine). A folder already named in the environment is kept."""
    if os.environ.get(MODEL_STORE_ENV):
        yield os.environ[MODEL_STORE_ENV]
        return
    os.environ[MODEL_STORE_ENV] = str(tmp_path_factory.mktemp("demo_models"))
    try:
        yield os.environ[MODEL_STORE_ENV]
    finally:
        os.environ.pop(MODEL_STORE_ENV, None)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


MATRIX = os.environ.get("STREAMING_CACHE_MATRIX", "").lower() == "all"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "newest_comfyui: runs on the newest configured ComfyUI only (CI's slice of the version matrix), "
        "on every one with STREAMING_CACHE_MATRIX=all")


def pytest_generate_tests(metafunc) -> None:
    """Tests that take ``comfyui`` run once per configured ComfyUI (ids: its version); those marked
    ``newest_comfyui`` on the newest only, unless STREAMING_CACHE_MATRIX=all."""
    if "comfyui" in metafunc.fixturenames:
        installs: list = list(comfyui_installs()) or [None]
        if not MATRIX and metafunc.definition.get_closest_marker("newest_comfyui") is not None:
            installs = installs[-1:]
        metafunc.parametrize("comfyui", installs, ids=[i.version if i else "no-comfyui" for i in installs],
                             scope="module")
    if "frontend_target" in metafunc.fixturenames:
        installs = list(comfyui_installs())
        targets: list = [(i, None, i.version) for i in installs] or [(None, None, "no-comfyui")]
        if installs:
            targets += [(installs[-1], root, f"{installs[-1].version}-frontend-{version}")
                        for version, root in extra_frontends()]
        metafunc.parametrize("frontend_target", targets, ids=[t[2] for t in targets], scope="module")
