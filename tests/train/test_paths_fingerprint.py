"""Path confinement of user-supplied names, and weight fingerprints."""

from __future__ import annotations

import os

import pytest
import torch

from streaming_cache.train.fingerprint import fingerprint_tensors
from streaming_cache.train.paths import PathError, plain_name, resolve_inside


def test_resolve_inside_accepts_names_and_refuses_escapes(tmp_path):
    root, other = tmp_path / "out", tmp_path / "in"
    root.mkdir(), other.mkdir()
    assert resolve_inside("caches/a", [str(root)]) == str(root / "caches" / "a")
    assert resolve_inside(str(other / "x"), [str(root), str(other)]) == str(other / "x")
    for bad in ("../secret", "a/../../secret", "/etc/passwd", ""):
        with pytest.raises(PathError):
            resolve_inside(bad, [str(root)], what="cache name")
    os.symlink(tmp_path, root / "link")
    with pytest.raises(PathError, match="outside the allowed folders"):
        resolve_inside("link/secret", [str(root)])


def test_plain_name():
    assert plain_name(" my_lora ") == "my_lora"
    for bad in ("a/b", "..", ".hidden", "c:x", ""):
        with pytest.raises(PathError, match="plain name"):
            plain_name(bad)


def test_fingerprint_changes_with_any_weight_change():
    g = torch.Generator().manual_seed(0)
    sd = {"a.weight": torch.randn(64, 64, generator=g), "a.bias": torch.randn(64, generator=g)}
    base = fingerprint_tensors(sd)
    assert fingerprint_tensors(dict(reversed(list(sd.items())))) == base, "order does not matter"
    changed = {k: v.clone() for k, v in sd.items()}
    changed["a.weight"] += 1e-3  # a fine-tune moves (almost) every value
    assert fingerprint_tensors(changed) != base
    assert fingerprint_tensors({**sd, "a.weight": sd["a.weight"].half()}) != base
    assert fingerprint_tensors({"b.weight": sd["a.weight"], "a.bias": sd["a.bias"]}) != base
    assert fingerprint_tensors(sd, extra={"layer": -2}) != base
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        assert fingerprint_tensors({"w": sd["a.weight"].to(fp8)}) != fingerprint_tensors({"w": sd["a.weight"]})


def test_fingerprint_of_a_tensor_larger_than_float_precision():
    big = torch.zeros(37_945_344, dtype=torch.uint8)  # 2**24 < n: float sample positions would overrun
    a = fingerprint_tensors({"w": big})
    big[-1] = 1  # the last element is always sampled
    assert fingerprint_tensors({"w": big}) != a
