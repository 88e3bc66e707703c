"""Fixtures shared by every test; shared code lives in ``helpers/``."""

from __future__ import annotations

import pytest

from helpers.installs import comfyui_installs, extra_frontends


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def pytest_generate_tests(metafunc) -> None:
    """Tests that take ``comfyui`` run once per configured ComfyUI (ids: its version)."""
    if "comfyui" in metafunc.fixturenames:
        installs: list = list(comfyui_installs()) or [None]
        metafunc.parametrize("comfyui", installs, ids=[i.version if i else "no-comfyui" for i in installs],
                             scope="module")
    if "frontend_target" in metafunc.fixturenames:
        installs = list(comfyui_installs())
        targets: list = [(i, None, i.version) for i in installs] or [(None, None, "no-comfyui")]
        if installs:
            targets += [(installs[-1], root, f"{installs[-1].version}-frontend-{version}")
                        for version, root in extra_frontends()]
        metafunc.parametrize("frontend_target", targets, ids=[t[2] for t in targets], scope="module")
