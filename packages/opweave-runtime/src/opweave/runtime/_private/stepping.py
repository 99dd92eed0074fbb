"""The engine driver: a plan's ranks advanced one scheduler step at a time.

An external scheduler (vLLM's, through :mod:`opweave.runtime.vllm`) decides each step which
requests run how many tokens; :class:`StepDriver` turns that into one iteration of the plan:
requests keep a slot of the global batch for their lifetime (so the replicas that hold their
state never change), a step's requests are split by their slots' microbatches, every microbatch
gets its :class:`~.work.Work` (admissions, frees and prefill chunks included), the microbatches
pipeline through the stages, and the step returns the tokens sampled for the requests that
reached the end of what they know (and appends them to those requests). Nothing here imports
vLLM.

A scheduler that runs ahead (vLLM's asynchronous scheduling) submits a step (:meth:`submit`)
before the previous one's tokens are in, asking to run tokens the driver does not know yet:
each such request's last token is still being sampled. Over static decode steps the ranks keep
those tokens: every decode step's work forwards its sampled tokens to the first segment's
leaders, and a microbatch whose requests all run exactly their in-flight token, sampled in the
microbatch's previous work, gets a carried work (see :class:`~.work.Work`). Any other step that
needs unknown tokens first waits for the steps in flight (:meth:`collect`), as a synchronous
scheduler would.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import RequestStateError
from .batch import one_new_token_each
from .cluster import Cluster
from .work import GREEDY, SamplingParams, Work


@dataclass
class _Request:
    slot: int
    token_ids: list[int]  # prompt, then every sampled token
    params: SamplingParams
    computed: int = 0  # tokens the ranks hold state for
    admitted: bool = False  # the ranks have seen it (its first work carries its parameters)
    sampled_at: int = -1  # the last iteration whose work samples its next token
    epoch: int = 0  # renewed by a restart: tokens of steps submitted before it are stale


@dataclass
class Step:
    """A submitted step: its iteration, the requests it samples a token for (with their epoch
    at submission), and, once every result is in, the tokens."""

    iteration: int
    sampling: dict[str, int]
    parts: int
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
    """Per-request token history and slots over a :class:`Cluster`, one step at a time."""

    cluster: Cluster
    requests: dict[str, _Request] = field(default_factory=dict)
    iteration: int = 0

    def __post_init__(self) -> None:
        self.iteration = max(self.iteration, self.cluster.first_iteration)  # after a warm-up
        self._owner_of: list[str | None] = [None] * self.cluster.global_batch
        self._free: dict[int, list[str]] = {k: [] for k in range(self.cluster.microbatches)}
        self._in_flight: deque[Step] = deque()
        self._forwarding: set[int] = set()  # microbatches whose last work forwards its tokens
        # whether tokens may stay on the ranks: over static decode steps, for a scheduler that
        # runs ahead (the vLLM executor sets it); otherwise each forward would be wasted
        self.carry = False
        self.carried_works = 0
        self._epochs = itertools.count(1)

    @property
    def capacity(self) -> int:
        """Requests the plan holds at once: its global batch."""
        return self.cluster.global_batch

    def add(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams = GREEDY
    ) -> None:
        """Give a new request a slot: the emptiest microbatch's first free one."""
        if request_id in self.requests:
            self.drop(request_id)
        if any(request_id in free for free in self._free.values()):
            # a free still to come could run after the new admission in the same iteration
            self.flush()
        if not prompt_token_ids:
            raise RequestStateError(f"request {request_id!r} has an empty prompt")
        placement = self.cluster.placement
        best: int | None = None
        best_load = None
        for k in range(placement.microbatches):
            slots = placement.microbatch_slots(k)
            free = [s for s in slots if self._owner_of[s] is None]
            load = len(slots) - len(free)
            if free and (best_load is None or load < best_load):
                best, best_load = free[0], load
        if best is None:
            raise RequestStateError(
                f"all {self.capacity} slots of the plan are taken; the scheduler must not admit "
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
        self._owner_of[req.slot] = None
        if req.admitted:
            self._free[self._microbatch(req.slot)].append(request_id)

    def restart(self, request_id: str, token_ids: Sequence[int] | None = None) -> None:
        """A preempted request: its state is recomputed from scratch when it next runs. With
        ``token_ids`` (every token, as vLLM re-sends them on resuming) they replace its own and
        a token still in flight for it is dropped when it comes; without, that token is still
        appended (as vLLM appends it)."""
        req = self.requests[request_id]
        req.computed = 0
        req.sampled_at = -1
        if token_ids is not None:
            req.token_ids = list(token_ids)
            req.epoch = next(self._epochs)

    def flush(self) -> None:
        """Free the state of requests dropped since the last step now (an iteration of empty
        microbatches carries the frees, and takes tokens a last work forwarded), rather than
        with the next step. Waits for every step in flight."""
        if any(self._free.values()) or self._forwarding:
            self.step([])

    def _microbatch(self, slot: int) -> int:
        placement = self.cluster.placement
        return next(
            k for k in range(placement.microbatches) if slot in placement.microbatch_slots(k)
        )

    def step(self, items: Sequence[StepItem]) -> dict[str, int]:
        """One iteration over every microbatch; the sampled token of each request whose run
        reached the last token it knows (a prompt chunk that continues yields none), also
        appended to it."""
        return self.collect(self.submit(items))

    def submit(self, items: Sequence[StepItem]) -> Step:
        """Submit one iteration over every microbatch without waiting for its tokens (collect
        them with :meth:`collect`). An item may end one token past what its request knows when
        that token is in flight (see the module's notes)."""
        m = self.cluster.microbatches
        i = self.iteration
        per_k: dict[int, list[tuple[int, StepItem]]] = {k: [] for k in range(m)}
        ahead: set[int] = set()  # microbatches with an item that runs an in-flight token
        for item in items:
            req = self.requests.get(item.request_id)
            if req is None:
                raise RequestStateError(f"request {item.request_id!r} was never added")
            end = item.start + item.count
            k = self._microbatch(req.slot)
            if end > len(req.token_ids):
                if end > len(req.token_ids) + 1 or req.sampled_at < 0:
                    raise RequestStateError(
                        f"request {item.request_id!r}: asked to run up to token {end}, "
                        f"only {len(req.token_ids)} are known"
                    )
                ahead.add(k)
            per_k[k].append((req.slot, item))
        carry = ahead
        if any(not self._can_carry(k, per_k[k], i) for k in ahead):
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
        works = []
        for k in range(m):
            chosen = sorted(per_k[k], key=lambda pair: pair[0])
            carried = k in carry
            rids, slots, ctx, qlen, sample, tokens = [], [], [], [], [], []
            params: dict[str, SamplingParams] = {}
            for slot, item in chosen:
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
                forward=forward,
                carried=carried,
            )
            self._free[k] = []
            self._forwarding.discard(k)
            if forward:
                self._forwarding.add(k)
            self.carried_works += carried
            works.append(work)
        for work in works:  # every work built (checked) before any is submitted
            self.cluster.submit(work)
        self.iteration += 1
        step = Step(i, sampling, sum(self.cluster.result_parts(k) for k in range(m)))
        self._in_flight.append(step)
        return step

    def _can_carry(self, k: int, chosen: list[tuple[int, StepItem]], i: int) -> bool:
        """Whether microbatch ``k``'s items can run as a carried work: each runs exactly its
        in-flight token, sampled by the microbatch's previous work, which forwarded it."""
        if not self.carry or k not in self._forwarding:
            return False
        for _, item in chosen:
            req = self.requests[item.request_id]
            if not (
                item.count == 1
                and item.start == req.computed == len(req.token_ids)
                and req.sampled_at == i - 1
            ):
                return False
        return True

    def _wait_in_flight(self) -> None:
        while self._in_flight:
            self.collect(self._in_flight[0])

    def collect(self, step: Step) -> dict[str, int]:
        """Wait for ``step``'s tokens (and those of the steps before it); each goes onto its
        request unless the request left or restarted since. Returns the step's tokens by
        request."""
        while step.tokens is None:
            msg = self.cluster.result()
            done = next((s for s in self._in_flight if s.iteration == msg.iteration), None)
            if done is None:
                raise RequestStateError(
                    f"a result came for iteration {msg.iteration}, not in flight"
                )
            done.got.append((msg.request_ids, msg.token_ids))
            if len(done.got) < done.parts:
                continue
            done.tokens = {}
            for rids, tokens in done.got:
                for rid, token in zip(rids, tokens, strict=True):
                    if rid not in done.sampling:
                        continue
                    done.tokens[rid] = int(token)
                    req = self.requests.get(rid)
                    if req is not None and req.epoch == done.sampling[rid]:
                        req.token_ids.append(int(token))
            self._in_flight.remove(done)
        return step.tokens
