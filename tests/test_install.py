"""The one-command installer's parts that need no network and no ComfyUI: sources, archives (crafted ones as an
attacker would make them), folders, checks, the record of where it installed.

The whole command (a ComfyUI, a Python environment, PyTorch, the demo LoRA) runs in
``tests/comfy/test_install_command.py``."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import io
import json
import ntpath
import os
import random
import shlex
import shutil
import struct
import sys
import tarfile
import threading
import warnings
import zipfile
import zlib

import install
import install_archive
import pytest

SHA = "0123456789abcdef0123456789abcdef01234567"
COMFY_FILES = {"main.py": "print('comfy')\n", "comfy/__init__.py": "", "comfyui_version.py": '__version__ = "0.33.0"\n',
               "requirements.txt": "numpy\n", ".ci/update.py": "# a dot-folder ComfyUI ships\n"}


@pytest.fixture(autouse=True)
def own_config(tmp_path, monkeypatch):
    """The record of installations goes to this test's folder, never to the user's configuration."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("APPDATA", str(tmp_path / "config"))
    return tmp_path / "config"


def _tar(path, files: dict[str, str | bytes], top: str = "ComfyUI", comment: str = "",
         links: dict[str, str] | None = None, mode: str = "w:gz"):
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT, pax_headers={"comment": comment} if comment else {}) as tf:
        for name, text in files.items():
            data = text.encode() if isinstance(text, str) else text
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return str(path)


def _zip(path, files: dict[str, str | bytes], top: str, compression: int = zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression) as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": the tests craft such archives on purpose
        for name, text in files.items():
            zf.writestr(f"{top}/{name}" if top else name, text)
    return str(path)


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _refused(source: str, tmp_path, match: str) -> None:
    """``source`` (a file the user gives) is refused by the check and by the unpack, naming it, keeping it, and
    leaving nothing of ComfyUI behind."""
    before = open(source, "rb").read()
    with pytest.raises(install.InstallError, match=match):
        install.check_comfyui_archive(source)
    dest = str(tmp_path / "inst" / "ComfyUI")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with pytest.raises(install.InstallError, match=match) as info:
        install.fetch_comfyui(source, dest, str(tmp_path / "dl"))
    assert f"--comfyui-source {source} is refused" in str(info.value) and "left as it is" in str(info.value)
    assert open(source, "rb").read() == before, "the user's file is kept as it was"
    assert os.listdir(os.path.dirname(dest)) == [], "nothing of ComfyUI (nor ComfyUI.partial) is left"


def test_an_archive_of_comfyui_unpacks_without_its_top_folder_and_names_its_commit(tmp_path):
    archive = _tar(tmp_path / "comfy.tar.gz", COMFY_FILES, comment=SHA)
    dest = str(tmp_path / "inst" / "ComfyUI")
    os.makedirs(os.path.dirname(dest))
    text = install.describe(*install.fetch_comfyui(archive, dest, str(tmp_path / "dl")))
    assert install.is_comfyui(dest) and os.path.isfile(os.path.join(dest, ".ci", "update.py"))
    assert "ComfyUI 0.33.0" in text and SHA[:8] in text and "tested with" in text, text
    assert not os.path.exists(dest + ".partial")


def test_a_github_zip_names_its_commit_in_its_top_folder(tmp_path):
    archive = _zip(tmp_path / "comfy.zip", COMFY_FILES, top=f"ComfyUI-{install.PINNED_COMMIT}")
    dest = str(tmp_path / "ComfyUI")
    text = install.describe(*install.fetch_comfyui(archive, dest, str(tmp_path / "dl")))
    assert install.is_comfyui(dest) and install.PINNED_COMMIT[:8] in text and "tested with" not in text, text


@pytest.mark.parametrize("evil", ["ComfyUI/../../escaped.txt", "ABSOLUTE", "../escaped.txt"])
def test_archive_members_that_climb_out_are_refused_before_anything_is_written(tmp_path, evil):
    absolute = str(tmp_path / "escaped-absolute.txt")
    evil = absolute if evil == "ABSOLUTE" else evil
    archive = _tar(tmp_path / "evil.tar.gz", {**COMFY_FILES, evil: "x"}, top="")
    zipped = _zip(tmp_path / "evil.zip", {**COMFY_FILES, evil: "x"}, top="")
    for source in (archive, zipped):
        dest = str(tmp_path / "a" / "b" / "ComfyUI")
        with pytest.raises(install.InstallError, match="refused: its member") as info:
            install.fetch_comfyui(source, dest, str(tmp_path / "dl"))
        assert source in str(info.value)
        assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")
    assert not os.path.exists(tmp_path / "escaped.txt") and not os.path.exists(tmp_path / "a" / "escaped.txt")
    assert not os.path.exists(absolute)


@pytest.mark.parametrize("evil", ["ComfyUI/C:/Users/Public/x.bat", "ComfyUI/comfy/x.py:stream",
                                  "ComfyUI\\..\\..\\escaped.txt", "ComfyUI/C:escaped.txt"])
def test_archive_members_windows_reads_outside_are_refused_on_every_os(tmp_path, evil):
    """Names that are harmless on Linux but leave the folder on Windows (a drive at any depth, ``C:name``, a stream,
    backslashes) refuse the archive wherever the installer runs."""
    files = {**{f"ComfyUI/{name}": text for name, text in COMFY_FILES.items()}, evil: "x"}
    for source in (_tar(tmp_path / "evil.tar.gz", files, top=""), _zip(tmp_path / "evil.zip", files, top="")):
        dest = str(tmp_path / "ComfyUI")
        with pytest.raises(install.InstallError, match="refused: its member"):
            install.fetch_comfyui(source, dest, str(tmp_path / "dl"))
        assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")


@pytest.mark.parametrize("rel", ["C:/Users/Public/x.bat", "a/../../x.bat", "D:x.bat", "/Windows/x.bat", ".", "a/.."])
def test_a_member_resolved_by_windows_rules_must_lie_inside_the_folder(rel):
    """The resolved path is checked, not a pattern: with Windows' rules (``ntpath``) ``join`` starts over at a
    drive or a root, and each of these would be written outside ``C:\\Users\\me\\ComfyUI`` (or be the folder)."""
    with pytest.raises(install_archive.ArchiveError, match="would be written outside"):
        install_archive.member_path("C:\\Users\\me\\ComfyUI", rel, ntpath)


