"""What :func:`streaming_cache.group.leave` waits for before it destroys a process group: every tensor handed to a
collective is let go of by the backend's threads (a reference they hold is stood in for by a view, which holds the
tensor the same way)."""

from __future__ import annotations

import threading

import pytest
import torch

from streaming_cache import group

pytestmark = pytest.mark.oldest_torch


def test_a_handed_tensor_is_kept_until_every_other_holder_lets_go(monkeypatch):
    monkeypatch.setattr(group, "_handed", [])
    t = group.handed(torch.zeros(3))
    worker_ref = t.view(3)  # what a worker thread's reference does to the tensor's count
    assert not group._await_release(0.05)
    assert group._handed and group._handed[0][0] is t
    del worker_ref
    assert group._await_release(0.05)
    assert group._handed == []


def test_released_tensors_are_dropped_at_the_next_hand(monkeypatch):
    monkeypatch.setattr(group, "_handed", [])
    held = group.handed(torch.zeros(1))
    ref = held.view(1)
    for _ in range(100):
        group.handed(torch.zeros(1))  # each let go of at once: none accumulates
    assert [kept for kept, _ in group._handed][0] is held and len(group._handed) == 2
    del ref
    group.handed(torch.zeros(1))
    assert len(group._handed) == 1


def test_a_reference_let_go_of_while_waiting_ends_the_wait(monkeypatch):
    monkeypatch.setattr(group, "_handed", [])
    t = group.handed(torch.zeros(2))
    refs = [t.view(2)]
    thread = threading.Timer(0.05, refs.clear)
    thread.start()
    assert group._await_release(60.0)
    thread.join()


def test_leave_without_a_group_does_nothing():
    assert not torch.distributed.is_initialized()
    group.leave(finished=True)


@pytest.fixture
def one_process_group(monkeypatch):
    """A real gloo process group of one process (the collectives run, the same code paths as with more), left
    through :func:`group.leave` with this test's handed tensors still kept: destroyed directly, a gloo thread that
    lets go of a collective's tensor just then hangs the destroy on PyTorch 2.5 (it did, on a loaded machine)."""
    monkeypatch.setattr(group, "_handed", [])
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield group.Group(0, 1)
    finally:
        group.leave(finished=True)
    assert not torch.distributed.is_initialized()


def test_objects_travel_only_in_tensors_the_group_keeps(one_process_group, monkeypatch):
    """Broadcast and gather hand gloo only tensors that :func:`group.handed` keeps (torch's object collectives
    make tensors of their own, which :func:`group.leave` could not wait for), and bring the objects back whole,
    made outside inference mode."""
    seen: list[int] = []

    def checked(collective):
        def call(*args, **kwargs):
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            kept = {id(t) for t, _ in group._handed}
            assert tensors and all(id(t) in kept for t in tensors), f"{collective.__name__} got a tensor not kept"
            seen.append(len(tensors))
            return collective(*args, **kwargs)
        return call

    for name in ("broadcast", "all_gather"):
        monkeypatch.setattr(torch.distributed, name, checked(getattr(torch.distributed, name)))
    obj = {"params": [torch.arange(4.0)], "step": 3, "name": "é" * 1000}
    with torch.inference_mode():
        sent = one_process_group.broadcast(obj)
        gathered = one_process_group.gather(obj)
    assert sent is obj and len(gathered) == 1
    assert gathered[0]["step"] == 3 and gathered[0]["name"] == obj["name"]
    assert torch.equal(gathered[0]["params"][0], obj["params"][0]) and not gathered[0]["params"][0].is_inference()
    assert len(seen) == 4, "sizes then bytes, for each"
