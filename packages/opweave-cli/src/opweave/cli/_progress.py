"""Progress of long work on stderr, through ``rich``.

On a terminal: a live bar with the count done, the time taken and an estimate of the time left,
removed when the work ends. Elsewhere (logs, CI, a test capturing stderr), where a redrawn line
makes a mess: :class:`StepProgress` prints a plain line every 10%, :class:`SearchProgress`
nothing, as before.

:class:`StepProgress` has the interface of the profiler's progress (``note``, ``update``,
``close``), so that ``opweave profile`` can hand it to the measurement loop; :class:`SearchProgress`
is a callback of the planner's progress reports (``phase``, ``done``, ``total``,
``simulator_calls``, ``best_usd_per_million_tokens``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

from ._console import console, is_terminal

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def _live(stream: TextIO, description: str, total: int | None) -> tuple[Progress, TaskID]:
    """A started rich progress display on ``stream`` with one task."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    display = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[label]}"),
        console=console(stream),
        transient=True,
    )
    task = display.add_task(description, total=total, label="")
    display.start()
    return display, task


class SearchProgress:
    """The plan search's progress reports as a live bar per phase (candidates evaluated, the
    cheapest plan so far); only on a terminal."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and is_terminal(self.stream)
        self._live: tuple[Progress, TaskID] | None = None
        self._phase: str | None = None

    def __call__(self, report: Any) -> None:
        if not self.enabled:
            return
        if self._live is None:
            self._live = _live(self.stream, report.phase, report.total)
        display, task = self._live
        if report.phase != self._phase:  # a new phase counts its own candidates
            display.reset(task, total=report.total, description=report.phase)
            self._phase = report.phase
        best = report.best_usd_per_million_tokens
        label = f"{report.simulator_calls} simulated, best " + (
            "-" if best is None else f"${best:.3f}/Mtok"
        )
        display.update(task, total=report.total, completed=report.done, label=label)

    def close(self) -> None:
        if self._live is not None:
            self._live[0].stop()
            self._live = None
