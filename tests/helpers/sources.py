"""Source folders for the builder tests and a toy encoder that records what it is asked to encode."""

from __future__ import annotations

import os
import time

import torch

import streaming_cache as sc


class Encoders:
    """A toy VAE and text encoder that record every input they see; ``bad`` inputs make them raise."""

    def __init__(self, fingerprint: str = "v1", batch_size: int = 4, bad: tuple[bytes, ...] = (b"BAD",)):
        self.images: list[str] = []
        self.captions: list[bytes] = []
        self.batches: list[int] = []
        self.bad = bad
        self.fingerprint = fingerprint
        self.batch_size = batch_size

    def vae(self, parts):
        self.batches.append(len(parts))
        out = []
        for p in parts:
            data = open(p.path, "rb").read()
            if any(b in data for b in self.bad):
                raise ValueError(f"cannot decode {os.path.basename(p.path)}")
            self.images.append(os.path.basename(p.path))
            out.append({"samples": torch.tensor([float(len(data)), float(data[0])]).reshape(1, 2, 1, 1)})
        return out

    def clip(self, parts):
        out = []
        for p in parts:
            self.captions.append(p.data)
            out.append([[torch.full((1, 3), float(len(p.data))), {"pooled_output": torch.ones(1, 2)}]])
        return out

    def encoders(self, settings=None):
        return {"latent": sc.Encoder("vae-" + self.fingerprint, self.vae, settings or {}, self.batch_size),
                "cond": sc.Encoder("clip-" + self.fingerprint, self.clip, batch_size=self.batch_size)}


def write_dataset(folder, n: int, captions=None) -> None:
    """``img000.bin`` + ``img000.txt`` ...: random bytes whose first byte is the image number."""
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        with open(os.path.join(folder, f"img{i:03d}.bin"), "wb") as f:
            f.write(bytes([i % 256]) + os.urandom(32))
        with open(os.path.join(folder, f"img{i:03d}.txt"), "w") as f:
            f.write(captions[i % len(captions)] if captions else f"caption {i}")


def write_one(folder, name, data: bytes, caption: str) -> None:
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    with open(os.path.join(folder, name[:-4] + ".txt"), "w") as f:
        f.write(caption)


def age_files(folder) -> None:
    """Make mtimes older than the racy window so the stat cache may trust them."""
    old = time.time() - 60
    for n in os.listdir(folder):
        os.utime(os.path.join(folder, n), (old, old))


def items_of(folder) -> list[sc.Item]:
    """One item per ``*.bin`` with its ``.txt`` caption."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".bin"):
            cap = open(os.path.join(folder, name[:-4] + ".txt"), "rb").read()
            out.append(sc.Item(name, {"latent": sc.Part(path=os.path.join(folder, name)), "cond": sc.Part(data=cap)}))
    return out
