"""The demo model store: the tiny checkpoint is built once per installation and linked into every home."""

from __future__ import annotations

import os
import threading

from demo_assets import from_store


def _counting_builder(calls: list[str]):
    def build(path: str) -> None:
        calls.append(path)
        with open(path + ".tmp", "wb") as f:
            f.write(b"weights" * 1000)
        os.replace(path + ".tmp", path)
    return build


def test_homes_share_one_built_file(tmp_path):
    calls: list[str] = []
    build = _counting_builder(calls)
    store = str(tmp_path / "store")
    homes = [str(tmp_path / f"home{i}" / "models" / "checkpoints" / "tiny.safetensors") for i in range(3)]
    for home in homes:
        from_store(home, store, build, "/comfyui/a")
    assert len(calls) == 1
    inodes = {os.stat(h).st_ino for h in homes}
    assert len(inodes) == 1 and os.stat(homes[0]).st_nlink == 4  # three homes and the store
    from_store(str(tmp_path / "other.safetensors"), store, build, "/comfyui/b")
    assert len(calls) == 2, "another installation gets its own build"


def test_processes_asking_at_once_build_once(tmp_path):
    calls: list[str] = []
    build = _counting_builder(calls)
    store = str(tmp_path / "store")
    threads = [threading.Thread(target=from_store, args=(str(tmp_path / f"h{i}" / "tiny.safetensors"), store, build, "x"))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert all(open(tmp_path / f"h{i}" / "tiny.safetensors", "rb").read() == b"weights" * 1000 for i in range(6))
