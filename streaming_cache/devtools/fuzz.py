"""Coverage-guided fuzzing of the parts that read untrusted bytes: the index, skeletons and shard headers.

A small mutation fuzzer in the spirit of atheris/libFuzzer, with no dependency beyond the engine's: inputs
start from a real cache's files; each round mutates one (bit flips, interesting integers, inserted, deleted
or duplicated bytes, splices), runs it through the reader under a line-edge tracer restricted to
``streaming_cache``, and keeps it in the corpus when it reaches an edge not seen before.

The contract being fuzzed: reading hostile bytes either works or raises :class:`CacheError` (a clear error);
anything else (IndexError, ValueError, RecursionError, MemoryError, a hang...) is a *finding*, and so is any
code the bytes make run (a sentinel file that must never appear). ``python -m streaming_cache fuzz --seconds N``
runs it; the test suite runs a short budget.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from .. import format as fmt
from .. import layout
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


def _json_leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _json_leaves(v, path + (k,))] + [path] if path else \
            [p for k, v in obj.items() for p in _json_leaves(v, path + (k,))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _json_leaves(v, path + (i,))] + [path]
    return [path]


def _mutate_structured(item: tuple[dict, dict[str, bytes]], rng: random.Random) -> tuple[dict, dict[str, bytes]]:
    """Mutate a parsed index (header values or one section's bytes); the caller re-serialises it with valid
    checksums, as an attacker who knows the format would, so the reader's deeper checks get exercised."""
    import copy

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
                            {}, True, "shards/../../etc"])
        if rng.random() < 0.1 and isinstance(parent, dict):
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = value
    else:
        name = rng.choice(sorted(sections))
        sections[name] = _mutate(sections[name], [sections[name]], rng)
    return header, sections


def _exercise_cache(path: str) -> None:
    r = CacheReader(path)
    n = len(r)
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
    r.verify()
    if n:
        try:
            DatasetHandle.from_reader(r).collate([0])
        except CacheError:
            pass


def _exercise_skeleton(data: bytes) -> None:
    import torch

    decode_skeleton(data, 4, lambda i, is_np: torch.zeros(1), "fuzz")


def _exercise_shard(path: str) -> None:
    with open(path, "rb") as f:
        fmt.read_shard_header(f, os.fstat(f.fileno()).st_size, path)


