"""What :func:`streaming_cache.group.leave` waits for before it destroys a process group: every tensor handed to a
collective is let go of by the backend's threads (a reference they hold is stood in for by a view, which holds the
tensor the same way)."""

from __future__ import annotations

import threading

import torch

from streaming_cache import group


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
