"""A 2-rank job that ends with collectives still in flight (posted asynchronously, never waited for, as the pack
posts its gradient buckets), under torchrun with gloo; each rank prints "done" just before it ends (see tests/engine/test_group_exit.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 group_exit.py MODE

MODE: ``leave`` (the pack's way out, :func:`streaming_cache.group.leave`), ``exit`` (joined through the pack, left
by nothing: the pack's exit handler must end the group), ``bare`` (``torch.distributed`` alone, nothing ends the
group: the gloo worker threads let go of the tensors while Python shuts down, and the process aborts with
"terminate called without an active exception" in most runs).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from streaming_cache import group

IN_FLIGHT = 200  # enough that the worker threads are still busy when the main thread is done


def main(mode: str) -> None:
    if mode == "bare":
        dist.init_process_group("gloo")
    else:
        assert group.init_from_env() is not None
    for _ in range(IN_FLIGHT):
        t = torch.ones(100_000)
        # the pack hands what it gives a collective to the group (as its gradient buckets do), which is what lets
        # the group be left without a hang on older PyTorch (see streaming_cache.group.handed)
        dist.all_reduce(t if mode == "bare" else group.handed(t), async_op=True)
    print("done", flush=True)
    if mode == "leave":
        group.leave(finished=True)


if __name__ == "__main__":
    main(sys.argv[1])
