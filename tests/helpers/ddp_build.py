"""Build a cache from a folder (``sources.py``'s toy images and captions) on one process or several, as torchrun
launches them:

    python -m torch.distributed.run --nproc-per-node 2 ddp_build.py SOURCE CACHE [--kill-rank R --kill-after N]

Commits after every batch. Each rank prints ``ENCODED <json>``: the images and captions it encoded; rank 0 prints
``REPORT <json>``. ``--kill-rank R --kill-after N``: rank R kills itself (SIGKILL) after encoding N batches.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import streaming_cache as sc  # noqa: E402
from helpers.sources import Encoders, items_of  # noqa: E402
from streaming_cache.group import init_from_env, leave  # noqa: E402


def _say(line: str) -> None:
    """One line in one write: the ranks share the output."""
    os.write(1, (line + "\n").encode())


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt("terminated")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("cache")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-after", type=int, default=0)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)
    group = init_from_env()
    rank = group.rank if group else 0
    enc = Encoders(batch_size=2)
    encoders = enc.encoders()
    vae = encoders["latent"].encode

    def counting_vae(parts):
        out = vae(parts)
        if rank == args.kill_rank and len(enc.batches) > args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    encoders["latent"].encode = counting_vae
    report = sc.build(args.cache, items_of(args.source), encoders, commit_seconds=0, group=group)
    _say("ENCODED " + json.dumps({"rank": rank, "images": enc.images, "captions": [c.decode() for c in enc.captions]}))
    if rank == 0:
        _say("REPORT " + json.dumps({"encoded": report.encoded, "reused": report.reused, "rows": report.rows,
                                     "failed": report.failed, "deduplicated": report.deduplicated,
                                     "failures": [f.item for f in report.failures]}))
    if group is not None:
        leave(finished=True)


if __name__ == "__main__":
    main()
