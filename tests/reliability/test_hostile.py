"""A stranger's cache must not touch anything outside itself, crash the process, or exhaust memory or time.

One section per class of attack; caches are crafted by hand as an attacker would (valid checksums included).
Tests that could crash the interpreter on a regression (stack overflow, SIGBUS) or hang it (a FIFO) run the
attack in a child process with a timeout, so a regression fails the test instead of killing the run.
"""

from __future__ import annotations

import collections
import gc
import os
import pickle
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import xxhash

import streaming_cache as sc
from helpers.cachefiles import INDEX_DAMAGE, damage_index, rewrite_index, shard_paths
from helpers.installs import subprocess_env
from helpers.values import latent
from streaming_cache import cli, layout, skeleton
from streaming_cache.loader import BatchLoader
from streaming_cache.skeleton import decode_skeleton

POSIX = os.name == "posix"
posix_only = pytest.mark.skipif(not POSIX, reason="needs POSIX symbolic links, FIFOs and sockets")


def make_cache(path, n: int = 3) -> str:
    path = str(path)
    with sc.CacheWriter(path) as w:
        for i in range(n):
            w.put(f"k{i}", latent(i))
    return path


def snapshot(folder) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes: to prove nothing there changed."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, folder)] = fh.read()
    return out


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env())


# ============================================================================ the filesystem
@posix_only
def test_reading_a_cache_never_deletes_through_a_symlinked_shards_folder(tmp_path):
    """Opening for reading used to clean "leftovers" in the link's target: someone's models folder."""
    outside = tmp_path / "models" / "checkpoints"
    outside.mkdir(parents=True)
    (outside / "precious.safetensors").write_bytes(b"weights")
    cache = make_cache(tmp_path / "cache")
    real_shards = layout.shard_dir(cache)
    for name in os.listdir(real_shards):
        os.rename(os.path.join(real_shards, name), outside / name)
    os.rmdir(real_shards)
    os.symlink(outside, real_shards)
    before = snapshot(tmp_path / "models")
    with pytest.raises(sc.CacheFormatError, match="shards folder is a symbolic link"):
        sc.open_cache(cache)
    with pytest.raises(sc.CacheFormatError, match="shards folder is a symbolic link"):
        sc.CacheWriter(cache)
    assert cli.main(["clean", cache, "--yes"]) == 2
    assert snapshot(tmp_path / "models") == before, "nothing outside the cache was touched"


@posix_only
@pytest.mark.parametrize("target_exists", [True, False])
def test_a_symlinked_lock_is_never_followed(tmp_path, target_exists):
    """The lock used to be opened with O_CREAT and truncated: opening a cache could create or wipe any file."""
    cache = make_cache(tmp_path / "cache")
    victim = tmp_path / "victim.txt"
    if target_exists:
        victim.write_text("keep me")
    os.remove(layout.lock_path(cache))
    os.symlink(victim, layout.lock_path(cache))
    assert len(sc.open_cache(cache)) == 3, "readers never use the lock"
    with pytest.raises(sc.CacheFormatError, match="writer lock is a symbolic link"):
        sc.CacheWriter(cache)
    assert (victim.read_text() == "keep me") if target_exists else not victim.exists()


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/absolute.safetensors", "x" * 300])
def test_compaction_never_deletes_a_path_the_index_names(tmp_path, name):
    cache = make_cache(tmp_path / "cache")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"someone's file")

    def mutate(header, sections):
        header["shards"].append({"name": name, "nbytes": 10})

    rewrite_index(cache, mutate)
    with pytest.raises(sc.CacheFormatError, match="not a plain file name"):
        sc.CacheWriter(cache)
    assert cli.main(["clean", cache, "--yes"]) == 2
    assert outside.read_bytes() == b"someone's file"


