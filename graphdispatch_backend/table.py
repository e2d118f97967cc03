"""Plain-text tables for the command line (reports, verdicts, benchmarks).

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
