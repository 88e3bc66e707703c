"""Crash harness: SIGKILL a real build -> rebuild -> clean sequence at many instants, check what survives.

The worker (a subprocess) builds a dataset from folder v1, rebuilds it from v2 (some files changed, removed and
added), then cleans the orphans (deleting entries and compacting shards). A kill plan makes it SIGKILL itself:

* ``call:NAME:N:before|after`` - at the N-th call of ``os.replace`` / ``os.rename`` / ``os.fsync`` /
  ``os.remove`` / ``os.write`` / ``open`` for writing, just before or just after it: every commit step
  (shard write, shard rename, index write, index replace, leftover removal) is hit deterministically;
* ``time:T`` - after T seconds, wherever it is (encoding, hashing, writing).

After every kill the harness checks: the cache opens; ``verify`` passes; the committed state is intact (the
generation on disk is the last one the worker reported, with exactly its keys, or the one being committed when
it died); then it resumes (runs the whole sequence again) and requires exactly the keys, tensor checksums and
manifest rows of an uninterrupted run. ``python -m streaming_cache crashtest`` prints the tally.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from ..builder import build
from ..clean import clean
from ..reader import open_cache
from ..writer import CacheWriter
from . import tool_parser
from .toy import folder_items, toy_encoders, write_folder, write_ppm

CALLS = ("replace", "rename", "fsync", "remove", "write", "open_w")
PHASES = ("build v1", "rebuild v2", "clean + compact", "after the sequence")


def _key_digest(keys: list[str]) -> str:
    return xxhash.xxh3_64_hexdigest("\0".join(sorted(keys)).encode())


def write_sources(root: str) -> tuple[str, str]:
    """Two versions of a small image folder: v2 changes 5 images, removes 3 and adds 3; captions repeat."""
    v1, v2 = os.path.join(root, "v1"), os.path.join(root, "v2")
    captions = [f"caption {i % 6}" for i in range(27)]
    write_folder(v1, captions[:24], size=16)
    write_folder(v2, captions, size=16)
    for i in (0, 5, 9, 14, 20):
        write_ppm(os.path.join(v2, f"img{i:03d}.ppm"), seed=1000 + i, size=16)
    for i in (3, 11, 19):
        for ext in (".ppm", ".txt"):
            os.remove(os.path.join(v2, f"img{i:03d}{ext}"))
    old = time.time() - 3600  # outside the racy-mtime window: the stat ladder may trust them
    for folder in (v1, v2):
        for name in os.listdir(folder):
            os.utime(os.path.join(folder, name), (old, old))
    return v1, v2


def sequence(cache: str, v1: str, v2: str, sleep_s: float = 0.0, log: Callable[[str], None] = lambda s: None) -> None:
    """The work under test: build from v1, rebuild from v2, clean orphans (compacting shards)."""
    for folder in (v1, v2):
        build(cache, folder_items(folder), toy_encoders(batch_size=4, sleep_s=sleep_s), commit_seconds=0)
        log("phase built " + os.path.basename(folder))
    clean(cache, dry_run=False)
    log("phase cleaned")


def snapshot(cache: str) -> dict[str, Any]:
    """Keys, each key's tensor checksums, and the manifest rows: what must equal an uninterrupted run."""
    r = open_cache(cache)
    digests = {k: [t.digest for t in r[k].tensors] for k in r.keys()}
    rows = sorted((x["name"], sorted(x["keys"].items())) for x in r.manifest("default")["rows"])
    return {"digests": digests, "rows": rows}


