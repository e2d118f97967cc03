"""Plain-text tables for the command line (reports, verdicts, benchmarks), and the cells
that read the same in all of them (`counts`, `plural`).

Left-aligned columns two spaces apart, a dashed rule under the header, no trailing
spaces. `max_width` cuts a longer cell to that many characters ending in "..."; the full
text belongs in a detail list under the table, so rows stay one line each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cell(value: Any, max_width: int | None) -> str:
    # a cell is one line: a newline (a traceback in a reason) would break the grid
    text = str(value).replace("\r\n", " ").replace("\n", " ").replace("\r", " ").replace("\t", " ")
    if max_width is not None and len(text) > max_width:
        return text[: max(max_width - 3, 1)] + "..."
    return text


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int | None = None) -> str:
    cells = [[_cell(c, None) for c in header]] + [[_cell(c, max_width) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


CELL = 48  # a report's widest table cell; the full text is listed under the table


def counts(by: dict[str, int] | None, skip: tuple[str, ...] = ()) -> str:
    """`{"warmup": 1, "verifying": 2}` as `verifying=2, warmup=1` (sorted), "-" when empty."""
    items = [(k, v) for k, v in sorted((by or {}).items()) if k not in skip]
    return ", ".join(f"{k}={v}" for k, v in items) or "-"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
