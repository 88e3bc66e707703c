"""What a rank receives from rank 0 inside inference mode (as ComfyUI runs nodes), under torchrun with gloo; rank 1
prints one JSON line (see tests/train/test_distributed.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 group_received.py
"""

from __future__ import annotations

import json

import torch

from streaming_cache.group import init_from_env, leave


def main() -> None:
    group = init_from_env()
    assert group is not None
    sent = {"params": [torch.ones(3)], "step": 2} if group.is_main else None  # ordinary tensors, as loaded
    mine = torch.full((2,), float(group.rank))
    with torch.inference_mode():
        state = group.broadcast(sent)
        gathered = group.gather(mine)
    received = [*state["params"], *gathered]
    for t in received:
        t.add_(1.0)  # what an optimizer loading the state does, outside inference mode
    if group.rank == 1:
        print("RESULT " + json.dumps({"inference": [t.is_inference() for t in received],
                                      "values": [t.tolist() for t in received], "step": state["step"]}), flush=True)
    leave(finished=True)


if __name__ == "__main__":
    main()
