"""One rank of a run: the stage-worker program, the same for offline generation and serving.

A rank joins its run (an authenticated control connection to the driver, then torch.distributed
for its tensor-parallel group and the transport between ranks), loads its operators (only its own
slices of their weights), reports ready, and then runs its compiled per-iteration schedule
(:mod:`.schedule`) for every iteration the driver asks for: per microbatch it takes the driver's
:class:`~.work.Work` (which requests, which to admit and free), runs its segments -- the first
segment embeds the work's tokens, the others receive activations from the previous segment's
leaders -- and the last segment's leaders send the sampled tokens back to the driver. Between
iterations a rank waits on its control connection without a bound (a server may idle); within
one every wait is bounded by the run's timeout, so a peer that died or hangs is named.

Per rank it measures time in operators (``compute_s``), blocked in transfers or waiting for the
driver (``comm_s``) and the rest of the loop, in total and at the end of every iteration
(``timeline``), so a steady-state window of one run can be read from its statistics; and, on
Linux, the time it was ready to run but waited for a CPU (``runq_s``: another process held its
core), which lands in whichever of the three it happened in.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opweave.costmodel import Plan, load_model

from ..errors import OpWeaveRuntimeError, RequestStateError
from .batch import TokenBatch
from .control import ChannelClosed, ControlClient, store_namespace
from .decode import DECODE_STEPS, compiled_graphs, is_decode, trust_warm_graphs
from .native import translate
from .placement import Placement
from .program import RankProgram
from .schedule import Compute, compile_schedule, microbatches_of, rank_ops
from .stage import StageModule
from .tensor_parallel import Shard, TPComm
from .transport import Transport, as_batch, merge, select
from .wire import PeerError, spin_budget
from .work import GREEDY, SamplingParams, Work, sample_rows

FAULT_ENV = "OPWEAVE_FAULT"  # "RANK:ITERATION:exit|hang|kill" -- test hook for fault handling
PROGRAM_ENV = "OPWEAVE_RANK_PROGRAM"  # "0": compiled CPU steps run one by one, no rank program
CONTROL_KEY = "opweave/control"  # store key under which the driver publishes its address
_HEARTBEAT_S = 1.0


@dataclass
class RankSpec:
    """Everything one rank needs to join its run; JSON-serialisable (spawned ranks read a file).

    ``store``: how torch.distributed rendezvous: ``{"file": path}`` (one node),
    ``{"host": h, "port": p}`` (the driver's TCP store, several nodes) or ``{"env": True}``
    (torchrun's). ``control``: the driver's address, or ``None`` to read it from the store.
    """

    plan: dict[str, Any]
    model_dir: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str
    timeout_s: float
    key: str
    host: str
    store: dict[str, Any]
    control: tuple[str, int] | None = None
    dtype: str | None = None
    kernels: str = "opweave"
    decode_step: str = "per-request"  # see .decode.DECODE_STEPS
    join_timeout_s: float = 600.0
    threads: int = 1
    log: str | None = None  # where a launcher-forked rank writes its output
    env: dict[str, str] | None = None  # a launcher-forked rank's environment: its driver's

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        data = json.loads(text)
        if data.get("control") is not None:
            data["control"] = tuple(data["control"])
        return cls(**data)


class _Shutdown(Exception):
    """The driver said stop."""


@dataclass
class _Request:
    params: SamplingParams = GREEDY
    generator: torch.Generator | None = None


@dataclass
class _Clock:
    compute_s: float = 0.0
    started: float | None = None
    runq_at_start: float = 0.0
    # decode iterations (every microbatch the rank ran was a decode step, and it launched
    # something): how many, their launches from Python and their host time
    decode_iterations: int = 0
    decode_submissions: int = 0
    decode_host_s: float = 0.0
    timeline: dict[str, list[float]] = field(
        default_factory=lambda: {"end_s": [], "busy_s": [], "comm_s": [], "runq_s": []}
    )


class RunQueueClock:
    """The calling thread's time spent runnable but not running (waiting for a CPU another
    process or thread held), from the scheduler's statistics (Linux ``schedstat``; 0 where
    there are none). Read in about 2 us."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StageWorker:
    """One rank's operators, schedule, transport and per-request state."""

    def __init__(self, spec: RankSpec, control: ControlClient, placement: Placement) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.control = control
        self.placement = placement
        self.info = placement.ranks[spec.rank]
        self.device = resolve_device(spec.device, spec.local_rank)
        self.actions: list[Compute] = compile_schedule(placement, spec.rank)
        self.mine = placement.replica_slots(self.info.owner, self.info.replica)
        self.timeout_s = spec.timeout_s
        self.group = None
        timeout = timedelta(seconds=spec.timeout_s)
        for ranks in placement.tp_groups:  # every rank creates every group, in the same order
            g = dist.new_group(list(ranks), timeout=timeout)
            if spec.rank in ranks:
                self.group = g
        own_core = self.device.type == "cpu" and pin_to_core(spec.local_rank, spec.local_world_size)
        self._programs = rank_programs(self.device.type, spec.decode_step)
        agreed: list[bool | None] = [None] * spec.world_size
        dist.all_gather_object(agreed, self._programs)
        if len(set(agreed)) > 1:
            raise OpWeaveRuntimeError(
                f"ranks {[r for r, on in enumerate(agreed) if on]} run rank programs and the "
                f"others do not: set {PROGRAM_ENV} alike on every node"
            )
        self.transport = Transport(
            spec.rank,
            self.device,
            spec.timeout_s,
            host=spec.host,
            key=bytes.fromhex(spec.key),
            spin_s=spin_budget(own_core) if spec.world_size > 1 else 0.0,
            native=self._programs and spec.world_size > 1,
        )
        if self._programs and spec.world_size > 1 and self.transport.native is None:
            self._programs = False  # OPWEAVE_P2P=torch: the steps run one by one
        self.program: RankProgram | None = None  # built at the warm-up
        shard = Shard(self.info.tp_rank, self.info.tp_size)
        self.comm = TPComm(shard, self.group) if self.info.tp_size > 1 else None
        dtype = None if spec.dtype is None else getattr(torch, spec.dtype)
        self.module = StageModule(
            spec.model_dir,
            rank_ops(placement, spec.rank),
            device=self.device,
            dtype=dtype,
            shard=shard,
            comm=self.comm,
            model=placement.model,
        )
        # a static decode step takes vLLM's GEMMs only (the rest of its kernels do not trace)
        static = spec.decode_step != "per-request"
        self.kernels = apply_kernels(self.module, spec.kernels, gemms_only=static)
        if spec.decode_step not in DECODE_STEPS:
            raise OpWeaveRuntimeError(
                f"unknown decode step {spec.decode_step!r}; one of {', '.join(DECODE_STEPS)}"
            )
        if spec.decode_step != "per-request":  # slabs for every slot, of the plan's context
            self.module.use_static_decode(
                rows=len(self.mine),
                tokens=min(placement.plan.context_tokens, placement.model.max_context_tokens),
                compile=DECODE_STEPS[spec.decode_step],
            )
        self.held: dict[str, _Request] = {}
        self._works: dict[tuple[int, int], Work] = {}
        self._synced: set[tuple[int, int]] = set()
        self.clock = _Clock()
        self.runq = RunQueueClock()  # this thread's: it runs the loop
        self.iterations = 0
        self._warm_up_iterations = 0  # the warm-up's, left out of the figures
        self._warm_up_s = 0.0
        self._graphs_at_warm_up = 0
        self._fault = _parse_fault(spec.rank)
        # (segment, microbatch) -> each input tensor's dtype and shape past the token dimension,
        # as the first batch brought them (what the warm-up builds its padding from)
        self._inputs: dict[tuple[int, int], dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        # static decode steps, from the warm-up on (_warm): per (segment, microbatch) the step's
        # input rows, one set per iteration parity (a set is refilled two iterations later,
        # once the sends that may still read it are reaped), and zero rows shaped as its
        # outputs (what goes out while none of the microbatch's requests is this replica's); a
        # message carries its tensors in name order
        self._rows_in: dict[tuple[int, int], tuple[dict[str, torch.Tensor], ...]] = {}
        self._rows_pad: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        # tokens that stay on the ranks (forward and carried works): the microbatches whose
        # next first action takes forwarded tokens, those this rank forwarded to itself, and
        # those it sent, kept until the sends of their iteration are reaped
        self._tokens_due: set[int] = set()
        self._tokens_here: dict[int, torch.Tensor] = {}
        self._tokens_sent: dict[tuple[int, int], torch.Tensor] = {}

    # -- the loop -----------------------------------------------------------------------------
    def serve(self) -> None:
        """Run iterations until the driver says stop."""
        mine = microbatches_of(self.actions)
        done: set[int] = set()
        i = 0
        try:
            while True:
                if mine <= done:  # offline: every microbatch went final; wait for the stop
                    self._next_message()
                    continue
                self._maybe_fault(i)
                submissions = self.module.submissions
                if not self._program_iteration(i, mine, done):
                    for action in self.actions:
                        k = action.microbatch
                        if k in done:
                            continue
                        work = self._work(i, k)
                        self._compute(action, work, i)
                ran = mine - done
                decode = all(self._works[(i, k)].decode for k in ran)
                finals = {k for k in ran if self._works[(i, k)].final}
                done |= finals
                self._works = {key: w for key, w in self._works.items() if key[0] > i}
                self._synced = {key for key in self._synced if key[0] > i}
                self.transport.reap(before_epoch=i)
                i += 1
                self.iterations = i
                self._mark(self.module.submissions - submissions if decode else 0)
        except _Shutdown:
            pass
        self.transport.flush()

    def _mark(self, decode_submissions: int) -> None:
        """The iteration's end on the timeline; ``decode_submissions``: its launches, if it
        was a decode iteration (else 0)."""
        assert self.clock.started is not None
        line = self.clock.timeline
        line["end_s"].append(time.perf_counter() - self.clock.started)
        line["busy_s"].append(self.clock.compute_s)
        line["comm_s"].append(self.transport.comm_s)
        line["runq_s"].append(self.runq.seconds() - self.clock.runq_at_start)
        if decode_submissions:
            ends, busy, comm = line["end_s"], line["busy_s"], line["comm_s"]
            took = ends[-1] - busy[-1] - comm[-1]  # since the loop started
            if len(ends) > 1:  # since the previous iteration's end
                took -= ends[-2] - busy[-2] - comm[-2]
            self.clock.decode_iterations += 1
            self.clock.decode_submissions += decode_submissions
            self.clock.decode_host_s += max(took, 0.0)

    def _next_message(self) -> None:
        """Take one control message into the work buffer; raises :class:`_Shutdown`."""
        while not self.control.poll():
            start = time.perf_counter()
            self.transport.wait_control(self.control.fileno())
            if self.clock.started is not None:
                self.transport.comm_s += time.perf_counter() - start
        msg = self.control.recv()
        kind = msg["t"]
        if kind == "shutdown":
            raise _Shutdown
        if kind == "warm":
            self._warm(msg)
            return
        if kind != "work":
            raise OpWeaveRuntimeError(f"unexpected control message {kind!r} from the driver")
        work = Work.from_message(msg)
        self._works[(work.iteration, work.microbatch)] = work
        if self.clock.started is None:
            self.clock.started = time.perf_counter()
            self.clock.runq_at_start = self.runq.seconds()

    def _work(self, i: int, k: int) -> Work:
        while (i, k) not in self._works:
            self._next_message()
        work = self._works[(i, k)]
        if (i, k) not in self._synced:
            self._synced.add((i, k))
            self._sync(work)
        return work

    def _sync(self, work: Work) -> None:
        """Free finished requests, admit new ones (a request at context 0 that is held restarts)."""
        for rid in work.free:
            if rid in self.held:
                self.module.free(rid)
                del self.held[rid]
        for i in work.requests_in(self.mine):
            rid, ctx = work.request_ids[i], work.context_lens[i]
            if ctx == 0:
                if rid in self.held:
                    self.module.free(rid)
                self.module.admit(rid, rows=[work.slots[i] - self.mine.start])
                params = work.params.get(rid, GREEDY)
                gen = None
                if params.seed is not None:
                    gen = torch.Generator().manual_seed(int(params.seed))
                self.held[rid] = _Request(params, gen)
            elif rid not in self.held:
                raise RequestStateError(
                    f"rank {self.rank} holds no state for request {rid!r} at context {ctx}"
                )

    def _compute(self, action: Compute, work: Work, i: int) -> None:
        if (work.forward or work.carried) and not self._rows_in:
            raise OpWeaveRuntimeError(
                f"rank {self.rank}: tokens stay on the ranks only between static decode steps "
                "(--decode-step static, compiled or traced)"
            )
        if action.first:
            self._take_tokens(action, work, i)
        if self._rows_in and work.decode:
            self._compute_rows(action, work, i)
            return
        leader = self.info.is_leader
        if action.first:
            batch = work.batch_for(action.slots, self.device)
        else:
            what = f"receiving segment {action.segment} microbatch {action.microbatch}"
            parts = [self.transport.recv(link, what) for link in action.sources] if leader else None
            if self.info.tp_size > 1:
                parts = self.transport.fanout(
                    parts, len(action.sources), self.info.leader, self.group
                )
            assert parts is not None
            start = time.perf_counter()
            batch = merge([as_batch(p) for p in parts])
            self.transport.comm_s += time.perf_counter() - start  # unpacking is transfer
        key = (action.segment, action.microbatch)
        if batch.meta.request_ids and key not in self._inputs:
            self._inputs[key] = {
                name: (t.dtype, tuple(t.shape[1:])) for name, t in batch.tensors.items()
            }
        batch = self._run(action, batch) if batch.meta.request_ids else TokenBatch(batch.meta, {})
        if not leader:
            return
        if action.last:
            self._reply(work, batch)
        else:
            for link in action.dests:
                self.transport.send(link, select(batch, link.slots), i)

    @torch.inference_mode()
    def _compute_rows(self, action: Compute, work: Work, i: int) -> None:
        """``action`` as a static decode step whose rows move between ranks as they are: the
        inputs arrive into this action's rows (a row per slot, the requests at their slots'
        rows), the step runs on them, and each destination gets its slots' rows of the outputs
        (:meth:`~.transport.Transport.send_rows`); no batch is built, packed or unpacked."""
        key = (action.segment, action.microbatch)
        at, leader = action.slots.start, self.info.is_leader
        inputs = self._rows_in[key][i & 1]
        idx = work.requests_in(action.slots)
        place = [work.slots[j] - at for j in idx]
        if action.first:
            if not work.carried:  # a carried work's tokens are in place (_take_tokens)
                assert work.token_ids is not None  # a decode step's work: a token per request
                ids = inputs["token_ids"]
                ids[torch.tensor(place, dtype=torch.int64, device=ids.device)] = torch.tensor(
                    [work.token_ids[j] for j in idx], dtype=torch.int64, device=ids.device
                )
        else:
            if leader:
                what = f"receiving segment {action.segment} microbatch {action.microbatch}"
                names = sorted(inputs)  # the order the sender sends in
                for link in action.sources:
                    lo, hi = link.slots.start - at, link.slots.stop - at
                    self.transport.recv_rows(link, [inputs[n][lo:hi] for n in names], what)
            if self.info.tp_size > 1:
                self.transport.fanout_rows(list(inputs.values()), self.info.leader, self.group)
        if idx:
            rids = [work.request_ids[j] for j in idx]
            with self._computing():
                out = self.module.run_rows(
                    inputs,
                    self._ops(action, sample=action.last and leader),
                    request_ids=rids,
                    context_lens=[work.context_lens[j] for j in idx],
                    place=place,
                )
        else:  # none of the microbatch's requests is this replica's: its rows go out as padding
            rids, out = [], self._rows_pad[key]
        if not leader:
            return
        if action.last:
            tokens = self._reply_rows(work, rids, out, place)
            if work.forward:
                self._forward_tokens(action, out, rids, place, tokens, i)
            return
        names = sorted(out)
        for link in action.dests:
            lo, hi = link.slots.start - at, link.slots.stop - at
            self.transport.send_rows(link, [out[name][lo:hi] for name in names], i)

    def _program_iteration(self, i: int, mine: set[int], done: set[int]) -> bool:
        """Run iteration ``i`` as the rank program, if it can: every microbatch of this rank
        still runs and decodes. Waits for all their works first. False: it cannot (the
        actions then run one by one)."""
        program = self.program
        if program is None or done:
            return False
        works = {k: self._work(i, k) for k in sorted(mine)}
        if not all(w.decode for w in works.values()):
            return False
        firsts: list[dict[str, torch.Tensor]] = []
        # a microbatch's actions run its requests in the same rows (this replica's slots, which
        # RankProgram checks): their rows and one schedule serve them all, made once with every
        # step of the microbatch
        each: dict[int, tuple[Work, list[str], list[int]]] = {}  # work, requests, rows
        index: dict[int, list[int]] = {}  # the requests' indices in the work
        shared: dict[int, Any] = {}
        with torch.inference_mode():
            for k, steps in program.microbatch_steps.items():
                work, slots = works[k], program.slots[k]
                idx = work.requests_in(slots)
                place = [work.slots[j] - slots.start for j in idx]
                rids = [work.request_ids[j] for j in idx]
                ctx = [work.context_lens[j] for j in idx]
                shared[k] = steps[0].schedule(rids, ctx, place, also=steps[1:])
                each[k], index[k] = (work, rids, place), idx
            for action in program.first_actions:
                k = action.microbatch
                work, rids, place = each[k]
                self._take_tokens(action, work, i)
                inputs = self._rows_in[(action.segment, k)][i & 1]
                if not work.carried and rids:
                    assert work.token_ids is not None
                    ids = [work.token_ids[j] for j in index[k]]
                    inputs["token_ids"][torch.tensor(place, dtype=torch.int64)] = torch.tensor(
                        ids, dtype=torch.int64
                    )
                firsts.append(inputs)
        schedules = [shared[a.microbatch] for a in self.actions]
        rows = [each[a.microbatch] for a in self.actions]
        ends = [(a, r) for a, r in zip(self.actions, rows, strict=True) if a.last]
        # a request sampled on the host forwards its token from the host: then all of them do,
        # in the schedule's order
        host_forward = any(w.forward and not self._all_greedy(r) for _, (w, r, _) in ends)
        forward = [works[k].forward and not host_forward for k in sorted(mine)]
        native = self.transport.native
        if native is not None:
            native.stats()  # start the program's counts from here
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                outputs = program(firsts, schedules, forward)
        except RuntimeError as exc:
            error = translate(exc, program.what)
            if error is exc:
                raise
            raise error from None
        took = time.perf_counter() - start
        waited = 0.0
        if native is not None:
            waited, nbytes, messages = native.stats()
            self.transport.bytes_sent += int(nbytes)
            self.transport.messages_sent += int(messages)
        self.transport.comm_s += waited
        self.clock.compute_s += took - waited
        self.module.submissions += program.submissions
        if not self.info.is_leader:
            return True
        sampled = [
            self._tokens_of(rids, out, place)
            for (_, (_, rids, place)), out in zip(ends, outputs, strict=True)
        ]
        self.control.send_all(  # every microbatch's tokens in one write
            [
                self._result(work, rids, tokens)
                for (_, (work, rids, _)), tokens in zip(ends, sampled, strict=True)
            ]
        )
        for (action, (work, rids, place)), out, tokens in zip(ends, outputs, sampled, strict=True):
            if not work.forward:
                continue
            if host_forward:
                self._forward_tokens(action, out, rids, place, tokens, i)
                continue
            at = action.slots.start
            for link in action.feeds:  # the program sent the others
                if link.peer == self.rank:
                    lo, hi = link.slots.start - at, link.slots.stop - at
                    self._tokens_here[action.microbatch] = out["token_ids"][lo:hi].clone()
        return True

    def _reply_rows(
        self, work: Work, rids: list[str], out: dict[str, torch.Tensor], place: list[int]
    ) -> list[int]:
        """The sampled tokens of a static step's requests, from their rows, to the driver;
        returns them."""
        tokens = self._tokens_of(rids, out, place)
        self._send_result(work, rids, tokens)
        return tokens

    def _tokens_of(self, rids: list[str], out: dict[str, torch.Tensor], place: list[int]):
        """The sampled tokens of a static step's requests, from their rows: the step's own
        (greedy), or sampled here from their logits."""
        if not rids:
            return []
        if self._all_greedy(rids):
            ids = out["token_ids"].tolist()  # a row per slot: a few integers
            return [ids[p] for p in place]
        rows = torch.tensor(place, dtype=torch.int64, device=out["token_ids"].device)
        return self._sample_tokens(rids, out["logits"][rows])

    def _all_greedy(self, rids: Sequence[str]) -> bool:
        return all(self.held[rid].params.greedy for rid in rids)

    def _forward_tokens(
        self,
        action: Compute,
        out: dict[str, torch.Tensor],
        rids: list[str],
        place: list[int],
        tokens: list[int],
        i: int,
    ) -> None:
        """A forward work's sampled tokens, a row per slot (the step's greedy ones, a
        sampled request's from the host), to the first segment's leaders holding them."""
        ids = out["token_ids"].clone()  # a CUDA graph's outputs change at its next replay
        if rids and not self._all_greedy(rids):
            rows = torch.tensor(place, dtype=torch.int64, device=ids.device)
            ids[rows] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
        self._tokens_sent[(action.microbatch, i & 1)] = ids
        at = action.slots.start
        for link in action.feeds:
            lo, hi = link.slots.start - at, link.slots.stop - at
            if link.peer == self.rank:
                self._tokens_here[action.microbatch] = ids[lo:hi]
            else:
                self.transport.send_rows(link, [ids[lo:hi]], i)

    @torch.inference_mode()
    def _take_tokens(self, action: Compute, work: Work, i: int) -> None:
        """At a first action: the tokens forwarded by the microbatch's previous iteration, into
        this iteration's token rows (the schedule sends them whatever this work is: a carried
        work embeds them, any other overwrites them with its own); then note whether this work
        forwards its own."""
        k = action.microbatch
        due = k in self._tokens_due
        self._tokens_due.discard(k)
        if work.forward:
            self._tokens_due.add(k)
        if not due:
            if work.carried:
                raise RequestStateError(
                    f"rank {self.rank}: microbatch {k} iteration {i} carries tokens its previous "
                    "iteration did not forward"
                )
            return
        rows = self._rows_in[(action.segment, k)][i & 1]["token_ids"]
        if self.info.is_leader:
            what = f"receiving the sampled tokens of microbatch {k}"
            at = action.slots.start
            for link in action.fed_by:
                lo, hi = link.slots.start - at, link.slots.stop - at
                if link.peer == self.rank:
                    rows[lo:hi] = self._tokens_here.pop(k)
                else:
                    self.transport.recv_rows(link, [rows[lo:hi]], what)
        if self.info.tp_size > 1 and work.carried:
            self.transport.fanout_rows([rows], self.info.leader, self.group)

    def _warm(self, msg: dict[str, Any]) -> None:
        """The driver's warm-up (:meth:`~.cluster.Cluster.warm_up`): its requests have been
        prefilled, so every action's inputs are known. Build (and compile) each action's static
        decode step and run it once on padding rows, set up the rows its decode steps receive
        into, free the warm-up's requests, and start the counters afresh, so the run's figures
        are the traffic's alone."""
        start = time.perf_counter()
        if self.module.static_decode is not None:
            for action in self.actions:  # TP ranks of a group: the same steps in the same order
                self._warm_action(action)
        for rid in msg.get("r", ()):
            if rid in self.held:
                self.module.free(rid)
                del self.held[rid]
        if self._programs and self.module.static_decode is not None:
            self._build_program()
        self.module.submissions = 0
        self.transport.comm_s = 0.0
        self.transport.bytes_sent = self.transport.messages_sent = 0
        if self.comm is not None:
            self.comm.comm_s = 0.0
        self.clock = _Clock()
        self._warm_up_iterations = self.iterations
        self._warm_up_s = time.perf_counter() - start
        self._graphs_at_warm_up = compiled_graphs()
        if DECODE_STEPS[self.spec.decode_step] is not None:
            trust_warm_graphs()  # every step this rank runs is compiled now
        self.control.send({"t": "warmed", "rank": self.rank})

    @torch.inference_mode()
    def _build_program(self) -> None:
        """Trace this rank's iteration as one :class:`~.program.RankProgram` (compiling it) and
        run it once on padding rows with the native wire dry (no peer takes part)."""
        if not self.actions:
            return
        leader = self.info.is_leader
        steps = [
            self.module.decode_step(self._ops(a, sample=a.last and leader), len(a.slots))
            for a in self.actions
        ]
        native = self.transport.native
        program = RankProgram(
            self.rank,
            self.actions,
            steps,
            [self._inputs[(a.segment, a.microbatch)] for a in self.actions],
            wire=native.id if native is not None else None,
            leader=leader,
            group=self.group if self.info.tp_size > 1 else None,
            compile=DECODE_STEPS[self.spec.decode_step],
        )
        firsts, schedules = program.padding()
        if native is not None:
            native.dry(True)
        try:
            program(firsts, schedules, [False] * len(program.microbatches))
        finally:
            if native is not None:
                native.dry(False)
                native.stats()
        self.program = program

    @torch.inference_mode()
    def _warm_action(self, action: Compute) -> None:
        """Compile ``action``'s static decode step, run it on padding rows, and allocate the
        rows its decode steps receive into (under inference mode, as the step's own tensors)."""
        key = (action.segment, action.microbatch)
        inputs = self._inputs.get(key)
        if inputs is None:  # the warm-up puts a request in every slot: every action saw inputs
            raise OpWeaveRuntimeError(
                f"rank {self.rank}: the warm-up brought no inputs to segment {action.segment} "
                f"microbatch {action.microbatch}"
            )
        size = len(action.slots)
        ops = self._ops(action, sample=action.last and self.info.is_leader)
        # zeros, not the outputs themselves: a CUDA graph's outputs are overwritten by its replays
        outputs = self.module.warm_up(ops, size=size, inputs=inputs)
        self._rows_pad[key] = {name: torch.zeros_like(t) for name, t in outputs.items()}
        self._rows_in[key] = tuple(  # in the warm-up's order: a step's guards check it
            {
                name: torch.zeros((size, *shape), dtype=dtype, device=self.device)
                for name, (dtype, shape) in inputs.items()
            }
            for _ in range(2)
        )

    def _run(self, action: Compute, batch: TokenBatch) -> TokenBatch:
        sample_here = action.last and self.info.is_leader
        greedy = self._all_greedy(batch.meta.request_ids)
        # the leader's static decode step always ends in the sample operator, which keeps the
        # logits: one step (compiled once, at the warm-up) for greedy and sampled requests
        static = self.module.static_decode is not None and is_decode(batch.meta)
        ops = self._ops(action, sample=sample_here and (greedy or static))
        at = action.slots.start  # a static decode step has a row per slot of the action
        place = [slot - at for slot in batch.meta.slots]
        with self._computing():
            batch = self.module.run(batch, ops, size=len(action.slots), place=place)
            if action.last and sample_here and not greedy:
                batch = self._sample(batch)
        return batch

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        """Time the operators run inside as compute, less their TP collectives, which count as
        communication."""
        start = time.perf_counter()
        tp_before = self.comm.comm_s if self.comm is not None else 0.0
        yield
        tp_comm = (self.comm.comm_s - tp_before) if self.comm is not None else 0.0
        self.transport.comm_s += tp_comm
        self.clock.compute_s += time.perf_counter() - start - tp_comm

    @staticmethod
    def _ops(action: Compute, *, sample: bool) -> slice:
        """The action's operators; the last one's ``sample`` only if ``sample`` (otherwise its
        tokens are sampled on the host, or, on a TP follower, not at all)."""
        stop = action.ops.stop - (1 if action.last and not sample else 0)
        return slice(action.ops.start, stop)

    def _sample(self, batch: TokenBatch) -> TokenBatch:
        tokens = self._sample_tokens(batch.meta.request_ids, batch["logits"])
        return batch.replace(drop=("logits",), token_ids=torch.tensor(tokens, dtype=torch.int64))

    def _sample_tokens(self, rids: Sequence[str], logits: torch.Tensor) -> list[int]:
        """A token per row of ``logits`` under each request's sampling parameters."""
        params = [self.held[rid].params for rid in rids]
        gens = [self.held[rid].generator for rid in rids]
        return sample_rows(logits, params, gens)

    def _reply(self, work: Work, batch: TokenBatch) -> None:
        rids = list(batch.meta.request_ids)
        self._send_result(work, rids, batch["token_ids"].tolist() if rids else [])

    def _send_result(self, work: Work, rids: list[str], tokens: list[int]) -> None:
        self.control.send(self._result(work, rids, tokens))

    @staticmethod
    def _result(work: Work, rids: list[str], tokens: list[int]) -> dict[str, Any]:
        return {"t": "result", "i": work.iteration, "k": work.microbatch, "r": rids, "x": tokens}

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

    # -- reporting ----------------------------------------------------------------------------
    def stats(self, load_s: float) -> dict[str, Any]:
        p, info = self.placement, self.info
        line = self.clock.timeline
        loop = line["end_s"][-1] if line["end_s"] else 0.0
        comm = self.transport.comm_s
        overhead = max(loop - self.clock.compute_s - comm, 0.0)
        clock = self.clock
        decodes = max(clock.decode_iterations, 1)
        return {
            "rank": self.rank,
            "owner": info.owner,
            "replica": info.replica,
            "tp_rank": info.tp_rank,
            "tp_size": info.tp_size,
            "device": str(self.device),
            "host": socket.gethostname(),
            "stages": p.stage_labels(self.rank),
            "weight_bytes_read": self.module.checkpoint.bytes_read,
            "weight_bytes": self.module.weight_bytes,
            "load_s": load_s,
            "kernels": self.kernels,
            "busy_s": self.clock.compute_s,
            "comm_s": comm,
            "loop_s": loop,
            "overhead_s": overhead,
            "runqueue_s": line["runq_s"][-1] if line["runq_s"] else 0.0,
            "wait": "spin" if self.transport.spin_s > 0 else "block",
            "iterations": self.iterations - self._warm_up_iterations,
            "computes_per_iteration": len(self.actions),
            "decode_step": self.spec.decode_step,
            "submissions": self.module.submissions,
            "decode_iterations": clock.decode_iterations,
            "submissions_per_token": clock.decode_submissions / decodes,
            "host_s_per_token": clock.decode_host_s / decodes,
            "warm_up_s": self._warm_up_s,
            "traffic_compiles": (
                compiled_graphs() - self._graphs_at_warm_up
                if DECODE_STEPS[self.spec.decode_step] is not None
                else 0
            ),
            "timeline": line,
            "requests_held_at_end": len(self.held),
            "state_bytes_at_end": self.module.state_bytes(),
            "bytes_sent": self.transport.bytes_sent,
            "messages_sent": self.transport.messages_sent,
        }


def rank_programs(device: str, decode_step: str) -> bool:
    """Whether ranks run each decode iteration as one rank program (:mod:`.program`): CPU
    ranks whose decode steps trace, unless ``OPWEAVE_RANK_PROGRAM=0``."""
    return (
        device == "cpu"
        and DECODE_STEPS.get(decode_step) is not None
        and os.environ.get(PROGRAM_ENV, "1").strip() != "0"
    )


def apply_kernels(module: StageModule, choice: str, *, gemms_only: bool = False) -> list[str]:
    """Swap operators for vLLM-kernel-backed ones (``vllm`` / ``vllm-all``); ``opweave``: none.
    ``gemms_only``: only prepack the projections for vLLM's oneDNN GEMM."""
    if choice == "opweave":
        return []
    from ..vllm import KERNELS_KEY
    from ..vllm._kernels import apply_kernel_choice

    return apply_kernel_choice(module, {KERNELS_KEY: choice}, gemms_only=gemms_only)


@contextlib.contextmanager
def heartbeat(control: ControlClient) -> Iterator[None]:
    """While weights load (possibly minutes), tell the driver this rank is alive."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(_HEARTBEAT_S):
            with contextlib.suppress(ChannelClosed):
                control.send({"t": "loading"})

    thread = threading.Thread(target=loop, name="opweave-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pin_to_core(local_rank: int, local_ranks: int) -> bool:
    """Bind a single-threaded CPU rank to one core of those this process may use, as a GPU
    rank is bound to its device: the scheduler then never migrates it (its caches stay warm)
    and two ranks never share a core while another one idles. More ranks than cores share
    them round-robin, from the last core down: the first cores are left to the OS's
    housekeeping and the unpinned front end (server, scheduler, clients). Measured on a 2-core
    VM, one rank serving 4 streaming clients, its core alternated six times: 99.8-143.0
    (median 126) output tok/s on the last core, 90.3-126.6 (median 114) on the first. Returns
    whether the rank has a core of its own (then it may spin while it waits, see
    :mod:`.wire`)."""
    if not hasattr(os, "sched_setaffinity") or torch.get_num_threads() != 1:
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[-1 - local_rank % len(cores)]})
    return local_ranks <= len(cores)


def _parse_fault(rank: int) -> tuple[int, str] | None:
    text = os.environ.get(FAULT_ENV)
    if not text:
        return None
    r, it, mode = text.split(":")
    return (int(it), mode) if int(r) == rank else None


def _store(spec: RankSpec, timeout: timedelta) -> Any:
    if "file" in spec.store:
        return dist.FileStore(spec.store["file"], spec.world_size)  # pyright: ignore[reportPrivateImportUsage]
    if "host" in spec.store:
        return in_namespace(
            dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                spec.store["host"], int(spec.store["port"]), spec.world_size, False, timeout=timeout
            ),
            bytes.fromhex(spec.key),
        )
    return None  # torchrun: env://


def in_namespace(store: Any, key: bytes) -> Any:
    """A TCP store seen through the prefix of the run whose secret is ``key``
    (:func:`store_namespace`): what the driver and every rank of the run read and write."""
    return dist.PrefixStore(store_namespace(key), store)  # pyright: ignore[reportPrivateImportUsage]


def connect(spec: RankSpec) -> tuple[ControlClient, Any]:
    """The rank's authenticated control connection to the driver, and its rendezvous store."""
    timeout = timedelta(seconds=spec.join_timeout_s)
    store = _store(spec, timeout)
    if spec.control is not None:
        host, port = spec.control
    else:
        if store is None:  # torchrun's store, reached through the environment
            store = in_namespace(
                dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    spec.world_size,
                    False,
                    timeout=timeout,
                ),
                bytes.fromhex(spec.key),
            )
        host, port_text = store.get(CONTROL_KEY).decode().rsplit(":", 1)
        port = int(port_text)
    control = ControlClient(host, port, bytes.fromhex(spec.key), spec.rank, spec.join_timeout_s)
    control.send(
        {"t": "hello", "rank": spec.rank, "pid": os.getpid(), "host": socket.gethostname()}
    )
    return control, store


