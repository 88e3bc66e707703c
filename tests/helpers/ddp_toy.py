"""Train the toy backend (``toy_backend.py``) on one process or several, as torchrun launches them:

    python -m torch.distributed.run --nproc-per-node 2 ddp_toy.py CACHE STATE OUT [options]

Rank 0 saves the checkpoint to STATE (every ``--save-every`` steps, at the end, and when the run is left by an
error or a signal) and writes the final weights, losses and step to OUT as JSON; ``--resume`` continues from
STATE (rank 0 reads it and sends it to the others). Faults for the tests: ``--stop-at K`` (Cancel on rank 0
after step K), ``--kill-rank R --kill-at K`` (SIGKILL of rank R after its step K), ``--fail-rank R --fail-x X``
(rank R cannot train on the sample x = X). ``--grad-check`` instead checks the gradient sum directly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import streaming_cache as sc  # noqa: E402
from helpers.toy_backend import Toy  # noqa: E402
from streaming_cache.group import init_from_env, leave  # noqa: E402
from streaming_cache.mix import DatasetMix, MixPart  # noqa: E402
from streaming_cache.train import checkpoint  # noqa: E402
from streaming_cache.train.backend import train_with  # noqa: E402
from streaming_cache.train.distributed import GradientSum  # noqa: E402
from streaming_cache.train.loop import TrainHooks  # noqa: E402
from streaming_cache.train.spec import TrainSpec  # noqa: E402


def _say(line: str) -> None:
    """One line in one write: the ranks share the output."""
    os.write(1, (line + "\n").encode())


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt("terminated")


def grad_check() -> None:
    """Gradients summed over 2 ranks in several buckets: each rank's gradient is its rank + 1 times a tensor's
    number; one tensor gets no gradient on rank 1 (zeros there); accumulation over two passes."""
    group = init_from_env()
    assert group is not None
    params = [torch.zeros(3, requires_grad=True) for _ in range(5)]
    grads = GradientSum(params, group, bucket_bytes=8)  # 3 floats = 12 bytes: one tensor per bucket
    assert len(grads.buckets) == 5
    for last in (False, True):
        with grads.backward(last):
            used = params if group.rank == 0 else params[:4]
            sum(p.sum() * (group.rank + 1) * (k + 1) for k, p in enumerate(used)).backward()
    grads.finish()
    got = [p.grad.tolist() for p in params]
    expected = [[2.0 * 3 * (k + 1)] * 3 for k in range(4)] + [[2.0 * 1 * 5] * 3]
    assert got == expected, got
    _say(f"rank {group.rank}: gradient sums ok")
    leave(finished=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cache", nargs="?")
    ap.add_argument("state", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at", type=int, default=0)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-x", type=float, default=None)
    ap.add_argument("--grad-check", action="store_true")
    ap.add_argument("--mix", action="store_true", help="train a mix: rows 0-13 and rows 14- (weight 0.5)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)
    if args.grad_check:
        grad_check()
        return
    group = init_from_env()
    rank = group.rank if group else 0
    main_rank = rank == 0
    spec = TrainSpec.build({"steps": args.steps, "learning_rate": 0.05, "batch_size": args.batch, "seed": 7,
                            "optimizer": "AdamW", "grad_accumulation_steps": args.accumulation, "workers": 1,
                            "save_every": args.save_every, "max_grad_norm": 1.0})
    state = checkpoint.load_checkpoint(args.state) if args.resume and main_rank else None
    if group is not None:
        state = group.broadcast(state)
    toy = Toy(fail=args.fail_x if rank == args.fail_rank else None)

    def on_step(step: int, loss: float) -> None:
        if rank == args.kill_rank and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    hooks = TrainHooks(on_step=on_step,
                       should_stop=(lambda: main_rank and args.stop_at > 0 and len(toy.micros) >= args.stop_at *
                                    args.accumulation),
                       save=(lambda s, final: checkpoint.save_checkpoint(args.state, s)) if main_rank else None)
    data = sc.open_cache(args.cache).dataset()
    if args.mix:
        data = DatasetMix([MixPart(data[:14], "first"), MixPart(data[14:], "rest", weight=0.5)])
    result = train_with(toy, data, spec, resume=state, hooks=hooks, group=group)
    out = {"rank": rank, "step": result.step, "stopped": result.stopped, "losses": result.losses,
           "w": toy.params["w"].item(), "b": toy.params["b"].item(), "datasets": result.dataset_losses}
    if main_rank:
        with open(args.out, "w") as f:
            json.dump(out, f)
    _say("RESULT " + json.dumps(out))
    if group is not None:
        leave(finished=True)


if __name__ == "__main__":
    main()
