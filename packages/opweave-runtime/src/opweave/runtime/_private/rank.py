"""One rank of a run: the stage-worker program, the same for offline generation and serving.

A rank (joined by :mod:`.join`) holds its operators (only its own slices of their weights) and
runs its compiled per-iteration schedule (:mod:`.schedule`) for every iteration the driver asks
for: per microbatch it takes the driver's :class:`~.work.Work` (which requests, which to admit
and free), runs its segments -- the first segment embeds the work's tokens, the others receive
activations from the previous segment's leaders -- and the last segment's leaders send the
sampled tokens back to the driver. How an iteration runs is its :class:`~.runners.IterationRunner`,
chosen once, at the warm-up. Between iterations a rank waits on its control connection without
a bound (a server may idle); within one every wait is bounded by the run's timeout, so a peer
that died or hangs is named.

Per rank it measures time in operators (``compute_s``), blocked in transfers or waiting for the
driver (``comm_s``) and the rest of the loop, in total and at the end of every iteration
(``timeline``), so a steady-state window of one run can be read from its statistics; and, on
Linux, the time it was ready to run but waited for a CPU (``runq_s``: another process held its
core), which lands in whichever of the three it happened in.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import OpWeaveRuntimeError, RequestStateError
from .control import ControlClient
from .decode import compiled_graphs, trust_warm_graphs
from .expert_parallel import join_groups
from .kernels import KernelSet
from .messages import Shutdown, Warm, Warmed
from .options import Hook, RunOptions, fault_hook
from .placement import Placement
from .prefill import StateInbox
from .proc import RunQueueClock, pin_to_core, resolve_device
from .program import RankProgram
from .rankcore import Clock, RankCore, RankRequest, Rows
from .runners import IterationRunner, PerRequestRunner, ProgramRunner, RowsRunner
from .schedule import Compute, compile_schedule, microbatches_of, rank_ops
from .stage import StageModule
from .tensor_parallel import Shard, TPComm, patient
from .transport import Transport
from .work import GREEDY, Work, skip_draw


class _Shutdown(Exception):
    """The driver said stop."""


class StageWorker(RankCore):
    """One rank's loop and request sync over its operators, schedule and transport."""

    def __init__(
        self,
        rank: int,
        options: RunOptions,
        control: ControlClient,
        placement: Placement,
        *,
        model_dir: str,
        local_rank: int,
        local_world_size: int,
        host: str,
        key: bytes,
    ) -> None:
        self.rank = rank
        self.options = options
        self.control = control
        self.placement = placement
        self.info = placement.ranks[rank]
        self.device = resolve_device(options.device, local_rank)
        self.actions: list[Compute] = compile_schedule(placement, rank)
        self.mine = placement.replica_slots(self.info.owner, self.info.replica)
        self.group, replica_group = join_groups(
            placement.tp_groups, placement.ep_groups, rank, options.timeout_s
        )
        experts = self.info.expert_shard
        self.ep = self.info.expert_exchange(replica_group, self.group)
        own_core = self.device.type == "cpu" and pin_to_core(local_rank, local_world_size)
        world = placement.world_size
        self.transport = Transport(
            rank,
            self.device,
            options.timeout_s,
            host=host,
            key=key,
            spin_s=options.spin_s(own_core) if world > 1 else 0.0,
            torch_p2p=options.test_torch_p2p,
        )
        # rank programs send on the native wire (none under the torch point-to-point seam)
        self.programs = options.programs and (world == 1 or self.transport.native is not None)
        shard = Shard(self.info.tp_rank, self.info.tp_size)
        self.comm = TPComm(shard, self.group) if self.info.tp_size > 1 else None
        step = options.decode_step
        self.module = StageModule(
            model_dir,
            rank_ops(placement, rank),
            device=self.device,
            dtype=None if options.dtype is None else getattr(torch, options.dtype),
            shard=shard,
            comm=self.comm,
            model=placement.model,
            # a static decode step takes vLLM's GEMMs only (the rest of its kernels do not trace)
            kernels=KernelSet(options.kernels, gemms_only=step.static),
            ep=self.ep,
            experts=experts,
        )
        if step.static:  # slabs for every slot, of the plan's context
            self.module.use_static_decode(
                rows=len(self.mine),
                tokens=min(placement.plan.context_tokens, placement.model.max_context_tokens),
                compile=step.compiler,
            )
        self.held: dict[str, RankRequest] = {}
        self.inbox = StateInbox(rank, placement, self.transport)  # states a prefill pool sent
        self._works: dict[tuple[int, int], Work] = {}
        self._synced: set[tuple[int, int]] = set()
        self.clock = Clock()
        self.runq = RunQueueClock()  # this thread's: it runs the loop
        self.iterations = 0
        self._warm_up_iterations = 0  # the warm-up's, left out of the figures
        self._warm_up_s = 0.0
        self._graphs_at_warm_up = 0
        # (segment, microbatch) -> each input tensor's dtype and shape past the token dimension,
        # as the first batch brought them (what the warm-up builds its padding from)
        self.inputs: dict[tuple[int, int], dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        self.runner: IterationRunner = PerRequestRunner(self)  # until the warm-up
        self.hooks: list[Hook] = []
        if options.fault is not None and options.fault.rank == rank:
            self.hooks.append(fault_hook(options.fault))

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
                for hook in self.hooks:
                    hook(i)
                submissions = self.module.submissions
                self.runner.run(i, done)
                ran = mine - done
                decode = all(self._works[(i, k)].decode for k in ran)
                done |= {k for k in ran if self._works[(i, k)].final}
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
        if isinstance(msg, Shutdown):
            raise _Shutdown
        if isinstance(msg, Warm):
            self.warm(msg.request_ids)
            return
        if not isinstance(msg, Work):
            raise OpWeaveRuntimeError(f"unexpected control message {msg!r} from the driver")
        self._works[(msg.iteration, msg.microbatch)] = msg
        if self.clock.started is None:
            self.clock.started = time.perf_counter()
            self.clock.runq_at_start = self.runq.seconds()

    def work(self, i: int, k: int) -> Work:
        """Microbatch ``k``'s work of iteration ``i`` (waiting for it), its requests in sync."""
        while (i, k) not in self._works:
            self._next_message()
        work = self._works[(i, k)]
        if (i, k) not in self._synced:
            self._synced.add((i, k))
            self._sync(work)
        return work

    def _sync(self, work: Work) -> None:
        """Free finished requests, admit new ones (a request at context 0 that is held
        restarts; one a prefill pool prefilled arrives with its state)."""
        for rid in work.free:
            if rid in self.held:
                self.module.free(rid)
                del self.held[rid]
        stateful = self.placement.holds_state(self.info.owner)
        for slot, replica, seq in work.discard:
            if stateful and slot in self.mine:
                self.inbox.take(replica, seq)
        for rid, (replica, seq) in work.imports.items():
            i = work.request_ids.index(rid)
            if work.slots[i] not in self.mine:
                continue
            if rid in self.held:
                self.module.free(rid)
            self.module.admit(rid, rows=[work.slots[i] - self.mine.start])
            self.held[rid] = held = self._request(work, rid)
            if held.generator is not None:  # the prefill rank drew the first token from it
                skip_draw(held.params, held.generator, self.placement.model.vocab_size)
            if stateful:
                self.module.import_state(rid, work.context_lens[i], self.inbox.take(replica, seq))
        for i in work.requests_in(self.mine):
            rid, ctx = work.request_ids[i], work.context_lens[i]
            if ctx == 0:
                if rid in self.held:
                    self.module.free(rid)
                self.module.admit(rid, rows=[work.slots[i] - self.mine.start])
                self.held[rid] = self._request(work, rid)
            elif rid not in self.held:
                raise RequestStateError(
                    f"rank {self.rank} holds no state for request {rid!r} at context {ctx}"
                )

    @staticmethod
    def _request(work: Work, rid: str) -> RankRequest:
        params = work.params.get(rid, GREEDY)
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(int(params.seed))
        return RankRequest(params, gen)

    # -- the warm-up ----------------------------------------------------------------------------
    def warm(self, request_ids: Sequence[str]) -> None:
        """The driver's warm-up (:func:`~.warmup.warm_up`): its requests have been prefilled,
        so every action's inputs are known. Choose the iteration runner: over static decode
        steps, build (and compile) each action's step and run it once on padding rows, set up
        the rows its decode steps receive into, and (CPU, compiled) the rank program; then free
        the warm-up's requests and start the counters afresh, so the run's figures are the
        traffic's alone."""
        start = time.perf_counter()
        if self.module.static_decode is not None:
            rows_in: dict[tuple[int, int], tuple[Rows, Rows]] = {}
            rows_pad: dict[tuple[int, int], Rows] = {}
            # a step's collectives wait for peers still compiling theirs: up to the warm-up's
            # deadline, not an iteration's
            groups = (self.group, *((self.ep.group, self.ep.tp_group) if self.ep else ()))
            with patient(groups, self.options.join_timeout_s, self.options.timeout_s):
                for action in self.actions:  # TP ranks of a group: the same steps, one order
                    key = (action.segment, action.microbatch)
                    rows_in[key], rows_pad[key] = self._warm_action(action)
            rows = RowsRunner(self, rows_in, rows_pad)
            self.runner = rows
            if self.programs and self.actions:
                self.runner = ProgramRunner(rows, self._build_program())
        for rid in request_ids:
            if rid in self.held:
                self.module.free(rid)
                del self.held[rid]
        self.module.submissions = 0
        self.transport.comm_s = 0.0
        self.transport.bytes_sent = self.transport.messages_sent = 0
        for c in (self.comm, self.ep):
            if c is not None:
                c.comm_s = 0.0
        self.clock = Clock()
        self._warm_up_iterations = self.iterations
        self._warm_up_s = time.perf_counter() - start
        self._graphs_at_warm_up = compiled_graphs()
        if self.options.decode_step.compiler is not None:
            trust_warm_graphs()  # every step this rank runs is compiled now
        self.control.send(Warmed(self.rank))

    @torch.inference_mode()
    def _warm_action(self, action: Compute) -> tuple[tuple[Rows, Rows], Rows]:
        """Compile ``action``'s static decode step, run it on padding rows; the rows its decode
        steps receive into (under inference mode, as the step's own tensors), two sets, and its
        padding outputs."""
        key = (action.segment, action.microbatch)
        inputs = self.inputs.get(key)
        if inputs is None:  # the warm-up puts a request in every slot: every action saw inputs
            raise OpWeaveRuntimeError(
                f"rank {self.rank}: the warm-up brought no inputs to segment {action.segment} "
                f"microbatch {action.microbatch}"
            )
        size = len(action.slots)
        ops = self.ops(action, sample=action.last and self.info.is_leader)
        # zeros, not the outputs themselves: a CUDA graph's outputs are overwritten by its replays
        outputs = self.module.warm_up(ops, size=size, inputs=inputs)
        pad = {name: torch.zeros_like(t) for name, t in outputs.items()}

        def rows() -> Rows:  # in the warm-up's order: a step's guards check it
            return {
                name: torch.zeros((size, *shape), dtype=dtype, device=self.device)
                for name, (dtype, shape) in inputs.items()
            }

        return (rows(), rows()), pad

    @torch.inference_mode()
    def _build_program(self) -> RankProgram:
        """Trace this rank's iteration as one :class:`~.program.RankProgram` (compiling it) and
        run it once on padding rows with the native wire dry (no peer takes part)."""
        leader = self.info.is_leader
        steps = [
            self.module.decode_step(self.ops(a, sample=a.last and leader), len(a.slots))
            for a in self.actions
        ]
        native = self.transport.native
        program = RankProgram(
            self.rank,
            self.actions,
            steps,
            [self.inputs[(a.segment, a.microbatch)] for a in self.actions],
            wire=native.id if native is not None else None,
            leader=leader,
            group=self.group if self.info.tp_size > 1 else None,
            compile=self.options.decode_step.compiler,
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
        return program

    # -- reporting ----------------------------------------------------------------------------
    def stats(self, load_s: float) -> dict[str, Any]:
        p, info, clock = self.placement, self.info, self.clock
        line = clock.timeline
        loop = line["end_s"][-1] if line["end_s"] else 0.0
        comm = self.transport.comm_s
        decodes = max(clock.decode_iterations, 1)
        step = self.options.decode_step
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
            "kernels": self.module.kernels,
            "busy_s": clock.compute_s,
            "comm_s": comm,
            "loop_s": loop,
            "overhead_s": max(loop - clock.compute_s - comm, 0.0),
            "runqueue_s": line["runq_s"][-1] if line["runq_s"] else 0.0,
            "wait": "spin" if self.transport.spin_s > 0 else "block",
            "iterations": self.iterations - self._warm_up_iterations,
            "computes_per_iteration": len(self.actions),
            "decode_step": str(step),
            "submissions": self.module.submissions,
            "decode_iterations": clock.decode_iterations,
            "submissions_per_token": clock.decode_submissions / decodes,
            "host_s_per_token": clock.decode_host_s / decodes,
            "warm_up_s": self._warm_up_s,
            "traffic_compiles": (
                compiled_graphs() - self._graphs_at_warm_up if step.compiler is not None else 0
            ),
            "timeline": line,
            "requests_held_at_end": len(self.held),
            "state_bytes_at_end": self.module.state_bytes(),
            "bytes_sent": self.transport.bytes_sent,
            "messages_sent": self.transport.messages_sent,
        }
