"""Coverage-guided fuzzing of everything that reads a cache someone else made.

A small mutation fuzzer in the spirit of atheris/libFuzzer, with no dependency beyond the engine's: inputs
start from a real cache's files; each round mutates one (bit flips, interesting integers, inserted, deleted
or duplicated bytes, splices), runs it through the engine under a line-edge tracer restricted to
``streaming_cache``, and keeps it in the corpus when it reaches an edge not seen before. Targets:

* ``index`` (raw bytes) and ``index, checksums fixed`` (header values and sections mutated, then written with
  valid checksums as an attacker would), with hostile JSON among the values: deep nesting, Infinity, 1e300,
  wrong types; run through the reader, the writer (opened and aborted) and ``clean``'s preview;
* ``manifest``: a dataset manifest mutated the same way, through the dataset handle and ``clean``;
* ``skeleton`` (real skeletons mutated) and ``skeleton, crafted`` (generated attacks: tuples nested deep and
  used as keys, ADDITEMS/APPENDS/SETITEM aimed at a tensor, shared sub-structures, constructors called with
  tensors or huge arguments, deep lists);
* ``shard``: safetensors headers;
* ``filesystem``: symbolic links, FIFOs, sockets and folders where the cache's files and folders belong, with a
  sentinel folder outside the cache that must come out unchanged.

The contract: each input either works or raises :class:`CacheError` (a clear error), within a time bound, and
touches nothing outside the cache. Anything else (IndexError, RecursionError, MemoryError, a hang, a file
outside the cache changed, code run: the sentinel file) is a *finding*. ``python -m streaming_cache fuzz
--seconds N`` runs it; the test suite runs a short budget.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import pickle
import random
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .. import format as fmt
from .. import layout
from ..clean import preview
from ..dataset import DatasetHandle
from ..errors import CacheError
from ..reader import CacheReader
from ..skeleton import decode_skeleton
from ..writer import CacheWriter
from . import tool_parser

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the engine; this folder is excluded
_HERE = os.path.dirname(os.path.abspath(__file__))
SLOW_SECONDS = 2.0
_INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1, 2**32, 64]


def _seed_cache(path: str, sentinel: str) -> None:
    import pickle

    import torch

    with CacheWriter(path) as w:
        w.put("latent", {"samples": torch.randn(1, 4, 8, 8), "batch_index": [0], "name": "x"})
        w.put("cond", [[torch.randn(1, 7, 16), {"pooled_output": torch.randn(1, 16), "guidance": 3.5}]])
        w.put("mixed", {"t": (torch.zeros(0), torch.arange(6).reshape(2, 3).t(), None, True, b"raw", 1.5),
                        "dtype": torch.bfloat16, "half": torch.ones(3, dtype=torch.float16)})
        w.set_manifest("default", b'{"version": 1, "columns": ["latent"], "rows": [{"name": "a", '
                                  b'"keys": {"latent": "latent"}, "repeats": 2}]}')
    # A hostile gadget in the corpus, so mutations start next to the dangerous paths too.
    class _Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {sentinel}",))

    with open(os.path.join(path, "evil.pkl"), "wb") as f:
        f.write(pickle.dumps(_Evil()))


def _mutate(data: bytes, corpus: list[bytes], rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        op = rng.randrange(7)
        if not b:
            b += bytes([rng.randrange(256)])
        pos = rng.randrange(len(b))
        if op == 0:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif op == 2 and len(b) >= pos + 8:
            value = rng.choice(_INTERESTING + [len(b), len(b) + 1, rng.randrange(2**32)])
            b[pos:pos + 8] = struct.pack("<Q", value % 2**64)
        elif op == 3:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 8, 64))))
        elif op == 4:
            del b[pos:pos + rng.choice((1, 8, 64, 512))]
        elif op == 5:
            n = rng.choice((8, 64, 512))
            b[pos:pos] = b[pos:pos + n]
        else:
            other = rng.choice(corpus)
            if other:
                cut = rng.randrange(len(other))
                b[pos:] = other[cut:cut + rng.choice((16, 256, 4096))] + b[pos:]
    return bytes(b)


def _untraced_seconds(call: Callable[[], None]) -> float:
    """How long ``call`` takes once more, without the tracer: an input that was slow under it is a finding only if
    it is slow again on its own (the tracer's cost, or a moment the machine was busy, are not the input's)."""
    t0 = time.perf_counter()
    _alarm(10)
    try:
        call()
    except Exception:  # what the input raises was judged on the traced run (a hang raises _Hang)
        pass
    finally:
        _alarm(0)
    return time.perf_counter() - t0


class _Tracer:
    """Line-edge coverage of the engine's own modules."""

    def __init__(self) -> None:
        self.edges: set[tuple[str, int, int]] = set()
        self.new = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if not name.startswith(_PKG) or name.startswith(_HERE):
            return None
        prev = [-1]

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                edge = (frame.f_code.co_filename, prev[0], frame.f_lineno)
                if edge not in self.edges:
                    self.edges.add(edge)
                    self.new += 1
                prev[0] = frame.f_lineno
            return local

        return local