def init_group(spec: RankSpec, store: Any) -> Placement:
    """Join the run's default process group (long timeout: other nodes may start late)."""
    kwargs: dict[str, Any] = dict(
        rank=spec.rank, world_size=spec.world_size, timeout=timedelta(seconds=spec.join_timeout_s)
    )
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if store is not None and "env" not in spec.store:
        dist.init_process_group(backend, store=store, **kwargs)
    else:
        dist.init_process_group(backend, init_method="env://", **kwargs)
    return Placement(Plan.model_validate(spec.plan), load_model(spec.model_dir))


def name_process(name: str) -> None:
    """Linux: the name ``ps``/``top`` show for this process (15 characters at most)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME


def run_rank(spec: RankSpec) -> int:
    """The whole life of one rank; 0 after a clean shutdown, 1 after reporting an error."""
    name_process(f"opweave-rank{spec.rank}")
    with contextlib.suppress(Exception):  # a crash in native code leaves its stack in the log
        faulthandler.enable(file=sys.__stderr__ or sys.stderr)
    control: ControlClient | None = None
    try:
        control, store = connect(spec)
        load_start = time.perf_counter()
        with heartbeat(control):
            worker = StageWorker(spec, control, init_group(spec, store))
        load_s = time.perf_counter() - load_start
        control.send(
            {
                "t": "ready",
                "rank": spec.rank,
                "weight_bytes_read": worker.module.checkpoint.bytes_read,
                "weight_bytes": worker.module.weight_bytes,
                "load_s": load_s,
                "kernels": worker.kernels,
            }
        )
        worker.serve()
        control.send({"t": "stats", "stats": worker.stats(load_s)})
        worker.transport.close()
        worker.runq.close()
        control.close()
        return 0
    except ChannelClosed:
        return 0 if control is None else 1  # the driver is gone: nobody to report to
    except BaseException as exc:
        traceback.print_exc()
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        is_peer = isinstance(exc, PeerError)
        report = {
            "t": "error",
            "kind": "peer" if is_peer else "error",
            "peer": exc.peer if is_peer else None,
            "message": text if is_peer else f"{type(exc).__name__}: {text}",
        }
        if control is not None:
            with contextlib.suppress(ChannelClosed, OSError):
                control.send(report)
        sys.stdout.flush()
        return 1
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it exits."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def watch_parent(parent: int) -> None:
    """Exit as soon as this process is re-parented (its starter is gone)."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=loop, name="opweave-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    """``python -m opweave.runtime._private.rank SPEC_FILE``: a spawned rank."""
    die_with_parent()
    watch_parent(os.getppid())
    path = Path(argv[0])
    spec = RankSpec.from_json(path.read_text())
    path.unlink(missing_ok=True)  # it holds the run's key
    torch.set_num_threads(spec.threads)
    return run_rank(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