@posix_only
def test_two_caches_sharing_a_shards_folder_cannot_destroy_each_other(tmp_path):
    a = make_cache(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    os.symlink(layout.shard_dir(a), layout.shard_dir(str(b)))
    before = snapshot(a)
    with pytest.raises(sc.CacheFormatError, match="symbolic link"):
        sc.CacheWriter(b)
    assert snapshot(a) == before and sc.open_cache(a).verify().ok


@posix_only
@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "symlink"])
@pytest.mark.parametrize("where", ["shard", "index"])
def test_no_regular_file_where_one_belongs_is_refused_without_blocking(tmp_path, kind, where):
    cache = make_cache(tmp_path / "cache")
    path = shard_paths(cache)[0] if where == "shard" else layout.index_path(cache)
    os.rename(path, tmp_path / "moved")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound by a relative name: socket paths are limited to about 100 bytes
        sock = socket.socket(socket.AF_UNIX)
        here = os.getcwd()
        os.chdir(os.path.dirname(path))
        try:
            sock.bind(os.path.basename(path))
        finally:
            os.chdir(here)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.symlink(tmp_path / "moved", path)
    code = f"""
import streaming_cache as sc
try:
    r = sc.open_cache({cache!r})
    print("VERIFY", r.verify().ok, sorted(r.verify().damaged))
except sc.CacheError as exc:
    print("REFUSED", exc)
try:
    sc.CacheWriter({cache!r}).close()
    print("WRITER OPENED")
except sc.CacheError as exc:
    print("WRITER REFUSED", exc)
"""
    proc = run_child(code, timeout=60)  # a FIFO opened for reading in blocking mode would hang here
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    if where == "index":
        assert "REFUSED" in out and "not a regular file" in out or "symbolic link" in out, out
        assert "WRITER REFUSED" in out, out
    else:
        assert "VERIFY False ['k0'" in out and "WRITER OPENED" in out, out  # only the entries in that shard
    assert os.path.exists(path) or os.path.islink(path), "nothing was removed"


def test_file_where_the_shards_folder_belongs_and_folder_where_the_lock_belongs(tmp_path):
    cache = make_cache(tmp_path / "c1")
    os.rename(layout.shard_dir(cache), tmp_path / "moved")
    open(layout.shard_dir(cache), "wb").close()
    with pytest.raises(sc.CacheFormatError, match="shards folder is a file|not a folder"):
        sc.CacheWriter(cache)
    with pytest.raises(sc.CacheFormatError, match="not a folder"):
        sc.open_cache(cache)
    cache = make_cache(tmp_path / "c2")
    os.remove(layout.lock_path(cache))
    os.mkdir(layout.lock_path(cache))
    with pytest.raises(sc.CacheFormatError, match="writer lock is a directory"):
        sc.CacheWriter(cache)


def test_a_read_only_cache_reads_and_refuses_writes_clearly(tmp_path, monkeypatch):
    cache = make_cache(tmp_path / "cache")
    real_open = os.open

    def read_only(path, flags, *a, **k):  # what a read-only mount answers (as root, chmod would not stop us)
        if str(path).startswith(cache) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    assert sc.open_cache(cache).verify().ok
    with pytest.raises(sc.CacheError, match="cannot write to this cache: the folder is read-only"):
        sc.CacheWriter(cache)


def test_a_writer_dropped_without_close_releases_its_lock(tmp_path):
    cache = make_cache(tmp_path / "cache")
    w = sc.CacheWriter(cache)
    w.put("x", latent(9))
    del w
    gc.collect()
    with sc.CacheWriter(cache) as w2:
        assert "x" not in w2, "nothing of an unclosed writer is committed"


# ============================================================================ skeletons
def deep_tuple_key(n: int) -> bytes:
    """A dict whose key is a tuple nested ``n`` deep: hashing it recursed in C and segfaulted the interpreter."""
    return b"\x80\x04}" + b")" + b"\x85" * n + b"Ns."


@pytest.mark.parametrize("depth", [200_000, 1_000_000])
def test_deeply_nested_tuples_are_refused_without_crashing(depth):
    code = f"""
import time
from streaming_cache.skeleton import decode_skeleton
from streaming_cache.errors import CacheFormatError
data = b"\\x80\\x04}}" + b")" + b"\\x85" * {depth} + b"Ns."
t = time.perf_counter()
try:
    decode_skeleton(data, 0, lambda i, n: None, "entry 'x'")
    print("DECODED")
except CacheFormatError as exc:
    print("REFUSED", round(time.perf_counter() - t, 3), exc)
"""
    proc = run_child(code.replace("}}", "}"))
    assert proc.returncode == 0, f"the process died ({proc.returncode}): {proc.stderr[-500:]}"
    assert "REFUSED" in proc.stdout, proc.stdout
    assert ("levels deep" in proc.stdout) if depth < 262144 else ("exceeds the limit" in proc.stdout)
    assert float(proc.stdout.split()[1]) < 1.0


