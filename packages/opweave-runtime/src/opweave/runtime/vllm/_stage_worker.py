"""One plan owner's stage worker process, driven step by step by the vLLM executor (the driver).

Started as ``python -m opweave.runtime.vllm._stage_worker CONTROL_FD PARENT_PID`` by
:class:`~._workers.WorkerPool`. It holds only its owner's operators (one
:class:`~opweave.runtime.StageModule` over all of that owner's segments, so only their weights are
read) and the per-request state those operators keep.

Wire: every link is a Unix socket pair wrapped in :class:`multiprocessing.connection.Connection`
(length-prefixed messages). Each worker has

- a *control* connection to the driver: step messages in; data for segment 0 in (first owner);
  logits out (last owner); a one-line error report out when it fails;
- one *data* connection per neighbouring owner: activations go worker to worker at every segment
  boundary, never through the driver.

Why sockets and not the runtime's gloo :class:`~opweave.runtime._private.transport.Transport`:
a peer that dies closes its end of the socket, so the survivors see EOF at once instead of
waiting for a timeout or being left with a poisoned process group that cannot be rebuilt; there
is no rendezvous store or port to pick, and no ``torch.distributed`` state in the vLLM engine's
process, which vLLM may own. The activations of a CPU engine live in host memory anyway.

Step protocol (deterministic, so no message needs to say what it is for): the driver sends every
worker ``{"step": n, "free": [...], "mb": m}``, then the ``m`` microbatches of segment 0 to the
first owner. A worker applies the frees, then for each of its segments in model order and each
microbatch receives the batch from the previous segment's owner, admits requests seen for the
first time (context 0), runs the segment and sends the result on (the last segment's logits go
to the driver). Sends go through a per-link writer thread (:class:`Outbox`), so a receive never
waits behind a send: every ``(segment, microbatch)`` depends only on strictly earlier ones and the
pipeline cannot deadlock, while microbatches overlap across workers.

Lifetime: a worker exits when its control connection reaches EOF (the driver is gone), when its
parent process changes (a watchdog thread polls ``getppid``: unlike ``PR_SET_PDEATHSIG``, which
fires when the *thread* that started the child exits, this follows the process), on a ``stop``
message, or after reporting an error. Waits on peers inside a step are bounded by the timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from .._private.batch import TokenBatch, pack, unpack
from .._private.graph import OpRef
from .._private.stage import StageModule
from ..errors import RequestStateError
from ._kernels import KERNELS_KEY, apply_kernel_choice

_JSON = ord("J")
_BATCH = ord("B")
_WATCHDOG_S = 0.2


class LinkError(Exception):
    """A link failed: the peer closed it (died), or sent nothing within the timeout."""


# -- the wire --------------------------------------------------------------------------------
def encode_json(obj: Any) -> bytes:
    return bytes([_JSON]) + json.dumps(obj, separators=(",", ":")).encode()


def encode_batch(batch: TokenBatch) -> Any:
    """One message: a kind byte, then :func:`pack`'s bytes (a buffer, sent without a copy)."""
    return torch.cat([torch.tensor([_BATCH], dtype=torch.uint8), pack(batch).cpu()]).numpy()


def decode(data: bytes) -> dict[str, Any] | TokenBatch:
    if data[0] == _JSON:
        return json.loads(data[1:])
    if data[0] == _BATCH:
        return unpack(torch.frombuffer(bytearray(data[1:]), dtype=torch.uint8))
    raise LinkError(f"unknown message kind {data[0]}")


def receive(conn: Connection, timeout_s: float | None, what: str) -> dict[str, Any] | TokenBatch:
    """The next message on ``conn``; :class:`LinkError` on EOF or after ``timeout_s``."""
    try:
        if not conn.poll(timeout_s):
            raise LinkError(f"nothing arrived within {timeout_s:g} s while {what}")
        return decode(conn.recv_bytes())
    except (EOFError, OSError) as exc:
        raise LinkError(f"the connection closed while {what} ({type(exc).__name__})") from None


class Outbox:
    """A connection's writer thread: :meth:`put` never blocks on a slow or full peer.

    A send that fails (the peer is gone) is kept and raised by the next :meth:`put`.
    """

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        if self.error is not None:
            raise LinkError(f"sending failed: {self.error}")
        self._queue.put(message)

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            if message is None:
                return
            try:
                self.conn.send_bytes(message)
            except (OSError, ValueError) as exc:
                self.error = exc
                return

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (bounded by ``timeout_s``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)


