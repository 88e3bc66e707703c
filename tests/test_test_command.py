"""The README's test command (``scripts/test.py``): its own virtual environment, PyTorch's CPU build from where it
can be had, nothing installed again on a second run, pytest's arguments and exit status passed through."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers.installs import SCRIPTS

# loaded under a name of its own: "test" is also the standard library's test package
_spec = importlib.util.spec_from_file_location("streaming_cache_test_command", os.path.join(SCRIPTS, "test.py"))
assert _spec is not None and _spec.loader is not None
test_command = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(test_command)

CPU_INDEX = test_command.TORCH_INDEXES["cpu"]


def test_pytorch_s_cpu_index_first_where_it_answers_on_every_system():
    for system in ("Linux", "Windows", "Darwin"):
        sources = test_command.torch_sources(system, cpu_index_answers=True)
        assert [args for args, _ in sources] == [[f"torch=={test_command.TORCH}", *CPU_INDEX]]


def test_without_it_the_configured_index_s_cpu_build_then_the_release():
    linux = [args for args, _ in test_command.torch_sources("Linux", cpu_index_answers=False)]
    assert linux == [[f"torch=={test_command.TORCH}+cpu"], [f"torch=={test_command.TORCH}"]]
    assert "CUDA" in test_command.torch_sources("Linux", False)[-1][1], "the user is told what the release brings"
    mac = [args for args, _ in test_command.torch_sources("Darwin", cpu_index_answers=False)]
    assert mac == [[f"torch=={test_command.TORCH}"]], "PyPI's macOS wheel is the CPU build; there is no +cpu one"


def test_the_pin_is_the_newest_pytorch_the_pack_is_tested_with():
    from streaming_cache import environment

    assert tuple(int(p) for p in test_command.TORCH.split(".")[:2]) == environment.TORCH_NEWEST_TESTED


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """The environment made for real (a venv without pip is cheap), pip and the torch probe recorded instead."""
    calls: list[list[str]] = []
    monkeypatch.setattr(test_command, "make_venv", lambda venv: os.path.join(venv, "python"))
    monkeypatch.setattr(test_command, "reachable", lambda host: False)
    monkeypatch.setattr(test_command, "_torch_version", lambda python: None)
    monkeypatch.setattr(test_command, "_pip", lambda python, args, quiet=False: calls.append(args) or 0)
    os.makedirs(tmp_path / "venv")
    return calls


def test_a_second_run_installs_nothing_until_the_requirements_change(fake_pip, tmp_path, monkeypatch):
    venv = str(tmp_path / "venv")
    test_command.prepare(venv)
    assert fake_pip[0][-1] == f"torch=={test_command.TORCH}+cpu" and "--only-binary" in fake_pip[0]
    assert fake_pip[1] == ["-e", f"{test_command.ROOT}[test]"]
    fake_pip.clear()
    test_command.prepare(venv)
    assert fake_pip == [], "nothing installed again"
    monkeypatch.setattr(test_command, "TORCH", "9.9.0")
    test_command.prepare(venv)
    assert fake_pip and fake_pip[0][-1] == "torch==9.9.0+cpu", "a new pin installs again"


def test_a_failed_install_says_what_to_do_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(test_command, "make_venv", lambda venv: os.path.join(venv, "python"))
    monkeypatch.setattr(test_command, "reachable", lambda host: False)
    monkeypatch.setattr(test_command, "_torch_version", lambda python: None)
    monkeypatch.setattr(test_command, "_pip", lambda python, args, quiet=False: 1)
    monkeypatch.setenv(test_command.VENV_ENV, str(tmp_path / "venv"))
    assert test_command.main(["-q"]) == 2
    err = capsys.readouterr().err
    assert "could not install PyTorch 2.13.0" in err and "package index" in err
    assert not os.path.exists(tmp_path / "venv" / test_command.STAMP), "an unfinished environment is not stamped"


def test_pytest_s_arguments_and_exit_status_pass_through(tmp_path):
    """With the environment already prepared (this interpreter's, stamped), the command is pytest itself."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    python = str(venv / "bin" / "python")
    (venv / test_command.STAMP).write_text(test_command.install_key(python))
    env = dict(os.environ, **{test_command.VENV_ENV: str(venv)})
    script = os.path.join(test_command.ROOT, "scripts", "test.py")
    ok = subprocess.run([sys.executable, script, "-q", "-p", "no:cacheprovider", "tests/test_test_command.py",
                         "-k", "cpu_index_first"], env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "1 passed" in ok.stdout, ok.stdout + ok.stderr
    assert "preparing" not in ok.stdout, "a stamped environment is used as it is"
    missing = subprocess.run([sys.executable, script, "-q", "tests/no_such_test_file.py"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 4, missing.stdout + missing.stderr