def _deep_json(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _json_leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _json_leaves(v, path + (k,))] + [path] if path else \
            [p for k, v in obj.items() for p in _json_leaves(v, path + (k,))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _json_leaves(v, path + (i,))] + [path]
    return [path]


def _mutate_json(obj: Any, rng: random.Random) -> Any:
    """One value of a JSON document replaced by a hostile one (or a key removed)."""
    obj = copy.deepcopy(obj)
    leaves = _json_leaves(obj)
    where = rng.choice(leaves) if leaves else ()
    if not where:
        return obj
    parent = obj
    for k in where[:-1]:
        parent = parent[k]
    value = rng.choice([rng.choice(_INTERESTING), -1, 2**70, 2e8, 0.5, "", None, [], {}, True, "x" * 300,
                        float("inf"), 1e300, _deep_json(rng.choice((50, 300))), ["x"], {"x": "k"}])
    if rng.random() < 0.1 and isinstance(parent, dict):
        parent.pop(where[-1], None)
    else:
        parent[where[-1]] = value
    return obj


def _mutate_structured(item: tuple[dict, dict[str, bytes]], rng: random.Random) -> tuple[dict, dict[str, bytes]]:
    """Mutate a parsed index (header values or one section's bytes); the caller re-serialises it with valid
    checksums, as an attacker who knows the format would, so the reader's deeper checks get exercised."""
    header, sections = copy.deepcopy(item[0]), dict(item[1])
    if rng.random() < 0.5 or not sections:
        leaves = _json_leaves(header)
        where = rng.choice(leaves) if leaves else ()
        if not where:
            return header, sections
        parent = header
        for k in where[:-1]:
            parent = parent[k]
        value = rng.choice([rng.choice(_INTERESTING), -1, -(2**63), 2**70, 0.5, "", "../x", "x" * 300, None, [],
                            {}, True, "shards/../../etc", float("inf"), float("nan"), 1e300, -0.0, "\udc80",
                            _deep_json(rng.choice((50, 300))), [{"name": "a", "nbytes": 1}] * 3])
        if rng.random() < 0.1 and isinstance(parent, dict):
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = value
    else:
        name = rng.choice(sorted(sections))
        sections[name] = _mutate(sections[name], [sections[name]], rng)
    return header, sections