def test_additems_and_appends_on_a_tensor_are_refused():
    """ADDITEMS called the object's ``.add``: on a tensor, a broadcasting add building an N x N result."""
    big = b"\x80\x04K\x00Q(" + b"\x8c\x01a" * 1 + b"\x90."  # tensor 0, MARK, 'a', ADDITEMS
    appends = b"\x80\x04K\x00Q(K\x01e."  # tensor 0, MARK, 1, APPENDS
    setitem = b"\x80\x04K\x00QK\x00K\x01s."  # tensor[0] = 1 via SETITEM
    for data in (big, appends, setitem):
        with pytest.raises(sc.CacheFormatError, match="to a tensor value"):
            decode_skeleton(data, 1, lambda i, n: torch.zeros(4), "entry 'v'")


@pytest.mark.parametrize("func", [b"\x8c\x08builtins\x8c\x03set\x93", b"\x8c\x05torch\x8c\x04Size\x93"])
def test_constructors_called_with_a_tensor_are_refused(func):
    """``set(tensor)`` / ``torch.Size(tensor)`` build huge Python objects from a small file."""
    data = b"\x80\x04" + func + b"K\x00Q\x85R."  # func((tensor,))
    with pytest.raises(sc.CacheFormatError, match="arguments a pickle of it never has"):
        decode_skeleton(data, 1, lambda i, n: torch.zeros(10_000), "entry 'v'")


def test_shared_substructures_cannot_expand_exponentially(cache):
    value: list = [1]
    for _ in range(40):
        value = [value, value]
    started = time.perf_counter()
    with sc.CacheWriter(cache) as w, pytest.raises(sc.UnsupportedValueError, match="containers and elements"):
        w.put("bomb", value)
    assert time.perf_counter() - started < 2.0
    data = pickle.dumps(value, protocol=4)  # 2**40 leaves by reference, a few hundred bytes
    with pytest.raises(sc.CacheFormatError, match="expands to more than"):
        decode_skeleton(data, 0, lambda i, n: None, "entry 'b'")
    shared = pickle.dumps([[1, 2]] * 3, protocol=4)  # modest sharing is fine and stays shared
    out = decode_skeleton(shared, 0, lambda i, n: None, "e")
    assert out == [[1, 2]] * 3 and out[0] is out[1]


def test_very_deep_lists_are_refused_not_a_recursion_error():
    data = b"\x80\x04]" + b"]" * 100_000 + b"a" * 100_000 + b"."  # EMPTY_LIST then a chain of APPENDs
    with pytest.raises(sc.CacheFormatError, match="levels deep"):
        decode_skeleton(data, 0, lambda i, n: None, "entry 'd'")
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(sc.UnsupportedValueError, match="levels deep"):
        skeleton.collect_leaves(deep)


def test_oversized_skeletons_are_refused_in_constant_time():
    data = b"\x80\x04(" + b"K\x01" * 4_000_000 + b"l."  # 8 MB of harmless opcodes
    started = time.perf_counter()
    with pytest.raises(sc.CacheFormatError, match="exceeds the limit"):
        decode_skeleton(data, 0, lambda i, n: None, "entry 'x'")
    assert time.perf_counter() - started < 0.05


def test_skeleton_limits_are_far_above_real_comfyui_values(cache):
    """What ComfyUI passes around (SDXL conditioning with its size options, Flux guidance, a latent with a
    noise mask, edit models' reference latents) stays far below every limit."""
    cond = [[torch.zeros(1, 77, 2048), {"pooled_output": torch.zeros(1, 1280), "width": 1024, "height": 1024,
                                         "crop_w": 0, "crop_h": 0, "target_width": 1024, "target_height": 1024,
                                         "guidance": 3.5, "reference_latents": [torch.zeros(1, 16, 64, 64)] * 2,
                                         "attention_mask": torch.ones(1, 77, dtype=torch.bool)}]]
    lat = {"samples": torch.zeros(1, 16, 1, 64, 64), "noise_mask": torch.ones(1, 1, 64, 64), "batch_index": [0]}
    with sc.CacheWriter(cache) as w:
        w.put("cond", cond)
        w.put("lat", lat)
    r = sc.open_cache(cache)
    assert r["cond"].materialize()[0][1]["width"] == 1024
    assert len(r.entry_record(r.index_of("cond")).skeleton) < 4096


# ============================================================================ hostile JSON and numbers
@pytest.mark.parametrize("mutation", ["deep", "inf_entries", "huge_generation", "float_count", "shards_not_list",
                                      "shard_nbytes_str", "manifests_bad_section", "cache_id_list"])
