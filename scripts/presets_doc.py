"""Writes the presets table of docs/presets.md from ``streaming_cache.train.presets`` (between its markers).

    python scripts/presets_doc.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "presets.md")
BEGIN, END = "<!-- presets table: scripts/presets_doc.py writes it -->", "<!-- end of the presets table -->"


def render(text: str) -> str:
    """``text`` (the doc) with the table between the markers written anew."""
    sys.path.insert(0, ROOT)
    try:
        from streaming_cache.train.presets import table_markdown
    finally:
        sys.path.pop(0)
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table_markdown()}{END}{tail}"


def main() -> int:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(render(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
