"""A worker process of Train LoRA's ``devices`` input (see ``nodes/workers.py``): rank 1..N-1 of a training
that ComfyUI's own process leads as rank 0.

    python scripts/train_worker.py JOB      # started by torch's process launcher with RANK, WORLD_SIZE, ...

Uses its GPU (``LOCAL_RANK``), boots ComfyUI with the arguments ComfyUI was started with (loading this pack),
loads the model from its file as the model's loader did, with the same patches, says it is ready on the store
rank 0 hosts, joins the process group and trains its share as any rank other than 0 does. The job file was
written by the node for this run, in ComfyUI's temporary folder.
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
PACK = os.path.dirname(SCRIPTS)


def use_gpu() -> int | None:
    """Make this worker's GPU (``$LOCAL_RANK``, which the node sets to the GPU's index) the current CUDA device,
    before ComfyUI starts and takes the current device as its own: the engine's
    :func:`~streaming_cache.group.use_local_device`. The GPU, or None without CUDA."""
    if PACK not in sys.path:
        sys.path.insert(0, PACK)
    from streaming_cache.group import use_local_device

    return use_local_device()


def main(job_path: str) -> int:
    use_gpu()
    sys.path.insert(0, SCRIPTS)
    import headless

    with open(job_path, "rb") as f:
        head = pickle.load(f)  # plain values: where ComfyUI is and how it was started
        headless.boot(head["comfyui"], head["argv"], quiet=True)
        job = pickle.load(f)  # after the pack is loaded: the job holds the pack's own objects
    compat = headless.pack_module("backend.compat")
    training_run = headless.pack_module("training_run")
    model = compat.restore_model(job["model"])
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=float(os.environ.get("STREAMING_CACHE_COLLECTIVE_TIMEOUT",
                                                                         "1800"))))
    rank = int(os.environ["RANK"])
    store.set(f"ready/{rank}", "1")
    from streaming_cache.group import join, leave

    join(store, rank, int(os.environ["WORLD_SIZE"]))
    finished = False
    try:
        training_run.train_lora(None, model, job["dataset"], job["spec"],
                                validation_dataset=job["validation_dataset"])
        finished = True
    finally:
        leave(finished)
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)(sys.argv[1]))
