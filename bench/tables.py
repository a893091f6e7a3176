"""Plain-text tables for the benchmark's output: a header, a rule, then rows."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows[0]`` is the header. The first column is left-aligned (names), the others right-aligned
    (figures)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
