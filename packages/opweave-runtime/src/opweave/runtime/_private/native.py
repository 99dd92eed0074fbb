"""The native submission extension: C++ point-to-point operators a compiled rank program calls.

``_native/wire.cpp`` (shipped with the package) is compiled against the installed torch the first
time a run needs it, by ``torch.utils.cpp_extension`` with the system's C++ compiler and ninja,
and cached under torch's extension folder (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); later runs load the cached library in milliseconds. It registers
the ``torch.ops.opweave`` operators: ``send``/``recv`` of byte messages over a :class:`NativeWire`
and ``after``, which orders a graph's host inputs after earlier operators. Their fake (meta)
forms below let ``torch.compile`` trace them; inductor's C++ wrapper then calls their C++ kernels
through the dispatcher, so a rank's whole per-token program (receives, steps, sends) runs as one
native call (:mod:`.program`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..errors import OpWeaveRuntimeError
from .wire import PeerError

SOURCE = Path(__file__).resolve().parent.parent / "_native" / "wire.cpp"
_loaded = False
_ids = itertools.count(1)
_log = logging.getLogger("opweave.runtime")
_PEER_ERROR = re.compile(r"opweave-peer (-?\d+): (.*)")


def load() -> None:
    """Build (once per torch version, cached) and load the extension; registers the operators.
    An error names what is missing (a C++ compiler, ninja) and what to install."""
    global _loaded
    if _loaded:
        return
    name = "opweave_native_" + re.sub(r"\W", "_", torch.__version__)
    start = time.perf_counter()
    # quiet: every multi-rank CPU run loads it, and a command's stderr is its one error line;
    # torch's builder warns (when imported) of CUDA it does not need
    builder = logging.getLogger("torch.utils.cpp_extension")
    level = builder.level
    builder.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=["-O2"],
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        first = next((line for line in lines if "error" in line.lower()), lines[0])[:300]
        raise OpWeaveRuntimeError(
            f"could not build the native extension ({first}); CPU ranks talk to each other "
            "over it, which needs a C++17 compiler (g++) and ninja on PATH"
        ) from None
    finally:
        builder.setLevel(level)
    _register_fakes()
    _loaded = True
    took = time.perf_counter() - start
    if took > 1.0:
        _log.info("built the native extension %s in %.0f s", name, took)


def _register_fakes() -> None:
    @torch.library.register_fake("opweave::send")
    def _send(data, after, when, wire, peer, tag):
        return torch.empty(1, dtype=torch.int64)

    @torch.library.register_fake("opweave::recv")
    def _recv(after, wire, peer, tag, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    @torch.library.register_fake("opweave::after")
    def _after(x, dep):
        return torch.empty_like(x)


def translate(exc: RuntimeError, what: Mapping[int, str] | None = None) -> Exception:
    """What a native operator's failure stands for: a :class:`PeerError` naming the peer, with
    ``what`` naming each tag's message ("receiving segment 2 microbatch 0"); the extension's
    own words for another failure of it; else ``exc`` itself. A compiled graph's wrapper
    replaces an operator's message with its own: the operator's is then read back from the
    extension."""
    text = str(exc)
    if _loaded and "opweave::" in text and "opweave-peer" not in text:
        text = str(torch.ops.opweave.wire_last_error()) or text
    found = _PEER_ERROR.search(text)
    if found is None:
        return OpWeaveRuntimeError(text) if text != str(exc) else exc
    message = found.group(2).strip().splitlines()[0]
    if what:
        tag = re.search(r"message (\d+)", message)
        if tag is not None and int(tag.group(1)) in what:
            message = re.sub(r"receiving message \d+", what[int(tag.group(1))], message, count=1)
    return PeerError(int(found.group(1)), message)


class NativeWire:
    """This rank's connections to every other rank (made by :func:`~.wire.connect_pairs`),
    owned by the extension from here on."""

    def __init__(self, sockets: Mapping[int, socket.socket], timeout_s: float, spin_s: float):
        load()
        # a constant of the compiled program: numbered per process, so the same in every run
        # of a plan (inductor's cache then serves the next run)
        self.id = next(_ids)
        torch.ops.opweave.wire_open(self.id, float(timeout_s), float(spin_s))
        for peer, sock in sockets.items():
            torch.ops.opweave.wire_add(self.id, peer, sock.detach())
        self._stats_at = (0.0, 0.0, 0.0)
        self._closed = False
        self.ones = torch.ones(1, dtype=torch.int64)

    def send(self, peer: int, tag: int, parts: Sequence[torch.Tensor], after: torch.Tensor) -> None:
        """``parts`` (byte views) as one message, without blocking."""
        data = parts[0] if len(parts) == 1 else torch.cat(list(parts))
        with _as_peer_error():
            torch.ops.opweave.send(data, after, self.ones, self.id, peer, tag)

    def recv(self, peer: int, tag: int, nbytes: int, what: str) -> torch.Tensor:
        with _as_peer_error({tag: what}):
            return torch.ops.opweave.recv(self.ones, self.id, peer, tag, nbytes)

    def recv_any(self, peer: int, tag: int, max_bytes: int, what: str) -> torch.Tensor:
        """The next message from ``peer``, of whatever length it announces (a packed batch)."""
        with _as_peer_error({tag: what}):
            return torch.ops.opweave.wire_recv_any(self.id, peer, tag, max_bytes)

    def dry(self, dry: bool) -> None:
        """While ``dry``, sends do nothing and receives return zeros (a program's warm-up)."""
        torch.ops.opweave.wire_dry(self.id, dry)

    def stats(self) -> tuple[float, float, float]:
        """Seconds receives waited, payload bytes and messages sent, since the last call."""
        now = tuple(float(x) for x in torch.ops.opweave.wire_stats(self.id).tolist())
        before, self._stats_at = self._stats_at, now  # type: ignore[assignment]
        return now[0] - before[0], now[1] - before[1], now[2] - before[2]

    def drain(self) -> None:
        with _as_peer_error():
            torch.ops.opweave.wire_drain(self.id)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            torch.ops.opweave.wire_close(self.id)


@contextlib.contextmanager
def _as_peer_error(what: Mapping[int, str] | None = None):
    try:
        yield
    except RuntimeError as exc:
        error = translate(exc, what)
        if error is exc:
            raise
        raise error from None
