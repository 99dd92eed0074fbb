"""How a rank runs one iteration: one :class:`IterationRunner`, chosen at the warm-up.

Every rank runs the same compiled schedule (:mod:`.schedule`) each iteration; what differs is
how a decode iteration's actions run:

- :class:`PerRequestRunner` (before the warm-up, and all along under ``--decode-step
  per-request``): each action's requests as one packed :class:`~.batch.TokenBatch` through the
  operators' per-request form; received from (and sent to) the neighbouring segments' leaders.
- :class:`RowsRunner` (static decode steps): a decode work's rows move between ranks as they
  are, straight from a step's outputs into the next step's inputs, laid out at the warm-up; a
  work that is not a decode step (a prefill) runs as above.
- :class:`ProgramRunner` (CPU ranks whose steps compile): a decode iteration in which every
  microbatch of the rank decodes runs as one :class:`~.program.RankProgram` call; any other
  iteration runs action by action, as above.

All three share the rank's request state, sampling and replies (:class:`~.rankcore.RankCore`)
and one :class:`TokenRelay` (the tokens that stay on the ranks between static decode steps).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ..errors import OpWeaveRuntimeError, RequestStateError
from .batch import TokenBatch
from .decode import is_decode
from .native import translate
from .program import RankProgram
from .rankcore import RankCore, Rows
from .schedule import Compute
from .transport import as_batch, merge, select
from .work import Work


class IterationRunner(Protocol):
    """Runs iteration ``i`` of the rank's schedule for its microbatches not in ``done``."""

    name: str

    def run(self, i: int, done: set[int]) -> None: ...


class TokenRelay:
    """The tokens that stay on the ranks (forward and carried works, :class:`~.work.Work`): the
    microbatches whose next first action takes forwarded tokens, those this rank forwarded to
    itself, and those it sent, kept until the sends of their iteration are reaped."""

    def __init__(self, worker: RankCore) -> None:
        self.w = worker
        self.due: set[int] = set()
        self.here: dict[int, torch.Tensor] = {}
        self.sent: dict[tuple[int, int], torch.Tensor] = {}

    @torch.inference_mode()
    def take(self, action: Compute, work: Work, i: int, rows: Rows | None) -> None:
        """At a first action: the tokens forwarded by the microbatch's previous iteration, into
        this iteration's token rows (the schedule sends them whatever this work is: a carried
        work embeds them, any other overwrites them with its own); then note whether this work
        forwards its own."""
        w, k = self.w, action.microbatch
        due = k in self.due
        self.due.discard(k)
        if work.forward:
            self.due.add(k)
        if not due:
            if work.carried:
                raise RequestStateError(
                    f"rank {w.rank}: microbatch {k} iteration {i} carries tokens its previous "
                    "iteration did not forward"
                )
            return
        assert rows is not None  # forwards happen between static decode steps only
        ids = rows["token_ids"]
        if w.info.is_leader:
            what = f"receiving the sampled tokens of microbatch {k}"
            at = action.slots.start
            for link in action.fed_by:
                lo, hi = link.slots.start - at, link.slots.stop - at
                if link.peer == w.rank:
                    ids[lo:hi] = self.here.pop(k)
                else:
                    w.transport.recv_rows(link, [ids[lo:hi]], what)
        if w.info.tp_size > 1 and work.carried:
            w.transport.fanout_rows([ids], w.info.leader, w.group)

    def forward(
        self,
        action: Compute,
        out: Rows,
        rids: list[str],
        place: list[int],
        tokens: list[int],
        i: int,
    ) -> None:
        """A forward work's sampled tokens, a row per slot (the step's greedy ones, a sampled
        request's from the host), to the first segment's leaders holding them."""
        w = self.w
        ids = out["token_ids"].clone()  # a CUDA graph's outputs change at its next replay
        if rids and not w.all_greedy(rids):
            rows = torch.tensor(place, dtype=torch.int64, device=ids.device)
            ids[rows] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
        self.sent[(action.microbatch, i & 1)] = ids
        at = action.slots.start
        for link in action.feeds:
            lo, hi = link.slots.start - at, link.slots.stop - at
            if link.peer == w.rank:
                self.here[action.microbatch] = ids[lo:hi]
            else:
                w.transport.send_rows(link, [ids[lo:hi]], i)

    def keep_own(self, action: Compute, out: Rows) -> None:
        """The tokens a rank program forwarded: those for this rank itself (it sent the rest)."""
        at = action.slots.start
        for link in action.feeds:
            if link.peer == self.w.rank:
                lo, hi = link.slots.start - at, link.slots.stop - at
                self.here[action.microbatch] = out["token_ids"][lo:hi].clone()


