"""Kernel launches counted without a GPU (``streaming_cache.train.launches``): operations by pass, views and
allocations left out, host reads apart."""

from __future__ import annotations

import pytest
import torch

from streaming_cache.train.launches import Launches
from streaming_cache.train.memory_count import counting

pytestmark = pytest.mark.oldest_torch


def test_operations_are_counted_by_pass_and_views_allocations_and_host_reads_are_not_launches():
    x, w = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)
    with Launches() as launched:
        y = x.mm(w)  # 1
        y.view(8).t().reshape(2, 4)[0]  # views: none
        torch.empty(5)  # an allocation: none
        loss = y.sum()  # 1
        assert loss.item() == loss.item()  # two host reads, no launch
        forward = launched.passes["forward"]
        loss.backward()
    assert forward == 2 and launched.host_reads["forward"] == 2 and launched.host_reads["backward"] == 0
    assert launched.passes["backward"] >= 1 and launched.ops["mm"] >= 2, "the gradient of w is a product too"
    summary = launched.summary(top=1)
    assert summary["total"] == summary["forward"] + summary["backward"] == launched.total
    assert summary["top"][0][0] in launched.ops


def test_the_memory_count_counts_the_launches_of_the_same_step():
    base = torch.randn(8, 8, device="meta")
    down = torch.randn(2, 8, device="meta", requires_grad=True)
    with counting(base, down, attention="math") as c:
        (torch.randn(4, 8, device="meta") @ base @ down.t()).sum().backward()
    assert c.launches.passes["forward"] >= 3 and c.launches.passes["backward"] >= 1
    assert c.storages.count().peak > 0


def test_a_graph_replay_is_one_launch_and_marks_keep_each_span():
    w = torch.randn(3, 3, requires_grad=True)
    with Launches() as launched:
        (w * 2).sum()  # 2
        launched.mark("eager")
        with launched.replay():
            (w * 2).sum()  # what stands for the graph's kernels: not launched
        launched.mark("replayed")
    assert launched.marks == {"eager": 2, "replayed": 1} and launched.ops["graph replay"] == 1
