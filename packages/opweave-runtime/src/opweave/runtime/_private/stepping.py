"""The driver: a plan's ranks advanced one scheduler step at a time.

A scheduler decides each step which requests run how many tokens -- vLLM's, through
:mod:`opweave.runtime.vllm`, or the small offline one of :mod:`.driver` -- and
:class:`StepDriver` turns that into iterations of the plan: requests keep a slot of the global
batch for their lifetime (so the replicas that hold their state never change), a step's requests
are split by their slots' microbatches, every microbatch it covers gets its
:class:`~.work.Work` (admissions, frees and prefill chunks included), the microbatches pipeline
through the stages, and the step returns the tokens sampled for the requests that reached the
end of what they know (and appends them to those requests). A step covers every microbatch (as
vLLM's engine steps) or some of them (the offline scheduler steps each microbatch as soon as its
previous tokens are in); each microbatch counts its own iterations. Nothing here imports vLLM.

A scheduler that runs ahead (vLLM's asynchronous scheduling, and the offline scheduler between
static decode steps) submits a step (:meth:`StepDriver.submit`) before the previous one's tokens
are in, asking to run tokens the driver does not know yet: each such request's last token is
still being sampled. Over static decode steps the ranks keep those tokens: every decode step's
work forwards its sampled tokens to the first segment's leaders, and a microbatch whose requests
all run exactly their in-flight token, sampled in the microbatch's previous work, gets a carried
work (see :class:`~.work.Work`). Any other step that needs unknown tokens first waits for the
steps in flight (:meth:`StepDriver.collect`), as a synchronous scheduler would.

A plan with a prefill pool (:mod:`.prefill`): the decode ranks never prefill. A step's item that
completes a request's prompt sends the whole prompt to a prefill replica instead (a chunk short of
the end waits for the rest), whose leader's first token is the step's token for it; the
request's next work admits it at the prompt's length (:attr:`~.work.Work.imports`), its state
coming from that replica. The driver counts the state bytes the prefill ranks sent
(:attr:`StepDriver.transfer`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import RequestStateError
from .batch import one_new_token_each
from .messages import Prefill, Prefilled, Result
from .work import GREEDY, SamplingParams, Work


class Ranks(Protocol):
    """What the driver needs of a plan installed on ranks (:class:`~.cluster.Cluster`)."""

    placement: Any
    first_iteration: int
    static_decode: bool

    @property
    def global_batch(self) -> int: ...

    @property
    def microbatches(self) -> int: ...

    def submit(self, work: Work) -> None: ...

    def result(self, timeout_s: float | None = None) -> Result | Prefilled: ...

    def result_parts(self, microbatch: int) -> int: ...

    def prefill(self, replica: int, prompts: Sequence[Prefill]) -> None: ...

    @property
    def prefill_parts(self) -> int: ...


@dataclass
class _Request:
    slot: int
    token_ids: list[int]  # prompt, then every sampled token
    params: SamplingParams
    computed: int = 0  # tokens the ranks hold state for
    admitted: bool = False  # the ranks have seen it (its first work carries its parameters)
    sampled_at: int = -1  # the last iteration (of its microbatch) whose work samples its token
    epoch: int = 0  # renewed by a restart: tokens of steps submitted before it are stale
    prefill: tuple[int, int] | None = None  # (replica, number) of its prefill, until imported
    token_due: int | None = None  # the prefill whose first token is still in flight


@dataclass
class Step:
    """A submitted step: the iteration it submitted of each microbatch, the requests it samples
    a token for (with their epoch at submission), and, once every result is in, the tokens."""

    iterations: dict[int, int]  # microbatch -> iteration
    sampling: dict[str, int]
    parts: int
    final: bool = False
    prefills: set[int] = field(default_factory=set)  # prefill numbers (a prefill pool's)
    got: list[tuple[Sequence[str], Sequence[int]]] = field(default_factory=list)
    tokens: dict[str, int] | None = None


@dataclass(frozen=True)
class StepItem:
    """Run ``count`` tokens of ``request_id`` starting at position ``start``."""

    request_id: str
    start: int
    count: int


@dataclass
class StepDriver:
    """Per-request token history and slots over a plan's ranks, one step at a time."""

    cluster: Ranks
    requests: dict[str, _Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        m = self.cluster.microbatches
        first = self.cluster.first_iteration  # after a warm-up
        self._next = dict.fromkeys(range(m), first)  # each microbatch's next iteration
        self._final: set[int] = set()  # microbatches that will never run again
        self._owner_of: list[str | None] = [None] * self.cluster.global_batch
        self._free: dict[int, list[str]] = {k: [] for k in range(m)}
        self._in_flight: deque[Step] = deque()
        self._done: deque[Step] = deque()  # complete, not yet taken by next_done
        self._forwarding: set[int] = set()  # microbatches whose last work forwards its tokens
        # whether tokens may stay on the ranks: over static decode steps, for a scheduler that
        # runs ahead (the vLLM executor sets it); otherwise each forward would be wasted
        self.carry = False
        self.carried_works = 0
        self._epochs = itertools.count(1)
        # a prefill pool: its replicas, prefill numbers, states to drop per microbatch, and the
        # state bytes and messages its ranks sent, in total and per request
        self.prefill_pool: int = self.cluster.placement.prefill_replicas
        self._prefills = itertools.count()
        self._discard: dict[int, list[tuple[int, int, int]]] = {k: [] for k in range(m)}
        self.transfer = {"bytes": 0, "messages": 0}
        self.transfer_bytes: dict[str, int] = {}

    @property
    def capacity(self) -> int:
        """Requests the plan holds at once: its global batch."""
        return self.cluster.global_batch

    def microbatch_of(self, request_id: str) -> int:
        return self._microbatch(self.requests[request_id].slot)

    def forwards(self, microbatch: int) -> bool:
        """Whether the microbatch's last work forwards its tokens (its next may be carried)."""
        return microbatch in self._forwarding

    def free_slots(self, microbatch: int) -> int:
        return sum(self._owner_of[s] is None for s in self._slots(microbatch))

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams = GREEDY,
        *,
        microbatch: int | None = None,
    ) -> None:
        """Give a new request a slot: the first free one of ``microbatch``, or (default) of the
        emptiest microbatch."""
        if request_id in self.requests:
            self.drop(request_id)
        if any(request_id in free for free in self._free.values()):
            # a free still to come could run after the new admission in the same iteration
            self.flush()
        if not prompt_token_ids:
            raise RequestStateError(f"request {request_id!r} has an empty prompt")
        best: int | None = None
        best_load = None
        chosen = range(self.cluster.microbatches) if microbatch is None else (microbatch,)
        for k in chosen:
            slots = self._slots(k)
            free = [s for s in slots if self._owner_of[s] is None]
            load = len(slots) - len(free)
            if free and (best_load is None or load < best_load):
                best, best_load = free[0], load
        if best is None:
            where = "of the plan" if microbatch is None else f"of microbatch {microbatch}"
            total = self.capacity if microbatch is None else len(self._slots(microbatch))
            raise RequestStateError(
                f"all {total} slots {where} are taken; the scheduler must not admit "
                "more requests than the plan's global batch"
            )
        self._owner_of[best] = request_id
        self.requests[request_id] = _Request(
            best, list(prompt_token_ids), params, epoch=next(self._epochs)
        )

    def drop(self, request_id: str) -> None:
        """Forget a finished or aborted request; its state is freed with the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._forget_prefill(req)
        self._owner_of[req.slot] = None
        if req.admitted:
            self._free[self._microbatch(req.slot)].append(request_id)

    def restart(self, request_id: str, token_ids: Sequence[int] | None = None) -> None:
        """A preempted request: its state is recomputed from scratch when it next runs. With
        ``token_ids`` (every token, as vLLM re-sends them on resuming) they replace its own and
        a token still in flight for it is dropped when it comes; without, that token is still
        appended (as vLLM appends it)."""
        req = self.requests[request_id]
        self._forget_prefill(req)
        req.computed = 0
        req.sampled_at = -1
        if token_ids is not None:
            req.token_ids = list(token_ids)
            req.epoch = next(self._epochs)

    def _forget_prefill(self, req: _Request) -> None:
        """A request leaves (or restarts) before its prefilled state was imported: the decode
        ranks receive that state with the microbatch's next work, and drop it."""
        if req.prefill is not None:
            self._discard[self._microbatch(req.slot)].append((req.slot, *req.prefill))
        req.prefill = req.token_due = None

    def flush(self) -> None:
        """Free the state of requests dropped since the last step now (an iteration of empty
        microbatches carries the frees, and takes tokens a last work forwarded), rather than
        with the next step. Waits for every step in flight."""
        if any(self._free.values()) or self._forwarding or any(self._discard.values()):
            self.step([])

    def _slots(self, k: int) -> range:
        return self.cluster.placement.microbatch_slots(k)

    def _microbatch(self, slot: int) -> int:
        return next(k for k in range(self.cluster.microbatches) if slot in self._slots(k))

    def step(self, items: Sequence[StepItem]) -> dict[str, int]:
        """One iteration over every microbatch; the sampled token of each request whose run
        reached the last token it knows (a prompt chunk that continues yields none), also
        appended to it."""
        return self.collect(self.submit(items))

    def submit(
        self,
        items: Sequence[StepItem],
        *,
        microbatches: Iterable[int] | None = None,
        final: bool = False,
    ) -> Step:
        """Submit the next iteration of ``microbatches`` (default: every one still running)
        without waiting for its tokens (collect them with :meth:`collect`); ``items`` are
        requests of those microbatches. ``final``: those microbatches never run again. An item
        may end one token past what its request knows when that token is in flight (see the
        module's notes)."""
        chosen = sorted(
            set(range(self.cluster.microbatches)) - self._final
            if microbatches is None
            else set(microbatches)
        )
        if ended := sorted(self._final.intersection(chosen)):
            raise RequestStateError(f"microbatch {ended[0]} went final; it runs no more")
        prompts: list[StepItem] = []
        if self.prefill_pool:
            items, prompts = self._prompts(items)
        per_k: dict[int, list[tuple[int, StepItem]]] = {k: [] for k in chosen}
        ahead: set[int] = set()  # microbatches with an item that runs an in-flight token
        for item in items:
            req = self.requests.get(item.request_id)
            if req is None:
                raise RequestStateError(f"request {item.request_id!r} was never added")
            end = item.start + item.count
            k = self._microbatch(req.slot)
            if k not in per_k:
                raise RequestStateError(
                    f"request {item.request_id!r} is in microbatch {k}, which this step skips"
                )
            if end > len(req.token_ids):
                if end > len(req.token_ids) + 1 or req.sampled_at < 0:
                    raise RequestStateError(
                        f"request {item.request_id!r}: asked to run up to token {end}, "
                        f"only {len(req.token_ids)} are known"
                    )
                ahead.add(k)
            per_k[k].append((req.slot, item))
        carry = ahead
        if any(not self._can_carry(k, per_k[k]) for k in ahead):
            self._wait_in_flight()  # their tokens become known
            carry = set()
        for item in items:
            req = self.requests[item.request_id]
            end = item.start + item.count
            if end > len(req.token_ids) and self._microbatch(req.slot) not in carry:
                raise RequestStateError(  # its token in flight never came (a restart)
                    f"request {item.request_id!r}: asked to run up to token {end}, "
                    f"only {len(req.token_ids)} are known"
                )
            if item.start < req.computed:  # behind what the ranks hold: recompute
                req.computed = 0
        sampling: dict[str, int] = {}
        prefills = self._prefill(prompts, sampling)
        works = [self._work(k, per_k[k], k in carry, final, sampling) for k in chosen]
        for work in works:  # every work built (checked) before any is submitted
            self.cluster.submit(work)
        iterations = {w.microbatch: w.iteration for w in works}
        for k in chosen:
            self._next[k] += 1
        if final:
            self._final.update(chosen)
        parts = sum(self.cluster.result_parts(k) for k in chosen)
        parts += len(prefills) * (self.cluster.prefill_parts if prefills else 0)
        step = Step(iterations, sampling, parts, final, prefills)
        self._in_flight.append(step)
        return step

    def _prompts(self, items: Sequence[StepItem]) -> tuple[list[StepItem], list[StepItem]]:
        """A prefill pool's split of ``items``: those the decode ranks run, and those that
        complete a prompt the ranks hold nothing of (the prefill pool runs them). A chunk short
        of its prompt's end runs nowhere yet; a request whose first token is still in flight
        waits for it."""
        decode, prompts = [], []
        for item in items:
            req = self.requests.get(item.request_id)
            if req is None:
                raise RequestStateError(f"request {item.request_id!r} was never added")
            if req.computed > 0 and item.start >= req.computed:
                decode.append(item)
            elif item.start + item.count >= len(req.token_ids):
                prompts.append(item)
        if any(self.requests[i.request_id].token_due is not None for i in decode):
            self._wait_in_flight()
        return decode, prompts

    def _prefill(self, items: Sequence[StepItem], sampling: dict[str, int]) -> set[int]:
        """Send ``items``' tokens (each its request's whole prompt) to the prefill replicas
        (round robin by prompt, each replica's share as one batch); their prefill numbers."""
        batches: dict[int, list[Prefill]] = {}
        for item in items:
            req = self.requests[item.request_id]
            seq = next(self._prefills)
            replica = seq % self.prefill_pool
            end = item.start + item.count
            batches.setdefault(replica, []).append(
                Prefill(seq, item.request_id, req.slot, tuple(req.token_ids[:end]), req.params)
            )
            req.computed, req.admitted, req.sampled_at = end, True, -1
            req.prefill, req.token_due = (replica, seq), seq
            sampling[item.request_id] = req.epoch
        for replica, prompts in batches.items():
            self.cluster.prefill(replica, prompts)
        return {p.seq for prompts in batches.values() for p in prompts}

    def _work(
        self,
        k: int,
        chosen: list[tuple[int, StepItem]],
        carried: bool,
        final: bool,
        sampling: dict[str, int],
    ) -> Work:
        """Microbatch ``k``'s work of its next iteration, for ``chosen`` (slot, item) pairs."""
        i = self._next[k]
        rids, slots, ctx, qlen, sample, tokens = [], [], [], [], [], []
        params: dict[str, SamplingParams] = {}
        imports: dict[str, tuple[int, int]] = {}
        for slot, item in sorted(chosen, key=lambda pair: pair[0]):
            req = self.requests[item.request_id]
            end = item.start + item.count
            lo = req.computed
            rids.append(item.request_id)
            slots.append(slot)
            ctx.append(lo)
            qlen.append(end - lo)
            tokens += req.token_ids[lo:end]
            last = end >= len(req.token_ids)
            sample.append(last)
            if last:
                sampling[item.request_id] = req.epoch
                req.sampled_at = i
            if lo == 0:
                params[item.request_id] = req.params
            if req.prefill is not None:  # admitted here with the prefill pool's state
                imports[item.request_id], req.prefill = req.prefill, None
                params[item.request_id] = req.params
            req.computed = end
            req.admitted = True
        forward = self.carry and one_new_token_each(qlen, ctx)
        work = Work(
            iteration=i,
            microbatch=k,
            request_ids=tuple(rids),
            slots=tuple(slots),
            context_lens=tuple(ctx),
            query_lens=tuple(qlen),
            sample=tuple(sample),
            token_ids=None if carried else tuple(tokens),
            free=tuple(self._free[k]),
            params=params,
            final=final,
            forward=forward,
            carried=carried,
            imports=imports,
            discard=tuple(self._discard[k]),
        )
        self._free[k] = []
        self._discard[k] = []
        self._forwarding.discard(k)
        if forward:
            self._forwarding.add(k)
        self.carried_works += carried
        return work

    def _can_carry(self, k: int, chosen: list[tuple[int, StepItem]]) -> bool:
        """Whether microbatch ``k``'s items can run as a carried work: each runs exactly its
        in-flight token, sampled by the microbatch's previous work, which forwarded it."""
        if not self.carry or k not in self._forwarding:
            return False
        previous = self._next[k] - 1
        for _, item in chosen:
            req = self.requests[item.request_id]
            if not (
                item.count == 1
                and item.start == req.computed == len(req.token_ids)
                and req.sampled_at == previous
            ):
                return False
        return True

    def _wait_in_flight(self) -> None:
        while self._in_flight:
            self.collect(self._in_flight[0])

    def collect(self, step: Step) -> dict[str, int]:
        """Wait for ``step``'s tokens (and any that come before them); each goes onto its
        request unless the request left or restarted since. Returns the step's tokens by
        request."""
        while step.tokens is None:
            self._absorb()
        with_step = [s for s in self._done if s is not step]
        self._done = deque(with_step)
        return step.tokens

    def next_done(self) -> Step:
        """The next step whose tokens are all in (in the order they completed), waiting for
        one if none is."""
        while not self._done:
            self._absorb()
        return self._done.popleft()

    def _absorb(self) -> None:
        """One result from the ranks, onto its step; a step whose results are all in gets its
        tokens (appended to their requests) and leaves the steps in flight."""
        msg = self.cluster.result()
        if isinstance(msg, Prefilled):
            done = next((s for s in self._in_flight if msg.seq in s.prefills), None)
            if done is None:
                raise RequestStateError(f"a result came for prefill {msg.seq}, not in flight")
            self.transfer["bytes"] += msg.state_bytes
            self.transfer["messages"] += msg.messages
            rid = msg.request_id
            self.transfer_bytes[rid] = self.transfer_bytes.get(rid, 0) + msg.state_bytes
            done.got.append(((rid,), (msg.token_id,)) if msg.token_id >= 0 else ((), ()))
        else:
            k, i = msg.microbatch, msg.iteration
            done = next((s for s in self._in_flight if s.iterations.get(k) == i), None)
            if done is None:
                raise RequestStateError(
                    f"a result came for microbatch {k} iteration {i}, which is not in flight"
                )
            done.got.append((msg.request_ids, msg.token_ids))
        if len(done.got) < done.parts:
            return
        done.tokens = {}
        for rids, tokens in done.got:
            for rid, token in zip(rids, tokens, strict=True):
                if rid not in done.sampling:
                    continue
                done.tokens[rid] = int(token)
                req = self.requests.get(rid)
                if req is not None and req.epoch == done.sampling[rid]:
                    req.token_ids.append(int(token))
                    if req.token_due in done.prefills:
                        req.token_due = None
        self._in_flight.remove(done)
        self._done.append(done)


def submit_warm_up(cluster: Ranks) -> tuple[str, ...]:
    """Iteration 0 of a warm-up: two prompt tokens for a warm-up request in every slot, so
    every rank's every action sees its inputs; waits for its results. Returns the requests
    (for the ranks to free)."""
    placement = cluster.placement
    everyone: list[str] = []
    for k in range(placement.microbatches):
        slots = tuple(placement.microbatch_slots(k))
        rids = tuple(f"opweave-warm-up-{s}" for s in slots)
        everyone += rids
        n = len(slots)
        cluster.submit(
            Work(
                iteration=0,
                microbatch=k,
                request_ids=rids,
                slots=slots,
                context_lens=(0,) * n,
                query_lens=(2,) * n,
                sample=(True,) * n,
                token_ids=(0,) * (2 * n),
            )
        )
    for _ in range(sum(cluster.result_parts(k) for k in range(placement.microbatches))):
        cluster.result()
    return tuple(everyone)
