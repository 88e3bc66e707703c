"""Kohya-style dataset folders: images or video clips with ``name.txt`` captions beside them, ``N_name``
repeat folders, and for edit models a reference image per sample.

Layout (what kohya sd-scripts and ComfyUI's own loaders accept, plus edit pairs and masks)::

    dataset/
      a.png  a.txt          # caption file beside the image; each non-empty line is one caption variant
      a_mask.png            # optional: where the loss counts (white) and where not (black)
      b.png  b_ref.png      # an edit pair: b.png is the target, b_ref.png the reference (or ref/b.png)
      clip.mp4  clip.txt    # a video clip (.mp4 .webm .mov .gif .mkv .avi .m4v)
      song.wav  song.txt    # an audio file, for audio models (.wav .flac .mp3 .ogg .m4a .opus)
      10_style/             # samples below are repeated 10 times per epoch; "style" is the fallback caption
        c.jpg  c.txt
        d.webp              # no caption file: the folder's class words ("style") are the caption

If any sample has a reference, the folder is an edit dataset and every sample needs one. Scanning never reads
image bytes; unreadable captions and missing references are reported per sample, not raised, so one bad file
cannot stop the rest.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import xxhash

from ..builder import Item, Part
from ..manifest import MAX_REPEATS

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".gif", ".mkv", ".avi", ".m4v")
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".m4a", ".opus")
REFERENCE_FOLDER = "ref"
_REPEAT_DIR = re.compile(r"^(\d+)_(.*)$")
_COMPANIONS = ("_ref", "_mask")


@dataclass(frozen=True)
class Sample:
    """One image, clip or audio file of a dataset folder. ``name`` is its path relative to the folder, with ``/``
    separators; ``image`` the file's path (a video for ``kind == "video"``, a sound for ``kind == "audio"``)."""

    name: str
    image: str
    captions: tuple[str, ...]
    repeats: int = 1
    caption_file: str | None = None
    kind: str = "image"
    reference: str | None = None
    mask: str | None = None


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


def _companion(dirpath: str, stem: str, suffix: str, names: set[str]) -> str | None:
    for ext in IMAGE_EXTENSIONS:
        for candidate in (f"{stem}{suffix}{ext}", f"{stem}{suffix}{ext.upper()}"):
            if candidate in names:
                return os.path.join(dirpath, candidate)
    return None


def _kind(ext: str) -> str:
    ext = ext.lower()
    return "video" if ext in VIDEO_EXTENSIONS else "audio" if ext in AUDIO_EXTENSIONS else "image"


