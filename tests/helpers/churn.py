"""A writer that keeps changing a cache: each round adds junk entries in small shards, removes them and compacts
(through ``clean``, as ``python -m streaming_cache clean --yes`` does), which rewrites every small shard, those of
the cache's own entries included. Run as a process beside readers or a training (tests/reliability/test_leases.py).

    python churn.py CACHE ROUNDS [STOP]      # ROUNDS rounds (0: until the file STOP exists); prints ROUNDS n
"""

from __future__ import annotations

import os
import sys

import torch

import streaming_cache as sc
from streaming_cache.clean import clean


def churn_round(cache: str, tag: str) -> None:
    with sc.CacheWriter(cache, shard_bytes=2048) as w:
        for i in range(4):
            w.put(f"junk{tag}-{i}", {"x": torch.full((64,), float(i))})
            w.commit()
        w.remove([f"junk{tag}-{i}" for i in range(4)])
    clean(cache, dry_run=False)


def churn(cache: str, rounds: int, stop: str | None = None) -> int:
    done = 0
    while (rounds == 0 or done < rounds) and not (stop and os.path.exists(stop)):
        churn_round(cache, f"{os.getpid()}-{done}")
        done += 1
    return done


if __name__ == "__main__":
    print(f"ROUNDS {churn(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)}", flush=True)