def _crafted_skeleton(rng: random.Random) -> bytes:
    """A generated attack on the skeleton decoder (see the module docstring), then sometimes mutated."""
    P = pickle
    kind = rng.randrange(9)
    n = rng.choice((3, 60, 70, 500, 5000, 200_000))
    if kind == 0:  # a tuple nested n deep, hashed as a dict key or a set member
        deep = b")" + P.TUPLE1 * n
        data = P.PROTO + b"\x04" + (P.EMPTY_DICT + deep + P.NONE + P.SETITEM if rng.random() < 0.5
                                     else P.EMPTY_SET + P.MARK + deep + P.ADDITEMS) + P.STOP
    elif kind == 1:  # container operations aimed at a tensor
        op = rng.choice((P.MARK + P.BININT1 + b"\x01" + P.ADDITEMS, P.MARK + P.BININT1 + b"\x01" + P.APPENDS,
                         P.BININT1 + b"\x00" + P.BININT1 + b"\x01" + P.SETITEM, P.BININT1 + b"\x01" + P.APPEND))
        data = P.PROTO + b"\x04" + P.BININT1 + b"\x00" + P.BINPERSID + op + P.STOP
    elif kind == 2:  # [x, x] nested: exponential expansion by reference
        data = P.PROTO + b"\x04" + P.BININT1 + b"\x01" + (P.DUP + P.TUPLE2) * min(n, 200) + P.STOP
    elif kind == 3:  # allowed constructors with hostile arguments
        func = rng.choice((b"builtins\nset\n", b"torch\nSize\n", b"builtins\nfrozenset\n",
                           b"collections\nOrderedDict\n", b"builtins\nbytearray\n", b"torch\ndevice\n"))
        arg = rng.choice((P.BININT1 + b"\x00" + P.BINPERSID, P.BININT + struct.pack("<i", 2**30),
                          P.MARK + P.BININT1 + b"\x01" * 1 + P.LIST))
        data = P.PROTO + b"\x04" + P.GLOBAL + func + arg + P.TUPLE1 + P.REDUCE + P.STOP
    elif kind == 4:  # lists nested n deep
        data = P.PROTO + b"\x04" + P.EMPTY_LIST * (n + 1) + P.APPEND * n + P.STOP
    elif kind == 5:  # memo games
        data = P.PROTO + b"\x04" + P.NONE + P.LONG_BINPUT + struct.pack("<I", rng.randrange(2**32)) + \
            P.LONG_BINGET + struct.pack("<I", rng.randrange(4)) + P.STOP
    elif kind == 6:  # long strings and numbers
        data = P.PROTO + b"\x04" + P.LONG4 + struct.pack("<i", rng.choice((8, 2**20, 2**31 - 1, -1))) + \
            b"\x01" * rng.choice((0, 8, 64)) + P.STOP
    elif kind == 7:  # a tensor reference with more digits than Python prints
        size = rng.choice((9, 2000, 3000))
        data = P.PROTO + b"\x04" + P.LONG4 + struct.pack("<i", size) + b"\x7f" * size + \
            rng.choice((b"", P.TUPLE1)) + P.BINPERSID + P.STOP
    else:  # a frame declaring more bytes than follow
        data = P.PROTO + b"\x04" + P.FRAME + struct.pack("<Q", rng.choice((2**62, 2**32, 7))) + P.NONE + P.STOP
    return _mutate(data, [data], rng) if rng.random() < 0.3 else data


def _make_fs_case(rng: random.Random, live: str, outside: str) -> str:
    """Put links, FIFOs, sockets or folders where the cache's files belong; return what was done."""
    shards = sorted(os.listdir(layout.shard_dir(live)))
    targets = {"index": layout.index_path(live), "lock": layout.lock_path(live),
               "shard": layout.shard_path(live, shards[0]) if shards else layout.index_path(live),
               "shards folder": layout.shard_dir(live),
               "leftover": layout.index_path(live) + ".tmp-1",
               "shard leftover": layout.shard_path(live, "0" * 32 + layout.SHARD_SUFFIX)}
    done = []
    for _ in range(rng.choice((1, 1, 2))):
        name = rng.choice(sorted(targets))
        path = targets[name]
        kind = rng.choice(("link to a file outside", "link to a folder outside", "dangling link", "fifo",
                           "socket", "folder"))
        if os.path.islink(os.path.dirname(path)) or not os.path.isdir(os.path.dirname(path)):
            continue  # its folder was itself replaced above: never change what is outside
        try:
            _replace_with(path, kind, outside)
        except OSError:
            continue
        done.append(f"{name}: {kind}")
    return "; ".join(done) or "nothing"


