"""One rank of a run: join the process group, load its operators, execute its schedule.

The loop is the compiled per-iteration action list (:mod:`.schedule`) run again and again; the
only decisions taken at run time are which requests a message carries, and those arrive inside
the messages. Per rank it measures time spent in operators (``compute_s``), blocked in transfers
(``comm_s``), in the driver's bookkeeping (``drive_s``, rank 0) and the rest of the loop
(orchestration), in total and, cumulatively, at the end of every iteration (``timeline``), so a
steady-state window can be read from one run.

Tensor parallelism: a TP group receives once at its leader, which broadcasts the bytes to the group
(:meth:`Transport.fanout`); the operators are sharded when :mod:`.tensor_parallel` can shard them,
otherwise every TP rank runs the full operator (replicated, exact) and the stats say so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opweave.costmodel import Plan, load_model

from ..errors import RequestStateError
from .batch import TokenBatch
from .driver import Driver, Request
from .placement import DRIVER_RANK, Placement
from .schedule import Compute, Drive, compile_schedule, microbatches_of, rank_ops
from .stage import StageModule
from .tensor_parallel import TPGroup, TPOp, run_sharded, shard_operators
from .transport import PeerError, Transport, as_batch, merge, select
from .wire import spin_budget

FAULT_ENV = "OPWEAVE_FAULT"  # "RANK:ITERATION:exit|hang|kill" -- test hook for fault handling


@dataclass
class WorkerSpec:
    """Everything one rank needs; JSON-serialisable so a spawned interpreter can read it."""

    plan: dict[str, Any]
    model_dir: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None
    backend: str
    device: str
    timeout_s: float
    run_dir: str | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    tp_mode: str = "auto"
    env_init: bool = False  # torchrun: rendezvous through its store (init_method="env://")
    local_world_size: int = 1  # ranks on this node (they share its cores)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


class Worker:
    """Executes one rank's schedule until every microbatch it serves has gone final."""

    def __init__(
        self,
        spec: WorkerSpec,
        placement: Placement,
        device: torch.device,
        *,
        spin_s: float = 0.0,
    ) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.placement = placement
        self.info = placement.ranks[spec.rank]
        self.device = device
        self.actions = compile_schedule(placement, spec.rank)
        self.transport = Transport(
            spec.rank, device, spec.timeout_s, master_addr=spec.master_addr, spin_s=spin_s
        )
        self.group = None
        for ranks in placement.tp_groups:  # every rank creates every group, in the same order
            g = dist.new_group(list(ranks))
            if spec.rank in ranks:
                self.group = g
        self.module = StageModule(spec.model_dir, rank_ops(placement, spec.rank), device=device)
        self.operators: list[Any] = list(self.module.operators)
        self.tp: TPGroup | None = None
        if self.info.tp_size > 1:
            self.operators, self.tp = shard_operators(
                self.operators, self.info.tp_rank, self.info.tp_size, self.group, spec.tp_mode
            )
        self.held: set[str] = set()
        self.driver: Driver | None = None
        if spec.rank == DRIVER_RANK:
            requests = [Request.from_json(r) for r in spec.requests]
            self.driver = Driver(placement, requests, self.module.spec.eos_token_ids, device)
        self.compute_s = 0.0
        self.drive_s = 0.0  # in Driver.drive, less its time blocked in the transport
        self.loop_s = 0.0
        self.timeline: dict[str, list[float]] = {
            key: [] for key in ("end_s", "compute_s", "comm_s", "drive_s")
        }
        self.iterations = 0
        self._fault = _parse_fault(spec.rank)

    def run(self) -> None:
        mine = microbatches_of(self.actions)
        done: set[int] = set()
        iteration = 0
        heartbeat = Heartbeat(self.spec.run_dir, self.rank)
        start = time.perf_counter()
        while mine - done:
            self._maybe_fault(iteration)
            finals: set[int] = set()
            for action in self.actions:
                if action.microbatch in done:
                    continue
                if isinstance(action, Drive):
                    final = self._drive(action, iteration)
                else:
                    final = self._compute(action, iteration)
                if final:
                    finals.add(action.microbatch)
            done |= finals
            self.transport.reap(before_epoch=iteration)
            iteration += 1
            heartbeat.beat()
            self._mark(time.perf_counter() - start)
        self.transport.flush()
        self.loop_s = time.perf_counter() - start
        self.iterations = iteration

    def _drive(self, action: Drive, iteration: int) -> bool:
        assert self.driver is not None
        start, comm = time.perf_counter(), self.transport.comm_s
        final = self.driver.drive(action, iteration, self.transport)
        self.drive_s += time.perf_counter() - start - (self.transport.comm_s - comm)
        return final

    def _mark(self, elapsed_s: float) -> None:
        """Cumulative times at the end of an iteration (``timeline``)."""
        line = self.timeline
        line["end_s"].append(elapsed_s)
        line["compute_s"].append(self.compute_s)
        line["comm_s"].append(self.transport.comm_s)
        line["drive_s"].append(self.drive_s)

    def _compute(self, action: Compute, iteration: int) -> bool:
        what = f"receiving segment {action.segment} microbatch {action.microbatch}"
        parts = None
        if self.info.is_leader:
            parts = [self.transport.recv(link, what) for link in action.sources]
        if self.info.tp_size > 1:
            parts = self.transport.fanout(parts, len(action.sources), self.info.leader, self.group)
        assert parts is not None
        unpack_start = time.perf_counter()
        batch = merge([as_batch(p) for p in parts])
        self.transport.comm_s += time.perf_counter() - unpack_start  # unpacking is transfer
        self._sync_state(batch)
        if batch.meta.request_ids:
            start = time.perf_counter()
            ops = self.operators[action.ops.start : action.ops.stop]
            with torch.inference_mode():
                if self.tp is None:
                    for op in ops:
                        batch = op(batch)
                else:  # TP collectives count as communication, not compute
                    tp_comm = self.tp.comm_s
                    batch = run_sharded(ops, batch, self.tp)
                    self.transport.comm_s += self.tp.comm_s - tp_comm
                    start += self.tp.comm_s - tp_comm
            self.compute_s += time.perf_counter() - start
        else:
            batch = TokenBatch(batch.meta, {})
        final = batch.meta.final
        if self.info.is_leader and not (action.samples and final):
            for link in action.dests:
                self.transport.send(link, select(batch, link.slots), iteration)
        return final

    def _sync_state(self, batch: TokenBatch) -> None:
        """Drop state of finished requests, admit requests seen for the first time."""
        meta = batch.meta
        for rid in meta.free:
            if rid in self.held:
                self.module.free(rid)
                self.held.discard(rid)
        for rid, ctx in zip(meta.request_ids, meta.context_lens, strict=True):
            if rid not in self.held:
                if ctx != 0:
                    raise RequestStateError(
                        f"rank {self.rank} holds no state for request {rid!r} at context {ctx}"
                    )
                self.module.admit(rid)
                self.held.add(rid)

    def _maybe_fault(self, iteration: int) -> None:
        if self._fault is None or self._fault[0] != iteration:
            return
        mode = self._fault[1]
        if mode == "exit":
            os._exit(1)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)

    def stats(self) -> dict[str, Any]:
        p, info = self.placement, self.info
        comm = self.transport.comm_s
        return {
            "rank": self.rank,
            "owner": info.owner,
            "replica": info.replica,
            "tp_rank": info.tp_rank,
            "tp_size": info.tp_size,
            "tp_compute": self._tp_compute(),
            "device": str(self.device),
            "stages": p.stage_labels(self.rank),
            "weight_bytes_read": self.module.checkpoint.bytes_read,
            "weight_bytes": self._weight_bytes(),
            "busy_s": self.compute_s,
            "compute_s": self.compute_s,
            "comm_s": comm,
            "loop_s": self.loop_s,
            "drive_s": self.drive_s,
            "overhead_s": max(self.loop_s - self.compute_s - comm, 0.0),
            "wait": "spin" if self.transport.spin_s > 0 else "block",
            "iterations": self.iterations,
            "actions_per_iteration": {
                "compute": sum(isinstance(a, Compute) for a in self.actions),
                "drive": sum(isinstance(a, Drive) for a in self.actions),
            },
            "timeline": self.timeline,
            "requests_held_at_end": len(self.held),
            "state_bytes_at_end": self.module.state_bytes(),
            "bytes_sent": self.transport.bytes_sent,
            "messages_sent": self.transport.messages_sent,
        }

    def _tp_compute(self) -> str:
        """``sharded`` / ``partly sharded`` / ``replicated`` (every TP rank runs the full op)."""
        if self.info.tp_size == 1:
            return "none"
        heavy = [  # the router is a tiny replicated GEMM by design
            op for op in self.operators if op.op_class != "small" and op.name != "router"
        ]
        sharded = sum(isinstance(op, TPOp) for op in heavy)
        if sharded == 0:
            return "replicated"
        return "sharded" if sharded == len(heavy) else "partly sharded"

    def _weight_bytes(self) -> int:
        """Resident weight bytes (shards after TP); a tied tensor held twice counts once."""
        sizes: dict[str, int] = {}
        for op in self.operators:
            sizes.update(op.weight_sizes)
        return sum(sizes.values())


