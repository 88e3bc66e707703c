"""Encoders' inputs prepared ahead (``streaming_cache.prepare``): decoding the next batch runs while the current
one encodes, a part that fails or hangs in preparation fails its own item only."""

from __future__ import annotations

import threading

import pytest
import torch

import streaming_cache as sc
from streaming_cache import prepare


def _items(n: int) -> list[sc.Item]:
    return [sc.Item(f"i{i}", {"x": sc.Part(data=bytes([i]))}) for i in range(n)]


def test_the_next_batch_is_prepared_while_the_current_one_encodes(tmp_path):
    """Preparing batch 2 waits until batch 1 is being encoded, and encoding batch 1 waits until batch 2 is
    prepared: only overlapped work finishes (a sequential pipeline would fail on the waits' timeouts)."""
    encoding_first, second_prepared = threading.Event(), threading.Event()

    def prep(part: sc.Part) -> torch.Tensor:
        if part.data[0] >= 2:  # batch 2: items 2 and 3
            assert encoding_first.wait(30), "batch 2 is prepared while batch 1 encodes"
            second_prepared.set()
        return torch.tensor([float(part.data[0])])

    def encode(values: list[torch.Tensor]) -> list[torch.Tensor]:
        if float(values[0]) == 0:
            encoding_first.set()
            assert second_prepared.wait(30), "batch 1 encodes while batch 2 is prepared"
        return [v * 10 for v in values]

    report = sc.build(tmp_path / "cache", _items(4), {"x": sc.Encoder("f", encode, batch_size=2, prepare=prep)})
    assert report.failed == 0 and report.encoded == 4
    reader = sc.open_cache(tmp_path / "cache")
    assert sorted(float(reader[k].materialize()) for k in reader.keys()) == [0, 10, 20, 30]


def test_a_part_that_cannot_be_prepared_fails_alone(tmp_path):
    def prep(part: sc.Part) -> int:
        if part.data[0] == 1:
            raise ValueError("cannot decode i1")
        return part.data[0]

    report = sc.build(tmp_path / "cache", _items(4),
                      {"x": sc.Encoder("f", lambda vs: [torch.tensor([v]) for v in vs], batch_size=4, prepare=prep)})
    assert report.encoded == 3 and [f.item for f in report.failures] == ["i1"]
    assert "cannot decode i1" in report.failures[0].error


def test_a_part_whose_preparation_never_returns_fails_after_the_timeout_and_nothing_hangs(tmp_path, monkeypatch):
    monkeypatch.setenv(prepare.TIMEOUT_ENV, "2")
    never = threading.Event()

    def prep(part: sc.Part) -> int:
        if part.data[0] == 2:
            never.wait()  # a decoder stuck on a damaged clip
        return part.data[0]

    try:
        report = sc.build(tmp_path / "cache", _items(5),
                          {"x": sc.Encoder("f", lambda vs: [torch.tensor([v]) for v in vs], batch_size=2,
                                           prepare=prep)})
    finally:
        never.set()
    assert report.encoded == 4 and [f.item for f in report.failures] == ["i2"]
    assert "longer than 2 s" in report.failures[0].error


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "nan"])
def test_a_timeout_setting_that_is_not_a_positive_number_is_refused_naming_it(monkeypatch, raw):
    monkeypatch.setenv(prepare.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=prepare.TIMEOUT_ENV):
        prepare.Lookahead([], {})