def test_hostile_json_in_the_index_header_is_refused_naming_the_file(tmp_path, mutation):
    cache = make_cache(tmp_path / "cache")

    def mutate(header, sections):
        if mutation == "deep":  # replaced below by 100,000 nested lists (json.dumps cannot write them)
            header["extra"] = "DEEP"
        elif mutation == "inf_entries":
            header["counts"]["entries"] = float("inf")
        elif mutation == "huge_generation":
            header["generation"] = 10**300
        elif mutation == "float_count":
            header["counts"]["entries"] = 3.0
        elif mutation == "shards_not_list":
            header["shards"] = {"a": 1}
        elif mutation == "shard_nbytes_str":
            header["shards"][0]["nbytes"] = "12"
        elif mutation == "manifests_bad_section":
            header["manifests"] = {"default": "keys.blob"}
        elif mutation == "cache_id_list":
            header["cache_id"] = [1, 2]

    rewrite_index(cache, mutate)
    if mutation == "deep":  # splice the nesting into the header and checksum it again, as an attacker would
        path = layout.index_path(cache)
        raw = open(path, "rb").read()
        n = struct.unpack("<Q", raw[8:16])[0]
        header = raw[24:24 + n].replace(b'"DEEP"', b"[" * 100_000 + b"]" * 100_000)
        with open(path, "wb") as f:  # sections are addressed from the end of the header: the body moves with it
            f.write(raw[:8] + struct.pack("<Q", len(header)) + xxhash.xxh3_64_digest(header) + header + raw[24 + n:])
    for opener in (sc.open_cache, sc.CacheWriter):
        with pytest.raises(sc.CacheFormatError) as info:
            opener(cache)
        assert "index.scc" in str(info.value)
    assert cli.main(["info", cache]) == 2 and cli.main(["verify", cache]) == 2 and cli.main(["clean", cache]) == 2


@pytest.mark.parametrize("manifest", [
    b'{"version": 1, "columns": ["x"], "rows": [{"name": "a", "keys": {"x": "k0"}, "repeats": 200000000}]}',
    b'{"version": 1, "columns": ["x"], "rows": [{"name": "a", "keys": {"x": "k0"}, "repeats": Infinity}]}',
    b'{"version": 1, "columns": ["x"], "rows": [{"name": "a", "keys": {"x": "k0"}, "repeats": 1e300}]}',
    b'{"version": 1, "columns": "x", "rows": []}',
    b'{"version": 1, "columns": ["x"], "rows": [{"name": "a", "keys": ["k0"]}]}',
    b'{"version": 1, "columns": ["x"], "rows": [{"name": 5, "keys": {"x": "k0"}}]}',
    b'{"version": 1, "columns": ["x"], "rows": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
])
def test_hostile_manifests_are_refused_naming_the_manifest(tmp_path, manifest):
    cache = make_cache(tmp_path / "cache")
    with sc.CacheWriter(cache) as w:
        w.set_manifest("default", manifest)
    started = time.perf_counter()
    with pytest.raises(sc.CacheFormatError, match="manifest 'default'"):
        sc.DatasetHandle.from_cache(cache, "default")
    assert time.perf_counter() - started < 1.0, "a 90-byte manifest must not allocate gigabytes"
    assert cli.main(["info", cache]) == 2
    assert cli.main(["clean", cache]) == 2, "clean refuses rather than guess which entries are live"


def test_a_folder_asking_for_absurd_repeats_is_refused_at_build_time(tmp_path):
    from streaming_cache.train.folder import folder_items

    (tmp_path / "1000000000000_cat").mkdir()
    (tmp_path / "1000000000000_cat" / "a.png").write_bytes(b"x")
    (tmp_path / ("9" * 200 + "_dog")).mkdir()
    (tmp_path / ("9" * 200 + "_dog") / "b.png").write_bytes(b"x")
    (tmp_path / "10_ok").mkdir()
    (tmp_path / "10_ok" / "c.png").write_bytes(b"x")
    items, problems = folder_items(str(tmp_path))
    assert [(it.name, it.repeats) for it in items] == [("10_ok/c.png", 10)]
    assert len(problems) == 2 and all("at most 1000" in p for p in problems)
    report = sc.build(str(tmp_path / "cache"), [sc.Item("big", {"x": sc.Part(data=b"x")}, repeats=10**12)],
                      {"x": sc.Encoder("t", lambda parts: [torch.zeros(1) for _ in parts])})
    assert report.failed == 1 and "at most 1000" in report.failures[0].error