# -- the worker ------------------------------------------------------------------------------
class StageWorker:
    """One owner's segments and the per-request state they hold; runs the step protocol."""

    def __init__(self, control: Connection, spec: dict[str, Any]) -> None:
        self.control = control
        self.owner: int = spec["owner"]
        self.owners: list[int] = spec["owners"]  # owner of every segment, in model order
        self.timeout_s: float = spec["timeout_s"]
        ops = [OpRef(layer, name) for layer, name in spec["ops"]]
        dtype = getattr(torch, spec["dtype"]) if spec.get("dtype") else None
        self.module = StageModule(spec["model_dir"], ops, dtype=dtype, device=spec["device"])
        self.kernels = apply_kernel_choice(
            self.module, {KERNELS_KEY: spec.get("kernels", "opweave")}
        )
        self.device = torch.device(spec["device"])
        # (segment index, first op, end op) of this owner's segments within self.module
        self.segments: list[tuple[int, int, int]] = [tuple(s) for s in spec["segments"]]
        self.inbound = {int(o): Connection(fd) for o, fd in spec["inbound"].items()}
        self.outbound = {
            int(o): Outbox(Connection(fd), f"opweave-send-{o}")
            for o, fd in spec["outbound"].items()
        }
        self.reply = Outbox(control, "opweave-send-driver")
        self.held: set[str] = set()

    def serve(self) -> None:
        """Run steps until the driver says stop or goes away."""
        self.reply.put(
            encode_json(
                {
                    "ready": True,
                    "pid": os.getpid(),
                    "weight_bytes": self.module.weight_bytes,
                    "kernels": self.kernels,
                }
            )
        )
        while True:
            try:
                msg = receive(self.control, None, "waiting for the next step")
            except LinkError:
                return  # the driver is gone
            if not isinstance(msg, dict) or "stop" in msg:
                return
            self._step(msg["free"], msg["mb"])

    def _step(self, free: Sequence[str], microbatches: int) -> None:
        for rid in free:
            if rid in self.held:
                self.module.free(rid)
                self.held.discard(rid)
        last = len(self.owners) - 1
        for seg, lo, hi in self.segments:
            src = self.control if seg == 0 else self.inbound[self.owners[seg - 1]]
            dest = self.reply if seg == last else self.outbound[self.owners[seg + 1]]
            ops = self.module.operators[lo:hi]
            if seg == last:
                ops = ops[:-1]  # the driver samples, with vLLM's sampling parameters
            for k in range(microbatches):
                what = f"receiving segment {seg} microbatch {k}"
                if seg:
                    what += f" from the worker of owner {self.owners[seg - 1]}"
                batch = receive(src, self.timeout_s, what)
                if not isinstance(batch, TokenBatch):
                    raise LinkError(f"expected activations while {what}, got {batch}")
                self._admit(batch)
                with torch.inference_mode():
                    for op in ops:
                        batch = op(batch)
                if seg == last:
                    batch = TokenBatch(batch.meta, {"logits": batch["logits"]})
                dest.put(encode_batch(batch))

    def _admit(self, batch: TokenBatch) -> None:
        meta = batch.meta
        for rid, ctx in zip(meta.request_ids, meta.context_lens, strict=True):
            if rid not in self.held:
                if ctx != 0:
                    raise RequestStateError(
                        f"the worker of owner {self.owner} holds no state for request {rid!r} "
                        f"at context {ctx}"
                    )
                self.module.admit(rid)
                self.held.add(rid)


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the parent process is gone (this process was re-parented)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(_WATCHDOG_S)


def main(argv: list[str]) -> int:
    control_fd, parent_pid = int(argv[0]), int(argv[1])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    control = Connection(control_fd)
    try:
        spec = receive(control, 60.0, "waiting for the worker spec")
    except LinkError:
        return 0
    assert isinstance(spec, dict)
    torch.set_num_threads(int(spec["threads"]))
    worker = None
    try:
        worker = StageWorker(control, spec)
        worker.serve()
        worker.reply.close()
        return 0
    except BaseException as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        kind = "peer" if isinstance(exc, LinkError) else "error"
        message = text if kind == "peer" else f"{type(exc).__name__}: {text}"
        report = encode_json({"error": message, "kind": kind})
        if worker is not None:  # behind what is queued: one writer per connection
            try:
                worker.reply.put(report)
                worker.reply.close(timeout_s=2.0)
            except LinkError:
                pass  # the driver is gone
        else:
            with contextlib.suppress(OSError):
                control.send_bytes(report)
        if kind == "error":
            import traceback

            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
