"""The engine driver: a plan's ranks advanced one scheduler step at a time.

An external scheduler (vLLM's, through :mod:`opweave.runtime.vllm`) decides each step which
requests run how many tokens; :class:`StepDriver` turns that into one iteration of the plan:
requests keep a slot of the global batch for their lifetime (so the replicas that hold their
state never change), a step's requests are split by their slots' microbatches, every microbatch
gets its :class:`~.work.Work` (admissions, frees and prefill chunks included), the microbatches
pipeline through the stages, and the step returns the tokens sampled for the requests that
reached the end of what they know. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import RequestStateError
from .cluster import Cluster
from .work import GREEDY, SamplingParams, Work


@dataclass
class _Request:
    slot: int
    token_ids: list[int]  # prompt, then every sampled token
    params: SamplingParams
    computed: int = 0  # tokens the ranks hold state for
    admitted: bool = False  # the ranks have seen it (its first work carries its parameters)


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
        self.requests[request_id] = _Request(best, list(prompt_token_ids), params)

    def drop(self, request_id: str) -> None:
        """Forget a finished or aborted request; its state is freed with the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._owner_of[req.slot] = None
        if req.admitted:
            self._free[self._microbatch(req.slot)].append(request_id)

    def restart(self, request_id: str, token_ids: Sequence[int] | None = None) -> None:
        """A preempted request: its state is recomputed from scratch when it next runs."""
        req = self.requests[request_id]
        req.computed = 0
        if token_ids is not None:
            req.token_ids = list(token_ids)

    def flush(self) -> None:
        """Free the state of requests dropped since the last step now (an iteration of empty
        microbatches carries the frees), rather than with the next step."""
        if any(self._free.values()):
            self.step([])

    def append_token(self, request_id: str, token: int) -> None:
        self.requests[request_id].token_ids.append(int(token))

    def _microbatch(self, slot: int) -> int:
        placement = self.cluster.placement
        return next(
            k for k in range(placement.microbatches) if slot in placement.microbatch_slots(k)
        )

    def step(self, items: Sequence[StepItem]) -> dict[str, int]:
        """One iteration over every microbatch; the sampled token of each request whose run
        reached the last token it knows (a prompt chunk that continues yields none)."""
        m = self.cluster.microbatches
        per_k: dict[int, list[tuple[int, StepItem]]] = {k: [] for k in range(m)}
        for item in items:
            req = self.requests.get(item.request_id)
            if req is None:
                raise RequestStateError(f"request {item.request_id!r} was never added")
            end = item.start + item.count
            if end > len(req.token_ids):
                raise RequestStateError(
                    f"request {item.request_id!r}: asked to run up to token {end}, "
                    f"only {len(req.token_ids)} are known"
                )
            if item.start < req.computed:  # behind what the ranks hold: recompute
                req.computed = 0
            per_k[self._microbatch(req.slot)].append((req.slot, item))
        i = self.iteration
        sampling: set[str] = set()
        for k in range(m):
            chosen = sorted(per_k[k], key=lambda pair: pair[0])
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
                last = end == len(req.token_ids)
                sample.append(last)
                if last:
                    sampling.add(item.request_id)
                if lo == 0:
                    params[item.request_id] = req.params
                req.computed = end
                req.admitted = True
            work = Work(
                iteration=i,
                microbatch=k,
                request_ids=tuple(rids),
                slots=tuple(slots),
                context_lens=tuple(ctx),
                query_lens=tuple(qlen),
                sample=tuple(sample),
                token_ids=tuple(tokens),
                free=tuple(self._free[k]),
                params=params,
            )
            self._free[k] = []
            self.cluster.submit(work)
        self.iteration += 1
        parts = sum(self.cluster.result_parts(k) for k in range(m))
        out: dict[str, int] = {}
        for _ in range(parts):
            msg = self.cluster.result()
            for rid, token in zip(msg["r"], msg["x"], strict=True):
                if rid in sampling:
                    out[rid] = int(token)
        return out
