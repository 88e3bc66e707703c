"""The content-addressed incremental builder: encode only what is new or changed, resumably.

A dataset is a list of :class:`Item` (one training sample each, e.g. an image and its caption) made of named
:class:`Part` s (one per column, e.g. ``latent`` and ``cond``). Each part becomes one cache entry whose key is

    xxh3-128( format version, encoder fingerprint, encoder settings, part params, xxh3-128 of the part's bytes )

so a re-run encodes only parts whose bytes, model or settings changed, identical captions are one entry
(encoded once), and a run that was stopped or killed resumes where it stopped: whatever it committed is found
by key. The dataset itself is stored as a *manifest* in the cache (rows of keys, plus a stat record per source
file), which is what training reads and what garbage collection keeps alive.

Validation ladder for source files, cheapest first: a per-process memo keyed by (path, size, mtime, inode); the
stat record in the previous manifest; only then the bytes are hashed. A record whose mtime is within two
seconds of when it was taken is not trusted (a write in the same mtime tick could go unseen).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from . import layout
from .errors import CacheError, CacheLockedError
from .format import FORMAT_VERSION
from .group import Group
from .manifest import MAX_REPEATS, Failure, Manifest, ManifestRow, SourceRecord
from .prepare import Lookahead
from .reader import CacheReader
from .writer import CacheWriter

log = logging.getLogger("streaming_cache")

_RACY_NS = 2_000_000_000
_digest_memo: dict[tuple[int, int, int, int], str] = {}


def forget_source_digests() -> None:
    """Drop this process's memo of source-file digests, as a new process starts (the manifest's stat records
    still apply)."""
    _digest_memo.clear()


@dataclass(frozen=True)
class Part:
    """One thing to encode: the bytes of a file (``path``) or inline bytes (``data``), e.g. a caption.

    ``params`` (JSON-serialisable) go into the key and to the encoder: anything per-part that changes the
    result, such as a target resolution. Parts of one column are batched together only if their ``group``
    (default: their params) is equal, so an encoder can require same-sized inputs in a batch.
    """

    path: str | None = None
    data: bytes | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    group: Hashable = None

    def batch_group(self) -> Hashable:
        return self.group if self.group is not None else _canonical(self.params)


@dataclass(frozen=True)
class Item:
    """One sample. ``name`` identifies it in the manifest and in reports (e.g. its relative image path)."""

    name: str
    parts: Mapping[str, Part]
    repeats: int = 1


@dataclass
class Encoder:
    """How one column is encoded. ``fingerprint`` must change whenever the model weights change.

    ``prepare(part)``, if given, makes one part ready for the model (reads and decodes its file, resizes it): it
    runs on threads for the next batches while ``encode`` works on the current one (:mod:`.prepare`), and
    ``encode`` then receives the prepared values instead of the parts. It must be safe to call from several
    threads; a part it fails on fails alone."""

    fingerprint: str
    encode: Callable[[list[Any]], Sequence[Any]]
    settings: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    prepare: Callable[[Part], Any] | None = None


@dataclass
class BuildReport:
    """What a build did. Counts of entries: ``encoded`` now, ``reused`` from the cache, ``deduplicated``
    (parts that shared another part's key in this run, e.g. identical captions); counts of items: ``rows``
    in the manifest, ``failed`` (see ``failures``), ``removed`` (in the previous manifest, gone now); ``hashed``
    source files whose bytes had to be read (the others were known unchanged by their stat records)."""

    manifest: str
    rows: int = 0
    encoded: int = 0
    reused: int = 0
    deduplicated: int = 0
    failed: int = 0
    removed: int = 0
    hashed: int = 0
    stopped: bool = False
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)

    def summary(self) -> str:
        s = (f"encoded {self.encoded}, reused {self.reused}, failed {self.failed}"
             f" (rows {self.rows}, deduplicated {self.deduplicated}, removed {self.removed})")
        return s + (" - stopped early, run again to resume" if self.stopped else "")


def _canonical(obj: Any) -> str:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except TypeError as exc:
        raise CacheError(f"settings and params must be JSON-serialisable: {exc}") from exc


def entry_key(encoder: Encoder, part: Part, content_digest: str) -> str:
    """xxh3-128 of the format version, the encoder's fingerprint and settings, the part's params and content."""
    h = xxhash.xxh3_128()
    for piece in (f"streaming-cache/v{FORMAT_VERSION}", encoder.fingerprint, _canonical(encoder.settings),
                  _canonical(part.params), content_digest):
        h.update(piece.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


_SCALARS = (str, int, float, bool, type(None))


class _KeyMaker:
    """:func:`entry_key` for many parts: the encoder prefix is hashed once, canonical params are memoized."""

    def __init__(self, encoder: Encoder):
        self.prefix = xxhash.xxh3_128()
        for piece in (f"streaming-cache/v{FORMAT_VERSION}", encoder.fingerprint, _canonical(encoder.settings)):
            self.prefix.update(piece.encode("utf-8"))
            self.prefix.update(b"\0")
        self.params: dict[Any, bytes] = {}

    def __call__(self, part: Part, content_digest: str) -> str:
        # Memoized only for flat params of plain scalars; the type is part of the memo key since 1 == 1.0 == True
        # but they canonicalize differently.
        items = part.params.items()
        memo: Any = tuple(sorted((k, type(v), v) for k, v in items)) \
            if all(type(v) in _SCALARS for _, v in items) else None
        params = self.params.get(memo) if memo is not None else None
        if params is None:
            params = _canonical(part.params).encode("utf-8") + b"\0"
            if memo is not None:
                self.params[memo] = params
        h = self.prefix.copy()
        h.update(params)
        h.update(content_digest.encode("utf-8"))
        h.update(b"\0")
        return h.hexdigest()


def _hash_file(path: str) -> tuple[str, os.stat_result]:
    """Hash a file, refusing a result if the file changed while it was read."""
    for _ in range(3):
        before = os.stat(path)
        h = xxhash.xxh3_128()
        n = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                n += len(chunk)
        after = os.stat(path)
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns) and n == after.st_size:
            return h.hexdigest(), after
    raise CacheError(f"{path}: the file kept changing while it was being read; try again once it is written")


class _Sources:
    """The validation ladder: content digests of source files with as little hashing as possible.

    1. this process already hashed the file and it is unchanged (same device, inode, size, mtime): reuse;
    2. the manifest recorded (size, mtime) and a digest taken well after that mtime: reuse;
    3. otherwise hash it. A file modified within ``_RACY_NS`` of being hashed is never trusted by stat alone,
       since a same-second rewrite could keep its size and mtime.
    """

    def __init__(self, records: Mapping[str, SourceRecord]):
        self.records = dict(records)
        self.new_records: dict[str, SourceRecord] = {}
        self.hashed = 0

    def digest(self, path: str) -> str:
        where = path if os.path.isabs(path) else os.path.abspath(path)
        st = os.stat(where)  # follows symlinks; a loop raises ELOOP, reported as the item's failure
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file")
        memo_key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        digest = _digest_memo.get(memo_key)
        rec = self.records.get(where)
        if rec is not None and rec.size == st.st_size and rec.mtime_ns == st.st_mtime_ns \
                and rec.recorded_ns - rec.mtime_ns > _RACY_NS and (digest is None or digest == rec.digest):
            self.new_records[where] = rec  # unchanged record: an unchanged tree rewrites an identical manifest
            return rec.digest
        if digest is None:
            digest, st = _hash_file(where)
            self.hashed += 1
        now = time.time_ns()
        if now - st.st_mtime_ns > _RACY_NS:
            _digest_memo[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = digest
        self.new_records[where] = SourceRecord(st.st_size, st.st_mtime_ns, digest, now)
        return digest


def _part_digest(part: Part, sources: _Sources) -> str:
    if (part.path is None) == (part.data is None):
        raise CacheError("a Part needs exactly one of path or data")
    if part.data is not None:
        return xxhash.xxh3_128_hexdigest(part.data)
    return "file:" + sources.digest(part.path)  # type: ignore[arg-type]


def build(
    cache: str | os.PathLike[str] | CacheWriter,
    items: Iterable[Item],
    encoders: Mapping[str, Encoder],
    *,
    manifest: str = "default",
    should_stop: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    commit_seconds: float = 30.0,
    group: Group | None = None,
) -> BuildReport:
    """Bring the cache's manifest ``manifest`` up to date with ``items``, encoding only missing entries.

    Batches hold up to ``encoder.batch_size`` parts of one column and group. If a batch raises, each of its
    parts is retried alone, so one bad input fails only its own item (listed in ``report.failures``). Work is
    committed every ``commit_seconds`` and at the end; ``should_stop()`` is checked between batches and ends
    the build early after committing. A KeyboardInterrupt also commits the finished entries before it
    propagates. ``progress(done, total)`` counts parts.

    With a process ``group`` (every rank calls this with the same arguments; ``cache`` a path), the ranks hash
    their shares of the items, then encode disjoint shares of the missing entries (each distinct caption still
    once); rank 0 writes into the cache, the others into parts of their own (``parts/`` in the cache, each an
    ordinary crash-safe cache) that rank 0 merges at the end, or at the start of the next build when a rank was
    killed. Stopping is decided together; every rank returns the same report.
    """
    started = time.perf_counter()
    if group is not None:
        if isinstance(cache, CacheWriter):
            raise CacheError("a build by several processes opens the cache itself: pass its path, not a writer")
        report = _build_together(os.fspath(cache), list(items), encoders, manifest, should_stop, progress,
                                 commit_seconds, group)
        report.seconds = time.perf_counter() - started
        log.debug("%s: %s in %.1fs (%d processes)", manifest, report.summary(), report.seconds, group.world_size)
        return report
    own_writer = not isinstance(cache, CacheWriter)
    writer = cache if isinstance(cache, CacheWriter) else CacheWriter(cache)
    try:
        report = _Build(writer, list(items), encoders, manifest).run(should_stop, progress, commit_seconds)
    finally:
        if own_writer:
            writer.close(commit=True)
    report.seconds = time.perf_counter() - started
    log.debug("%s: %s in %.1fs", manifest, report.summary(), report.seconds)
    return report


def plan_batches(todo: Sequence[tuple[str, str, Part]], batch_sizes: Mapping[str, int]
                 ) -> Iterator[tuple[str, list[tuple[str, Part]]]]:
    """Batches of ``(column, [(key, part), ...])`` from ``todo`` = ``[(key, column, part), ...]`` in order.

    A batch holds parts of one column and one :meth:`Part.batch_group`; a batch is yielded as soon as it has
    ``batch_sizes[column]`` parts, and the partial ones at the end, oldest first. Pure: no I/O.
    """
    pending: dict[tuple[str, Hashable], list[tuple[str, Part]]] = {}
    for key, column, part in todo:
        group = (column, part.batch_group())
        batch = pending.setdefault(group, [])
        batch.append((key, part))
        if len(batch) >= max(1, batch_sizes[column]):
            yield column, pending.pop(group)
    for (column, _), batch in pending.items():
        yield column, batch


def _key_items(items: Sequence[Item], encoders: Mapping[str, Encoder], sources: _Sources
               ) -> tuple[dict[str, dict[str, str]], dict[str, Failure]]:
    """Every item's keys by column (hashing only changed files), and the items that failed (unreadable source,
    bad repeat count), by name."""
    columns = sorted(encoders)
    key_makers = {col: _KeyMaker(encoders[col]) for col in columns}
    item_keys: dict[str, dict[str, str]] = {}
    failed: dict[str, Failure] = {}
    for it in items:
        if sorted(it.parts) != columns:
            raise CacheError(f"item {it.name!r} has parts {sorted(it.parts)} but the encoders are {columns}")
        if type(it.repeats) is not int or not 1 <= it.repeats <= MAX_REPEATS:
            failed[it.name] = Failure(it.name, columns[0], f"ValueError: it asks to repeat {it.repeats!r} times "
                                      f"per epoch; at most {MAX_REPEATS} are supported")
            continue
        keys = {}
        for col in columns:
            part = it.parts[col]
            try:
                keys[col] = key_makers[col](part, _part_digest(part, sources))
            except (OSError, CacheError) as exc:
                failed[it.name] = Failure(it.name, col, _describe_error(exc))
                break
        else:
            item_keys[it.name] = keys
    return item_keys, failed


class _Build:
    """One run of :func:`build`: keys for every part, then the missing ones encoded and committed. ``writer``
    may be a read-only view of the cache (:class:`_CacheView`) for a rank that only computes keys."""

    def __init__(self, writer: CacheWriter | _CacheView, items: list[Item], encoders: Mapping[str, Encoder],
                 manifest: str):
        self.writer, self.items, self.encoders = writer, items, encoders
        self.columns = sorted(encoders)
        self.report = BuildReport(manifest=manifest)
        names = [it.name for it in items]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise CacheError(f"item names must be unique; {dup!r} appears more than once")
        self.previous = _load_manifest(writer, manifest)
        self.sources = _Sources(self.previous.sources if self.previous else {})
        self.item_keys: dict[str, dict[str, str]] = {}
        self.failed: dict[str, Failure] = {}
        self.done_keys: set[str] = set()
        self.bad_keys: dict[str, str] = {}

    def keys(self) -> list[tuple[str, str, Part]]:
        """Compute every part's key (hashing only changed files); returns the parts still to encode."""
        self.item_keys, failed = _key_items(self.items, self.encoders, self.sources)
        self.failed.update(failed)
        return self.missing()

    def missing(self) -> list[tuple[str, str, Part]]:
        """The parts still to encode, each key once, in item order (counting reused and deduplicated parts)."""
        todo: dict[str, tuple[str, Part]] = {}
        seen: set[str] = set()
        for it in self.items:
            for col, key in self.item_keys.get(it.name, {}).items():
                if key in seen:
                    self.report.deduplicated += 1
                    continue
                seen.add(key)
                if key in self.writer:
                    self.report.reused += 1
                else:
                    todo[key] = (col, it.parts[col])
        return [(key, col, part) for key, (col, part) in todo.items()]

    def encode(self, writer: CacheWriter, column: str, batch: list[tuple[str, Part, Any]]) -> None:
        """Encode one batch (``(key, part, prepared value or the exception preparing it raised)``) into
        ``writer``, recording what was done and what failed."""
        ready = []
        for key, _, value in batch:
            if isinstance(value, Exception):
                self.bad_keys[key] = _describe_error(value)
            else:
                ready.append((key, value))
        for key, value in _encode(self.encoders[column], ready, self.bad_keys) if ready else []:
            try:
                writer.put(key, value)
                self.done_keys.add(key)
            except CacheError as exc:
                self.bad_keys[key] = _describe_error(exc)

    def run(self, should_stop: Callable[[], bool] | None, progress: Callable[[int, int], None] | None,
            commit_seconds: float) -> BuildReport:
        assert isinstance(self.writer, CacheWriter)
        todo = self.keys()
        report = self.report
        last_commit = time.monotonic()
        batches = list(plan_batches(todo, {c: e.batch_size for c, e in self.encoders.items()}))
        ahead = self.lookahead(batches)
        try:
            for k, (column, _) in enumerate(batches):
                if should_stop is not None and should_stop():
                    report.stopped = True
                    break
                self.encode(self.writer, column, ahead.take(k))
                if progress:
                    progress(len(self.done_keys) + len(self.bad_keys), len(todo))
                if time.monotonic() - last_commit >= commit_seconds:
                    self.checkpoint(final=False)
                    last_commit = time.monotonic()
        except BaseException:
            self.save_on_error()
            raise
        finally:
            ahead.close()
        return self.finish()

    def lookahead(self, batches: list[tuple[str, list[tuple[str, Part]]]]) -> Lookahead:
        """The batches' inputs prepared ahead of the encoders (:mod:`.prepare`)."""
        return Lookahead(batches, {c: e.prepare for c, e in self.encoders.items()})

    def save_on_error(self) -> None:
        try:
            self.checkpoint(final=False)
        except Exception as exc:  # the original error matters more; the resume will redo this batch
            log.warning("could not commit finished work after an error: %s", exc)

    def finish(self) -> BuildReport:
        """The report, after the manifest is written and committed (complete unless the build stopped)."""
        report = self.report
        report.encoded = len(self.done_keys)
        for name, keys in self.item_keys.items():
            for col, key in keys.items():
                if key in self.bad_keys and name not in self.failed:
                    self.failed[name] = Failure(name, col, self.bad_keys[key])
        report.failed = len(self.failed)
        report.failures = list(self.failed.values())
        report.rows = self.checkpoint(final=not report.stopped)
        report.hashed = self.sources.hashed
        current = {it.name for it in self.items}
        report.removed = sum(1 for r in (self.previous.rows if self.previous else []) if r.name not in current)
        return report

    def checkpoint(self, final: bool) -> int:
        """Write the manifest and commit; returns the number of complete rows."""
        rows = self.complete_rows()
        previous = self.previous
        manifest = Manifest(
            columns=list(self.columns),
            rows=rows,
            complete=final,
            encoders={c: {"fingerprint": e.fingerprint, "settings": dict(e.settings)}
                      for c, e in self.encoders.items()},
            sources=dict(self.sources.new_records),
            failed=list(self.failed.values()),
        )
        if not final:
            # Entries encoded for rows that are not complete yet must survive a clean before the resume.
            manifest.pending_keys = sorted(self.done_keys | set(previous.pending_keys or () if previous else ()))
            manifest.rows = rows + self.unfinished_rows(rows)
            manifest.sources = {**(previous.sources if previous else {}), **manifest.sources}
        data = manifest.to_json()
        writer = self.writer
        assert isinstance(writer, CacheWriter)
        if writer.get_manifest(self.report.manifest) != data:  # an unchanged tree leaves the cache untouched
            writer.set_manifest(self.report.manifest, data)
        writer.commit()
        return len(rows)

    def complete_rows(self) -> list[ManifestRow]:
        rows = []
        for it in self.items:
            keys = self.item_keys.get(it.name)
            if keys is None or it.name in self.failed:
                continue
            if all(k not in self.bad_keys and k in self.writer for k in keys.values()):
                rows.append(ManifestRow(it.name, dict(keys), int(it.repeats)))
        return rows

    def unfinished_rows(self, rows: list[ManifestRow]) -> list[ManifestRow]:
        """During a build: the previous manifest's rows for items not finished yet, while their entries exist."""
        names = {r.name for r in rows}
        old = self.previous.rows if self.previous else []
        return [r for r in old if r.name not in names and all(k in self.writer for k in r.keys.values())]