# ============================================================================ writer, clean, info, verify
@pytest.mark.parametrize("damage", INDEX_DAMAGE)
def test_the_writer_and_cli_refuse_what_the_reader_refuses_cleanly(tmp_path, damage):
    cache = make_cache(tmp_path / "cache", 4)

    damage_index(cache, damage)
    try:
        with sc.CacheWriter(cache) as w:
            assert w.damaged, "a writer that opens drops (and names) the damaged entries"
    except sc.CacheError as exc:
        assert "index.scc" in str(exc) or "entry" in str(exc)
    for command in (["info", cache], ["verify", cache], ["verify", cache, "--drop-damaged"], ["clean", cache]):
        assert cli.main(command) in (0, 1, 2), command  # a clean exit status, never a traceback


def test_clean_works_after_verify_drops_the_entries_of_a_missing_shard(tmp_path):
    cache = str(tmp_path / "cache")
    with sc.CacheWriter(cache, shard_bytes=1024) as w:  # one shard per entry
        for i in range(4):
            w.put(f"k{i}", latent(i))
    os.remove(shard_paths(cache)[0])
    assert cli.main(["verify", cache, "--drop-damaged"]) == 1
    assert cli.main(["clean", cache, "--yes"]) == 0, "clean used to fail forever with FileNotFoundError"
    r = sc.open_cache(cache)
    assert len(r) == 3 and r.verify().ok and len(shard_paths(cache)) == len(r.index.info.shards)


# ============================================================================ put gives back what it was given
def test_numpy_values_round_trip_exactly_or_are_refused(cache):
    good = {"zero_d": np.array(3.5, dtype=np.float32), "c64": np.arange(3, dtype=np.complex64),
            "bool": np.array([True, False])}
    with sc.CacheWriter(cache) as w:
        w.put("good", good)
        for name, value, why in [("masked", np.ma.masked_array([1.0, 2.0], mask=[0, 1]), "mask"),
                                 ("matrix", np.matrix([[1, 2]]), "matrix"),
                                 ("c128", np.arange(3, dtype=np.complex128), "not storable"),
                                 ("nested", torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "nested")]:
            with pytest.raises(sc.UnsupportedValueError, match=why):
                w.put(name, {"v": value})
    out = sc.open_cache(cache)["good"].materialize()
    for k, v in good.items():
        assert type(out[k]) is np.ndarray and out[k].shape == v.shape and out[k].dtype == v.dtype
        assert np.array_equal(out[k], v)


def test_a_key_that_cannot_be_encoded_is_refused_at_put_and_loses_nothing_else(cache):
    with sc.CacheWriter(cache) as w:
        w.put("before", latent(1))
        with pytest.raises(sc.UnsupportedValueError, match="not valid Unicode"):
            w.put("bad\udc80key", latent(2))
        w.put("after", latent(3))
    assert sorted(sc.open_cache(cache).keys()) == ["after", "before"]


def test_values_come_back_with_their_types(cache):
    value = collections.OrderedDict(t=(1, [2, (3,)]), s={1, 2}, f=frozenset({"a"}), b=bytearray(b"xy"),
                                    size=torch.Size([2, 3]), dev=torch.device("cpu"), dt=torch.bfloat16,
                                    c=complex(1, 2), text="lone \udc80 surrogate in a value")
    with sc.CacheWriter(cache) as w:
        w.put("v", value)
    out = sc.open_cache(cache)["v"].materialize()
    assert out == value and type(out) is collections.OrderedDict
    assert type(out["t"]) is tuple and type(out["t"][1]) is list and type(out["b"]) is bytearray


# ============================================================================ smaller ones
def test_loader_state_with_a_bad_position_is_refused(tmp_path):
    cache = make_cache(tmp_path / "cache", 6)
    loader = BatchLoader(sc.DatasetHandle.from_cache(cache), 2)
    state = loader.state_dict()
    for bad in ({"position": -1}, {"position": 99}, {"epoch": -2}, {"position": 1.5}):
        with pytest.raises(sc.CacheError, match="position"):
            loader.load_state_dict(dict(state, **bad))