class PerRequestRunner:
    """Each action's requests as one packed batch through the operators' per-request form."""

    name = "per-request"

    def __init__(self, worker: RankCore) -> None:
        self.w = worker

    def run(self, i: int, done: set[int]) -> None:
        for action in self.w.actions:
            if action.microbatch not in done:
                self.compute(action, self.w.work(i, action.microbatch), i)

    def compute(self, action: Compute, work: Work, i: int) -> None:
        if work.forward or work.carried:
            raise OpWeaveRuntimeError(
                f"rank {self.w.rank}: tokens stay on the ranks only between static decode steps "
                "(--decode-step static, compiled or traced)"
            )
        self.packed(action, work, i)

    def packed(self, action: Compute, work: Work, i: int) -> None:
        w = self.w
        leader = w.info.is_leader
        if action.first:
            batch = work.batch_for(action.slots, w.device)
        else:
            what = f"receiving segment {action.segment} microbatch {action.microbatch}"
            parts = [w.transport.recv(link, what) for link in action.sources] if leader else None
            if w.info.tp_size > 1:
                parts = w.transport.fanout(parts, len(action.sources), w.info.leader, w.group)
            assert parts is not None
            start = time.perf_counter()
            batch = merge([as_batch(p) for p in parts])
            w.transport.comm_s += time.perf_counter() - start  # unpacking is transfer
        key = (action.segment, action.microbatch)
        if batch.meta.request_ids and key not in w.inputs:
            w.inputs[key] = {
                name: (t.dtype, tuple(t.shape[1:])) for name, t in batch.tensors.items()
            }
        if batch.meta.request_ids:
            batch = self._run(action, batch)
        else:
            if w.module.expert_parallel:  # the data-parallel peers' exchanges need this rank
                with w.computing(), torch.inference_mode():
                    w.module.idle(w.ops(action, sample=False))
            batch = TokenBatch(batch.meta, {})
        if not leader:
            return
        if action.last:
            rids = list(batch.meta.request_ids)
            w.reply(work, rids, batch["token_ids"].tolist() if rids else [])
        else:
            for link in action.dests:
                w.transport.send(link, select(batch, link.slots), i)

    def _run(self, action: Compute, batch: TokenBatch) -> TokenBatch:
        w = self.w
        sample_here = action.last and w.info.is_leader
        greedy = w.all_greedy(batch.meta.request_ids)
        # the leader's static decode step always ends in the sample operator, which keeps the
        # logits: one step (compiled once, at the warm-up) for greedy and sampled requests
        static = w.module.static_decode is not None and is_decode(batch.meta)
        ops = w.ops(action, sample=sample_here and (greedy or static))
        at = action.slots.start  # a static decode step has a row per slot of the action
        place = [slot - at for slot in batch.meta.slots]
        with w.computing():
            batch = w.module.run(batch, ops, size=len(action.slots), place=place)
            if sample_here and not greedy:
                tokens = w.sample_tokens(batch.meta.request_ids, batch["logits"])
                batch = batch.replace(
                    drop=("logits",), token_ids=torch.tensor(tokens, dtype=torch.int64)
                )
        return batch


class RowsRunner:
    """Static decode steps whose rows move between ranks as they are; other works packed.

    Per (segment, microbatch) the step's input rows, one set per iteration parity (a set is
    refilled two iterations later, once the sends that may still read it are reaped), and zero
    rows shaped as its outputs (what goes out while none of the microbatch's requests is this
    replica's); a message carries its tensors in name order. Built at the warm-up
    (:meth:`~.rank.StageWorker.warm`)."""

    name = "static"

    def __init__(
        self,
        worker: RankCore,
        rows_in: dict[tuple[int, int], tuple[Rows, Rows]],
        rows_pad: dict[tuple[int, int], Rows],
    ) -> None:
        self.w = worker
        self.rows_in = rows_in
        self.rows_pad = rows_pad
        self.packed = PerRequestRunner(worker)
        self.tokens = TokenRelay(worker)

    def run(self, i: int, done: set[int]) -> None:
        for action in self.w.actions:
            if action.microbatch not in done:
                self.compute(action, self.w.work(i, action.microbatch), i)

    def inputs(self, action: Compute, i: int) -> Rows:
        return self.rows_in[(action.segment, action.microbatch)][i & 1]

    def compute(self, action: Compute, work: Work, i: int) -> None:
        if action.first:
            self.tokens.take(action, work, i, self.inputs(action, i))
        if work.decode:
            self._rows(action, work, i)
        else:
            self.packed.packed(action, work, i)

    @torch.inference_mode()
    def _rows(self, action: Compute, work: Work, i: int) -> None:
        """``action`` as a static decode step whose rows move between ranks as they are: the
        inputs arrive into this action's rows (a row per slot, the requests at their slots'
        rows), the step runs on them, and each destination gets its slots' rows of the outputs
        (:meth:`~.transport.Transport.send_rows`); no batch is built, packed or unpacked."""
        w = self.w
        key = (action.segment, action.microbatch)
        at, leader = action.slots.start, w.info.is_leader
        inputs = self.inputs(action, i)
        idx = work.requests_in(action.slots)
        place = [work.slots[j] - at for j in idx]
        if action.first:
            if not work.carried:  # a carried work's tokens are in place (TokenRelay.take)
                put_tokens(inputs, work, idx, place)
        else:
            if leader:
                what = f"receiving segment {action.segment} microbatch {action.microbatch}"
                names = sorted(inputs)  # the order the sender sends in
                for link in action.sources:
                    lo, hi = link.slots.start - at, link.slots.stop - at
                    w.transport.recv_rows(link, [inputs[n][lo:hi] for n in names], what)
            if w.info.tp_size > 1:
                w.transport.fanout_rows(list(inputs.values()), w.info.leader, w.group)
        # under EP a replica with none of the microbatch's requests still runs its padding
        # rows: its data-parallel peers' expert exchanges need it
        if idx or w.module.expert_parallel:
            rids = [work.request_ids[j] for j in idx]
            with w.computing():
                out = w.module.run_rows(
                    inputs,
                    w.ops(action, sample=action.last and leader),
                    request_ids=rids,
                    context_lens=[work.context_lens[j] for j in idx],
                    place=place,
                )
        else:  # none of the microbatch's requests is this replica's: its rows go out as padding
            rids, out = [], self.rows_pad[key]
        if not leader:
            return
        if action.last:
            tokens = w.tokens_of(rids, out, place)
            w.reply(work, rids, tokens)
            if work.forward:
                self.tokens.forward(action, out, rids, place, tokens, i)
            return
        names = sorted(out)
        for link in action.dests:
            lo, hi = link.slots.start - at, link.slots.stop - at
            w.transport.send_rows(link, [out[name][lo:hi] for name in names], i)


