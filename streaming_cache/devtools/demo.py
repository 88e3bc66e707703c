"""A self-contained demonstration of the engine on a generated sample dataset.

It writes small PPM images with kohya-style captions (``name.txt`` beside ``name.ppm``, some captions shared),
encodes them with two toy encoders standing in for a VAE and a text encoder, then shows what the cache does:
a second build encodes nothing, editing one image re-encodes exactly that image, identical captions are
encoded once, and every entry verifies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..builder import BuildReport, build
from ..dataset import DatasetHandle
from ..reader import open_cache
from . import tool_parser
from .toy import folder_items, toy_encoders, write_folder, write_ppm

_CAPTIONS = ["a red square", "a blue circle", "a green triangle", "a red square", "a yellow star", "a blue circle"]


def run_demo(workdir: str, json_output: bool = False, out: Callable[..., None] = print) -> int:
    images = os.path.join(workdir, "images")
    cache = os.path.join(workdir, "cache")
    write_folder(images, _CAPTIONS * 4)
    encoders = toy_encoders()
    steps: dict[str, BuildReport] = {}
    steps["first build"] = build(cache, folder_items(images), encoders, manifest="demo")
    steps["second build (nothing changed)"] = build(cache, folder_items(images), encoders, manifest="demo")
    write_ppm(os.path.join(images, "img005.ppm"), seed=1000)
    steps["after editing img005.ppm"] = build(cache, folder_items(images), encoders, manifest="demo")
    with open_cache(cache) as reader:
        handle = DatasetHandle.from_reader(reader, "demo")
        first = handle[0].materialize()
        verify = reader.verify()
    result: dict[str, Any] = {
        "cache": os.path.abspath(cache),
        "builds": {k: {"encoded": r.encoded, "reused": r.reused, "deduplicated": r.deduplicated,
                       "failed": r.failed, "rows": r.rows, "seconds": round(r.seconds, 3)} for k, r in steps.items()},
        "rows": len(handle),
        "first_row": {"latent": list(first["latent"]["samples"].shape), "cond": list(first["cond"][0][0].shape)},
        "verify_ok": verify.ok,
    }
    if json_output:
        out(json.dumps(result, indent=2))
    else:
        out(f"sample dataset: {len(_CAPTIONS) * 4} images in {images} ({len(set(_CAPTIONS))} distinct captions)")
        for label, r in steps.items():
            out(f"{label:>32}: {r.summary()}")
        out(f"dataset handle: {handle}")
        out(f"first row: latent {result['first_row']['latent']}, conditioning {result['first_row']['cond']}")
        out(f"verify: {'OK' if verify.ok else verify.damaged}")
        out(f"inspect it with: python -m streaming_cache info {cache}")
    return 0 if verify.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = tool_parser("demo")
    p.add_argument("path", nargs="?", default="streaming-cache-demo", help="working directory (default: %(default)s)")
    args = p.parse_args(argv)
    return run_demo(args.path, json_output=args.json, out=print)
