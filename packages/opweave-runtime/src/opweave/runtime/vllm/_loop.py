# pyright: reportMissingImports=false
# (uvloop comes with vLLM, an optional extra: this module is imported by serve() only)
"""uvloop's event loop, handing the server's stopping signals to the drain."""

from __future__ import annotations

import signal
from typing import Any

import uvloop

from ._guard import Drain


class NotingLoop(uvloop.Loop):
    """uvloop's loop; a signal vLLM's server installs a handler for goes to :attr:`drain`
    (one per server run, set before the loop runs), which calls vLLM's handler once the
    drain has ended. SIGHUP (a closed terminal or session), which vLLM leaves to its default
    of killing the process at once, drains as SIGTERM does, unless it was ignored (nohup)."""

    drain: Drain

    def add_signal_handler(self, sig: int, callback: Any, *args: Any) -> None:
        self._drain_on(sig, callback, *args)
        if sig == signal.SIGTERM and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            self._drain_on(signal.SIGHUP, callback, *args)

    def _drain_on(self, sig: int, callback: Any, *args: Any) -> None:
        drain = self.drain

        def stop() -> None:
            callback(*args)

        def note() -> None:
            drain.on_signal(sig, stop)

        super().add_signal_handler(sig, note)
