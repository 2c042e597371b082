"""What the benchmark scripts print and write: a table of rows, and the rows as JSON."""

from __future__ import annotations

import json
from pathlib import Path


def print_rows(rows: list[dict], columns: list[str]) -> None:
    """Print ``rows`` as a right-aligned table of ``columns`` (a header line, then one per row)."""
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` as indented JSON to ``path`` (its folder made), when a path is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")