def scan_folder(root: str, *, caption_extension: str = ".txt") -> ScanResult:
    """List the samples of a dataset folder, sorted by name. Symbolic links to folders are not followed."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such dataset folder")
    result = ScanResult()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if REFERENCE_FOLDER in dirnames:
            dirnames.remove(REFERENCE_FOLDER)  # references, found through their targets
        rel_dir = os.path.relpath(dirpath, root)
        repeats, class_words = 1, ""
        for part in ([] if rel_dir == "." else rel_dir.split(os.sep)):
            m = _REPEAT_DIR.match(part)
            if m:
                digits = m.group(1)  # int() of thousands of digits raises; anything that long is too many anyway
                repeats = max(1, int(digits)) if len(digits) <= 9 else MAX_REPEATS + 1
                class_words = m.group(2).replace("_", " ").strip()
        media = [fn for fn in sorted(filenames)
                 if os.path.splitext(fn)[1].lower() in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS + AUDIO_EXTENSIONS
                 and not os.path.splitext(fn)[0].endswith(_COMPANIONS)]
        prefix = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        rel = lambda fn, prefix=prefix: prefix + fn
        if repeats > MAX_REPEATS:
            result.problems += [(rel(fn), f"folder {rel_dir!r} asks for {repeats} repeats per epoch; at most "
                                 f"{MAX_REPEATS} are supported: rename the folder") for fn in media]
            continue
        names = set(filenames)
        ref_dir = os.path.join(dirpath, REFERENCE_FOLDER)
        ref_names = set(os.listdir(ref_dir)) if os.path.isdir(ref_dir) and not os.path.islink(ref_dir) else set()
        for fn in media:
            stem, ext = os.path.splitext(fn)
            name = rel(fn)
            caption_path = os.path.join(dirpath, stem + caption_extension)
            caption_file = caption_path if os.path.isfile(caption_path) else None
            captions: tuple[str, ...] = ()
            if caption_file is not None:
                try:
                    captions = read_caption(caption_file)
                except (OSError, ValueError) as exc:
                    result.problems.append((name, str(exc)))
                    continue
            if not captions:
                captions = (class_words,)
            reference = _companion(dirpath, stem, "_ref", names) or _companion(ref_dir, stem, "", ref_names)
            result.samples.append(Sample(name, os.path.join(dirpath, fn), captions, repeats, caption_file,
                                         _kind(ext), reference,
                                         _companion(dirpath, stem, "_mask", names)))
    if any(s.reference for s in result.samples):
        result.problems += [(s.name, "has no reference image (name_ref.png beside it, or ref/name.png); an edit "
                             "dataset needs one per sample") for s in result.samples if not s.reference]
        result.samples = [s for s in result.samples if s.reference]
    return result


PartMaker = Callable[[Sample], Part]


def folder_items(root: str, *, image_column: str = "latent", caption_column: str = "cond",
                 reference_column: str = "ref", mask_column: str = "mask", masks: bool | None = None,
                 media_part: PartMaker | None = None,
                 caption_part: Callable[[Sample, str], Part] | None = None,
                 reference_part: PartMaker | None = None,
                 mask_part: Callable[[Sample], Part | None] | None = None,
                 captions: Callable[[Sample], tuple[str, ...]] | None = None,
                 extra_parts: Mapping[str, PartMaker] | None = None,
                 flip_columns: frozenset[str] = frozenset()) -> tuple[list[Item], list[str]]:
    """Builder items for a dataset folder: one per sample and caption variant (``name#2`` for the second line),
    with the image or clip and the caption text as parts (and the reference image, for an edit dataset) and
    the folder's repeats. The ``*_part`` callables make the parts when the defaults (the file's bytes, the
    caption's UTF-8 bytes) are not enough, e.g. to add a clip's frame settings; ``captions`` may widen a
    sample's caption variants (e.g. shuffled tags); ``extra_parts`` adds a column made from every sample (e.g.
    its start frame for image-to-video models).

    ``flip_columns``: each image and clip also comes as a horizontally mirrored copy (kohya's ``flip_aug``, made
    before caching): an item named ``name (flipped)`` whose parts in these columns carry ``"flip": True`` in their
    params (so their cache keys differ and the encoders mirror them), the others (its caption, a sound track)
    shared with the original. Audio files have nothing to mirror.

    Masks: with ``masks`` true (default: when any sample has a ``name_mask`` file) every item gets a mask part,
    so the column is uniform; ``mask_part`` decides what a sample without a mask file gets (default: the
    mask file's bytes, or an empty part meaning "everything counts"; None: no mask part for this sample, e.g. an
    audio file). Also returns the problems of :func:`scan_folder` as ``"name: reason"`` lines, for the build
    report."""
    scan = scan_folder(root)
    media_part = media_part or (lambda s: Part(path=s.image))
    caption_part = caption_part or (lambda s, text: Part(data=text.encode("utf-8")))
    reference_part = reference_part or (lambda s: Part(path=s.reference))
    mask_part = mask_part or (lambda s: Part(path=s.mask) if s.mask else Part(data=b"", params={"mask": "full"}))
    captions = captions or (lambda s: s.captions)
    with_masks = any(s.mask for s in scan.samples) if masks is None else masks
    items, problems = [], [f"{name}: {why}" for name, why in scan.problems]
    for s in scan.samples:
        try:
            media = media_part(s)
            ref = reference_part(s) if s.reference else None
            mask = mask_part(s) if with_masks else None
            variants = captions(s)
            extra = {column: make(s) for column, make in (extra_parts or {}).items()}
        except (OSError, ValueError) as exc:  # e.g. an unreadable file whose size was needed
            problems.append(f"{s.name}: {exc}")
            continue
        mirrors = (False, True) if flip_columns and s.kind != "audio" else (False,)
        for flipped in mirrors:
            for k, caption in enumerate(variants):
                name = s.name if len(variants) == 1 else f"{s.name}#{k + 1}"
                parts = {image_column: media, caption_column: caption_part(s, caption), **extra}
                if ref is not None:
                    parts[reference_column] = ref
                if mask is not None:
                    parts[mask_column] = mask
                if flipped:
                    name = f"{name} (flipped)"
                    parts = {c: _mirrored(p) if c in flip_columns else p for c, p in parts.items()}
                items.append(Item(name, parts, s.repeats))
    return items, problems


def _mirrored(part: Part) -> Part:
    return dataclasses.replace(part, params={**part.params, "flip": True})


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
