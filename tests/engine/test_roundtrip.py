"""Every value shape the cache promises to store comes back exactly as it was put."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streaming_cache as sc
from helpers.cachefiles import shard_paths
from helpers.values import conditioning, latent
from streaming_cache import format as fmt

pytestmark = pytest.mark.oldest_torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (PyTorch before 2.6 compares no fp8 tensor, not even an empty one)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same(a, b) -> bool:
    """Exact equality of nested values, tensors compared bit for bit (NaNs and fp8 included)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def roundtrip(cache, value):
    with sc.CacheWriter(cache) as w:
        w.put("k", value)
    return sc.open_cache(cache)["k"].materialize()


def test_comfyui_latent_and_conditioning(cache):
    lat, cond = latent(1), conditioning(2)
    with sc.CacheWriter(cache) as w:
        w.put("lat", lat)
        w.put("cond", cond)
    r = sc.open_cache(cache)
    assert same(r["lat"].materialize(), lat)
    assert same(r["cond"].materialize(), cond)
    assert r["cond"].tensors[0] == sc.TensorInfo("F32", (1, 77, 768), 77 * 768 * 4)


def test_containers_and_scalars(cache):
    value = {
        "list": [1, 2.5, "s", None, True, b"\x00\xff", complex(1, -2)],
        "tuple": (1, (2, (3,))),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a"}),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 2**70,
        "dtype": torch.bfloat16,
        "device": torch.device("cuda", 1),
        "size": torch.Size([2, 3]),
        ("tuple", "key"): 1,
        7: "int key",
        "bytearray": bytearray(b"xy"),
    }
    assert same(roundtrip(cache, value), value)


@pytest.mark.parametrize("dtype", sorted(fmt.TORCH_DTYPE.values(), key=str))
def test_every_storable_dtype(cache, dtype):
    raw = torch.randint(0, 256, (3, 5), dtype=torch.uint8)
    if dtype == torch.bool:
        t = raw > 127
    else:
        size = torch.empty((), dtype=dtype).element_size()
        t = torch.randint(0, 256, (3, 5 * size), dtype=torch.uint8).view(dtype)
    assert same(roundtrip(cache, {"t": t}), {"t": t})


def test_awkward_tensors(cache):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value = {
        "transposed": base.T,
        "strided": base[::2, 1::3],
        "zero_size": torch.empty(0, 3, dtype=torch.float16),
        "scalar": torch.tensor(3.25),
        "grad": torch.ones(2, requires_grad=True),
        "numpy": np.arange(6, dtype=np.int16).reshape(2, 3),
        "numpy_f": np.linspace(0, 1, 4, dtype=np.float32)[::2],
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    out = roundtrip(cache, value)
    assert not out["grad"].requires_grad and type(out["param"]) is torch.Tensor
    expected = dict(value, grad=value["grad"].detach(), param=value["param"].detach(),
                    numpy_f=np.ascontiguousarray(value["numpy_f"]))
    expected = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in expected.items()}
    out = {k: (v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    assert same(out, {k: (v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v)
                      for k, v in expected.items()})


def test_shared_tensor_stored_once_and_identity_kept(cache):
    pooled = torch.randn(1, 768)
    cond = [[torch.randn(1, 77, 768), {"pooled_output": pooled, "again": pooled}]]
    with sc.CacheWriter(cache) as w:
        w.put("a", cond)
        w.put("b", [[cond[0][0].clone(), {"pooled_output": pooled.clone()}]])  # same bytes, other objects
    r = sc.open_cache(cache)
    assert r.index.header["counts"]["tensors"] == 2
    out = r["a"].materialize()
    assert out[0][1]["pooled_output"] is out[0][1]["again"]
    assert same(r["b"].materialize()[0][1]["pooled_output"], pooled)
    data_bytes = sum(os.path.getsize(p) for p in shard_paths(cache))
    assert data_bytes < (77 * 768 + 768) * 4 * 1.1


def test_materialized_tensors_are_owned_by_the_caller(cache):
    big = torch.randn(512, 1024)  # 2 MiB: the private-mapping path
    small = torch.randn(8)
    with sc.CacheWriter(cache) as w:
        w.put("k", {"big": big, "small": small})
    r = sc.open_cache(cache)
    first = r["k"].materialize()
    first["big"].zero_()
    first["small"].zero_()
    again = r["k"].materialize()
    assert torch.equal(again["big"], big) and torch.equal(again["small"], small)
    assert sc.open_cache(cache)["k"].materialize(check=True)["big"].abs().sum() > 0


def test_shards_are_plain_safetensors(cache):
    values = {f"k{i}": {"t": torch.randn(3, i + 1).to(dt)} for i, dt in
              enumerate([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])}
    with sc.CacheWriter(cache) as w:
        for k, v in values.items():
            w.put(k, v)
    loaded = {}
    for p in shard_paths(cache):
        loaded.update(safetensors.torch.load_file(p))
    assert len(loaded) == len(values)
    stored = sorted((str(t.dtype), tuple(t.shape), t.float().sum().item()) for t in loaded.values())
    expected = sorted((str(v["t"].dtype), tuple(v["t"].shape), v["t"].float().sum().item()) for v in values.values())
    assert stored == expected


def _random_tensor(dt: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    if dt == torch.bool:
        return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5
    n = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
    raw = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return raw.view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)


_leaf_tensor = st.builds(
    _random_tensor,
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.float8_e4m3fn,
                     torch.int64, torch.complex64]),
    st.lists(st.integers(0, 4), min_size=1, max_size=3),
    st.integers(0, 1000),
)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
                    st.binary(max_size=8))
_value = st.recursive(
    st.one_of(_scalar, _leaf_tensor),
    lambda children: st.one_of(st.lists(children, max_size=4), st.tuples(children, children),
                               st.dictionaries(st.text(max_size=5), children, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_value)
def test_random_structures_roundtrip(tmp_path, value):
    path = tmp_path / "hyp"
    with sc.CacheWriter(path) as w:
        w.put("k", value)
    assert same(sc.open_cache(path)["k"].materialize(), value)
    w = sc.CacheWriter(path)
    w.remove(["k"])
    w.close()