def _replace_with(path: str, kind: str, outside: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if kind == "link to a file outside":
        os.symlink(os.path.join(outside, "victim.safetensors"), path)
    elif kind == "link to a folder outside":
        os.symlink(outside, path)
    elif kind == "dangling link":
        os.symlink(os.path.join(outside, "created-by-the-engine"), path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound by a relative name: socket paths are limited to about 100 bytes
        here = os.getcwd()
        os.chdir(os.path.dirname(path))
        try:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(os.path.basename(path))
            sock.close()
        finally:
            os.chdir(here)
    else:
        os.mkdir(path)


def _snapshot(folder: str) -> dict[str, tuple[int, bytes]]:
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        for f in files + dirs:
            full = os.path.join(dirpath, f)
            st = os.lstat(full)
            data = b""
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as fh:
                    data = fh.read()
            out[os.path.relpath(full, folder)] = (st.st_mode, data)
    return out


def _exercise_cache(path: str, writer: bool = True) -> None:
    """What a user or a node does with a cache: read it all, verify it, open a writer, preview a clean."""
    try:
        r = CacheReader(path)
        for key in list(r.keys())[:16]:
            i = r.index_of(key)
            if i is None:  # a key table whose hashes lie: the key is just not found
                continue
            try:
                r.materialize(i)
            except CacheError:
                pass
        for name in r.manifests:
            r.manifest(name)
            try:
                DatasetHandle.from_reader(r, name).fingerprint()
            except CacheError:
                pass
        r.verify()
        try:
            handle = DatasetHandle.from_reader(r)
        except CacheError:
            handle = None
        rows = len(handle) if handle is not None else 0  # a user asks for rows the handle has
        for batch in (list(range(min(rows, 1))), list(range(min(rows, 8))),
                      list(range(rows - 1, max(-1, rows - 9), -1))):
            if batch and handle is not None:
                try:
                    handle.collate(batch)
                except CacheError:
                    pass
    except CacheError:
        pass
    if writer:
        try:
            CacheWriter(path).close(commit=False)
        except CacheError:
            pass
        preview(path)


def _exercise_skeleton(data: bytes) -> None:
    import torch

    decode_skeleton(data, 4, lambda i, is_np: torch.zeros(1), "fuzz")


def _exercise_shard(path: str) -> None:
    with open(path, "rb") as f:
        fmt.read_shard_header(f, os.fstat(f.fileno()).st_size, path)


class _Hang(Exception):
    pass


def _alarm(seconds: int) -> None:
    if hasattr(signal, "SIGALRM"):
        signal.alarm(seconds)


TARGETS = ("index", "index, checksums fixed", "index, checksums fixed", "manifest", "skeleton",
           "skeleton, crafted", "shard", "filesystem")


def run(seconds: float = 60.0, seed: int = 0, out: Callable[..., None] = print,
        keep_findings: str | None = None) -> dict[str, Any]:
    """Fuzz for ``seconds``; returns executions, corpus size, coverage and findings (type, target, message)."""
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="streaming-cache-fuzz-")
    sentinel = os.path.join(work, "PWNED")
    outside = os.path.join(work, "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "victim.safetensors"), "wb") as victim:
        victim.write(b"someone else's file")
    engine_log = logging.getLogger("streaming_cache")
    previous_level = engine_log.level
    engine_log.setLevel(logging.ERROR)  # hostile inputs make the engine warn on every execution
    previous_handler = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(_Hang())) \
        if hasattr(signal, "SIGALRM") else None
    try:
        pristine = os.path.join(work, "pristine")
        _seed_cache(pristine, sentinel)
        shards = [os.path.join(layout.SHARD_DIR, n) for n in os.listdir(layout.shard_dir(pristine))]
        with open(layout.index_path(pristine), "rb") as src:
            index = src.read()
        with open(os.path.join(pristine, "evil.pkl"), "rb") as src:
            evil = src.read()
        r = CacheReader(pristine)
        skeletons = [r.entry_record(i).skeleton for i in range(len(r))]
        manifest = json.loads(r.manifest_bytes("default"))
        with open(os.path.join(pristine, shards[0]), "rb") as src:
            shard = src.read()
        parsed = fmt.IndexFile(layout.index_path(pristine))
        structured = [({k: v for k, v in parsed.header.items() if k not in ("sections", "format_version")},
                       {n: bytes(parsed.section(n).tobytes()) for n in parsed.header["sections"]})]
        del parsed, r
        targets: dict[str, list[Any]] = {"index": [index], "skeleton": skeletons + [evil], "shard": [shard],
                                         "index, checksums fixed": structured, "manifest": [manifest],
                                         "skeleton, crafted": [], "filesystem": []}
        live = os.path.join(work, "live")
        before_outside = _snapshot(outside)
        tracer = _Tracer()
        findings: list[dict[str, Any]] = []
        seen_findings: set[tuple[str, str]] = set()
        execs = 0
        started = time.perf_counter()
        last_report = started

        def fresh_live() -> None:
            if os.path.lexists(live):
                shutil.rmtree(live, ignore_errors=True)
            shutil.copytree(pristine, live)

        def index_bytes(header: dict, sections: dict[str, bytes]) -> bytes | None:
            path = os.path.join(work, "fuzzed.scc")
            if os.path.lexists(path):
                os.remove(path)
            try:
                fmt.write_index(path, header, sections)
            except Exception:  # not even serialisable: not an input the reader can be given
                return None
            with open(path, "rb") as f:
                return f.read()

        fresh_live()
        while time.perf_counter() - started < seconds:
            target = rng.choice(TARGETS)
            corpus = targets[target]
            item: Any = None
            data: bytes | None = None
            if target == "index, checksums fixed":
                item = _mutate_structured(rng.choice(corpus), rng)
                data = index_bytes(*item)
            elif target == "manifest":
                item = _mutate_json(rng.choice(corpus), rng)
                header, sections = copy.deepcopy(structured[0][0]), dict(structured[0][1])
                section = header["manifests"]["default"]
                try:
                    sections[section] = json.dumps(item).encode()
                except (ValueError, RecursionError):
                    continue
                data = index_bytes(header, sections)
            elif target == "skeleton, crafted":
                data = _crafted_skeleton(rng)
            elif target != "filesystem":
                data = _mutate(rng.choice(corpus), corpus, rng)
            if target == "filesystem":
                fresh_live()
                data = _make_fs_case(rng, live, outside).encode()
            if data is None:  # the mutated structure cannot be written as an index
                continue
            if target in ("index", "index, checksums fixed", "manifest"):
                fresh_live()
                with open(layout.index_path(live), "wb") as f:
                    f.write(data)
                call: Callable[[], None] = lambda: _exercise_cache(live)
            elif target == "filesystem":
                call = lambda: _exercise_cache(live)
            elif target == "shard":
                spath = os.path.join(work, "fuzzed.safetensors")
                with open(spath, "wb") as f:
                    f.write(data)
                call = functools.partial(_exercise_shard, spath)
            else:
                call = functools.partial(_exercise_skeleton, data)
            tracer.new = 0
            t0 = time.perf_counter()
            problem: tuple[str, str, str] | None = None
            sys.settrace(tracer)
            _alarm(10)
            try:
                call()
            except CacheError:
                pass
            except _Hang:
                problem = ("HANG", "one input ran for 10 s (blocked?)", "")
            except Exception as exc:  # the contract says CacheError or success: anything else is a finding
                problem = (type(exc).__name__, str(exc)[:300],
                           "".join(traceback.format_tb(exc.__traceback__)[-2:])[-600:])
            finally:
                _alarm(0)
                sys.settrace(None)
            took = time.perf_counter() - t0
            if problem is None and took > SLOW_SECONDS:
                again = _untraced_seconds(call)
                if again > SLOW_SECONDS:
                    problem = ("SLOW", f"one input took {took:.1f}s under the tracer and {again:.1f}s again without "
                               f"it (> {SLOW_SECONDS}s)", "")
            if problem is None and target == "filesystem" and _snapshot(outside) != before_outside:
                problem = ("ESCAPE", f"a file outside the cache changed after: {data!r}", "")
                shutil.rmtree(outside)
                os.makedirs(outside)
                with open(os.path.join(outside, "victim.safetensors"), "wb") as f:
                    f.write(b"someone else's file")
            if problem is None and os.path.exists(sentinel):
                problem = ("CODE EXECUTION", "the sentinel was created", "")
            if problem is not None:
                kind, message, where = problem
                sig = (kind, where[-200:] if where else target)
                if sig not in seen_findings:
                    seen_findings.add(sig)
                    findings.append({"target": target, "type": kind, "message": message, "where": where})
                    if keep_findings and data is not None:
                        os.makedirs(keep_findings, exist_ok=True)
                        with open(os.path.join(keep_findings, f"{target}-{len(findings)}.bin"), "wb") as f:
                            f.write(data)
                if kind == "CODE EXECUTION":
                    break
            execs += 1
            if tracer.new and target not in ("skeleton, crafted", "filesystem"):
                corpus.append(item if target in ("index, checksums fixed", "manifest") else data)
            if time.perf_counter() - last_report > 5:
                last_report = time.perf_counter()
                out(f"\r{execs} executions, {len(tracer.edges)} edges, corpus "
                    f"{sum(len(c) for c in targets.values())}, findings {len(findings)}", end="", flush=True)
        elapsed = time.perf_counter() - started
        out(f"\r{execs} executions in {elapsed:.0f}s, {len(tracer.edges)} coverage edges, corpus "
            f"{sum(len(c) for c in targets.values())}, findings {len(findings)}")
        for found in findings:
            out(f"  finding [{found['target']}] {found['type']}: {found['message']}\n{found['where']}")
        return {"executions": execs, "seconds": round(elapsed, 1), "edges": len(tracer.edges),
                "corpus": {k: len(v) for k, v in targets.items()}, "findings": findings}
    finally:
        engine_log.setLevel(previous_level)
        if previous_handler is not None:
            signal.signal(signal.SIGALRM, previous_handler)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = tool_parser("fuzz", seeded=True)
    p.add_argument("--seconds", type=float, default=60.0, help="time budget (default %(default)s)")
    p.add_argument("--keep", metavar="DIR", help="save the inputs of findings in DIR")
    args = p.parse_args(argv)
    report = run(seconds=args.seconds, seed=args.seed, out=(lambda *a, **k: None) if args.json else print,
                 keep_findings=args.keep)
    if args.json:
        print(json.dumps(report, indent=2))
    return 1 if report["findings"] else 0
