"""The one table every benchmark prints, and the cell formats its figures share.

A table is a header and rows of cells. As text (the terminal) its columns are padded to the widest cell; as
Markdown (a ``.md`` file, docs/benchmarks.md) its cells are not padded, a ``|`` inside one is escaped, and the
line under the header carries the alignment. The caller formats its numbers into cells (each benchmark knows
its precision); the table only lays them out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, align: str | None = None,
          widths: Sequence[int] = (), markdown: bool = False) -> str:
    """``header`` and ``rows`` as lines. ``align``: one ``<`` (left) or ``>`` (right) per column; by default the
    first column (a row's name) left, the others (numbers) right. ``widths``: the least width of each column, so
    that rows printed one at a time (a long run's progress) line up under a header printed before them."""
    rows = [[str(cell) for cell in row] for row in rows]
    align = align or "<" + ">" * (len(header) - 1)
    if markdown:
        lines = ["| " + " | ".join(markdown_cell(cell) for cell in line) + " |" for line in [header, *rows]]
        lines.insert(1, "|" + "|".join("---" if a == "<" else "---:" for a in align) + "|")
        return "\n".join(lines)
    sizes = [max([len(h), *(len(row[i]) for row in rows), widths[i] if i < len(widths) else 0])
             for i, h in enumerate(header)]
    return "\n".join("  ".join(f"{cell:{a}{size}}" for cell, a, size in zip(line, align, sizes)).rstrip()
                     for line in [list(header), *rows])


def markdown_cell(text: object) -> str:
    """A cell's text as Markdown keeps it in its cell: ``|`` escaped, on one line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_ms(x: float) -> str:
    """Milliseconds, three decimals below 10 ms."""
    return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms"