def _encode(encoder: Encoder, parts: list[tuple[str, Any]], bad_keys: dict[str, str]) -> list[tuple[str, Any]]:
    """Encode a batch (each key with its part or prepared input); on failure retry each part alone so one bad
    part cannot fail the others."""
    try:
        values = list(encoder.encode([p for _, p in parts]))
        if len(values) != len(parts):
            raise CacheError(f"encoder returned {len(values)} values for {len(parts)} inputs")
        return [(k, v) for (k, _), v in zip(parts, values)]
    except Exception as exc:
        if len(parts) == 1:
            bad_keys[parts[0][0]] = _describe_error(exc)
            return []
        log.info("batch of %d failed (%s); retrying one by one", len(parts), exc)
    out = []
    for one in parts:
        out.extend(_encode(encoder, [one], bad_keys))
    return out


class _CacheView:
    """What a rank that does not write the cache needs of it: which keys it holds and its manifests, as last
    committed (an empty view when it has no index yet)."""

    def __init__(self, path: str):
        self.path = path
        self.reader = CacheReader(path) if layout.is_cache_dir(path) else None

    def __contains__(self, key: object) -> bool:
        return self.reader is not None and key in self.reader

    def get_manifest(self, name: str) -> bytes | None:
        if self.reader is None or name not in self.reader.manifests:
            return None
        return self.reader.manifest_bytes(name)


