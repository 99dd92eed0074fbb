"""Progress of a profiling run on stderr: a live bar on a terminal, plain lines otherwise.

Profiles of large models take minutes, so the user should see which operator is being timed
and how far along the run is. Logs and CI capture stderr without a terminal, where carriage
returns make a mess, so there the same information is printed as a line every 10%.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 24


class Progress:
    """Counts measured cells; ``update`` after each, ``note`` for phases without cells."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.started = time.monotonic()
        self._next_line_pct = 0

    def note(self, message: str) -> None:
        if not self.enabled:
            return
        if self.live:
            self._clear()
        self.stream.write(f"profile: {message}\n")
        self.stream.flush()

    def update(self, label: str, cells: int = 1) -> None:
        self.done = min(self.done + cells, self.total)
        if not self.enabled:
            return
        pct = 100 * self.done // self.total
        elapsed = time.monotonic() - self.started
        eta = _eta(elapsed, self.done, self.total)
        if self.live:
            filled = _WIDTH * self.done // self.total
            bar = "#" * filled + "-" * (_WIDTH - filled)
            self.stream.write(
                f"\r[{bar}] {pct:3d}% {self.done}/{self.total} {elapsed:5.1f}s, {eta:<14} "
                f"{label[:40]:<40}"
            )
            self.stream.flush()
        elif pct >= self._next_line_pct:
            self.stream.write(
                f"profile: {pct:3d}% ({self.done}/{self.total} cells, {elapsed:.1f} s, {eta}) "
                f"{label}\n"
            )
            self.stream.flush()
            self._next_line_pct = pct - pct % 10 + 10

    def _clear(self) -> None:
        self.stream.write("\r" + " " * (_WIDTH + 86) + "\r")

    def close(self) -> None:
        if self.enabled and self.live:
            self._clear()
            self.stream.flush()


def _eta(elapsed_s: float, done: int, total: int) -> str:
    """``about 42 s left``: the remaining cells at the mean pace so far (cells of one run take
    alike long, within a factor of a few)."""
    if done <= 0 or done >= total:
        return "done" if done >= total else "starting"
    left = elapsed_s / done * (total - done)
    return f"about {left:.0f} s left" if left < 120 else f"about {left / 60:.0f} min left"
