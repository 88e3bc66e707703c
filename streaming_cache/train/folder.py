"""Kohya-style dataset folders: images with ``name.txt`` captions beside them, ``N_name`` repeat folders.

Layout (what kohya sd-scripts and ComfyUI's own loaders accept)::

    dataset/
      a.png  a.txt          # caption file beside the image; each non-empty line is one caption variant
      10_style/             # images below are repeated 10 times per epoch; "style" is the fallback caption
        b.jpg  b.txt
        c.webp              # no caption file: the folder's class words ("style") are the caption

Scanning never reads image bytes; unreadable captions are reported per sample, not raised, so one bad file
cannot stop the rest.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import xxhash

from ..builder import Item, Part
from ..manifest import MAX_REPEATS

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_REPEAT_DIR = re.compile(r"^(\d+)_(.*)$")


@dataclass(frozen=True)
class Sample:
    """One image of a dataset folder. ``name`` is its path relative to the folder, with ``/`` separators."""

    name: str
    image: str
    captions: tuple[str, ...]
    repeats: int = 1
    caption_file: str | None = None


@dataclass
class ScanResult:
    samples: list[Sample] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (relative name, what is wrong)


def read_caption(path: str) -> tuple[str, ...]:
    """The caption variants of a caption file: its non-empty lines, stripped. Raises ValueError if not UTF-8."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: caption is not UTF-8 text (byte {exc.start}); re-save it as UTF-8") from exc
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def scan_folder(root: str, *, caption_extension: str = ".txt") -> ScanResult:
    """List the samples of a dataset folder, sorted by name. Symbolic links to folders are not followed."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such dataset folder")
    result = ScanResult()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        repeats, class_words = 1, ""
        for part in ([] if rel_dir == "." else rel_dir.split(os.sep)):
            m = _REPEAT_DIR.match(part)
            if m:
                digits = m.group(1)  # int() of thousands of digits raises; anything that long is too many anyway
                repeats = max(1, int(digits)) if len(digits) <= 9 else MAX_REPEATS + 1
                class_words = m.group(2).replace("_", " ").strip()
        if repeats > MAX_REPEATS:
            result.problems += [(f"{rel_dir.replace(os.sep, '/')}/{fn}", f"folder {rel_dir!r} asks for {repeats} "
                                 f"repeats per epoch; at most {MAX_REPEATS} are supported: rename the folder")
                                for fn in sorted(filenames) if os.path.splitext(fn)[1].lower() in IMAGE_EXTENSIONS]
            continue
        for fn in sorted(filenames):
            stem, ext = os.path.splitext(fn)
            if ext.lower() not in IMAGE_EXTENSIONS:
                continue
            image = os.path.join(dirpath, fn)
            name = fn if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{fn}"
            caption_file = os.path.join(dirpath, stem + caption_extension)
            if os.path.isfile(caption_file):
                try:
                    captions = read_caption(caption_file)
                except (OSError, ValueError) as exc:
                    result.problems.append((name, str(exc)))
                    continue
            else:
                caption_file = None
                captions = ()
            if not captions:
                captions = (class_words,)
            result.samples.append(Sample(name, image, captions, repeats, caption_file))
    return result


def folder_items(root: str, *, image_column: str = "latent", caption_column: str = "cond") -> tuple[list[Item], list[str]]:
    """Builder items for a dataset folder: one per image and caption variant (``name#2`` for the second line),
    with the image file and the caption text as parts and the folder's repeats. Also returns the problems of
    :func:`scan_folder` as ``"name: reason"`` lines, for the build report."""
    scan = scan_folder(root)
    items = []
    for s in scan.samples:
        for k, caption in enumerate(s.captions):
            name = s.name if len(s.captions) == 1 else f"{s.name}#{k + 1}"
            items.append(Item(name, {image_column: Part(path=s.image),
                                     caption_column: Part(data=caption.encode("utf-8"))}, s.repeats))
    return items, [f"{name}: {why}" for name, why in scan.problems]


def folder_stamp(root: str) -> str:
    """Changes when any file below ``root`` is added, removed or modified (names, sizes, mtimes); cheap, reads no
    file contents. ComfyUI uses it to know when to run the encoding node again."""
    h = xxhash.xxh3_64()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            try:
                st = os.stat(os.path.join(dirpath, fn))
            except OSError:
                continue
            h.update(f"{dirpath}/{fn}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    return h.hexdigest()
