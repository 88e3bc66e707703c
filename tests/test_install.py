"""The one-command installer's parts that need no network and no ComfyUI: sources, archives, folders, checks.

The whole command (a ComfyUI, a Python environment, PyTorch, the demo LoRA) runs in
``tests/comfy/test_install_command.py``."""

from __future__ import annotations

import contextlib
import http.server
import io
import ntpath
import os
import shutil
import tarfile
import threading
import zipfile

import install
import pytest

SHA = "0123456789abcdef0123456789abcdef01234567"
COMFY_FILES = {"main.py": "print('comfy')\n", "comfy/__init__.py": "", "comfyui_version.py": '__version__ = "0.33.0"\n',
               "requirements.txt": "numpy\n", ".ci/update.py": "# a dot-folder ComfyUI ships\n"}


def _tar(path, files: dict[str, str], top: str = "ComfyUI", comment: str = "", links: dict[str, str] | None = None):
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT, pax_headers={"comment": comment} if comment else {}) as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return str(path)


def _zip(path, files: dict[str, str], top: str):
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(f"{top}/{name}" if top else name, text)
    return str(path)


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
    with pytest.raises(install.InstallError, match="would be written outside"):
        install.member_path("C:\\Users\\me\\ComfyUI", rel, ntpath)


def test_members_inside_the_folder_resolve_under_it_by_windows_and_posix_rules(tmp_path):
    assert install.member_path("C:\\Users\\me\\ComfyUI", "comfy/sd.py", ntpath) == \
        "C:\\Users\\me\\ComfyUI\\comfy\\sd.py"
    assert install.member_path("C:\\Users\\me\\ComfyUI", "a/../main.py", ntpath) == "C:\\Users\\me\\ComfyUI\\main.py"
    assert install.member_path(str(tmp_path), "comfy/sd.py") == os.path.join(os.path.realpath(tmp_path), "comfy",
                                                                               "sd.py")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "dest" / "m")
    with pytest.raises(install.InstallError, match="would be written outside"):
        install.member_path(str(tmp_path / "dest"), "m/x.py")  # a link already in the folder is followed


def test_archive_links_are_refused(tmp_path):
    archive = _tar(tmp_path / "links.tar.gz", COMFY_FILES, links={"models": "/etc"})
    with pytest.raises(install.InstallError, match="links or special files"):
        install.fetch_comfyui(archive, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    assert not os.path.exists(tmp_path / "ComfyUI")


def test_sources_that_are_not_a_supported_comfyui_are_refused(tmp_path):
    not_comfy = _tar(tmp_path / "other.tar.gz", {"README.md": "hello\n", "src/x.py": ""})
    with pytest.raises(install.InstallError, match="does not hold a ComfyUI"):
        install.fetch_comfyui(not_comfy, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    old = _tar(tmp_path / "old.tar.gz", {**COMFY_FILES, "comfyui_version.py": '__version__ = "0.3.40"\n'})
    with pytest.raises(install.InstallError, match="needs v0.3.64 or newer"):
        install.fetch_comfyui(old, str(tmp_path / "ComfyUI"), str(tmp_path / "dl"))
    broken = tmp_path / "cut.tar.gz"
    broken.write_bytes(open(_tar(tmp_path / "whole.tar.gz", COMFY_FILES), "rb").read()[:100])
    with pytest.raises(install.InstallError, match="could not unpack"):
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
             (whole[: len(whole) // 2], None, "not a whole .tar.gz or .zip"),
             (other, None, "without ComfyUI in it")]
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
