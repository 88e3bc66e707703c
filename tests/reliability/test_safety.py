"""Hostile and damaged caches: refused with clear errors naming the entry or file; no code ever runs."""

from __future__ import annotations

import builtins
import collections
import json
import os
import pickle
import struct
import subprocess

import numpy as np
import pytest
import torch

import streaming_cache as sc
from helpers.cachefiles import entry_digests, flip_byte, rewrite_index, shard_paths, tensor_file_offset
from helpers.values import latent
from streaming_cache import cli, layout
from streaming_cache import format as fmt


class _Reduce:
    """Pickles as ``func(*args)``: the classic code-execution gadget."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _gadgets(sentinel: str) -> dict[str, bytes]:
    cmd = f"touch {sentinel}"
    getattr_chain = pickle.dumps(_Reduce(getattr, _Reduce(builtins.__import__, "os"), "system"))
    return {
        "os.system": pickle.dumps(_Reduce(os.system, cmd)),
        "posix.system": pickle.dumps(_Reduce(os.system, cmd)).replace(b"os\n", b"posix\n"),
        "subprocess": pickle.dumps(_Reduce(subprocess.call, ["touch", sentinel])),
        "eval": pickle.dumps(_Reduce(builtins.eval, f"__import__('os').system('{cmd}')")),
        "exec": pickle.dumps(_Reduce(builtins.exec, f"open({sentinel!r}, 'w').close()")),
        "getattr_chain": getattr_chain,
        "open": pickle.dumps(_Reduce(open, sentinel, "w")),
        # allowed callables with hostile arguments must still do nothing dangerous
        "ordereddict_args": pickle.dumps(_Reduce(collections.OrderedDict, [("x", _Reduce(os.system, cmd))])),
        "device_args": pickle.dumps(_Reduce(torch.device, _Reduce(eval, "'cpu'"))),
        "set_of_evil": pickle.dumps({1, _Reduce(os.system, cmd)} if False else _Reduce(set, [_Reduce(os.system, cmd)])),
    }


def _inject(cache, key: str, payload: bytes) -> None:
    """Point entry ``key`` at a new skeleton holding ``payload`` (checksums recomputed, as an attacker would)."""
    r = sc.open_cache(cache)
    i = r.index_of(key)

    def mutate(header, sections):
        blob = sections["skeletons.blob"] + payload
        offsets = np.frombuffer(sections["skeletons.offsets"], "<u8").tolist() + [len(blob)]
        sk = np.frombuffer(sections["entries.skeleton"], "<u4").copy()
        sk[i] = len(offsets) - 2
        sections["skeletons.blob"] = blob
        sections["skeletons.offsets"] = np.array(offsets, "<u8").tobytes()
        sections["entries.skeleton"] = sk.tobytes()
        header["counts"]["skeletons"] += 1

    rewrite_index(cache, mutate)


@pytest.mark.parametrize("gadget", sorted(_gadgets("x")))
def test_malicious_skeleton_never_runs(tmp_path, gadget):
    cache = str(tmp_path / "cache")
    sentinel = str(tmp_path / "PWNED")
    with sc.CacheWriter(cache) as w:
        w.put("victim", latent(1))
        w.put("bystander", latent(2))
    _inject(cache, "victim", _gadgets(sentinel)[gadget])
    r = sc.open_cache(cache)
    with pytest.raises(sc.CacheError) as info:
        r["victim"].materialize()
    assert "victim" in str(info.value)
    assert isinstance(info.value, (sc.DamagedEntryError, sc.UnsafeSkeletonError, sc.CacheFormatError))
    assert torch.equal(r["bystander"].materialize()["samples"], latent(2)["samples"])
    report = r.verify()
    assert list(report.damaged) == ["victim"]
    # also through a writer re-opening the cache and through the CLI
    with sc.CacheWriter(cache):
        pass
    assert cli.main(["verify", cache]) == 1
    assert not os.path.exists(sentinel), "the payload ran"


def test_payload_is_real(tmp_path):
    """The gadgets above do run under plain pickle: the test proves the allow-list, not a broken payload."""
    sentinel = str(tmp_path / "PWNED")
    pickle.loads(_gadgets(sentinel)["os.system"])
    assert os.path.exists(sentinel)


def test_unsafe_skeleton_error_names_the_global(tmp_path):
    cache = str(tmp_path / "c")
    with sc.CacheWriter(cache) as w:
        w.put("v", 1)
    _inject(cache, "v", pickle.dumps(_Reduce(os.system, "true")))
    with pytest.raises(sc.DamagedEntryError, match=r"system.*not on the allow-list"):
        sc.open_cache(cache)["v"].materialize()


def test_flipped_tensor_byte_is_named_by_verify(cache):
    with sc.CacheWriter(cache) as w:
        for i in range(5):
            w.put(f"e{i}", latent(i))
        w.put("shares", {"again": latent(3)["samples"]})  # same tensor as e3
    digest = entry_digests(cache, "e3")[0]
    path, begin, end = tensor_file_offset(cache, digest)
    flip_byte(path, begin + (end - begin) // 2)
    r = sc.open_cache(cache)
    report = r.verify()
    assert sorted(report.damaged) == ["e3", "shares"] and not report.ok
    assert "checksum" in report.damaged["e3"]
    with pytest.raises(sc.DamagedEntryError, match="e3"):
        r["e3"].materialize(check=True)
    for i in (0, 1, 2, 4):
        assert torch.equal(r[f"e{i}"].materialize(check=True)["samples"], latent(i)["samples"])


def test_truncated_shard_only_affects_its_entries(cache):
    with sc.CacheWriter(cache, shard_bytes=4096) as w:
        for i in range(6):
            w.put(f"e{i}", latent(i, shape=(1, 4, 16, 16)))  # 4 KiB each: one shard per entry
    shards = shard_paths(cache)
    assert len(shards) == 6
    victim = tensor_file_offset(cache, entry_digests(cache, "e2")[0])[0]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    r = sc.open_cache(cache)
    with pytest.raises(sc.DamagedEntryError, match="e2"):
        r["e2"].materialize()
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(r[f"e{i}"].materialize()["samples"], latent(i, shape=(1, 4, 16, 16))["samples"])
    assert list(r.verify().damaged) == ["e2"]


def test_missing_shard_is_reported(cache):
    with sc.CacheWriter(cache, shard_bytes=1024) as w:
        w.put("a", latent(1))
        w.put("b", latent(2))
    os.remove(tensor_file_offset(cache, entry_digests(cache, "a")[0])[0])
    r = sc.open_cache(cache)
    with pytest.raises(sc.DamagedEntryError, match="missing"):
        r["a"].materialize()
    assert r["b"].materialize() is not None


@pytest.mark.parametrize("damage", ["flip_section", "flip_header", "truncate", "magic", "version", "empty"])
def test_damaged_index_is_refused_with_its_path(cache, damage):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
    path = layout.index_path(cache)
    size = os.path.getsize(path)
    if damage == "flip_section":
        index = fmt.IndexFile(path)
        rows = index.header["sections"]["tensors.rows"]
        base = 24 + struct.unpack("<Q", open(path, "rb").read()[8:16])[0]
        flip_byte(path, base + rows["offset"] + 20)
    elif damage == "flip_header":
        flip_byte(path, 30)
    elif damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "magic":
        flip_byte(path, 0)
    elif damage == "version":
        rewrite_index(cache, lambda h, s: None)
        raw = open(path, "rb").read()
        n = struct.unpack("<Q", raw[8:16])[0]
        hdr = raw[24:24 + n].replace(b'"format_version":1', b'"format_version":9')
        import xxhash
        open(path, "wb").write(raw[:16] + xxhash.xxh3_64_digest(hdr) + hdr + raw[24 + n:])
    else:
        open(path, "wb").close()
    with pytest.raises(sc.CacheFormatError) as info:
        r = sc.open_cache(cache)
        r["a"].materialize()
        report = r.verify()
        assert report.ok
    assert layout.INDEX_NAME in str(info.value)
    if damage == "version":
        assert "version" in str(info.value)


def _shard_with_header(tmp_path, header: dict, data: bytes = b"\0" * 16, declared: int | None = None) -> str:
    raw = json.dumps(header).encode()
    path = str(tmp_path / "evil.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", declared if declared is not None else len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header,declared,match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, None, "overlap"),
    ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, None, "invalid header record"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, None, "invalid header record"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, None, "invalid header record"),
    ({"a": {"dtype": "EVIL", "shape": [1], "data_offsets": [0, 4]}}, None, "invalid header record"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}, None, "invalid header record"),
    ({}, 2**62, "claims"),
    ({}, 200 * 1024 * 1024, "claims"),
])
def test_hostile_safetensors_headers(tmp_path, header, declared, match):
    path = _shard_with_header(tmp_path, header, declared=declared)
    with open(path, "rb") as f, pytest.raises(sc.CacheFormatError, match=match):
        fmt.read_shard_header(f, os.path.getsize(path), path)


def test_header_bomb_json_nesting(tmp_path):
    path = _shard_with_header(tmp_path, {})
    raw = b"[" * 100000 + b"]" * 100000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    with open(path, "rb") as f, pytest.raises(sc.CacheFormatError):
        fmt.read_shard_header(f, os.path.getsize(path), path)


def test_path_traversal_shard_names_refused(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))

    def mutate(header, sections):
        header["shards"][0]["name"] = "../../etc/passwd"

    rewrite_index(cache, mutate)
    with pytest.raises(sc.CacheFormatError, match="not a plain file name"):
        sc.open_cache(cache)


def test_index_pointing_past_tables_is_refused(cache):
    with sc.CacheWriter(cache) as w:
        w.put("a", latent(1))
        w.put("b", latent(2))

    def mutate(header, sections):
        leaves = np.frombuffer(sections["leaves.tensor"], "<u4").copy()
        leaves[0] = 999
        sections["leaves.tensor"] = leaves.tobytes()

    rewrite_index(cache, mutate)
    r = sc.open_cache(cache)
    with pytest.raises(sc.DamagedEntryError, match="'a'"):
        r["a"].materialize()
    assert r["b"].materialize() is not None
    assert "a" in r.verify().damaged
    with sc.CacheWriter(cache) as w:  # the writer sees the same damage and drops only that entry
        assert w.damaged == ["a"] and "b" in w and "a" not in w
    r = sc.open_cache(cache)
    assert list(r.keys()) == ["b"] and r.verify().ok


def test_writer_refuses_unstorable_values_at_put_time(cache):
    class Hook:
        pass

    bad = {
        "custom": ([[torch.ones(1), {"hook": Hook()}]], "value[0][1]['hook']"),
        "lambda": ({"f": lambda: 1}, "value['f']"),
        "numpy_objects": ({"a": np.array([object()])}, "value['a']"),
        "sparse": ({"s": torch.eye(2).to_sparse()}, "value['s']"),
        "numpy_scalar": ({"x": np.float32(1)}, "value['x']"),
    }
    cyclic: list = []
    cyclic.append(cyclic)
    with sc.CacheWriter(cache) as w:
        w.put("ok", latent(0))
        for name, (value, path) in bad.items():
            with pytest.raises(sc.UnsupportedValueError) as info:
                w.put(name, value)
            assert path.replace("value", f"entry '{name}'") in str(info.value), str(info.value)
        with pytest.raises(sc.UnsupportedValueError, match="cycle"):
            w.put("cycle", cyclic)
    r = sc.open_cache(cache)
    assert list(r.keys()) == ["ok"]
