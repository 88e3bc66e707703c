"""Tools for developing and verifying the engine, kept out of the runtime package: benchmarks of the read path
and the loader, the crash harness, the fuzzer, a demo, and toy encoders they share. Reachable from the CLI
(``python -m streaming_cache bench|bench-loader|crashtest|fuzz|demo``, imported only when such a command runs);
nothing outside this folder imports it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from ..cli import DEV_COMMANDS


def tool_parser(command: str, *, seeded: bool = False) -> argparse.ArgumentParser:
    """The argument parser of a developer command, with the help text the main CLI lists it with, ``--json``
    and (``seeded``) ``--seed``."""
    p = argparse.ArgumentParser(prog=f"python -m streaming_cache {command}", description=DEV_COMMANDS[command][1])
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    if seeded:
        p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    return p


def benchmark_main(command: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[..., dict[str, Any]], argv: Sequence[str] | None) -> int:
    """The command line of a benchmark: a working directory, its own options, ``--json``."""
    p = tool_parser(command)
    p.add_argument("path", nargs="?", default=None, help="working directory (default: a temporary one)")
    add_arguments(p)
    args = p.parse_args(argv)
    results = run(args, out=(lambda *a, **k: None) if args.json else print)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    return 0
