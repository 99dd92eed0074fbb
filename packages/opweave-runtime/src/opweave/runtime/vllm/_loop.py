# pyright: reportMissingImports=false
# (uvloop comes with vLLM, an optional extra: this module is imported by serve() only)
"""uvloop's event loop, noting which signal vLLM's server stopped for."""

from __future__ import annotations

from typing import Any

import uvloop


class NotingLoop(uvloop.Loop):
    """uvloop's loop; each signal the server's own handlers are called for is appended to
    :attr:`stopped_by` (one list per server run, set before the loop runs)."""

    stopped_by: list[int]

    def add_signal_handler(self, sig: int, callback: Any, *args: Any) -> None:
        stopped_by = self.stopped_by

        def note(*given: Any) -> None:
            stopped_by.append(sig)
            callback(*given)

        super().add_signal_handler(sig, note, *args)
