"""ComfyUI's archive (``.tar.gz``, ``.tar``, ``.zip``) read as untrusted input: checked whole, then unpacked within
bounds. The installer's part that reads archives; standard library only, like the installer.

One opener, :func:`open_archive`, chosen by the file's content (never its name), serves both the check and the
unpack, so both see the same archive. Opening reads the archive to its end before any member is trusted: a
``.tar.gz`` through gzip's checksum and length (``tarfile`` stops at tar's end-of-archive blocks and never reads
them), a tar through its end-of-archive blocks (a damaged header in the middle ends ``tarfile``'s listing without
a word; here it refuses the archive), a zip through every member's CRC. Its members are checked before anything
is written: regular files and folders only (no links, devices or sparse files), at most ``MAX_MEMBERS`` of them
holding at most ``MAX_BYTES``, names that stay inside the folder by POSIX's and Windows' rules alike and that name
one file each.

Every error the archive libraries raise on crafted input becomes :class:`ArchiveError`, whose text says what is
wrong with the archive; the caller says whose file it is and what to do. Errors writing the unpacked files stay
``OSError`` (a full disk is not the archive's fault).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol

MAX_BYTES = 2_000_000_000
"""At most this many bytes are unpacked (ComfyUI's source is tens of MB)."""
MAX_MEMBERS = 50_000
"""At most this many members (ComfyUI's source has a few thousand)."""
CHUNK = 1 << 20
"""Bytes read at once; also the largest tar header (a long name, pax records) read."""
TAR_BLOCK = 512
TAR_HEADERS_PER_MEMBER = 4
"""Tar blocks of headers and padding a member may take besides its data (its header, a pax header and its records,
the padding of its data): with the members' bytes, what bounds the tar stream a ``.tar.gz`` decompresses to."""
TAR_END = 2 * TAR_BLOCK
"""Tar's end-of-archive marker: two blocks of zeros (GNU tar, git archive and Python's tarfile write at least that)."""
MAX_PART = 255
"""The longest name of one file or folder (bytes) that common file systems take."""
WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$",
                    *(f"{device}{n}" for device in ("COM", "LPT") for n in "0123456789\u00b9\u00b2\u00b3")}
"""Device names Windows opens instead of a file, with any extension (``aux.txt`` is the device AUX)."""
WINDOWS_FORBIDDEN = re.compile(r'[<>:"|?*\x00-\x1f]')
"""Characters Windows refuses in a name (``:`` also names a drive or an alternate data stream)."""


class ArchiveError(Exception):
    """What is wrong with an archive, in words ("its member 'x' is a link"); the caller adds whose file it is and
    what to do."""


@dataclass(frozen=True)
class Member:
    """A checked member: its name as stored, its ``path`` (``/``-separated, without ``.`` parts or a trailing
    ``/``), whether it is a folder, its size as the archive states it, whether it is executable, and the archive
    library's own record of it."""

    name: str
    path: str
    is_dir: bool
    size: int
    executable: bool
    info: Any


@dataclass(frozen=True)
class Archive:
    """An archive read whole and checked: its members, the folder they all lie in (``top``, "" for none), the
    commit it names ("" for none) and how to read a member's data (only while the archive is open)."""

    members: list[Member]
    top: str
    commit: str
    read: Callable[[Member], IO[bytes]]


@contextlib.contextmanager
def _library_errors(what: str) -> Iterator[None]:
    """Errors of tarfile, zipfile, gzip and zlib (many kinds on crafted input: ``zlib.error``,
    ``NotImplementedError``, ``RuntimeError``, ``EOFError``, ``struct.error``...) as :class:`ArchiveError`."""
    try:
        yield
    except ArchiveError:
        raise
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
        raise ArchiveError(f"{what} ({reason})") from exc