def _merge_parts(writer: CacheWriter) -> int:
    """Merge every part in the cache (another rank's share of this build, or of an earlier one whose rank was
    killed) into ``writer``, commit, and remove the merged parts. A part still locked by a live writer is left
    for later. Returns the number of entries added."""
    added = 0
    merged = []
    for part in layout.list_parts(writer.path):
        try:
            with CacheWriter(part) as check:  # holds the part's lock: no live rank still writes it
                check.close(commit=False)
            added += writer.merge(part)
        except CacheLockedError:
            log.warning("%s: a part of this cache is still being written by another process; it is merged later",
                        part)
            continue
        except CacheError as exc:
            log.warning("%s: a part of this cache cannot be merged (%s); its entries are encoded again", part, exc)
        merged.append(part)
    writer.commit()
    for part in merged:
        layout.remove_part(part)
    return added


def _build_together(path: str, items: list[Item], encoders: Mapping[str, Encoder], manifest: str,
                    should_stop: Callable[[], bool] | None, progress: Callable[[int, int], None] | None,
                    commit_seconds: float, group: Group) -> BuildReport:
    """:func:`build` by every rank of ``group`` (see there)."""
    path = os.path.abspath(path)
    writer = CacheWriter(path) if group.is_main else None
    part: CacheWriter | None = None
    work: _Build | None = None
    ahead: Lookahead | None = None
    try:
        if writer is not None:
            _merge_parts(writer)  # what killed ranks of an earlier build finished
        group.barrier()
        view: CacheWriter | _CacheView = writer if writer is not None else _CacheView(path)
        work = _Build(view, items, encoders, manifest)
        keys, failed = _key_items(items[group.rank::group.world_size], encoders, work.sources)
        shares = group.gather((keys, failed, work.sources.new_records, work.sources.hashed))
        found = {name: k for share in shares for name, k in share[0].items()}
        work.item_keys = {it.name: found[it.name] for it in items if it.name in found}
        work.failed = {name: f for share in shares for name, f in share[1].items()}
        work.sources.new_records = {p: r for share in shares for p, r in share[2].items()}
        work.sources.hashed = sum(share[3] for share in shares)
        todo = work.missing()
        mine = todo[group.rank::group.world_size]
        if writer is None:
            part = CacheWriter(layout.part_path(path, f"rank{group.rank}-{uuid.uuid4().hex[:12]}"))
        target = writer if writer is not None else part
        assert target is not None
        batches = list(plan_batches(mine, {c: e.batch_size for c, e in encoders.items()}))
        ahead = work.lookahead(batches)
        last_commit = time.monotonic()
        for step in itertools.count():
            wanted = should_stop is not None and should_stop()
            stop, more, done = group.sum([float(wanted), float(step < len(batches)),
                                          float(len(work.done_keys) + len(work.bad_keys))])
            if progress and step:
                progress(int(done), len(todo))
            if stop:
                work.report.stopped = True
                break
            if not more:
                break
            if step < len(batches):
                work.encode(target, batches[step][0], ahead.take(step))
            if time.monotonic() - last_commit >= commit_seconds:
                if part is not None:
                    part.commit()
                else:
                    work.checkpoint(final=False)
                last_commit = time.monotonic()
        if part is not None:
            part.close(commit=True)
        results = group.gather((work.done_keys, work.bad_keys, work.report.stopped))
        report: BuildReport | None = None
        if writer is not None:
            for done_keys, bad_keys, _ in results:
                work.done_keys |= done_keys
                work.bad_keys.update(bad_keys)
            _merge_parts(writer)
            report = work.finish()
        return group.broadcast(report)
    except BaseException:
        if part is not None:
            part.close(commit=True)  # the finished entries stay in the part: the next build merges them
        if writer is not None and work is not None:
            work.save_on_error()
        raise
    finally:
        if ahead is not None:
            ahead.close()
        if writer is not None:
            writer.close(commit=True)


def _load_manifest(writer: CacheWriter | _CacheView, name: str) -> Manifest | None:
    raw = writer.get_manifest(name)
    if raw is None:
        return None
    try:
        return Manifest.from_json(raw, f"{writer.path}: manifest {name!r}")
    except CacheError as exc:
        log.warning("%s; rebuilding it from scratch", exc)
        return None


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