def test_a_new_value_under_the_same_key_changes_the_fingerprint(tmp_path):
    cache = make_cache(tmp_path / "cache")
    before = sc.DatasetHandle.from_cache(cache).fingerprint()
    with sc.CacheWriter(cache) as w:
        w.put("k2", latent(42))  # the last key: the key order stays the same
    assert sc.DatasetHandle.from_cache(cache).fingerprint() != before
    assert sc.DatasetHandle.from_cache(cache).fingerprint() == sc.DatasetHandle.from_cache(cache).fingerprint()


def test_collate_of_nothing_says_so(tmp_path):
    cache = make_cache(tmp_path / "cache")
    with pytest.raises(sc.CacheError, match="empty batch"):
        sc.open_cache(cache).collate([])
    with pytest.raises(sc.CacheError, match="empty batch"):
        sc.loader.collate([])
    with pytest.raises(sc.CacheError, match="empty batch"):
        sc.DatasetHandle.from_cache(cache).collate([])


def test_a_tensor_reference_too_large_to_print_is_refused():
    """A persistent id with more digits than Python converts to text: refused, the message says its size."""
    data = b"\x80\x04" + pickle.LONG4 + struct.pack("<i", 3000) + b"\x7f" * 3000 + pickle.BINPERSID + b"."
    with pytest.raises(sc.CacheFormatError, match="a 23999-bit number"):
        decode_skeleton(data, 1, lambda i, n: torch.zeros(1), "entry 'x'")
    with pytest.raises(sc.CacheFormatError, match="invalid tensor reference"):
        decode_skeleton(b"\x80\x04" + pickle.LONG4 + struct.pack("<i", 3000) + b"\x7f" * 3000 + pickle.TUPLE1
                        + pickle.BINPERSID + b".", 1, lambda i, n: torch.zeros(1), "entry 'x'")


def test_a_frame_longer_than_the_skeleton_is_refused():
    data = b"\x80\x04" + pickle.FRAME + struct.pack("<Q", 2**62) + b"N."
    with pytest.raises(sc.CacheFormatError, match="longer than what follows"):
        decode_skeleton(data, 0, lambda i, n: None, "entry 'f'")
    fine = pickle.dumps([1, "a"], protocol=4)  # a real frame, as pickle writes one
    assert decode_skeleton(fine, 0, lambda i, n: None, "entry 'f'") == [1, "a"]


def test_a_record_whose_shape_no_tensor_can_have_is_a_damaged_entry(tmp_path):
    """No bytes, as its shape (0, 2**40, 2**40) says, but strides no tensor can have: the entry is damaged, the
    others read."""
    cache = make_cache(tmp_path / "cache")
    damage_index(cache, "overflow_shape")
    reader = sc.open_cache(cache)
    damaged = [k for k in ("k0", "k1", "k2") if _fails(lambda k=k: reader[k].materialize())]
    assert len(damaged) == 1
    assert reader.verify().damaged.keys() == set(damaged)


def _fails(fn) -> bool:
    try:
        fn()
    except sc.DamagedEntryError:
        return True
    return False


def test_decoded_skeletons_are_bounded_in_bytes():
    cache = skeleton._Templates(max_bytes=64 * 1024)
    for i in range(200):
        data = pickle.dumps(["x" * 4000, i], protocol=4)
        cache.get(data, 0, "e")
    assert cache.bytes <= 64 * 1024 + 5000 and len(cache.items) < 20


@pytest.mark.skipif(not POSIX, reason="SIGBUS is POSIX")
def test_a_shard_truncated_in_place_while_mapped_does_not_kill_the_process(tmp_path):
    cache = make_cache(tmp_path / "cache", 8)
    code = f"""
import os, streaming_cache as sc
from helpers.cachefiles import shard_paths
r = sc.open_cache({cache!r})
r["k0"].materialize()
batch = r.collate([0, 1])
with open(shard_paths({cache!r})[0], "r+b") as f:  # what cp or rsync --inplace over a shard does
    f.truncate(100)
for what in ("materialize", "collate"):
    try:
        r["k5"].materialize() if what == "materialize" else r.collate([4, 5])
        print(what, "READ")
    except sc.CacheError as exc:
        print(what, "REFUSED", exc)
"""
    proc = run_child(code)
    assert proc.returncode == 0, f"the process died with {proc.returncode} (SIGBUS is -7): {proc.stderr[-800:]}"
    assert proc.stdout.count("REFUSED") == 2 and "truncated or overwritten while in use" in proc.stdout