class ProgramRunner:
    """A decode iteration as one :class:`~.program.RankProgram` call, when every microbatch of
    the rank still runs and decodes; any other iteration as :class:`RowsRunner` runs it."""

    name = "program"

    def __init__(self, rows: RowsRunner, program: RankProgram) -> None:
        self.w = rows.w
        self.rows = rows
        self.program = program

    def run(self, i: int, done: set[int]) -> None:
        if done or not self._iteration(i):
            self.rows.run(i, done)

    def _iteration(self, i: int) -> bool:
        """Run iteration ``i`` as the rank program, if every microbatch decodes (waits for all
        their works first); False: it cannot (the actions then run one by one)."""
        w, program, relay = self.w, self.program, self.rows.tokens
        mine = sorted({a.microbatch for a in w.actions})
        works = {k: w.work(i, k) for k in mine}
        if not all(work.decode for work in works.values()):
            return False
        firsts: list[Rows] = []
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
                inputs = self.rows.inputs(action, i)
                relay.take(action, work, i, inputs)
                if not work.carried and rids:
                    put_tokens(inputs, work, index[k], place)
                firsts.append(inputs)
        schedules = [shared[a.microbatch] for a in w.actions]
        rows = [each[a.microbatch] for a in w.actions]
        ends = [(a, r) for a, r in zip(w.actions, rows, strict=True) if a.last]
        # a request sampled on the host forwards its token from the host: then all of them do,
        # in the schedule's order
        host_forward = any(wk.forward and not w.all_greedy(r) for _, (wk, r, _) in ends)
        forward = [works[k].forward and not host_forward for k in mine]
        native = w.transport.native
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
            w.transport.bytes_sent += int(nbytes)
            w.transport.messages_sent += int(messages)
        w.transport.comm_s += waited
        w.clock.compute_s += took - waited
        w.module.submissions += program.submissions
        if not w.info.is_leader:
            return True
        sampled = [
            w.tokens_of(rids, out, place)
            for (_, (_, rids, place)), out in zip(ends, outputs, strict=True)
        ]
        w.reply_all(  # every microbatch's tokens in one write
            [
                (work, rids, tokens)
                for (_, (work, rids, _)), tokens in zip(ends, sampled, strict=True)
            ]
        )
        for (action, (work, rids, place)), out, tokens in zip(ends, outputs, sampled, strict=True):
            if not work.forward:
                continue
            if host_forward:
                relay.forward(action, out, rids, place, tokens, i)
            else:
                relay.keep_own(action, out)
        return True


def put_tokens(inputs: Rows, work: Work, idx: Iterable[int], place: list[int]) -> None:
    """The work's token ids of requests ``idx`` into the token rows ``place``."""
    assert work.token_ids is not None  # a decode step's work: a token per request
    ids = inputs["token_ids"]
    ids[torch.tensor(place, dtype=torch.int64, device=ids.device)] = torch.tensor(
        [work.token_ids[j] for j in idx], dtype=torch.int64, device=ids.device
    )