class Heartbeat:
    """Touches ``run_dir/rank{r}.alive`` at most once a second, for the coordinator's watchdog.

    The loop beats once per iteration; while weights load (no iterations yet, possibly minutes)
    a background thread beats instead, so a slow load is not mistaken for a stall.
    """

    def __init__(self, run_dir: str | None, rank: int) -> None:
        self.path = None if run_dir is None else Path(run_dir) / f"rank{rank}.alive"
        self.last = 0.0
        self._stop: threading.Event | None = None

    def beat(self) -> None:
        now = time.monotonic()
        if self.path is not None and now - self.last > 1.0:
            self.path.touch()
            self.last = now

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        stop = threading.Event()
        path = self.path

        def loop() -> None:
            while path is not None and not stop.wait(1.0):
                path.touch()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _parse_fault(rank: int) -> tuple[int, str] | None:
    text = os.environ.get(FAULT_ENV)
    if not text:
        return None
    r, it, mode = text.split(":")
    return (int(it), mode) if int(r) == rank else None


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pin_to_core(local_rank: int, local_ranks: int) -> bool:
    """Bind a single-threaded CPU rank to one core of those this process may use, as a GPU
    rank is bound to its device: the scheduler then never migrates it (its caches stay warm)
    and two ranks never share a core while another one idles. More ranks than cores share
    them round-robin. Returns whether the rank has a core of its own (then it may spin while
    it waits, see :mod:`.wire`)."""
    if not hasattr(os, "sched_setaffinity") or torch.get_num_threads() != 1:
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})
    return local_ranks <= len(cores)


