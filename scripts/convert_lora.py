"""Convert a LoRA file between key formats: ComfyUI's own, kohya's (A1111, Forge, SD.Next, Civitai, kohya's scripts)
and diffusers' (``load_lora_weights``). Run it with ComfyUI's Python:

    python scripts/convert_lora.py IN.safetensors OUT.safetensors --to kohya|diffusers|comfyui --model MODEL
        [--comfyui PATH] [--force]

``--model`` is the checkpoint or diffusion model (.safetensors) the LoRA is for: module names differ between
architectures, and ComfyUI's map of them is built from the model's layout. Only its header is read (no weights
are loaded, so a 20 GB model takes a second). A checkpoint brings its text encoders' names, for LoRAs with
``lora_te*`` keys. IN may be in any layout ComfyUI's LoRA loader reads for that model. OUT keeps IN's metadata,
with ``streaming_cache_lora_format`` set; it is written atomically and never over an existing file unless
``--force``. kohya's and diffusers' formats hold LoRA matrices only: offsets of norms and biases (which ComfyUI's
trainer learns) are left out, and the report says how many.

ComfyUI is found as ``headless.py`` finds it (``--comfyui``, ``COMFYUI_PATH``, or this pack's place in
``ComfyUI/custom_nodes``); only this pack's nodes are loaded. Exit status 0, or 1 with what went wrong, which
file, and what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import headless

FORMATS = ("comfyui", "kohya", "diffusers")


def refuse_existing(dst: str, force: bool) -> None:
    if os.path.lexists(dst) and not force:
        raise ValueError(f"{dst} exists; give another output file, or --force to replace it")


def convert_file(src: str, dst: str, fmt: str, model: str, *, force: bool = False) -> dict[str, Any]:
    """Write the LoRA ``src`` to ``dst`` in the format ``fmt``, with the module names of ``model``; what was done
    (formats, key counts, what was left out). ValueError, naming the file and the remedy, for bad input.
    Needs a booted ComfyUI (:func:`headless.boot`)."""
    from safetensors import safe_open

    compat = headless.pack_module("backend.compat")
    lora_formats = headless.pack_module("train.lora_formats", "streaming_cache")
    checkpoint = headless.pack_module("train.checkpoint", "streaming_cache")
    lora_formats.check_format(fmt)
    refuse_existing(dst, force)
    try:
        with safe_open(src, "pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own types for a missing or damaged file
        raise ValueError(f"{src}: not a readable .safetensors LoRA ({exc}); give a LoRA file in safetensors") from exc
    table = compat.lora_name_table_of_file(model)
    source = lora_formats.detect_format(tensors, table)
    try:
        converted = lora_formats.convert(tensors, table, fmt)
    except lora_formats.LoraFormatError as exc:
        raise ValueError(f"{src}: {exc}") from exc
    metadata[lora_formats.FORMAT_METADATA_KEY] = fmt
    checkpoint.save_lora(dst, converted.tensors, metadata)
    return {"input": src, "output": dst, "family": table.family, "from": source or "mixed", "to": fmt,
            "keys_in": len(tensors), "keys_out": len(converted.tensors), "left_out": converted.left_out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="convert_lora.py", description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="the LoRA file (.safetensors), in any layout ComfyUI reads")
    p.add_argument("output", help="the file to write (.safetensors)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the key format to write")
    p.add_argument("--model", required=True, help="checkpoint or diffusion model (.safetensors) the LoRA is for")
    p.add_argument("--comfyui", help="ComfyUI folder (default: COMFYUI_PATH or the custom_nodes parent)")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = p.parse_args(argv)
    src, dst, model = (os.path.abspath(x) for x in (args.input, args.output, args.model))  # boot changes directory
    for path, what in ((src, "LoRA"), (model, "model")):
        if not os.path.isfile(path):
            print(f"error: {path}: no such file; give the {what} file's path", file=sys.stderr)
            return 1
    try:
        refuse_existing(dst, args.force)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    headless.boot(headless.find_comfyui(args.comfyui), ["--cpu"], quiet=True, others=False)
    try:
        report = convert_file(src, dst, args.to, model, force=args.force)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot write {dst} ({exc}); give a writable path", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['output']}: {report['keys_out']} keys in the {report['to']} format (read as {report['from']}, "
          f"{report['keys_in']} keys; {report['family']} model)")
    if report["left_out"]:
        print(f"left out {len(report['left_out'])} offsets of norms and biases, which only ComfyUI's format holds "
              f"(e.g. {', '.join(report['left_out'][:3])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