# ------------------------------------------------------------------------------------------------ worker side
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _wrap(name: str, func: Callable[..., Any], hook: Callable[[str, str], None]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if name == "open_w":
            mode = args[1] if len(args) > 1 else kwargs.get("mode", kwargs.get("flags", "r"))
            writes = mode & _WRITE_FLAGS if isinstance(mode, int) else any(c in mode for c in "wax+")
            if not writes:
                return func(*args, **kwargs)
        hook(name, "before")
        result = func(*args, **kwargs)
        hook(name, "after")
        return result
    return wrapped


def _hook_calls(hook: Callable[[str, str], None]) -> None:
    """Make ``hook(name, "before" | "after")`` run around every call of :data:`CALLS` in this process."""
    import builtins

    for name in CALLS:
        if name == "open_w":
            builtins.open = _wrap(name, builtins.open, hook)
            os.open = _wrap(name, os.open, hook)  # the engine creates its files with os.open
        else:
            setattr(os, name, _wrap(name, getattr(os, name), hook))


def _install_kill(plan: str) -> None:
    kind, _, rest = plan.partition(":")
    if kind == "time":
        import threading

        threading.Timer(float(rest), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        return
    target_name, n, when = rest.split(":")
    target, count = int(n), [0]

    def hook(name: str, phase: str) -> None:
        if name != target_name:
            return
        count[0] += phase == "before"
        if count[0] == target and phase == when:
            os.kill(os.getpid(), signal.SIGKILL)

    _hook_calls(hook)


def _count_calls() -> dict[str, int]:
    counts = {n: 0 for n in CALLS}

    def hook(name: str, phase: str) -> None:
        counts[name] += phase == "before"

    _hook_calls(hook)
    return counts


def worker(cache: str, v1: str, v2: str, plan: str, sleep_s: float) -> None:
    original = CacheWriter.commit

    def logged_commit(self: Any) -> bool:
        changed = original(self)
        if changed:
            r = open_cache(self.path)
            print(f"committed {r.generation} {_key_digest(list(r.keys()))}", flush=True)
        return changed

    CacheWriter.commit = logged_commit  # type: ignore[method-assign]
    counts = _count_calls() if plan == "count" else None
    if plan not in ("none", "count"):
        _install_kill(plan)
    started = time.perf_counter()
    sequence(cache, v1, v2, sleep_s, log=lambda s: print(s, flush=True))
    if counts is not None:
        print("counts " + json.dumps(counts), flush=True)
        print(f"elapsed {time.perf_counter() - started:.4f}", flush=True)
    print("finished", flush=True)


# ------------------------------------------------------------------------------------------------ harness side
def _child(cache: str, v1: str, v2: str, plan: str, sleep_s: float, log_path: str) -> None:
    with open(log_path, "w", buffering=1) as log:
        sys.stdout = log
        try:
            worker(cache, v1, v2, plan, sleep_s)
        except BaseException:
            import traceback

            log.write("error " + traceback.format_exc().replace("\n", "\nerror "))
            raise


def _run_worker(cache: str, v1: str, v2: str, plan: str, sleep_s: float) -> tuple[int, list[str]]:
    """Run :func:`worker` in a child forked from a forkserver that has the engine imported: a start costs
    milliseconds instead of an interpreter and torch import, and the fork happens in a single-threaded process
    (forking this one, which may run threads, could deadlock the child). Returns (exit code or -signal, lines)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["streaming_cache.devtools.crashtest"])
    log_path = cache.rstrip(os.sep) + ".log"
    proc = ctx.Process(target=_child, args=(cache, v1, v2, plan, sleep_s, log_path))
    proc.start()
    proc.join(300)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise RuntimeError(f"worker hung with plan {plan}")
    with open(log_path) as f:
        lines = f.read().splitlines()
    os.remove(log_path)
    rc = proc.exitcode if proc.exitcode is not None else 1
    if rc not in (0, -signal.SIGKILL):
        raise RuntimeError(f"worker failed ({rc}) with plan {plan}:\n" + "\n".join(lines[-40:]))
    return rc, lines


def run(kills: int = 60, seed: int = 0, workdir: str | None = None, sleep_s: float = 0.003,
        out: Callable[..., None] = print) -> dict[str, Any]:
    """Run the harness; returns the tally. Raises AssertionError on the first violated guarantee."""
    if not hasattr(signal, "SIGKILL"):
        raise RuntimeError("the crash harness needs POSIX SIGKILL")
    rng = random.Random(seed)
    own = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="streaming-cache-crash-")
    try:
        v1, v2 = write_sources(os.path.join(work, "src"))
        reference = os.path.join(work, "reference")
        _, lines = _run_worker(reference, v1, v2, "count", sleep_s)
        duration = float(next(line for line in lines if line.startswith("elapsed "))[8:])
        expected = snapshot(reference)
        counts = json.loads(next(line for line in lines if line.startswith("counts "))[7:])
        plans = []
        n_call = (kills * 2) // 3
        for i in range(n_call):
            name = [n for n in CALLS if counts.get(n)][i % len([n for n in CALLS if counts.get(n)])]
            plans.append(f"call:{name}:{rng.randint(1, counts[name])}:{rng.choice(['before', 'after'])}")
        plans += [f"time:{rng.uniform(0.05, max(0.1, duration * 0.9)):.3f}" for _ in range(kills - n_call)]
        tally: dict[str, Any] = {"kills": 0, "finished_before_kill": 0, "by_plan": {}, "by_phase": {}, "verified": 0,
                                 "no_index_yet": 0, "resumed_equal": 0, "calls_per_run": counts,
                                 "reference_entries": len(expected["digests"])}
        for i, plan in enumerate(plans):
            cache = os.path.join(work, f"trial{i:03d}")
            rc, lines = _run_worker(cache, v1, v2, plan, sleep_s)
            killed = rc == -signal.SIGKILL
            tally["kills"] += killed
            tally["finished_before_kill"] += not killed
            kind = plan.split(":")[1] if plan.startswith("call") else "time"
            tally["by_plan"][kind] = tally["by_plan"].get(kind, 0) + killed
            phase = PHASES[min(3, sum(line.startswith("phase ") for line in lines))] if killed else "finished"
            tally["by_phase"][phase] = tally["by_phase"].get(phase, 0) + 1
            commits = [line.split() for line in lines if line.startswith("committed ")]
            if os.path.exists(os.path.join(cache, "index.scc")):
                r = open_cache(cache)
                assert r.verify().ok, f"{plan}: verify failed after the kill"
                if commits:
                    gen, digest = int(commits[-1][1]), commits[-1][2]
                    assert r.generation in (gen, gen + 1), f"{plan}: generation {r.generation}, last commit {gen}"
                    if r.generation == gen:
                        assert _key_digest(list(r.keys())) == digest, f"{plan}: committed entries lost or changed"
                else:
                    assert r.generation == 1, f"{plan}: an uncommitted generation {r.generation} is visible"
                tally["verified"] += 1
            else:
                assert not commits, f"{plan}: the worker committed but no index exists"
                tally["no_index_yet"] += 1
            sequence(cache, v1, v2)  # the resume, in this process
            assert snapshot(cache) == expected, f"{plan}: the resumed run differs from an uninterrupted one"
            assert open_cache(cache).verify().ok
            tally["resumed_equal"] += 1
            shutil.rmtree(cache, ignore_errors=True)
            out(f"\rkills {tally['kills']}/{i + 1}, resumed equal {tally['resumed_equal']}", end="", flush=True)
        out("")
        return tally
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = tool_parser("crashtest", seeded=True)
    p.add_argument("--kills", type=int, default=60, help="number of killed runs (default %(default)s)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    tally = run(kills=args.kills, seed=args.seed, out=(lambda *a, **k: None) if args.json else print)
    tally["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(tally, indent=2))
    else:
        print(f"{tally['kills']} SIGKILLs ({tally['finished_before_kill']} runs finished first) in "
              f"{tally['seconds']}s; by kill point {tally['by_plan']}; by phase {tally['by_phase']}")
        print(f"after every kill: cache opened and verified {tally['verified']} times (the others died before "
              f"the first commit), committed state intact; resumed runs equal to the uninterrupted one: "
              f"{tally['resumed_equal']}/{sum(tally['by_phase'].values())}")
    return 0