def archive_kind(path: str) -> str:
    """``tar.gz``, ``tar`` or ``zip``, by the file's first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(TAR_BLOCK)
    except OSError as exc:
        raise ArchiveError(f"it cannot be read ({exc.strerror or exc})") from exc
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    if not head:
        raise ArchiveError("it is empty")
    page = head.lstrip().lower().startswith((b"<!doctype html", b"<html"))
    hint = " (an HTML page: a proxy or a login page answered instead)" if page else ""
    raise ArchiveError(f"it is not a .tar.gz, .tar or .zip archive{hint}")


@contextlib.contextmanager
def open_archive(path: str, max_bytes: int = MAX_BYTES, max_members: int = MAX_MEMBERS) -> Iterator[Archive]:
    """The archive at ``path``, read to its end and checked (see the module's text), open for reading its members;
    :class:`ArchiveError` when it is damaged, cut short, too large or has a member that is refused."""
    kind = archive_kind(path)
    opener = _open_zip if kind == "zip" else _open_tar
    with opener(path, kind == "tar.gz", max_bytes, max_members) as (members, comment, read):
        check_members(members, max_bytes)
        top = single_top([m.path for m in members])
        commit = comment if re.fullmatch(r"[0-9a-f]{40}", comment) else ""
        if not commit:  # GitHub's archives name the commit in their top folder
            found = re.search(r"[0-9a-f]{40}", top)
            commit = found.group(0) if found else ""
        yield Archive(members, top, commit, read)


_Opened = tuple[list[Member], str, Callable[[Member], IO[bytes]]]


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def tell(self) -> int: ...


class _TarStream:
    """The tar stream as ``tarfile`` reads it, bounded: nothing past ``limit`` bytes (a small ``.tar.gz`` can
    decompress to terabytes of zeros) and no single read over :data:`CHUNK` (``tarfile`` reads a long name or pax
    records in one read of whatever size their header states). Keeps the last block read, where the listing
    ended."""

    def __init__(self, raw: _Readable, limit: int):
        self.raw, self.limit = raw, limit
        self.last: tuple[int, bytes] = (-1, b"")

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > CHUNK:
            raise ArchiveError(f"a member's header states a size of {size} bytes")
        start = self.raw.tell()
        allowed = max(0, self.limit - start)
        data = self.raw.read(min(size, allowed + 1))
        if len(data) > allowed:
            raise ArchiveError(f"its tar stream runs past {self.limit:,} bytes, more than its members may take")
        self.last = (start, data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset > self.limit:
            raise ArchiveError(f"its tar stream runs past {self.limit:,} bytes, more than its members may take")
        return self.raw.seek(offset)

    def tell(self) -> int:
        return self.raw.tell()


@contextlib.contextmanager
def _open_tar(path: str, compressed: bool, max_bytes: int, max_members: int) -> Iterator[_Opened]:
    limit = max_bytes + (max_members + 1) * TAR_HEADERS_PER_MEMBER * TAR_BLOCK + 2 * tarfile.RECORDSIZE
    with open(path, "rb") as raw, (gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw) as data:
        stream = _TarStream(data, limit)
        with _library_errors("it is damaged or cut short, or holds no tar archive"):
            tf = tarfile.open(fileobj=stream, mode="r:")  # type: ignore[call-overload]
        with tf:
            members = _tar_members(tf, max_members)
            _read_tar_end(stream, tf.offset)
            comment = str(tf.pax_headers.get("comment", ""))

            def read(member: Member) -> IO[bytes]:
                with _library_errors(f"its member {member.name!r} cannot be read"):
                    found = tf.extractfile(member.info)
                if found is None:
                    raise ArchiveError(f"its member {member.name!r} has no data")
                return found

            yield members, comment, read


def _tar_members(tf: tarfile.TarFile, max_members: int) -> list[Member]:
    members: list[Member] = []
    while True:
        with _library_errors("it is damaged or cut short"):
            info = tf.next()
        if info is None:
            return members
        if len(members) == max_members:
            raise ArchiveError(f"it has more than {max_members:,} members")
        members.append(_tar_member(info))


def _tar_member(info: tarfile.TarInfo) -> Member:
    """A tar member as a :class:`Member`: a folder or a regular file, not sparse (a sparse member of a few bytes
    in the archive writes as large a file as its header states)."""
    sparse = info.sparse is not None or info.type == tarfile.GNUTYPE_SPARSE or \
        any(key.startswith("GNU.sparse") for key in info.pax_headers)
    if sparse:
        raise ArchiveError(f"its member {info.name!r} is a sparse file (a few bytes in the archive that unpack to a "
                           f"file of {info.size:,} bytes), which a ComfyUI archive does not hold")
    if not (info.isdir() or info.type in (tarfile.REGTYPE, tarfile.AREGTYPE)):
        raise ArchiveError(f"it holds links or special files ({info.name!r}), which a ComfyUI archive does not")
    return Member(info.name, member_name(info.name), info.isdir(), 0 if info.isdir() else info.size,
                  bool(info.mode & 0o111), info)


def _read_tar_end(stream: _TarStream, offset: int) -> None:
    """Read from where ``tarfile``'s listing ended to the end of the stream (through gzip's checksum and length):
    only zeros, at least tar's end-of-archive marker. ``tarfile`` ends its listing at a damaged header as at that
    marker, leaving out every member after it."""
    at, block = stream.last
    if at != offset:
        with _library_errors("it is damaged or cut short"):
            stream.seek(offset)
            block = stream.read(TAR_BLOCK)
    if block.strip(b"\0"):
        raise ArchiveError(f"the member header at byte {offset:,} of its tar stream is damaged (the members after it "
                           "would be left out)")
    zeros = len(block)
    while True:
        with _library_errors("it is damaged or cut short"):
            chunk = stream.read(CHUNK)
        if not chunk:
            break
        if chunk.strip(b"\0"):
            raise ArchiveError(f"data follows its end-of-archive marker at byte {offset:,}")
        zeros += len(chunk)
    if zeros < TAR_END:
        raise ArchiveError("it is cut short (it ends without tar's end-of-archive marker)")


@contextlib.contextmanager
def _open_zip(path: str, compressed: bool, max_bytes: int, max_members: int) -> Iterator[_Opened]:
    with _library_errors("it is damaged or cut short, or not a zip archive"):
        zf = zipfile.ZipFile(path)
    with zf:
        with _library_errors("it is damaged or cut short, or not a zip archive"):
            infos = zf.infolist()
        if len(infos) > max_members:
            raise ArchiveError(f"it has more than {max_members:,} members")
        members = [_zip_member(info) for info in infos]

        def read(member: Member) -> IO[bytes]:
            with _library_errors(f"its member {member.name!r} cannot be read"):
                return zf.open(member.info)

        check_members(members, max_bytes)
        done = 0
        for member in members:  # every member read through its CRC before any is trusted
            if not member.is_dir:
                with read(member) as src:
                    done += drain(src, member, max_bytes - done, max_bytes)
        yield members, zf.comment.decode("ascii", "replace").strip(), read


def _zip_member(info: zipfile.ZipInfo) -> Member:
    """A zip member as a :class:`Member`: a folder or a regular file, stored or deflated (the methods every zip
    tool writes and this Python reads), not encrypted."""
    mode = info.external_attr >> 16
    is_dir = info.is_dir() or stat.S_ISDIR(mode)
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise ArchiveError(f"it holds links or special files ({info.filename!r}), which a ComfyUI archive does not")
    if info.flag_bits & 0x1:
        raise ArchiveError(f"its member {info.filename!r} is encrypted")
    if not is_dir and info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ArchiveError(f"its member {info.filename!r} is compressed with method {info.compress_type} (only "
                           "stored and deflated members are read)")
    return Member(info.filename, member_name(info.filename), is_dir, 0 if is_dir else info.file_size,
                  bool(mode & 0o111) and not is_dir, info)


def drain(src: IO[bytes], member: Member, budget: int, max_bytes: int, out: IO[bytes] | None = None) -> int:
    """Read ``src`` (the data of ``member``) to its end, writing it to ``out`` if given; return its size. Refused
    when it holds more than its stated size or the ``budget`` left of ``max_bytes``."""
    done = 0
    while True:
        with _library_errors(f"its member {member.name!r} is damaged"):
            chunk = src.read(CHUNK)
        if not chunk:
            return done
        done += len(chunk)
        if done > budget:
            raise ArchiveError(f"it unpacks to more than {max_bytes:,} bytes")
        if done > member.size:
            raise ArchiveError(f"its member {member.name!r} holds more than the {member.size:,} bytes it states")
        if out is not None:
            out.write(chunk)


def member_name(name: str) -> str:
    """The member's path, ``/``-separated, without ``.`` parts or a trailing ``/``; :class:`ArchiveError` unless it
    stays inside the folder it is unpacked into and names a file Windows writes as named, on every OS (an archive
    that Windows would unpack differently is not the one checked here)."""
    path = name.replace("\\", "/")
    parts = path.rstrip("/").split("/")
    while parts[:1] == ["."]:  # "./ComfyUI/main.py", as ``tar -C folder .`` writes
        parts = parts[1:]
    if path.startswith("/") or "\0" in path or any(part in ("", "..") or ":" in part for part in parts):
        raise ArchiveError(f"its member {name!r} would be written outside the folder it is unpacked into")
    kept = [part for part in parts if part != "."]
    for part in kept:
        problem = _windows_problem(part)
        if problem:
            raise ArchiveError(f"its member {name!r} has a name Windows cannot write as named: {problem}")
    return "/".join(kept)


def _windows_problem(part: str) -> str:
    """Why Windows does not write a file or folder named ``part`` as named ("" when it does)."""
    if part[-1] in ". ":
        return f"{part!r} ends in a dot or a space, which Windows drops (another member's file would be overwritten)"
    if WINDOWS_FORBIDDEN.search(part):
        return f"{part!r} holds a character Windows refuses in names"
    if part.split(".", 1)[0].rstrip(" ").upper() in WINDOWS_RESERVED:
        return f"{part!r} is a device name on Windows"
    if len(part.encode("utf-8", "surrogateescape")) > MAX_PART:
        return f"a name of more than {MAX_PART} bytes"
    return ""


def check_members(members: list[Member], max_bytes: int) -> None:
    """Refuse an archive whose members state more than ``max_bytes`` in all, or that name one file twice (also as
    Windows and macOS compare names, ignoring case) or a file as a folder."""
    total = sum(m.size for m in members)
    if total > max_bytes:
        raise ArchiveError(f"it unpacks to more than {max_bytes:,} bytes (its members state {total:,})")
    files: dict[str, str] = {}
    folders: set[str] = set()
    for member in members:
        key = member.path.casefold()
        parts = key.split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
        if member.is_dir:
            folders.add(key)
        elif not key:
            raise ArchiveError(f"its member {member.name!r} is a file without a name")
        elif key in files:
            raise ArchiveError(f"its members {files[key]!r} and {member.name!r} name the same file")
        else:
            files[key] = member.name
    clash = next((files[key] for key in files if key in folders), None)
    if clash is not None:
        raise ArchiveError(f"its member {clash!r} is a file, and other members put files in a folder of that name")


def single_top(paths: list[str]) -> str:
    """The one folder every member is in ("" when there is none: the archive holds the files themselves)."""
    named = [p for p in paths if p]
    tops = {p.split("/", 1)[0] for p in named}
    if len(tops) == 1 and any("/" in p for p in named):
        return tops.pop()
    return ""


def strip_top(path: str, top: str) -> str:
    """``path`` without the top folder ("" for the top folder itself)."""
    return path[len(top):].lstrip("/") if top else path


def require_comfyui(archive: Archive) -> None:
    """Refuse an archive without ComfyUI's ``main.py`` (a file) and ``comfy/`` (a folder) at its top (or in its one
    top folder)."""
    kinds = {strip_top(m.path, archive.top): m.is_dir for m in archive.members}
    if kinds.get("main.py") is not False or not any(p.startswith("comfy/") or (p == "comfy" and d)
                                                       for p, d in kinds.items()):
        raise ArchiveError("it holds no ComfyUI (no main.py file and comfy/ folder at its top)")


def check_comfyui(path: str, max_bytes: int = MAX_BYTES, max_members: int = MAX_MEMBERS) -> None:
    """:class:`ArchiveError` unless ``path`` is a whole archive of ComfyUI whose members all pass the checks."""
    with open_archive(path, max_bytes, max_members) as archive:
        require_comfyui(archive)


def extract(path: str, dest: str, max_bytes: int = MAX_BYTES, max_members: int = MAX_MEMBERS) -> str:
    """Unpack the ComfyUI archive at ``path`` into ``dest`` (made here) without its top folder, after the checks
    of :func:`check_comfyui`; return the commit it names ("" for none). ``dest`` is removed on any failure:
    :class:`ArchiveError` for the archive, ``OSError`` for the disk."""
    try:
        with open_archive(path, max_bytes, max_members) as archive:
            require_comfyui(archive)
            _write(archive, dest, max_bytes)
            return archive.commit
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _write(archive: Archive, dest: str, max_bytes: int) -> None:
    os.makedirs(dest)
    done = 0
    for member in archive.members:
        rel = strip_top(member.path, archive.top)
        if not rel:
            continue
        out = member_path(dest, rel)
        if member.is_dir:
            os.makedirs(out, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with archive.read(member) as src, open(out, "xb") as dst:
            done += drain(src, member, max_bytes - done, max_bytes, dst)
        if member.executable:
            os.chmod(out, 0o755)


def member_path(dest: str, rel: str, paths: Any = os.path) -> str:
    """Where the member ``rel`` (``/``-separated, top folder stripped) is written under ``dest``, by the rules of
    ``paths`` (``os.path``; ``ntpath`` for Windows in the tests): joined and resolved (links followed), and refused
    unless the result lies inside ``dest``. On Windows ``join`` starts over at a drive or a root (``C:/...``,
    ``/...``, ``D:name``), so a name that passed a pattern check could still land elsewhere: the resolved path is
    what is checked."""
    root = paths.normpath(paths.abspath(dest))
    out = paths.normpath(paths.join(root, rel))
    if paths is os.path:
        root, out = os.path.realpath(root), os.path.realpath(out)
    try:
        inside = paths.normcase(out) != paths.normcase(root) and \
            paths.normcase(paths.commonpath([root, out])) == paths.normcase(root)
    except ValueError:  # another drive, or a relative path left by a drive without a root
        inside = False
    if not inside:
        raise ArchiveError(f"its member {rel!r} would be written outside {dest}")
    return out