def test_members_inside_the_folder_resolve_under_it_by_windows_and_posix_rules(tmp_path):
    assert install_archive.member_path("C:\\Users\\me\\ComfyUI", "comfy/sd.py", ntpath) == \
        "C:\\Users\\me\\ComfyUI\\comfy\\sd.py"
    assert install_archive.member_path("C:\\Users\\me\\ComfyUI", "a/../main.py", ntpath) == \
        "C:\\Users\\me\\ComfyUI\\main.py"
    assert install_archive.member_path(str(tmp_path), "comfy/sd.py") == \
        os.path.join(os.path.realpath(tmp_path), "comfy", "sd.py")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "dest" / "m")
    with pytest.raises(install_archive.ArchiveError, match="would be written outside"):
        install_archive.member_path(str(tmp_path / "dest"), "m/x.py")  # a link already in the folder is followed


def test_archive_links_are_refused(tmp_path):
    archive = _tar(tmp_path / "links.tar.gz", COMFY_FILES, links={"models": "/etc"})
    with pytest.raises(install.InstallError, match="links or special files"):
        install.fetch_comfyui(archive, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    assert not os.path.exists(tmp_path / "ComfyUI")


def test_sources_that_are_not_a_supported_comfyui_are_refused(tmp_path):
    not_comfy = _tar(tmp_path / "other.tar.gz", {"README.md": "hello\n", "src/x.py": ""})
    with pytest.raises(install.InstallError, match="holds no ComfyUI"):
        install.fetch_comfyui(not_comfy, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    old = _tar(tmp_path / "old.tar.gz", {**COMFY_FILES, "comfyui_version.py": '__version__ = "0.3.40"\n'})
    with pytest.raises(install.InstallError, match="needs v0.3.64 or newer"):
        install.fetch_comfyui(old, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    broken = tmp_path / "cut.tar.gz"
    broken.write_bytes(open(_tar(tmp_path / "whole.tar.gz", COMFY_FILES), "rb").read()[:100])
    with pytest.raises(install.InstallError, match="is refused: it is damaged or cut short"):
        install.fetch_comfyui(str(broken), str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    assert not os.path.exists(tmp_path / "ComfyUI")
    with pytest.raises(install.InstallError, match="no such folder or archive"):
        install.source_kind(str(tmp_path / "nowhere.tar.gz"))


def test_a_comfyui_folder_is_copied(tmp_path):
    source = tmp_path / "src"
    for name, text in COMFY_FILES.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    version, commit = install.fetch_comfyui(str(source), str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    assert install.is_comfyui(str(tmp_path / "ComfyUI")) and (version, commit) == ("0.33.0", "")
    (tmp_path / "empty").mkdir()
    with pytest.raises(install.InstallError, match="is not a ComfyUI folder"):
        install.fetch_comfyui(str(tmp_path / "empty"), str(tmp_path / "C2"), str(tmp_path / "dl"))


def test_source_kinds():
    assert install.source_kind("https://github.com/comfyanonymous/ComfyUI") == "git"
    assert install.source_kind("git@github.com:comfyanonymous/ComfyUI.git") == "git"
    assert install.source_kind("https://example.org/ComfyUI.tar.gz") == "url"
    assert install.source_kind("https://example.org/ComfyUI.ZIP") == "url"


def test_without_git_the_official_source_is_the_pinned_commits_archive(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(install.shutil, "which", lambda name: None)
    monkeypatch.setattr(install, "download", lambda url, downloads: fetched.append(url) or _tar(
        tmp_path / "pinned.tar.gz", COMFY_FILES, top=f"ComfyUI-{install.PINNED_COMMIT}"))
    version, commit = install.fetch_comfyui(None, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    assert fetched == [f"{install.OFFICIAL_REPOSITORY}/archive/{install.PINNED_COMMIT}.tar.gz"]
    assert commit == install.PINNED_COMMIT
    with pytest.raises(install.InstallError, match="install git"):
        install.fetch_comfyui("https://example.org/other/ComfyUI.git", str(tmp_path / "C2"), str(tmp_path / "dl"))


def test_an_unreachable_download_names_the_url_and_the_remedy(tmp_path):
    url = "http://127.0.0.1:9/ComfyUI.tar.gz"  # the discard port: nothing listens, the connection is refused
    with pytest.raises(install.InstallError, match="could not download") as info:
        install.download(url, str(tmp_path))
    assert url in str(info.value) and "--comfyui-source FILE" in str(info.value)
    assert os.listdir(tmp_path) == []


class _Served(http.server.BaseHTTPRequestHandler):
    """Answers every GET with ``body`` and a Content-Length of ``length`` (a lie when it differs)."""

    body, length, gets = b"", 0, 0

    def do_GET(self):  # noqa: N802 (the standard library's name)
        type(self).gets += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(self.length))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serving(body: bytes, length: int | None = None):
    handler = type("Handler", (_Served,), {"body": body, "length": len(body) if length is None else length})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/ComfyUI.tar.gz", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_download_that_is_not_a_comfyui_archive_is_deleted_and_said(tmp_path):
    """A proxy's HTML page served with status 200, a cut download and an archive of something else are each
    refused and deleted: nothing stays in the downloads folder for a later run to reuse."""
    downloads = str(tmp_path / "dl")
    whole = open(_tar(tmp_path / "comfy.tar.gz", COMFY_FILES), "rb").read()
    other = open(_tar(tmp_path / "other.tar.gz", {"README.md": "hello\n"}), "rb").read()
    cases = [(b"<!DOCTYPE html><html><body>Sign in to continue</body></html>", None, "an HTML page"),
             (whole[: len(whole) // 2], len(whole), "stopped after"),
             (whole[: len(whole) // 2], None, "damaged or cut short"),
             (b"plain text, no archive", None, "not a .tar.gz, .tar or .zip archive"),
             (other, None, "holds no ComfyUI")]
    for body, length, said in cases:
        with _serving(body, length) as (url, _):
            with pytest.raises(install.InstallError, match=said):
                install.download(url, downloads)
        assert os.listdir(downloads) == [], (said, os.listdir(downloads))


def test_a_good_download_is_kept_and_a_bad_kept_one_is_downloaded_again(tmp_path, capsys):
    downloads = str(tmp_path / "dl")
    whole = open(_tar(tmp_path / "comfy.tar.gz", COMFY_FILES), "rb").read()
    with _serving(whole) as (url, served):
        path = install.download(url, downloads)
        assert open(path, "rb").read() == whole and install.download(url, downloads) == path
        assert served.gets == 1  # the second run reused the file
        with open(path, "wb") as f:
            f.write(b"<html>an earlier release kept this</html>")
        assert install.download(url, downloads) == path and open(path, "rb").read() == whole
        assert served.gets == 2
    assert "deleted, downloading it again" in capsys.readouterr().out


def test_a_download_is_capped_in_bytes(tmp_path):
    whole = open(_tar(tmp_path / "comfy.tar.gz", COMFY_FILES), "rb").read()
    downloads = tmp_path / "dl"
    with _serving(whole) as (url, _):
        with pytest.raises(install.InstallError, match=f"sends more than {len(whole) - 1:,} bytes"):
            install.download(url, str(downloads), max_bytes=len(whole) - 1)
        assert os.listdir(downloads) == []
        assert open(install.download(url, str(downloads), max_bytes=len(whole)), "rb").read() == whole


@pytest.mark.parametrize("device", ["cuda", "rocm", "xpu", "mps", "cpu"])
def test_the_start_command_suits_the_device_and_the_os(device):
    """ComfyUI finds CUDA, ROCm, XPU and MPS itself: only the CPU is named (the command once said --cpu on every
    machine without CUDA, Apple silicon and Intel GPUs included). Paths are quoted for the OS's shell."""
    cpu = " --cpu" if device == "cpu" else ""
    posix = install.start_command("/home/me/my comfy/venv/bin/python", "/home/me/my comfy/ComfyUI", device,
                                  windows=False)
    assert posix == f"'/home/me/my comfy/venv/bin/python' '/home/me/my comfy/ComfyUI/main.py'{cpu}"
    windows = install.start_command("C:\\My Comfy\\venv\\Scripts\\python.exe", "C:\\My Comfy\\ComfyUI", device,
                                    windows=True)
    assert windows == f'"C:\\My Comfy\\venv\\Scripts\\python.exe" "C:\\My Comfy\\ComfyUI\\main.py"{cpu}'


def test_the_device_is_the_one_this_environments_torch_runs_on():
    import sys

    import torch

    expected = "rocm" if torch.cuda.is_available() and torch.version.hip else \
        "cuda" if torch.cuda.is_available() else "cpu"
    if expected == "cpu" and (getattr(torch, "xpu", None) is not None and torch.xpu.is_available()):
        expected = "xpu"
    elif expected == "cpu" and torch.backends.mps.is_available():
        expected = "mps"
    assert install.torch_device(sys.executable) == expected


def test_without_pytorchs_index_torch_comes_from_the_configured_index_and_says_which(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(install, "reachable", lambda host: False)
    monkeypatch.setattr(install, "pip", lambda python, arguments, what, remedy: calls.append(arguments))
    monkeypatch.setattr(install, "installed_torch", lambda python: {"torch": "2.13.0+cpu", "torchvision": "0.28.0",
                                                                    "torchaudio": "2.13.0", "cuda": False})
    install.install_torch("python", "amd", None, None)
    assert calls == [install.TORCH_PACKAGES], "no --index-url of download.pytorch.org"
    out = capsys.readouterr().out
    assert "download.pytorch.org cannot be reached" in out and "took torch 2.13.0+cpu" in out
    assert "a CPU-only build" in out and "amd build" in out
    calls.clear()
    monkeypatch.setattr(install, "reachable", lambda host: True)
    install.install_torch("python", "amd", None, None)
    assert calls == [[*install.TORCH_PACKAGES, *install.TORCH_INDEXES["amd"]]]


def test_folders_the_installer_must_not_write_into(tmp_path):
    (tmp_path / "taken" / "ComfyUI").mkdir(parents=True)
    (tmp_path / "taken" / "ComfyUI" / "notes.txt").write_text("mine")
    with pytest.raises(install.InstallError, match="is not a ComfyUI"):
        install.check_target(str(tmp_path / "taken"))
    comfy = tmp_path / "mycomfy"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "main.py").write_text("")
    with pytest.raises(install.InstallError, match="is a ComfyUI folder") as info:
        install.check_target(str(comfy))
    assert "custom_nodes" in str(info.value)
    (tmp_path / "afile").write_text("")
    with pytest.raises(install.InstallError, match="not a folder"):
        install.check_target(str(tmp_path / "afile"))
    install.check_target(str(tmp_path / "new" / "place"))  # a folder yet to be made is fine


def test_too_little_disk_space_is_said_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(install.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100e9, 99e9, 1e9))
    with pytest.raises(install.InstallError, match="about 3.3 GB is needed .* 1.0 GB free"):
        install.check_disk(str(tmp_path / "not" / "yet"), 3.3)
    install.check_disk(str(tmp_path), 0.5)
    target = tmp_path / "inst"
    assert install.main([str(target), "--torch", "cpu", "--no-demo"]) == 2
    assert not target.exists()


def test_torch_wheels_are_installed_from_the_files_given(tmp_path):
    names = ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "torchvision-0.28.0-cp311-cp311-any.whl",
             "torchaudio-2.11.0-cp311-cp311-any.whl"]
    for name in [*names, "numpy-2.0.0-cp311-cp311-any.whl"]:
        (tmp_path / name).write_bytes(b"")
    assert install.torch_wheel_files(str(tmp_path)) == [str(tmp_path / n) for n in names]
    os.remove(tmp_path / names[2])
    with pytest.raises(install.InstallError, match="no wheel file of torchaudio"):
        install.torch_wheel_files(str(tmp_path))


def test_the_torch_build_follows_the_machine(monkeypatch):
    monkeypatch.setattr(install.sys, "platform", "linux")
    monkeypatch.setattr(install.shutil, "which", lambda name: None)
    assert install.machine_torch() == "cpu"
    monkeypatch.setattr(install.shutil, "which", lambda name: "/usr/bin/" + name if name == "nvidia-smi" else None)
    monkeypatch.setattr(install, "_succeeds", lambda command: command[0] == "nvidia-smi")
    assert install.machine_torch() == "nvidia"
    monkeypatch.setattr(install, "_succeeds", lambda command: False)  # a driver tool but no GPU answers
    assert install.machine_torch() == "cpu"
    monkeypatch.setattr(install.sys, "platform", "darwin")
    assert install.machine_torch() == "mps"


def test_the_pack_is_linked_into_custom_nodes_once(tmp_path):
    comfy = tmp_path / "ComfyUI"
    place = install.link_pack(str(comfy))
    assert os.path.realpath(place) == os.path.realpath(install.PACK_DIR)
    assert install.link_pack(str(comfy)) == place
    os.unlink(place)
    os.makedirs(place)
    with pytest.raises(install.InstallError, match="another copy of this pack"):
        install.link_pack(str(comfy))


def test_the_cuda_build_follows_the_driver():
    assert install.cuda_build((13, 1)) == "cu130" and install.cuda_build(None) == "cu130"
    assert install.cuda_build((12, 9)) == "cu128" and install.cuda_build((12, 8)) == "cu128"
    assert install.cuda_build((12, 6)) == "cu126" and install.cuda_build((12, 2)) == "cu126"


def test_where_links_are_not_allowed_the_pack_is_copied_and_the_copy_renewed(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError("links not allowed")

    monkeypatch.setattr(install.os, "symlink", no_links)
    monkeypatch.setattr(install.shutil, "ignore_patterns", lambda *p: lambda d, names: [
        n for n in names if n not in ("scripts", "pyproject.toml") and d == install.PACK_DIR])
    place = install.link_pack(str(tmp_path / "ComfyUI"))
    assert not os.path.islink(place) and os.path.isfile(os.path.join(place, "scripts", "install.py"))
    (tmp_path / "ComfyUI" / "custom_nodes" / "comfyui-streaming-cache" / "stale.txt").write_text("old")
    assert install.link_pack(str(tmp_path / "ComfyUI")) == place, "a second run renews its own copy"
    assert not os.path.exists(os.path.join(place, "stale.txt"))


def _portable(root) -> str:
    """ComfyUI's Windows portable build as it unpacks: its Python beside ComfyUI, the run_*.bat files."""
    for name, text in {"python_embeded/python.exe": "", "run_nvidia_gpu.bat": "", "update/update_comfyui.bat": "",
                       **{f"ComfyUI/{k}": v for k, v in COMFY_FILES.items()}}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_a_comfyui_the_user_has_is_recognised_with_the_python_that_runs_it(tmp_path):
    portable = _portable(tmp_path / "ComfyUI_windows_portable")
    python = os.path.join(portable, "python_embeded", "python.exe")
    for given in (portable, os.path.join(portable, "ComfyUI")):
        assert install.existing_comfyui(given) == \
            install.ExistingComfyUI(os.path.join(portable, "ComfyUI"), python, portable), given
    manual = tmp_path / "manual" / "ComfyUI"
    for name, text in COMFY_FILES.items():
        (manual / name).parent.mkdir(parents=True, exist_ok=True)
        (manual / name).write_text(text)
    assert install.existing_comfyui(str(manual)) is None, "a ComfyUI whose Python cannot be told"
    (manual / ".venv" / "Scripts").mkdir(parents=True)
    (manual / ".venv" / "Scripts" / "python.exe").write_text("")
    assert install.existing_comfyui(str(manual), windows=True) == \
        install.ExistingComfyUI(str(manual), os.path.join(str(manual), ".venv", "Scripts", "python.exe"))
    assert install.existing_comfyui(str(manual), windows=False) is None, "bin/python on Linux and macOS"
    own = tmp_path / "own"  # what this installer makes: DIR/ComfyUI and DIR/venv, installed (again) as usual
    shutil.copytree(manual, own / "ComfyUI")
    (own / "venv" / "bin").mkdir(parents=True)
    (own / "venv" / "bin" / "python").write_text("")
    assert install.existing_comfyui(str(own), windows=False) is None
    assert install.existing_comfyui(str(tmp_path / "nothing")) is None


def test_the_pack_is_added_to_the_portable_build_with_its_own_python(tmp_path, monkeypatch, capsys):
    portable = _portable(tmp_path / "ComfyUI_windows_portable")
    python = os.path.join(portable, "python_embeded", "python.exe")
    pips, demos = [], []
    monkeypatch.setattr(install, "pip", lambda py, args, what, remedy, isolated=False: pips.append((py, args, isolated)))
    monkeypatch.setattr(install, "torch_version", lambda py: "2.13.0+cu130")
    monkeypatch.setattr(install, "torch_device", lambda py: "cuda")
    monkeypatch.setattr(install, "run_demo", lambda py, comfy, demo: demos.append((py, comfy, demo)))
    monkeypatch.setattr(install, "make_venv", lambda venv: pytest.fail("no environment is made"))
    monkeypatch.setattr(install, "fetch_comfyui", lambda *a: pytest.fail("the user's ComfyUI is kept"))
    before = sorted(os.listdir(portable))

    assert install.install(portable, "https://example.com/ComfyUI.zip", "auto", "/wheels", demo=True) == 0
    comfy = os.path.join(portable, "ComfyUI")
    place = os.path.join(comfy, "custom_nodes", install.PACK_NAME)
    assert os.path.realpath(place) == os.path.realpath(install.PACK_DIR)
    assert pips == [(python, ["-r", os.path.join(install.PACK_DIR, "requirements.txt")], True)]
    assert demos == [(python, comfy, os.path.join(portable, "streaming-cache-demo"))]
    assert sorted(os.listdir(portable)) == before, "nothing is added beside ComfyUI but the demo's folder"
    out = capsys.readouterr().out
    assert "ComfyUI's portable build in" in out and "note: --torch-wheels /wheels is not used" in out
    assert "note: --comfyui-source https://example.com/ComfyUI.zip is not used: that ComfyUI is kept" in out
    assert "ready (torch 2.13.0+cu130, runs on an NVIDIA GPU)" in out
    assert f"{install.shlex.quote(python)} -s {install.shlex.quote(os.path.join(comfy, 'main.py'))} " \
           "--windows-standalone-build" in out, out
    assert install.recorded_install() == install.Recorded(comfy, python, True), "headless.py finds it, run with -s"
    assert out.strip().splitlines()[-2] == "    " + install.headless_command(
        python, comfy, os.path.join(portable, "streaming-cache-demo"), portable=True)


def test_the_torch_a_python_imports_is_asked_of_torch_alone(tmp_path):
    import sys

    import torch

    assert install.torch_version(sys.executable) == torch.__version__
    assert install.torch_version(str(tmp_path / "no-python")) is None
    without_torch = tmp_path / "python-without-torch"  # runs, and its import of torch fails
    without_torch.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'raise ImportError(\"no torch\")'\n")
    without_torch.chmod(0o755)
    assert install.torch_version(str(without_torch)) is None


def test_the_portable_builds_start_command_and_a_windows_environments_python():
    assert install.start_command("C:\\ComfyUI_windows_portable\\python_embeded\\python.exe",
                                 "C:\\ComfyUI_windows_portable\\ComfyUI", "cpu", windows=True, portable=True) == \
        ("C:\\ComfyUI_windows_portable\\python_embeded\\python.exe -s "
         "C:\\ComfyUI_windows_portable\\ComfyUI\\main.py --windows-standalone-build --cpu")
    assert install.venv_python("C:\\My Comfy\\venv", windows=True) == "C:\\My Comfy\\venv\\Scripts\\python.exe"
    assert install.venv_python("/home/me/venv", windows=False) == "/home/me/venv/bin/python"


def test_a_portable_build_too_old_for_the_pack_is_refused_with_how_to_update_it(tmp_path, monkeypatch):
    portable = _portable(tmp_path / "ComfyUI_windows_portable")
    (tmp_path / "ComfyUI_windows_portable" / "ComfyUI" / "comfyui_version.py").write_text('__version__ = "0.3.40"\n')
    monkeypatch.setattr(install, "pip", lambda *a, **k: pytest.fail("nothing is installed"))
    with pytest.raises(install.InstallError, match=r"older than v0.3.64.*update_comfyui.bat"):
        install.install(portable, None, "auto", None, demo=False)
    assert not os.path.lexists(os.path.join(portable, "ComfyUI", "custom_nodes"))


# Archives as an attacker makes them: each is refused before anything of it is kept, without a traceback.


def _raw_tar(files: dict[str, bytes], top: str = "ComfyUI", end: bool = True) -> bytes:
    """An uncompressed tar of ``files`` (ustar headers: one 512-byte block each, then the data in blocks), with
    tar's end-of-archive blocks or (``end`` False) without them."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        members_end = tf.offset
    return out.getvalue() if end else out.getvalue()[:members_end]


COMFY_BYTES = {name: text.encode() for name, text in COMFY_FILES.items()}


@pytest.mark.parametrize("where", ["checksum", "length", "data"])
def test_a_tar_gz_is_read_through_its_gzip_checksum(tmp_path, where):
    """``tarfile`` stops at tar's end-of-archive blocks and never reads gzip's checksum and length: one flipped byte
    there, or in data stored as is (random bytes do not compress), passed and installed a different file."""
    payload = random.Random(0).randbytes(20000)
    raw = gzip.compress(_raw_tar({**COMFY_BYTES, "comfy/model.bin": payload}), mtime=0)
    at = {"checksum": len(raw) - 8, "length": len(raw) - 3, "data": len(raw) // 2}[where]
    damaged = bytearray(raw)
    damaged[at] ^= 0x55
    source = _write(tmp_path / "flipped.tar.gz", bytes(damaged))
    with tarfile.open(source) as tf:  # the library alone takes it
        assert "ComfyUI/main.py" in tf.getnames()
        if where == "data":
            assert tf.extractfile("ComfyUI/comfy/model.bin").read() != payload
    _refused(source, tmp_path, r"damaged or cut short \((CRC check failed|Incorrect length)")


@pytest.mark.parametrize("compressed", [True, False])
def test_a_damaged_tar_header_in_the_middle_refuses_the_archive(tmp_path, compressed):
    """``tarfile`` takes a damaged header after the first one for the end of the archive: 3 of 5 members unpacked
    without a word. Here the archive is refused, naming where."""
    raw = bytearray(_raw_tar({"main.py": b"x", "comfy/__init__.py": b"#", "comfyui_version.py": b"#",
                              "requirements.txt": b"numpy\n", "nodes.py": b"import comfy\n"}))
    raw[3 * 1024 + 148:3 * 1024 + 156] = b"0000000\0"  # the fourth member's header checksum (a header, a block)
    data = gzip.compress(bytes(raw), mtime=0) if compressed else bytes(raw)
    source = _write(tmp_path / ("damaged.tar.gz" if compressed else "damaged.tar"), data)
    with tarfile.open(source) as tf:
        assert len(tf.getmembers()) == 3, "the library lists three members and says nothing"
    _refused(source, tmp_path, "the member header at byte 3,072 of its tar stream is damaged")


def test_a_tar_without_its_end_or_with_data_after_it_is_refused(tmp_path):
    whole = _raw_tar(COMFY_BYTES)
    _refused(_write(tmp_path / "cut.tar", _raw_tar(COMFY_BYTES, end=False)), tmp_path, "cut short")
    _refused(_write(tmp_path / "more.tar", whole + b"hidden" + b"\0" * 506), tmp_path, "data follows its end")


def _sparse_member(kind: str, size: int) -> bytes:
    """The tar blocks of a sparse member ``ComfyUI/big.bin`` of ``size`` bytes holding no data: an old GNU sparse
    header, or a pax 1.0 one (its map in the member's data)."""
    if kind == "gnu":
        info = tarfile.TarInfo("ComfyUI/big.bin")
        info.type = tarfile.GNUTYPE_SPARSE
        block = bytearray(info.tobuf(tarfile.GNU_FORMAT))
        block[483:495] = b"%011o\0" % size  # the file's real size
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % sum(block)
        return bytes(block)
    info = tarfile.TarInfo("ComfyUI/big.bin")
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "ComfyUI/big.bin",
                        "GNU.sparse.realsize": str(size)}
    info.size = 512
    return info.tobuf(tarfile.PAX_FORMAT) + b"1\n0\n0\n".ljust(512, b"\0")


@pytest.mark.parametrize("kind", ["gnu", "pax"])
def test_a_sparse_member_is_refused(tmp_path, kind):
    """A .tar.gz of a few hundred bytes with a sparse 1 GiB member wrote until the disk was full."""
    raw = _raw_tar(COMFY_BYTES, end=False) + _sparse_member(kind, 1 << 30) + bytes(tarfile.RECORDSIZE)
    source = _write(tmp_path / "sparse.tar.gz", gzip.compress(raw, mtime=0))
    assert os.path.getsize(source) < 1000
    with tarfile.open(source) as tf:
        assert tf.getmember("ComfyUI/big.bin").size == 1 << 30, "the library would write 1 GiB"
    _refused(source, tmp_path, "is a sparse file")


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_an_unpack_is_capped_in_bytes(tmp_path, kind):
    """A megabyte of zeros compresses to about a kilobyte; the cap counts what a member unpacks to."""
    files = {**COMFY_BYTES, "comfy/zeros.bin": bytes(1_000_000)}
    source = _tar(tmp_path / "big.tar.gz", files) if kind == "tar.gz" else \
        _zip(tmp_path / "big.zip", files, "ComfyUI", zipfile.ZIP_DEFLATED)
    assert os.path.getsize(source) < 5000
    dest = str(tmp_path / "ComfyUI")
    with pytest.raises(install.InstallError, match="unpacks to more than 500,000 bytes"):
        install.check_comfyui_archive(source, max_bytes=500_000)
    with pytest.raises(install.InstallError, match="unpacks to more than 500,000 bytes"):
        install.extract_archive(source, dest, max_bytes=500_000)
    assert not os.path.exists(dest)
    assert install.extract_archive(source, dest, max_bytes=1_100_000) == ""
    assert os.path.getsize(os.path.join(dest, "comfy", "zeros.bin")) == 1_000_000
    assert (install_archive.MAX_BYTES, install_archive.MAX_MEMBERS) == (2_000_000_000, 50_000)


def test_a_tar_gz_that_decompresses_past_its_members_is_refused_early(tmp_path):
    """Gigabytes of zeros after the end-of-archive blocks are never written, and not read to their end either."""
    raw = _raw_tar(COMFY_BYTES) + bytes(20_000_000)
    source = _write(tmp_path / "padded.tar.gz", gzip.compress(raw, compresslevel=9, mtime=0))
    with pytest.raises(install.InstallError, match="its tar stream runs past"):
        install.check_comfyui_archive(source, max_bytes=1_000_000, max_members=100)
    install.check_comfyui_archive(source)  # zeros up to the cap are tar's padding


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_an_unpack_is_capped_in_members(tmp_path, kind):
    files = {**COMFY_BYTES, **{f"comfy/m{i}.py": b"" for i in range(100 - len(COMFY_BYTES))}}
    make = (lambda path, f: _tar(path, f)) if kind == "tar.gz" else (lambda path, f: _zip(path, f, "ComfyUI"))
    install.check_comfyui_archive(make(tmp_path / f"ok.{kind}", files), max_members=100)
    source = make(tmp_path / f"many.{kind}", {**files, "comfy/one_more.py": b""})
    with pytest.raises(install.InstallError, match="more than 100 members"):
        install.check_comfyui_archive(source, max_members=100)
    with pytest.raises(install.InstallError, match="more than 100 members"):
        install.extract_archive(source, str(tmp_path / "ComfyUI"), max_members=100)
    assert not os.path.exists(tmp_path / "ComfyUI")


def _patch_zip(path: str, name: str, *, flag: int = 0, method: int | None = None, data: bytes | None = None) -> str:
    """Change the member ``name`` of the zip at ``path`` in its local header and in the central directory: set
    ``flag`` bits, its compression ``method``, or overwrite the start of its compressed data with ``data``."""
    blob = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(name).header_offset
    central = blob.index(b"PK\x01\x02")
    while blob[central + 46:central + 46 + len(name)] != name.encode():
        central = blob.index(b"PK\x01\x02", central + 4)
    for header, at in ((local, 6), (central, 8)):
        struct.pack_into("<H", blob, header + at, struct.unpack_from("<H", blob, header + at)[0] | flag)
        if method is not None:
            struct.pack_into("<H", blob, header + at + 2, method)
    if data is not None:
        start = local + 30 + sum(struct.unpack_from("<HH", blob, local + 26))
        blob[start:start + len(data)] = data
    return _write(path, bytes(blob))


def _bad_zip(path, case: str) -> str:
    source = _zip(path, {**COMFY_BYTES, "comfy/sd.py": b"import torch\n" * 200}, "ComfyUI", zipfile.ZIP_DEFLATED)
    if case == "deflate":
        return _patch_zip(source, "ComfyUI/comfy/sd.py", data=b"\xff")  # a block of type 3, which does not exist
    if case == "method 9":
        return _patch_zip(source, "ComfyUI/comfy/sd.py", method=9)  # deflate64, which zipfile does not read
    return _patch_zip(source, "ComfyUI/comfy/sd.py", flag=0x1)  # encrypted


ZIP_CASES = {"deflate": (zlib.error, "is damaged"), "method 9": (NotImplementedError, "compressed with method 9"),
             "encrypted": (RuntimeError, "is encrypted")}


@pytest.mark.parametrize("case", sorted(ZIP_CASES))
def test_a_zip_the_zip_library_cannot_read_is_refused_and_the_users_file_named(tmp_path, case):
    library_error, said = ZIP_CASES[case]
    source = _bad_zip(tmp_path / "bad.zip", case)
    with pytest.raises(library_error), zipfile.ZipFile(source) as zf:  # what crashed the installer
        zf.testzip()
    _refused(source, tmp_path, said)


@pytest.mark.parametrize("case", sorted(ZIP_CASES))
def test_a_bad_zip_in_the_downloads_folder_is_deleted_and_fetched_again(tmp_path, case, capsys):
    """A kept download that the archive library cannot read is deleted and downloaded again, every run no longer
    crashing on it; a bad one freshly downloaded is deleted and said."""
    downloads = tmp_path / "dl"
    downloads.mkdir()
    good = open(_zip(tmp_path / "good.zip", COMFY_BYTES, "ComfyUI", zipfile.ZIP_DEFLATED), "rb").read()
    bad = open(_bad_zip(tmp_path / "bad.zip", case), "rb").read()
    with _serving(good) as (url, served):
        kept = _write(downloads / url.rsplit("/", 1)[-1], bad)
        assert install.download(url, str(downloads)) == kept and open(kept, "rb").read() == good
        assert served.gets == 1
    assert "deleted, downloading it again" in capsys.readouterr().out
    os.remove(kept)
    with _serving(bad) as (url, _):
        with pytest.raises(install.InstallError, match=ZIP_CASES[case][1]) as info:
            install.download(url, str(downloads))
    assert "It was deleted" in str(info.value) and os.listdir(downloads) == []


def test_a_download_refused_when_unpacked_is_deleted_for_the_next_run(tmp_path, monkeypatch):
    """Should a download pass its check and its unpack fail (the file changed on disk in between), the download is
    deleted all the same (and named), and no ComfyUI.partial stays."""
    downloads = tmp_path / "dl"
    downloads.mkdir()
    archive = _write(downloads / "ComfyUI.tar.gz", open(_tar(tmp_path / "c.tar.gz", COMFY_FILES), "rb").read())

    def changed(path, dest, max_bytes, max_members):
        os.makedirs(os.path.join(dest, "comfy"))
        raise install_archive.ArchiveError("it is damaged or cut short")

    monkeypatch.setattr(install, "download", lambda url, folder: archive)
    monkeypatch.setattr(install_archive, "extract", changed)
    dest = str(tmp_path / "inst" / "ComfyUI")
    os.makedirs(os.path.dirname(dest))
    with pytest.raises(install.InstallError, match="downloaded from https://example.org/C.tar.gz is refused.*"
                                                   "It was deleted"):
        install.fetch_comfyui("https://example.org/C.tar.gz", dest, str(downloads))
    assert os.listdir(downloads) == [] and os.listdir(os.path.dirname(dest)) == []


def test_the_format_is_read_from_the_content_not_the_name(tmp_path):
    """The check and the unpack open an archive with one opener, chosen by its first bytes: a zip named .tar.gz
    (and the other way round) is unpacked as what it is."""
    zipped = _zip(tmp_path / "zip-named.tar.gz", COMFY_FILES, f"ComfyUI-{install.PINNED_COMMIT}")
    tarred = _tar(tmp_path / "tar-named.zip", COMFY_FILES, comment=SHA)
    for source, commit in ((zipped, install.PINNED_COMMIT), (tarred, SHA)):
        install.check_comfyui_archive(source)
        dest = str(tmp_path / f"from-{os.path.basename(source)}" / "ComfyUI")
        os.makedirs(os.path.dirname(dest))
        assert install.fetch_comfyui(source, dest, str(tmp_path / "dl")) == ("0.33.0", commit)
        assert open(os.path.join(dest, "main.py")).read() == COMFY_FILES["main.py"]
    plain = _tar(tmp_path / "plain.tar.gz", COMFY_FILES, mode="w")  # an uncompressed tar, named .tar.gz
    assert install.extract_archive(plain, str(tmp_path / "plain")) == ""


def test_the_check_refuses_what_the_unpack_refuses(tmp_path):
    """The check runs the member checks and needs main.py to be a file: a kept download that passed the check and
    failed every unpack was never fetched again."""
    climbing = _tar(tmp_path / "climbing.tar.gz", {**COMFY_FILES, "../escaped.txt": "x"}, top="")
    with pytest.raises(install.InstallError, match="its member '../escaped.txt' would be written outside"):
        install.check_comfyui_archive(climbing)
    folder = _tar(tmp_path / "folder.tar.gz", {"main.py/x.py": "", "comfy/__init__.py": ""})
    with pytest.raises(install.InstallError, match="no main.py file"):
        install.check_comfyui_archive(folder)
    downloads = tmp_path / "dl"
    downloads.mkdir()
    good = open(_tar(tmp_path / "good.tar.gz", COMFY_FILES), "rb").read()
    with _serving(good) as (url, served):
        for bad in (climbing, folder):
            kept = _write(downloads / "ComfyUI.tar.gz", open(bad, "rb").read())
            assert install.download(url, str(downloads)) == kept and open(kept, "rb").read() == good
        assert served.gets == 2


WINDOWS_NAMES = ["ComfyUI/main.py.", "ComfyUI/main.py ", "ComfyUI/comfy ./x.py", "ComfyUI/CON", "ComfyUI/aux.txt",
                 "ComfyUI/comfy/LPT1.py", "ComfyUI/comfy/Nul.tar.gz", "ComfyUI/comfy/com\u00b9", "ComfyUI/comfy/a?b.py",
                 'ComfyUI/comfy/"x".py', "ComfyUI/comfy/tab\t.py"]


@pytest.mark.parametrize("evil", WINDOWS_NAMES)
def test_names_windows_writes_elsewhere_or_not_at_all_are_refused_on_every_os(tmp_path, evil):
    """``main.py.`` is written as ``main.py`` on Windows (overwriting it), ``CON`` and ``aux.txt`` open devices."""
    files = {**{f"ComfyUI/{name}": text for name, text in COMFY_FILES.items()}, evil: "x"}
    for source in (_tar(tmp_path / "evil.tar.gz", files, top=""), _zip(tmp_path / "evil.zip", files, top="")):
        _refused(source, tmp_path, "has a name Windows cannot write as named")


def test_a_dot_slash_absolute_name_is_refused_by_the_check(tmp_path):
    """``.//<absolute path>`` passed the member check and was refused only partway through the unpack."""
    evil = "./" + str(tmp_path / "escaped.txt")  # ".//tmp/...": "./" then an absolute path
    files = {**{f"ComfyUI/{name}": text for name, text in COMFY_FILES.items()}, evil: "x"}
    for source in (_tar(tmp_path / "evil.tar.gz", files, top=""), _zip(tmp_path / "evil.zip", files, top="")):
        _refused(source, tmp_path, "would be written outside")
    assert not os.path.exists(tmp_path / "escaped.txt")


@pytest.mark.parametrize("names", [("comfy/sd.py", "comfy/sd.py"), ("comfy/SD.py", "comfy/sd.py"),
                                   ("comfy/x", "comfy/x/y.py"), ("comfy/x\\y.py", "comfy/x/y.py")])
def test_members_that_name_one_file_twice_are_refused(tmp_path, names):
    """With duplicate names the last one won; names that differ in case only are one file on Windows and macOS,
    and a file cannot be a folder too."""
    first, second = names
    entries = [(f"ComfyUI/{name}", text) for name, text in COMFY_FILES.items()]
    entries += [(f"ComfyUI/{first}", "good"), (f"ComfyUI/{second}", "evil")]
    zipped = tmp_path / "twice.zip"
    with zipfile.ZipFile(zipped, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, text in entries:
            zf.writestr(name, text)
    tarred = tmp_path / "twice.tar.gz"
    with tarfile.open(tarred, "w:gz") as tf:
        for name, text in entries:
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tf.addfile(info, io.BytesIO(text.encode()))
    for source in (str(zipped), str(tarred)):
        _refused(source, tmp_path, "name the same file|is a file, and other members put files in a folder")


def test_torch_wheels_are_taken_as_binaries_only(tmp_path, monkeypatch):
    """An sdist in the wheels folder would be built, running its setup.py: pip is told to take binaries only."""
    names = ["torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", "torchvision-0.28.0-cp311-cp311-linux_x86_64.whl",
             "torchaudio-2.13.0-cp311-cp311-linux_x86_64.whl", "torch-2.13.0.tar.gz"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    calls = []
    monkeypatch.setattr(install, "pip", lambda python, arguments, what, remedy: calls.append(arguments))
    found = iter([None, {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0", "cuda": False}])
    monkeypatch.setattr(install, "installed_torch", lambda python: next(found))
    install.install_torch("python", "wheels", str(tmp_path), None)
    wheels = [str(tmp_path / name) for name in names[:3]]
    assert calls == [["--only-binary", ":all:", "--find-links", str(tmp_path), *wheels],
                     ["--force-reinstall", "--no-deps", "--only-binary", ":all:", "--find-links", str(tmp_path),
                      *wheels]]


# Where the installer may install, and the record of where it did


def test_the_install_folder_may_not_be_the_clone_or_lie_inside_it(tmp_path):
    """A clone made in ``~`` is ``~/comfyui-streaming-cache``, once the default folder: the installer filled the
    checkout with ComfyUI, a venv and the demo."""
    assert os.path.basename(install.DEFAULT_DIR) != install.PACK_NAME
    link = tmp_path / "clone-link"
    os.symlink(install.PACK_DIR, link)
    for target in (install.PACK_DIR, os.path.join(install.PACK_DIR, "inst"), str(link), str(link / "scripts" / "x")):
        with pytest.raises(install.InstallError, match="pack's clone") as info:
            install.check_target(target)
        assert "Choose a folder outside it" in str(info.value)
    before = sorted(os.listdir(install.PACK_DIR))
    assert install.main([os.path.join(install.PACK_DIR, "inst"), "--no-demo"]) == 2
    assert install.main([install.PACK_DIR, "--no-demo"]) == 2
    assert sorted(os.listdir(install.PACK_DIR)) == before
    install.check_target(str(tmp_path / f"{install.PACK_NAME}-install"))  # beside the clone is fine


def test_the_record_lives_in_the_users_configuration_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    env = {"XDG_CONFIG_HOME": "/xdg/config", "APPDATA": "C:\\Users\\me\\AppData\\Roaming"}
    assert install.record_path(env, windows=False) == "/xdg/config/comfyui-streaming-cache/installs.json"
    assert install.record_path({"XDG_CONFIG_HOME": "relative"}, windows=False) == \
        str(tmp_path / "home" / ".config" / "comfyui-streaming-cache" / "installs.json"), "a relative one is ignored"
    assert install.record_path(env, windows=True) == \
        "C:\\Users\\me\\AppData\\Roaming\\comfyui-streaming-cache\\installs.json"


def test_each_clone_has_its_entry_and_an_unreadable_record_is_kept_aside(tmp_path, own_config):
    record = install.record_path()
    assert record == str(own_config / "comfyui-streaming-cache" / "installs.json")
    assert install.recorded_install() is None
    one, two = install.Recorded("/a/ComfyUI", "/a/venv/bin/python"), install.Recorded("/b/ComfyUI", "/b/py.exe", True)
    assert install.record_install(one) == record
    assert install.record_install(two, pack_dir=str(tmp_path)) == record
    assert install.recorded_install() == one and install.recorded_install(str(tmp_path)) == two
    newer = install.Recorded("/c/ComfyUI", "/c/venv/bin/python")
    install.record_install(newer)
    assert install.recorded_install() == newer and install.recorded_install(str(tmp_path)) == two
    with open(record, "w") as f:
        f.write("{not json")
    assert install.recorded_install() is None
    install.record_install(one)
    assert open(record + ".unreadable").read() == "{not json"
    assert json.load(open(record)) == {"installs": {os.path.realpath(install.PACK_DIR): {
        "comfyui": "/a/ComfyUI", "python": "/a/venv/bin/python", "isolated": False}}}


def test_a_record_that_cannot_be_written_is_said_and_the_install_goes_on(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    found = install.Recorded("/a/ComfyUI", "/a/venv/bin/python")
    assert install.record_install(found, path=str(tmp_path / "file" / "installs.json")) is None
    assert "could not record this installation" in capsys.readouterr().out


def test_the_headless_command_is_quoted_for_the_os():
    assert install.headless_command("/home/me/my inst/venv/bin/python", "/home/me/my inst/ComfyUI",
                                    "/home/me/my inst/demo", windows=False, pack_dir="/src/pack") == \
        "'/home/me/my inst/venv/bin/python' /src/pack/scripts/headless.py --demo '/home/me/my inst/demo' " \
        "--comfyui '/home/me/my inst/ComfyUI'"
    assert install.headless_command("C:\\P\\python_embeded\\python.exe", "C:\\P\\ComfyUI", "C:\\P\\demo",
                                    windows=True, portable=True, pack_dir="C:\\src\\pack") == \
        "C:\\P\\python_embeded\\python.exe -s C:\\src\\pack\\scripts\\headless.py --demo C:\\P\\demo --comfyui " \
        "C:\\P\\ComfyUI"


def test_a_fresh_install_records_itself_and_ends_with_the_headless_command(tmp_path, monkeypatch, capsys):
    """The steps that need a network or minutes (the environment, PyTorch, the requirements, the demo) stand in;
    ComfyUI comes from an archive. The install is recorded before the demo runs, so a failed demo leaves it
    found."""
    target = tmp_path / "inst"
    python = sys.executable
    seen = []
    monkeypatch.setattr(install, "make_venv", lambda venv: python)
    monkeypatch.setattr(install, "install_torch", lambda *a: {"torch": "2.13.0", "torchvision": "0.28.0",
                                                              "torchaudio": "2.13.0", "cuda": False})
    monkeypatch.setattr(install, "torch_device", lambda py: "cpu")
    monkeypatch.setattr(install, "install_requirements", lambda *a: None)
    monkeypatch.setattr(install, "run_demo", lambda py, comfy, demo: seen.append(install.recorded_install()))
    archive = _tar(tmp_path / "comfy.tar.gz", COMFY_FILES)
    assert install.install(str(target), archive, "cpu", None, demo=True) == 0
    comfy = str(target / "ComfyUI")
    assert seen == [install.Recorded(comfy, python)] and install.recorded_install() == seen[0]
    lines = capsys.readouterr().out.strip().splitlines()
    command = shlex.join([python, os.path.join(install.PACK_DIR, "scripts", "headless.py"), "--demo",
                          str(target / "demo"), "--comfyui", comfy])
    assert lines[-2:] == [f"    {command}", f"[install] recorded in {install.record_path()}: scripts/headless.py of "
                          f"{install.PACK_DIR}, run with any Python, uses this ComfyUI and its Python."], lines[-4:]
