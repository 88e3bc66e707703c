"""Write the model-families table of ``docs/families.md`` from the family sweep's reports.

    python scripts/families_table.py test-artifacts/families-comfyui-0.33.0.json \\
        test-artifacts/families-comfyui-0.3.64.json [--doc docs/families.md | --print]

Each report is what ``tests/comfy/test_families.py`` writes for one ComfyUI version (``STREAMING_CACHE_SWEEP=all``
for every family), or the ``sweep-partial.json`` a sweep keeps in its work folder while it runs; several reports of
one version are joined. One row per sweep family: its ComfyUI class, kind, one sample's latent, what the cache holds
for its conditioning, and per version whether it trained (parameters of the tiny model; seconds to build it, train
two steps and sample with the LoRA) or why not; then
whether ComfyUI's own TrainLoraNode trains it. Above the table, per version: families trained of the entries in
ComfyUI's ``supported_models`` list, and how many of those are not diffusion models. The doc's table sits
between ``<!-- families:start -->`` and ``<!-- families:end -->``; nothing else in the file is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

START, END = "<!-- families:start -->", "<!-- families:end -->"
NOT_DIFFUSION = "not a diffusion model"
NOT_RUN = "not run"


def _shape(shape: list | None) -> str:
    return "×".join(str(s) for s in shape[1:]) if shape else ""


def _params(n: int | None) -> str:
    if not n:
        return ""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.0f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def status(row: dict | None) -> str:
    """One version's cell: trained (with the tiny model's size and the time it took) or why not."""
    if row is None:
        return "not in this version"
    if row.get("trained"):
        seconds = sum(row.get(k, 0.0) for k in ("detect_seconds", "build_seconds", "train_seconds", "check_seconds"))
        return f"trained ({_params(row.get('params'))}, {seconds:.0f} s)"
    if not _ran(row):
        return "not run"
    if row.get("reason"):
        return row["reason"]
    return f"**fails**: {row.get('error') or 'no LoRA change'}"[:200]


def comfy_trainer(rows: list[dict | None]) -> str:
    results = [r.get("comfy_trainer") for r in rows if r and r.get("comfy_trainer")]
    if not results:
        return ""
    return "; ".join(f"{r['version']}: " + ("trains" if r["ok"] else f"fails ({r['error'][:80]})")
                     for r in results)


def _ran(row: dict) -> bool:
    return not str(row.get("reason", "")).startswith(NOT_RUN)


def merge(reports: list[dict]) -> list[dict]:
    """One report per ComfyUI version, in the order versions first appear. Several reports of one version (a full
    sweep stopped midway, the default test run's) are joined: a family's row is the first one that ran it, else
    the first one at all. A report without its total ``seconds`` is one the sweep wrote while still running."""
    merged: dict[str, dict] = {}
    for report in reports:
        into = merged.setdefault(report["comfyui"], {**report, "families": {}, "stopped": False})
        into["stopped"] = into["stopped"] or "seconds" not in report
        for key, row in report["families"].items():
            if key not in into["families"] or (not _ran(into["families"][key]) and _ran(row)):
                into["families"][key] = row
    return list(merged.values())


def summary(report: dict) -> str:
    """``trained / listed (not diffusion models)`` for one version's report, and how many families it did not
    run."""
    listed = report["supported_models"]
    rows = report["families"].values()
    trained = {r["config"] for r in rows if r.get("trained")}
    not_diffusion = {r["config"] for r in rows if r.get("kind") == NOT_DIFFUSION}
    not_run = sum(1 for r in rows if not _ran(r))
    text = (f"ComfyUI {report['comfyui']}: **{len(trained)} of {len(listed)}** `supported_models` entries trained "
            f"({len(not_diffusion)} of them are not diffusion models; {len(listed) - len(not_diffusion)} are)")
    if not_run:
        text += (f"; {not_run} families not run in {'this stopped sweep' if report.get('stopped') else 'this run'} "
                 "(`STREAMING_CACHE_SWEEP=all` runs them)")
    return text


def table(reports: list[dict]) -> str:
    reports = merge(reports)
    versions = [r["comfyui"] for r in reports]
    keys: list[str] = []
    for report in reports:
        keys += [k for k in report["families"] if k not in keys]
    lines = [f"- {summary(r)}" for r in reports]
    lines += ["", "| family | ComfyUI class | kind | latent per sample | conditioning in the cache | "
              + " | ".join(f"ComfyUI {v}" for v in versions) + " | ComfyUI's TrainLoraNode |",
              "|---|---|---|---|---|" + "---|" * len(versions) + "---|"]
    for key in keys:
        rows = [r["families"].get(key) for r in reports]
        first = next(r for r in rows if r is not None)
        shape = next((r.get("latent") for r in rows if r and r.get("latent")), None)
        lines.append(f"| {key} | `{first['config']}` | {first.get('kind', '')} | {_shape(shape)} | "
                     f"{first.get('encoders', '')} | " + " | ".join(status(r) for r in rows)
                     + f" | {comfy_trainer(rows)} |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"the file has no {START} ... {END} block to replace")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="families-comfyui-<version>.json reports, newest version first; "
                                                   "several of one version are joined (the first that ran a family "
                                                   "gives its row)")
    parser.add_argument("--doc", "--readme", dest="doc", help="the file holding the table (default docs/families.md)",
                        default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                                             "families.md"))
    parser.add_argument("--print", action="store_true", help="print the table instead of writing the doc")
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    block = table(reports)
    if args.print:
        print(block)
        return 0
    with open(args.doc, encoding="utf-8") as f:
        text = f.read()
    with open(args.doc, "w", encoding="utf-8") as f:
        f.write(replace_block(text, block))
    print(f"wrote the families table of {len(reports)} report(s) to {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
