"""Builds a cache from a folder with a slow deterministic encoder, committing after every batch.

Used by the kill tests: ``python build_worker.py SOURCE CACHE [SLEEP_S]``. Prints ``progress D/T`` lines.
"""

import os
import sys
import time

import torch

import streaming_cache as sc


def encoders(sleep_s: float) -> dict:
    def vae(parts):
        time.sleep(sleep_s * len(parts))
        out = []
        for p in parts:
            data = open(p.path, "rb").read()
            g = torch.Generator().manual_seed(int.from_bytes(data[:4], "little"))
            out.append({"samples": torch.randn(1, 4, 16, 16, generator=g)})
        return out

    def clip(parts):
        time.sleep(sleep_s * len(parts))
        return [[[torch.full((1, 8, 16), float(len(p.data))), {"pooled_output": torch.ones(1, 16)}]] for p in parts]

    return {"latent": sc.Encoder("vae", vae, batch_size=4), "cond": sc.Encoder("clip", clip, batch_size=4)}


def items(folder: str) -> list:
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".bin"):
            cap = open(os.path.join(folder, name[:-4] + ".txt"), "rb").read()
            out.append(sc.Item(name, {"latent": sc.Part(path=os.path.join(folder, name)), "cond": sc.Part(data=cap)}))
    return out


def build(src: str, cache: str, sleep_s: float = 0.0, **kwargs):
    return sc.build(cache, items(src), encoders(sleep_s), commit_seconds=0, **kwargs)


if __name__ == "__main__":
    src, cache = sys.argv[1], sys.argv[2]
    sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.005
    build(src, cache, sleep_s, progress=lambda d, t: print(f"progress {d}/{t}", flush=True))
    print("done", flush=True)