def run_worker(spec: WorkerSpec) -> dict[str, Any] | None:
    """Join the group, run, gather every rank's stats on rank 0; rank 0 returns the result."""
    plan = Plan.model_validate(spec.plan)
    placement = Placement(plan, load_model(spec.model_dir))
    device = resolve_device(spec.device, spec.local_rank)
    own_core = False
    if device.type == "cpu" and spec.world_size > 1:  # a lone rank may use any idle core
        own_core = pin_to_core(spec.local_rank, spec.local_world_size)
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.env_init:
        dist.init_process_group(
            spec.backend,
            init_method="env://",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            spec.backend,
            store=_connect_store(spec, timeout),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
    try:
        control = dist.new_group(backend="gloo") if spec.backend != "gloo" else None
        load_start = time.perf_counter()
        with Heartbeat(spec.run_dir, spec.rank).background():
            worker = Worker(spec, placement, device, spin_s=spin_budget(own_core))
        load_s = time.perf_counter() - load_start
        _collective(lambda: dist.barrier(group=control), "waiting for every rank to load")
        worker.run()
        stats = worker.stats() | {"load_s": load_s}
        gathered: list[Any] | None = [None] * spec.world_size if spec.rank == 0 else None
        _collective(
            lambda: dist.gather_object(stats, gathered, dst=0, group=control),
            "gathering statistics",
        )
        if worker.driver is None:
            return None
        driver = worker.driver
        return {
            "outputs": driver.outputs(),
            "tpot_s": driver.tpot_s(),
            "iterations": worker.iterations,
            "wall_s": worker.loop_s,
            "max_active": driver.max_active,
            "ranks": gathered,
        }
    finally:
        dist.destroy_process_group()


def _collective(fn: Any, what: str) -> None:
    try:
        fn()
    except RuntimeError as exc:
        raise PeerError(None, f"{what} failed: {str(exc).strip().splitlines()[0]}") from None


def _connect_store(spec: WorkerSpec, timeout: timedelta) -> dist.TCPStore:
    """The coordinator's TCPStore; its port comes in the spec or, for local runs, a file."""
    port = spec.master_port
    if port is None:
        assert spec.run_dir is not None
        path = Path(spec.run_dir) / "store_port"
        deadline = time.monotonic() + timeout.total_seconds()
        while not path.exists():
            if time.monotonic() > deadline:
                raise PeerError(None, "timed out waiting for the coordinator's store")
            time.sleep(0.01)
        port = int(path.read_text())
    return dist.TCPStore(spec.master_addr, port, spec.world_size, is_master=False, timeout=timeout)
