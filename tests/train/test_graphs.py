"""CUDA graphs of a training step: the option, the eager path, the signature that decides which recording serves a
call, the checkpointing it needs. Recording and replay run through the CPU emulation in ``test_graph_replay.py``
and on a GPU in its ``cuda`` cases."""

from __future__ import annotations

import uuid

import pytest
import torch

from streaming_cache.train import graphs
from streaming_cache.train.recompute import Replay

pytestmark = pytest.mark.oldest_torch


@pytest.mark.parametrize("value,expected", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_overrides_the_setting(monkeypatch, value, expected):
    monkeypatch.setenv("STREAMING_CACHE_CUDA_GRAPHS", value)
    assert graphs.requested(True) is expected and graphs.requested(False) is expected


def test_without_the_environment_variable_the_setting_decides(monkeypatch):
    monkeypatch.delenv("STREAMING_CACHE_CUDA_GRAPHS", raising=False)
    assert graphs.requested(True) is True and graphs.requested(False) is False


def test_an_unknown_option_value_says_what_to_use(monkeypatch):
    monkeypatch.setenv("STREAMING_CACHE_CUDA_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="use 1 .on. or 0 .off."):
        graphs.requested()


def test_calls_on_the_cpu_run_the_module_as_before_and_the_forward_is_given_back():
    module = torch.nn.Linear(4, 4)
    adapter = torch.zeros(4, requires_grad=True)
    x = torch.randn(2, 4)
    expected = module(x)
    with graphs.graphed_forward(module, [adapter]) as graphed:
        assert graphed is not None and "forward" in module.__dict__
        torch.testing.assert_close(module(x), expected)
        with torch.no_grad():
            module(x)
        assert graphed.eager_calls == 2 and graphed.attempts == 0 and not graphed.recordings
    assert "forward" not in module.__dict__
    assert {k: graphs.last_run[k] for k in ("recorded", "replays", "eager_calls", "failed")} == \
        {"recorded": 0, "replays": 0, "eager_calls": 2, "failed": None}


def test_not_enabled_leaves_the_module_alone():
    module = torch.nn.Linear(4, 4)
    with graphs.graphed_forward(module, [], enabled=False) as graphed:
        assert graphed is None and "forward" not in module.__dict__


def test_a_recording_serves_calls_whose_tensors_and_simple_values_match():
    def tensor(*shape, **kwargs):  # a device tensor (the meta device stands for CUDA here)
        return torch.empty(*shape, device="meta", **kwargs)

    t = tensor(2, 3)
    sig = graphs._signature([t, 1, "a", None, uuid.uuid4()])
    assert sig == graphs._signature([tensor(2, 3), 1, "a", None, uuid.uuid4()])  # other values, same kinds
    for other in ([tensor(2, 4), 1, "a", None, uuid.uuid4()],  # shape
                  [tensor(2, 3, dtype=torch.float16), 1, "a", None, uuid.uuid4()],  # dtype
                  [tensor(2, 3, requires_grad=True), 1, "a", None, uuid.uuid4()],
                  [t, 2, "a", None, uuid.uuid4()], [t, 1, "b", None, uuid.uuid4()],
                  [t, 1, "a", 0, uuid.uuid4()], [t, 1, "a", None, "uuid"]):
        assert graphs._signature(other) != sig, other
    # a small CPU tensor is a constant of the recording: its values count
    assert graphs._signature([torch.ones(2)]) == graphs._signature([torch.ones(2)])
    assert graphs._signature([torch.ones(2)]) != graphs._signature([torch.zeros(2)])


@pytest.mark.parametrize("preserve", [True, False])
def test_checkpointing_saves_the_random_state_unless_told_not_to(monkeypatch, preserve):
    seen = {}

    def fake(function, *args, **kwargs):
        seen.update(kwargs)
        return function(*args)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", fake)
    Replay([], preserve_rng_state=preserve).checkpoint(lambda x: x + 1, torch.zeros(1))
    assert seen["preserve_rng_state"] is preserve and seen["use_reentrant"] is False
