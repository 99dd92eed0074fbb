"""The driver side of the stage workers: one process per plan owner, driven step by step.

:class:`WorkerPool` is the executor's default :class:`~._engine.Pipeline` for a plan. It starts
one :mod:`._stage_worker` process per owner (each loads only its own segments' weights), wires
them with Unix socket pairs -- a control link driver <-> worker, and one data link per pair of
owners whose segments meet -- and runs every engine step as: the step message (frees, microbatch
count) to every worker, the step's ragged token batch cut into the plan's microbatches to the first
segment's worker, then the last segment's logits back from its worker. Activations cross segment
boundaries worker to worker; the driver only feeds tokens and collects logits.

Workers are spawned as fresh interpreters (``subprocess`` with ``pass_fds``), not forked: the
vLLM engine process runs threads (ZMQ, asyncio, OpenMP) that a fork would copy mid-flight, and a
fresh process inherits exactly the sockets named, so a dead driver is seen as EOF by every worker.

Faults: a worker that dies closes its sockets, so the driver (and its neighbours) see EOF at once;
one that hangs is caught by the step timeout. Either way the pool fails: it names the culprit
(its owner, stages and how it ended), kills every worker, and raises :class:`RunFailedError` from
the step and from every later call, including :meth:`check`. A monitor thread notices a worker
that dies between steps and calls the failure callbacks (vLLM's engine then reports itself dead).
Workers exit by themselves when the driver goes away (see :mod:`._stage_worker`); :meth:`close`
stops and reaps them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from .._private.batch import BatchMeta, TokenBatch
from .._private.config import parse_config
from ..errors import PlanMismatchError, RunFailedError
from ._engine import plan_layout
from ._stage_worker import LinkError, Outbox, decode, encode_batch, encode_json

_STOP_GRACE_S = 3.0  # on close, how long workers get to exit before SIGKILL
_SETTLE_S = 1.0  # after a fault, how long a dying worker gets to be reaped (to name it)
_MONITOR_S = 0.2
WORKER_MODULE = "opweave.runtime.vllm._stage_worker"


@dataclasses.dataclass
class _Worker:
    owner: int
    stages: str
    popen: subprocess.Popen[bytes]
    control: Connection
    outbox: Outbox
    report: str | None = None  # the worker's own one-line error, if it sent one
    report_kind: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def describe(self) -> str:
        return f"stage worker of owner {self.owner} (pid {self.pid}; stages {self.stages})"

    def ended(self) -> str | None:
        """How the process ended (``None`` while it runs)."""
        code = self.popen.poll()
        if code is None:
            return None
        if code < 0:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"exited with status {code}"


class WorkerPool:
    """A plan's owners as worker processes; the same interface as :class:`~._engine.PlanPipeline`.

    Each owner must be one process: plans whose owners have replicas or tensor parallelism are
    refused with a one-line error (serve them with one replica and tp 1 per owner, or use the
    ``inprocess`` mode, which ignores both).
    """

    def __init__(
        self,
        model_dir: str | Path,
        plan: Any,
        *,
        dtype: torch.dtype | None = None,
        device: str = "cpu",
        timeout_s: float = 120.0,
        threads: int | None = None,
        kernels: str = "opweave",
    ) -> None:
        self.layout = plan_layout(model_dir, plan)
        self.plan = self.layout.plan
        if self.plan is None:
            raise PlanMismatchError("stage workers need a plan (without one, run in-process)")
        for o, owner in enumerate(self.plan.owners):
            if owner.replicas != 1 or owner.tp != 1:
                raise PlanMismatchError(
                    f"plan owner {o} has {owner.replicas} replica(s) x tp {owner.tp}, but the "
                    "vLLM executor runs one worker process per owner: serve a plan whose owners "
                    'have replicas 1 and tp 1, or set additional_config opweave_workers="inprocess"'
                )
        spec = parse_config(model_dir)
        self.spec = spec if dtype is None else dataclasses.replace(spec, dtype=dtype)
        self.timeout_s = float(timeout_s)
        self.microbatches = int(self.plan.microbatches)
        self.on_failure: list[Callable[[], None]] = []
        self._free: dict[str, None] = {}  # ordered set of ids to drop with the next step
        self._step = 0
        self._failed: RunFailedError | None = None
        self._closing = False
        self._lock = threading.Lock()
        n_owners = len(self.plan.owners)
        if threads is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            threads = max(1, cores // n_owners)
        self.workers: list[_Worker] = []
        # operators each owner's worker switched to vLLM kernels (reported when it is ready)
        self.kernels: list[list[str]] = [[] for _ in range(n_owners)]
        try:
            self._start(str(model_dir), dtype, device, threads, kernels)
        except BaseException:
            self._kill_all()
            raise
        self._monitor = threading.Thread(target=self._watch, name="opweave-monitor", daemon=True)
        self._monitor.start()

    # -- start-up --------------------------------------------------------------------------
    def _start(
        self, model_dir: str, dtype: torch.dtype | None, device: str, threads: int, kernels: str
    ) -> None:
        layout = self.layout
        n_owners = len(self.plan.owners)
        # one data link per ordered pair of owners whose segments meet: (sender, receiver)
        pairs = sorted(
            {(a, b) for a, b in zip(layout.owners, layout.owners[1:], strict=False) if a != b}
        )
        links = {pair: socket.socketpair() for pair in pairs}
        try:
            for o in range(n_owners):
                ours, theirs = socket.socketpair()
                fds = {"control": theirs.fileno()}
                inbound = {str(a): links[(a, b)][1].fileno() for a, b in pairs if b == o}
                outbound = {str(b): links[(a, b)][0].fileno() for a, b in pairs if a == o}
                popen = subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, str(fds["control"]), str(os.getpid())],
                    pass_fds=[fds["control"], *inbound.values(), *outbound.values()],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the driver only
                    env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                )
                theirs.close()
                control = Connection(ours.detach())
                self.workers.append(
                    _Worker(o, layout.owner_stages(o), popen, control, Outbox(control, f"w{o}"))
                )
                ops, segs = [], []
                for s, (group, owner) in enumerate(zip(layout.groups, layout.owners, strict=True)):
                    if owner == o:
                        segs.append([s, len(ops), len(ops) + len(group)])
                        ops += [[ref.layer, ref.name] for ref in group]
                self.workers[-1].outbox.put(
                    encode_json(
                        {
                            "owner": o,
                            "owners": layout.owners,
                            "ops": ops,
                            "segments": segs,
                            "model_dir": model_dir,
                            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
                            "device": device,
                            "timeout_s": self.timeout_s,
                            "threads": threads,
                            "kernels": kernels,
                            "inbound": inbound,
                            "outbound": outbound,
                        }
                    )
                )
        finally:
            for a, b in links.values():  # the workers hold their ends now
                a.close()
                b.close()
        # Loading weights may take long on a big model: wait without a step timeout, but fail
        # at once when a worker dies while loading.
        deadline = time.monotonic() + max(self.timeout_s, 600.0)
        waiting = list(self.workers)
        while waiting:
            w, msg = self._receive_any(waiting, deadline, "the workers load their stages")
            if not isinstance(msg, dict) or not msg.get("ready"):
                raise self._fail(f"{w.describe()} sent {msg!r} instead of ready", culprit=w)
            waiting.remove(w)
            self.kernels[w.owner] = list(msg.get("kernels", ()))

    # -- the Pipeline interface ------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return int(self.plan.global_batch)

    @property
    def num_segments(self) -> int:
        return len(self.layout.groups)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def admit(self, request_id: str) -> None:
        pass  # a worker admits a request when it first sees it (at context 0)

    def free(self, request_id: str) -> None:
        self._free[request_id] = None

    def flush(self) -> None:
        if self._free:
            self._send_step(0)

    def logits(self, batch: TokenBatch) -> torch.Tensor:
        """One step through the workers: logits of each request's last row, in batch order."""
        parts = _split(batch, self.microbatches)
        self._send_step(len(parts))
        first, last = self.workers[self.layout.owners[0]], self.workers[self.layout.owners[-1]]
        for part in parts:
            self._put(first, encode_batch(part))
        out = []
        deadline = time.monotonic() + self.timeout_s
        for k in range(len(parts)):
            msg = self._receive_step(last, deadline, f"waiting for microbatch {k}'s logits")
            out.append(msg["logits"])
        return torch.cat(out)

    def check(self) -> None:
        """Raise :class:`RunFailedError` if a worker died or the pool failed."""
        if self._failed is None and not self._closing:
            for w in self.workers:
                how = w.ended()
                if how is not None:
                    self._fail(f"{w.describe()} {how}")
                    break
        if self._failed is not None:
            raise self._failed

    def close(self) -> None:
        """Ask every worker to stop, then kill the ones that do not, and reap them all."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for w in self.workers:
            with contextlib.suppress(LinkError):
                w.outbox.put(encode_json({"stop": True}))
        deadline = time.monotonic() + _STOP_GRACE_S
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.popen.wait(max(deadline - time.monotonic(), 0.01))
        self._kill_all()
        for w in self.workers:
            w.control.close()

    # -- internals -------------------------------------------------------------------------
    def _send_step(self, microbatches: int) -> None:
        if self._failed is not None:
            raise self._failed
        self._step += 1
        message = encode_json({"step": self._step, "free": list(self._free), "mb": microbatches})
        self._free.clear()
        for w in self.workers:
            self._put(w, message)

    def _put(self, w: _Worker, message: Any) -> None:
        try:
            w.outbox.put(message)
        except LinkError:
            raise self._fail(f"{w.describe()} cannot be reached", culprit=w) from None

    def _receive_step(self, w: _Worker, deadline: float, what: str) -> Any:
        """The next message from ``w`` before ``deadline``, watching every other worker too:
        any worker's EOF or error report fails the step at once."""
        return self._receive_any([w], deadline, what)[1]

    def _receive_any(
        self, expected: list[_Worker], deadline: float, what: str
    ) -> tuple[_Worker, Any]:
        """The next message from any ``expected`` worker; anything from another worker, an EOF,
        an error report or the deadline fails the pool."""
        conns = {id(x.control): x for x in self.workers}
        while True:
            if self._failed is not None:
                raise self._failed
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(x.describe() for x in expected)
                raise self._fail(
                    f"nothing arrived within {self.timeout_s:g} s while {what}: "
                    f"{names} stopped responding",
                    culprit=expected[0],
                )
            try:
                ready = wait([x.control for x in self.workers], timeout=min(left, 1.0))
            except (OSError, ValueError):  # a connection closed under us by a failure
                if self._failed is not None:
                    raise self._failed from None
                raise
            for conn in ready:
                x = conns[id(conn)]
                try:
                    data = conn.recv_bytes()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    raise self._fail(f"{x.describe()} closed its connection", culprit=x) from None
                msg = decode(data)
                if isinstance(msg, dict) and "error" in msg:
                    x.report, x.report_kind = msg["error"], msg.get("kind")
                    raise self._fail(f"{x.describe()} failed: {msg['error']}", culprit=x)
                if x not in expected:
                    raise self._fail(f"{x.describe()} sent an unexpected message", culprit=x)
                return x, msg

    def _fail(self, message: str, culprit: _Worker | None = None) -> RunFailedError:
        """Record the pool's failure (the first one wins), kill every worker, notify vLLM."""
        with self._lock:
            if self._failed is not None:
                return self._failed
            self._failed = RunFailedError(self._diagnose(message, culprit))
        self._kill_all()
        for callback in self.on_failure:
            with contextlib.suppress(Exception):
                callback()
        return self._failed

    def _diagnose(self, message: str, culprit: _Worker | None) -> str:
        """Blame a worker that died over one that only noticed it (it reports a lost peer)."""
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() < deadline:
            dead = [w for w in self.workers if w.ended() is not None and w.report is None]
            if dead:
                w = dead[0]
                return (
                    f"{w.describe()} {w.ended()}; the OpWeave executor cannot continue: "
                    "restart the engine"
                )
            if culprit is not None and culprit.report_kind == "error":
                break  # the culprit raised on its own: it is alive and named already
            time.sleep(0.02)
        return f"{message}; the OpWeave executor cannot continue: restart the engine"

    def _kill_all(self) -> None:
        for w in self.workers:
            if w.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.popen.kill()
            w.popen.wait()
        for w in self.workers:
            w.outbox.close(timeout_s=0.5)

    def _watch(self) -> None:
        """Between steps, a worker's death is noticed here (and reported to vLLM) too."""
        while not self._closing and self._failed is None:
            for w in self.workers:
                how = w.ended()
                if how is not None and not self._closing:
                    self._fail(f"{w.describe()} {how}", culprit=w)
                    return
            time.sleep(_MONITOR_S)


def _split(batch: TokenBatch, microbatches: int) -> list[TokenBatch]:
    """The batch's requests cut into up to ``microbatches`` contiguous, near-equal parts."""
    meta = batch.meta
    n = len(meta.request_ids)
    m = max(1, min(microbatches, n))
    if m == 1:
        return [batch]
    ids = batch["token_ids"]
    parts = []
    for k in range(m):
        lo, hi = k * n // m, (k + 1) * n // m
        sub = BatchMeta(meta.request_ids[lo:hi], meta.query_lens[lo:hi], meta.context_lens[lo:hi])
        rows = ids[meta.row_offsets[lo] : meta.row_offsets[hi]]
        parts.append(TokenBatch(sub, {"token_ids": rows}))
    return parts
