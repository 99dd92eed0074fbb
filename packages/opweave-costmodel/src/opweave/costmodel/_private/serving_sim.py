"""A discrete-event simulation of one engine's scheduler: continuous batching with chunked
prefill under a per-step token budget, as vLLM's V1 scheduler runs it (``vllm/v1/core/sched/
scheduler.py``, ``Scheduler.schedule``):

1. the running requests first, in arrival order: a decoding request gets one token, a request
   still prefilling the next chunk of its prompt, as much as the budget left allows;
2. then waiting requests, first come first served, while budget is left, fewer than
   ``max_num_seqs`` run, and the KV cache holds the tokens scheduled for them;
3. when the running requests' next tokens do not fit in the KV cache, the last one admitted is
   preempted: it frees its cache and goes back to the front of the queue, to recompute its
   prompt and the tokens it generated (V1's recompute preemption); no waiting request joins
   in a step that preempted (``if not preempted_reqs`` before the waiting loop).

[V1-PREFIX] With automatic prefix caching (vLLM V1's default: ``CacheConfig.
enable_prefix_caching = True``) a preempted request's blocks are freed but keep their hashes:
they stay in the free queue, evictable, and when the request is scheduled again
``KVCacheManager.get_computed_blocks`` finds its prompt and generated tokens there (all but
the last token), so it recomputes only what was evicted meanwhile. Its blocks were freed tail
first (``SingleTypeKVCacheManager.free``: reverse order, "so that tail blocks are evicted
first") and new blocks come from the free queue's head, least recently freed first; here the
running requests' growth erodes the kept tokens of the earliest-preempted waiting request,
from its tail. Readmitting it needs the cache to hold its kept tokens and its next chunk
(``allocate_slots`` counts evictable computed blocks as blocks to allocate). A prompt whose
next chunk does not fit therefore waits without losing the chunks it computed, and the steps
meanwhile decode only. vLLM hands out the least recently freed blocks first, so the blocks of
requests that finish after the preemption are taken after the kept ones; the simulation erodes
kept tokens only as far as the running requests need the room, which is optimistic where
requests finish and new ones are admitted before the preempted one returns. Without prefix
caching (SGLang's retraction is modelled so too) a preempted request recomputes from scratch.

[TRT-NOEVICT] TensorRT-LLM's capacity scheduler defaults to ``GUARANTEED_NO_EVICT``
(``tensorrt_llm.llmapi.SchedulerConfig.capacity_scheduler_policy``; the performance-tuning
guide, "Useful Runtime Options": "guarantee that a started request is never paused"): a request
starts only when the cache can hold its prompt and its whole answer (the request's
``max_tokens``; the simulated answer length here), so running requests never outgrow the cache
and none is preempted.

The step that finishes a prompt samples the request's first token (TTFT ends there); every
later step gives it one more token. A request's TPOT is ``(finish - first token) / (output - 1)``,
the definition of vLLM's and SGLang's benchmark clients. Deterministic for a given seed.

[SGL-RECV] SGLang's scheduler can take in new requests less often than every step
(``--scheduler-recv-interval N``; ``python/sglang/srt/managers/scheduler_recv_skipper.py``,
``SchedulerRecvSkipper``): each decode step adds 1 to a counter, a step with prompt chunks adds
1000, and the requests that arrived meanwhile are taken in once it reaches ``N``. A request that
arrives while the engine decodes waits for that point before its prefill can start; an idle
engine takes it in at once.

[SGL-SCHED] SGLang's scheduler (``python/sglang/srt/managers/scheduler.py``,
``get_next_batch_to_run``) builds a prefill batch from the waiting queue (a chunked prompt
first, up to ``--chunked-prefill-size`` tokens) and runs it if there is one ("run prefill
first"), a decode step of every running request otherwise; ``--enable-mixed-chunk`` (off by
default) adds the running decodes to the prefill batch instead.

Steps that only decode, with nothing to admit, repeat until the next completion or arrival: the
simulation takes them as one run, with their step times vectorised over the run
(:meth:`~.engine_step.EngineStepCost.decode_run_s`), so its cost grows with requests, not tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from .engine_step import EngineStepCost


@dataclass
class _Request:
    index: int
    prompt: int
    output: int
    arrival_s: float
    target: int = 0  # tokens to have in the cache before the next sample
    cached: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    kept: int = 0  # [V1-PREFIX]: tokens of its freed cache still reusable while it waits
    first_token_s: float = math.nan
    finish_s: float = math.nan

    def __post_init__(self) -> None:
        self.target = self.prompt

    @property
    def prefilling(self) -> bool:
        return self.cached < self.target

    @property
    def context(self) -> int:
        """Positions its next decode attends: the cache and the token it feeds."""
        return self.cached + 1


@dataclass(frozen=True)
class EngineSetup:
    """The engine's limits: per-step token budget, running requests, cache bytes per GPU;
    and its step policy: ``prefill_first`` runs a step of prompt chunks alone whenever prompts
    wait, decode steps only otherwise ([SGL-SCHED]); else decodes and prompt chunks share a
    step, decodes first (vLLM V1, this module's doc). New requests reach the queue every
    ``recv_interval`` decode steps, and after any step with prompt chunks ([SGL-RECV])."""

    max_num_batched_tokens: int
    max_num_seqs: int
    kv_capacity_bytes: float
    prefill_first: bool = False
    recv_interval: int = 1  # [SGL-RECV]: decode steps between taking in new requests
    prefix_caching: bool = False  # [V1-PREFIX]: a preempted request's cache stays reusable
    reserve_output: bool = False  # [TRT-NOEVICT]: admit only with room for the whole answer


@dataclass(frozen=True)
class SimResult:
    """Per-request times of one simulation (request order), and the engine's totals."""

    arrival_s: NDArray[np.float64]
    first_token_s: NDArray[np.float64]
    finish_s: NDArray[np.float64]
    output_tokens: NDArray[np.int64]
    times_s: NDArray[np.float64]  # event times ...
    tokens_out: NDArray[np.float64]  # ... and output tokens generated by then
    decode_batch_time_s: NDArray[np.float64]  # per event: decodes x seconds
    steps: int
    preemptions: int

    @property
    def ttft_s(self) -> NDArray[np.float64]:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> NDArray[np.float64]:
        """Per request with more than one output token."""
        keep = self.output_tokens > 1
        return (self.finish_s[keep] - self.first_token_s[keep]) / (self.output_tokens[keep] - 1)

    def throughput(self, start_s: float, end_s: float) -> tuple[float, float]:
        """Output tokens/s over ``[start_s, end_s]``, and the mean decode batch there."""
        tokens = np.interp([start_s, end_s], self.times_s, self.tokens_out)
        span = max(end_s - start_s, 1e-12)
        inside = (self.times_s > start_s) & (self.times_s <= end_s)
        return float(tokens[1] - tokens[0]) / span, float(
            self.decode_batch_time_s[inside].sum() / span
        )


@dataclass
class _Engine:
    cost: EngineStepCost
    setup: EngineSetup
    running: list[_Request] = field(default_factory=list)
    waiting: deque[_Request] = field(default_factory=deque)
    inbox: deque[_Request] = field(default_factory=deque)  # arrived, not yet taken in
    evictable: list[_Request] = field(default_factory=list)  # [V1-PREFIX], earliest first
    decodes_since_recv: int = 0
    preemptions: int = 0
    per_token: float = 0.0
    per_request: float = 0.0

    def __post_init__(self) -> None:
        # a request's cache is concave in its tokens (a window caps it): the line through
        # its sizes at 0 and 1 token bounds it from above
        self.per_request = float(self.cost.kv_bytes(0.0))
        self.per_token = float(self.cost.kv_bytes(1.0)) - self.per_request

    def kv_after(self, extra: dict[int, int]) -> float:
        """Cache bytes of the running requests once each has ``extra[index]`` more tokens."""
        # the bound of a cache that grows per token everywhere (no window) is exact without
        # sliding windows and decides most steps without building the array
        n = len(self.running)
        total = sum(r.cached for r in self.running) + sum(extra.values())
        bound = self.per_token * total + self.per_request * n
        if bound <= self.setup.kv_capacity_bytes:
            return bound
        held = [r.cached + extra.get(r.index, 0) for r in self.running]
        return float(self.cost.kv_bytes(np.array(held, dtype=np.float64)).sum())

    def receive(self, force: bool = False) -> None:
        """Take in the requests that arrived, at the engine's receive points ([SGL-RECV]): one
        every ``recv_interval`` decode steps, one after a step with prompt chunks (``force``),
        and at once on an idle engine. A decode run that passed a receive point before its
        last step left what arrived at its end for the next one."""
        interval = self.setup.recv_interval
        if force or not (self.running or self.waiting):
            self.decodes_since_recv = 0
        elif self.decodes_since_recv >= interval:
            self.decodes_since_recv %= interval
        else:
            return
        if self.decodes_since_recv == 0:
            self.waiting.extend(self.inbox)
            self.inbox.clear()

    def decodes_to_receive(self) -> int:
        """Decode steps before the next receive point (at least 1)."""
        return max(1, self.setup.recv_interval - self.decodes_since_recv)

    def schedule(self) -> tuple[list[_Request], list[tuple[_Request, int]]]:
        """The next step's decodes and prefill chunks (preempting where the cache is full)."""
        if self.setup.prefill_first:
            return self._prefill_first()
        setup = self.setup
        preempted = False
        while True:
            budget = setup.max_num_batched_tokens
            decodes: list[_Request] = []
            chunks: list[tuple[_Request, int]] = []
            extra: dict[int, int] = {}
            for r in self.running:
                if budget <= 0:
                    break
                if r.cached < r.target:
                    take = min(r.target - r.cached, budget)
                    chunks.append((r, take))
                else:
                    take = 1
                    decodes.append(r)
                extra[r.index] = take
                budget -= take
            if (
                setup.reserve_output
                or len(self.running) <= 1
                or self.kv_after(extra) <= setup.kv_capacity_bytes
            ):
                break
            self._preempt()
            preempted = True
        if not preempted:
            self._admit(chunks, self._held(extra), budget)
        return decodes, chunks

    def _held(self, extra: dict[int, int]) -> float:
        """Cache bytes the running requests hold for admission: once each has ``extra[index]``
        more tokens, or ([TRT-NOEVICT]) with their whole answers reserved."""
        if not self.setup.reserve_output:
            return self.kv_after(extra)
        ends = np.array([r.prompt + r.output for r in self.running], dtype=np.float64)
        return float(self.cost.kv_bytes(ends).sum()) if len(ends) else 0.0

    def _admit(self, chunks: list[tuple[_Request, int]], used: float, budget: int) -> None:
        """Waiting requests join, first come first served, with their first chunk, while
        ``budget`` tokens are left, fewer than ``max_num_seqs`` run and the cache (``used``
        bytes so far) holds what joining takes: the tokens it kept and the chunk
        ([V1-PREFIX]), or its prompt and whole answer ([TRT-NOEVICT])."""
        setup = self.setup
        while self.waiting and budget > 0 and len(self.running) < setup.max_num_seqs:
            r = self.waiting[0]
            start = min(r.kept, r.target - 1)  # [V1-PREFIX]: its cached tokens, reused
            take = min(r.target - start, budget)
            held = r.prompt + r.output if setup.reserve_output else start + take
            need = float(self.cost.kv_bytes(float(held)))
            if self.running and used + need > setup.kv_capacity_bytes:
                break
            self.waiting.popleft()
            if r.kept:
                self.evictable.remove(r)
                r.kept = 0
            r.cached = start
            self.running.append(r)
            chunks.append((r, take))
            used += need
            budget -= take

    def _prefill_first(self) -> tuple[list[_Request], list[tuple[_Request, int]]]:
        """[SGL-SCHED]: prompt chunks alone while any can run, else every running decode."""
        setup = self.setup
        budget = setup.max_num_batched_tokens
        chunks: list[tuple[_Request, int]] = []
        extra: dict[int, int] = {}
        for r in self.running:  # a prompt part-way through its chunks goes on first
            if r.prefilling and budget > 0:
                take = min(r.target - r.cached, budget)
                chunks.append((r, take))
                extra[r.index] = take
                budget -= take
        self._admit(chunks, self._held(extra), budget)
        if chunks:
            return [], chunks
        while len(self.running) > 1 and not setup.reserve_output:
            if self.kv_after({r.index: 1 for r in self.running}) <= setup.kv_capacity_bytes:
                break
            self._preempt()
        return list(self.running), []

    def _preempt(self) -> None:
        victim = self.running.pop()
        # recompute: its prompt and every token it generated, then sample the next
        victim.target = victim.prompt + victim.generated
        if self.setup.prefix_caching and victim.cached:
            victim.kept = victim.cached
            self.evictable.append(victim)
        victim.cached = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def evict(self) -> None:
        """[V1-PREFIX]: drop kept tokens, earliest-preempted request first and its tail first,
        until the running requests' cache and the kept tokens fit the capacity together."""
        if not self.evictable:
            return
        held = np.array([r.cached for r in self.running], dtype=np.float64)
        used = float(self.cost.kv_bytes(held).sum()) if len(held) else 0.0
        free = self.setup.kv_capacity_bytes - used
        kept = [float(self.cost.kv_bytes(float(r.kept))) for r in self.evictable]
        over = sum(kept) - free
        while over > 0 and self.evictable:
            r, size = self.evictable[0], kept.pop(0)
            if size <= over:
                r.kept = 0
                self.evictable.pop(0)
                over -= size
                continue
            # the most of its first tokens whose cache fits what is left (a window makes the
            # cache concave in the tokens)
            r.kept = _most(
                r.kept, lambda t, room=size - over: float(self.cost.kv_bytes(float(t))) <= room
            )
            if r.kept == 0:
                self.evictable.pop(0)
            over = 0.0


def simulate(
    cost: EngineStepCost,
    setup: EngineSetup,
    prompts: NDArray[np.int64],
    outputs: NDArray[np.int64],
    *,
    arrivals_s: NDArray[np.float64] | None = None,
    clients: int | None = None,
) -> SimResult:
    """Serve ``len(prompts)`` requests: open loop at ``arrivals_s`` (sorted), or a closed loop of
    ``clients`` that each send the next request when their last one finishes."""
    n = len(prompts)
    reqs = [_Request(i, int(prompts[i]), int(outputs[i]), math.inf) for i in range(n)]
    engine = _Engine(cost, setup)
    pending: deque[_Request] = deque(reqs)
    if clients is not None:
        for _ in range(min(clients, n)):
            r = pending.popleft()
            r.arrival_s = 0.0
            engine.waiting.append(r)
    else:
        assert arrivals_s is not None
        for r, a in zip(reqs, arrivals_s, strict=True):
            r.arrival_s = float(a)
    t, done, steps, tokens = 0.0, 0, 0, 0.0
    times, produced, batch_time = [0.0], [0.0], [0.0]

    def finish(r: _Request, at: float) -> None:
        nonlocal done
        r.finish_s = at
        engine.running.remove(r)
        done += 1
        if clients is not None and pending:
            nxt = pending.popleft()
            nxt.arrival_s = at
            engine.inbox.append(nxt)

    after_prompts = True  # [SGL-RECV]: a step with prompt chunks takes new requests in next
    while done < n:
        if clients is None:
            while pending and pending[0].arrival_s <= t:
                engine.inbox.append(pending.popleft())
        engine.receive(force=after_prompts)
        decodes, chunks = engine.schedule()
        if not decodes and not chunks:  # idle: receive() took the inbox in
            if clients is not None or not pending:
                raise RuntimeError("the engine cannot hold one request: a bug in the caller")
            t = pending[0].arrival_s
            continue
        if not chunks:
            # nothing to admit until a request finishes (or one arrives and is taken in):
            # decode-only steps until a completion, an arrival, a receive point or a full cache
            contexts = np.array([r.context for r in decodes], dtype=np.float64)
            k = min(r.output - r.generated for r in decodes)
            if engine.inbox:
                k = min(k, engine.decodes_to_receive())
            times_s = cost.decode_run_s(contexts, k)
            cum = np.cumsum(times_s)
            if clients is None and pending:
                k = min(k, int(np.searchsorted(cum, pending[0].arrival_s - t, side="left")) + 1)
            k = max(1, min(k, _steps_that_fit(engine, k)))
            dt = float(cum[k - 1])
            steps += k
            engine.decodes_since_recv += k
            after_prompts = False
            for r in decodes:
                r.generated += k
                r.cached += k
        else:
            contexts = np.array([r.context for r in decodes], dtype=np.float64)
            dt = cost.step_s(contexts, [(r.cached, c) for r, c in chunks])
            steps += 1
            k = 1
            after_prompts = True
            for r in decodes:
                r.generated += 1
                r.cached += 1
        t += dt
        new_tokens = k * len(decodes)
        for r, c in chunks:
            r.cached += c
            if not r.prefilling:
                r.generated += 1
                new_tokens += 1
                if math.isnan(r.first_token_s):
                    r.first_token_s = t
        tokens += new_tokens
        times.append(t)
        produced.append(tokens)
        batch_time.append(len(decodes) * dt)
        for r in [r for r in engine.running if r.generated >= r.output]:
            finish(r, t)
        engine.evict()
    return SimResult(
        arrival_s=np.array([r.arrival_s for r in reqs]),
        first_token_s=np.array([r.first_token_s for r in reqs]),
        finish_s=np.array([r.finish_s for r in reqs]),
        output_tokens=np.array([r.output for r in reqs], dtype=np.int64),
        times_s=np.array(times),
        tokens_out=np.array(produced),
        decode_batch_time_s=np.array(batch_time),
        steps=steps,
        preemptions=engine.preemptions,
    )


def _steps_that_fit(engine: _Engine, k: int) -> int:
    """Decode steps (at most ``k``) before the running requests outgrow the cache."""
    held = np.array([r.cached for r in engine.running], dtype=np.float64)
    cost, cap = engine.cost, engine.setup.kv_capacity_bytes
    if engine.per_token * (held.sum() + k * len(held)) + engine.per_request * len(held) <= cap:
        return k
    # the most tokens more each that the cache holds
    return _most(k, lambda j: float(cost.kv_bytes(held + j).sum()) <= cap)


def _most(high: int, fits: Callable[[int], bool]) -> int:
    """The largest ``j`` in ``[0, high]`` with ``fits(j)``, for ``fits`` true up to some point
    and false beyond it (``fits(0)`` taken as true): a bisection."""
    lo, hi = 0, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
