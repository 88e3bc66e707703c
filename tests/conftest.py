"""Fixtures shared by every test; shared code lives in ``helpers/``."""

from __future__ import annotations

import os

import pytest
from demo_assets import MODEL_STORE_ENV

from helpers import hang_limit
from helpers.installs import comfyui_installs, extra_frontends
from helpers.orphans import LAUNCH_ENV, launch_token, outliving, stop


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
    hang_limit.open_report()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test (its set-up and tear-down included) runs under the hang limit (helpers/hang_limit.py)."""
    hang_limit.arm(hang_limit.limit())
    try:
        yield
    finally:
        hang_limit.disarm()


def pytest_generate_tests(metafunc) -> None:
    """Tests that take ``comfyui`` run once per configured ComfyUI (ids: its version); those marked
    ``newest_comfyui`` on the newest only, unless STREAMING_CACHE_MATRIX=all. The frontend tests run on each
    ComfyUI with the frontend it ships and on the newest with each frontend of ``STREAMING_CACHE_FRONTENDS``;
    where such frontends are given and there are several ComfyUIs, the newest ComfyUI's own frontend only with
    STREAMING_CACHE_MATRIX=all."""
    if "comfyui" in metafunc.fixturenames:
        installs: list = list(comfyui_installs()) or [None]
        if not MATRIX and metafunc.definition.get_closest_marker("newest_comfyui") is not None:
            installs = installs[-1:]
        metafunc.parametrize("comfyui", installs, ids=[i.version if i else "no-comfyui" for i in installs],
                             scope="module")
    if "frontend_target" in metafunc.fixturenames:
        installs = list(comfyui_installs())
        targets: list = [(i, None, i.version) for i in installs] or [(None, None, "no-comfyui")]
        extra = [(installs[-1], root, f"{installs[-1].version}-frontend-{version}")
                 for version, root in extra_frontends()] if installs else []
        if extra and len(installs) > 1 and not MATRIX:
            # The ends of the range: the oldest ComfyUI's own frontend and the newest frontends on the newest
            # ComfyUI; the frontend the newest ComfyUI ships lies between them (STREAMING_CACHE_MATRIX=all adds it).
            targets = targets[:-1]
        targets += extra
        metafunc.parametrize("frontend_target", targets, ids=[t[2] for t in targets], scope="module")


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request):
    """A test marked ``multiprocess`` fails when a process it started (a rank, a writer, a launcher's child) is
    still alive once the test is over: a rank that hangs at exit, or outlives a launcher that was killed, is a
    failure even when the test's own checks passed. Such processes are killed, so they do not hold memory or
    ports for the tests after. The processes are told apart by a variable in the environment they inherit."""
    if request.node.get_closest_marker("multiprocess") is None:
        yield
        return
    token = launch_token(request.node.nodeid)
    previous = os.environ.get(LAUNCH_ENV)
    os.environ[LAUNCH_ENV] = token
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LAUNCH_ENV, None)
        else:
            os.environ[LAUNCH_ENV] = previous
        left = outliving(token)
        if left:
            stop(left)
            pytest.fail("processes this test started outlived it (killed now): "
                        + "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in left.items()), pytrace=False)