def run(seconds: float = 60.0, seed: int = 0, out: Callable[..., None] = print,
        keep_findings: str | None = None) -> dict[str, Any]:
    """Fuzz for ``seconds``; returns executions, corpus size, coverage and findings (type, target, message)."""
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="streaming-cache-fuzz-")
    sentinel = os.path.join(work, "PWNED")
    try:
        pristine = os.path.join(work, "pristine")
        _seed_cache(pristine, sentinel)
        shards = [os.path.join(layout.SHARD_DIR, n) for n in os.listdir(layout.shard_dir(pristine))]
        with open(layout.index_path(pristine), "rb") as f:
            index = f.read()
        with open(os.path.join(pristine, "evil.pkl"), "rb") as f:
            evil = f.read()
        r = CacheReader(pristine)
        skeletons = [r.entry_record(i).skeleton for i in range(len(r))]
        with open(os.path.join(pristine, shards[0]), "rb") as f:
            shard = f.read()
        parsed = fmt.IndexFile(layout.index_path(pristine))
        structured = [({k: v for k, v in parsed.header.items() if k not in ("sections", "format_version")},
                       {n: bytes(parsed.section(n).tobytes()) for n in parsed.header["sections"]})]
        del parsed
        targets: dict[str, list[Any]] = {"index": [index], "skeleton": skeletons + [evil], "shard": [shard],
                                         "index, checksums fixed": structured}
        live = os.path.join(work, "live")
        shutil.copytree(pristine, live)
        tracer = _Tracer()
        findings: list[dict[str, Any]] = []
        seen_findings: set[tuple[str, str]] = set()
        execs = 0
        started = time.perf_counter()
        last_report = started
        while time.perf_counter() - started < seconds:
            target = rng.choice(("index", "index, checksums fixed", "index, checksums fixed", "skeleton", "shard"))
            corpus = targets[target]
            if target == "index, checksums fixed":
                item = _mutate_structured(rng.choice(corpus), rng)
                try:
                    fmt.write_index(os.path.join(work, "fuzzed.scc"), item[0], item[1])
                    with open(os.path.join(work, "fuzzed.scc"), "rb") as f:
                        data = f.read()
                except Exception:  # not even serialisable: not an input the reader can be given
                    continue
            else:
                data = _mutate(rng.choice(corpus), corpus, rng)
            for rel in shards:  # the reader may delete files it does not know as leftovers: restore them
                if not os.path.exists(os.path.join(live, rel)):
                    shutil.copy(os.path.join(pristine, rel), os.path.join(live, rel))
            if target.startswith("index"):
                with open(layout.index_path(live), "wb") as f:
                    f.write(data)
                call: Callable[[], None] = lambda: _exercise_cache(live)
            elif target == "shard":
                spath = os.path.join(work, "fuzzed.safetensors")
                with open(spath, "wb") as f:
                    f.write(data)
                call = lambda: _exercise_shard(spath)
            else:
                call = lambda: _exercise_skeleton(data)
            tracer.new = 0
            t0 = time.perf_counter()
            sys.settrace(tracer)
            try:
                call()
            except CacheError:
                pass
            except Exception as exc:  # the contract says CacheError or success: anything else is a finding
                sig = (type(exc).__name__, traceback.extract_tb(exc.__traceback__)[-1].lineno.__str__())
                if sig not in seen_findings:
                    seen_findings.add(sig)
                    findings.append({"target": target, "type": type(exc).__name__, "message": str(exc)[:300],
                                     "where": "".join(traceback.format_tb(exc.__traceback__)[-2:])[-600:]})
                    if keep_findings:
                        os.makedirs(keep_findings, exist_ok=True)
                        with open(os.path.join(keep_findings, f"{target}-{len(findings)}.bin"), "wb") as f:
                            f.write(data)
            finally:
                sys.settrace(None)
            took = time.perf_counter() - t0
            if took > SLOW_SECONDS and ("slow", target) not in seen_findings:
                seen_findings.add(("slow", target))
                findings.append({"target": target, "type": "SLOW", "message": f"one input took {took:.1f}s "
                                 f"(> {SLOW_SECONDS}s under the tracer)", "where": ""})
                if keep_findings:
                    os.makedirs(keep_findings, exist_ok=True)
                    with open(os.path.join(keep_findings, f"{target}-slow.bin"), "wb") as f:
                        f.write(data)
            execs += 1
            if tracer.new:
                corpus.append(item if target == "index, checksums fixed" else data)
            if os.path.exists(sentinel):
                findings.append({"target": target, "type": "CODE EXECUTION", "message": "the sentinel was created",
                                 "where": ""})
                break
            if time.perf_counter() - last_report > 5:
                last_report = time.perf_counter()
                out(f"\r{execs} executions, {len(tracer.edges)} edges, corpus "
                    f"{sum(len(c) for c in targets.values())}, findings {len(findings)}", end="", flush=True)
        elapsed = time.perf_counter() - started
        out(f"\r{execs} executions in {elapsed:.0f}s, {len(tracer.edges)} coverage edges, corpus "
            f"{sum(len(c) for c in targets.values())}, findings {len(findings)}")
        for f in findings:
            out(f"  finding [{f['target']}] {f['type']}: {f['message']}\n{f['where']}")
        return {"executions": execs, "seconds": round(elapsed, 1), "edges": len(tracer.edges),
                "corpus": {k: len(v) for k, v in targets.items()}, "findings": findings}
    finally:
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
