"""Tables on stdout through ``rich``.

On a terminal a table takes the terminal's width, with a bold header and a rule under it.
Anywhere else (a pipe, a file, a test capturing stdout) it is plain text without colour or
escape codes: a header, a line of dashes under each column, then the rows, at least
:data:`PLAIN_WIDTH` characters wide and as wide as the table needs, so no cell is wrapped or cut.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

PLAIN_WIDTH = 160  # columns of plain text when the stream is no terminal (no wrapping below)
_UNBOUNDED = 1 << 16  # the width a table is measured in: what its cells need, nothing cut


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def console(stream: TextIO | None = None, *, width: int | None = None) -> Console:
    """A console on ``stream`` (stdout by default, looked up now, so a redirection counts):
    colour on a terminal, plain text elsewhere; never markup, emoji or highlighting, which
    would change what a model name or a path prints as."""
    from rich.console import Console

    file = sys.stdout if stream is None else stream
    terminal = is_terminal(file)
    return Console(
        file=file,
        force_terminal=terminal,
        color_system="auto" if terminal else None,
        no_color=not terminal,
        width=None if terminal else (width or PLAIN_WIDTH),
        markup=False,
        emoji=False,
        highlight=False,
    )


def make_table(
    rows: Sequence[Sequence[object]], header: Sequence[str], *, text: Sequence[int] = (0,)
) -> Table:
    """A table of ``rows`` under ``header``: the columns numbered in ``text`` left-aligned,
    the others (numbers) right-aligned."""
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        header_style="bold",
    )
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i in text else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    return table


# the plain form of rich's SIMPLE_HEAD: no edges, a line of dashes under the header
_PLAIN_BOX_LINES = ("    ", "    ", " -  ", "    ", "    ", "    ", "    ", "    ")


def _plain(table: Table, width: int) -> str:
    """``table`` as plain text lines, without trailing blanks."""
    from rich import box

    table.box = box.Box("".join(f"{line}\n" for line in _PLAIN_BOX_LINES), ascii=True)
    table.header_style = ""
    buffer = io.StringIO()
    out = console(buffer, width=width)
    for column in table.columns:
        column.no_wrap = True
    out.print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def table(
    rows: Sequence[Sequence[object]], header: Sequence[str], *, text: Sequence[int] = (0,)
) -> str:
    """The table as plain text (for a command that prints it among other lines)."""
    built = make_table(rows, header, text=text)
    natural = console(io.StringIO(), width=_UNBOUNDED).measure(built).maximum
    return _plain(built, max(PLAIN_WIDTH, natural))


def print_table(
    rows: Sequence[Sequence[object]], header: Sequence[str], *, text: Sequence[int] = (0,)
) -> None:
    """Print the table on stdout: rich's on a terminal, plain text elsewhere."""
    if not is_terminal(sys.stdout):
        sys.stdout.write(table(rows, header, text=text) + "\n")
        sys.stdout.flush()
        return
    console().print(make_table(rows, header, text=text))
