"""Offline generation: the driver that feeds a list of requests through a plan's ranks.

The driver keeps the token history and the plan's slots (the global batch; slot ``s`` of
microbatch ``k`` is held by whichever replica of each owner serves it). Per microbatch it takes
the tokens the last segment sampled, retires finished requests (their ids ride in the next
work's ``free`` list, so every rank holding their state drops it), admits waiting requests into
free slots, and submits the microbatch's next iteration at once: microbatches pipeline through
the stages across iterations, and prefill (a new request's whole prompt) mixes with decode.

A microbatch whose slots are all empty while nobody waits is submitted once more as ``final``
and then never again; the run ends when every microbatch went final.

Over static decode steps the driver runs one iteration ahead of the ranks: a decode step's work
asks them to forward the tokens they sample (``Work.forward``), and the microbatch's next work,
if it only continues the same requests, is submitted at once, *carried*: without token ids, the
first segment's ranks embed the tokens the last segment's leaders forwarded to them. The ranks
then never wait for the driver between decode steps. A request that samples a stop token has
one more step in flight; its token from that step is dropped, and it is freed in the next work.
A slot that frees up while requests wait stops the running ahead until the microbatch's last
result is in, so the new request is admitted with its prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from opweave.costmodel import ModelSpec, Plan

from ..errors import RequestStateError
from .batch import one_new_token_each
from .cluster import Cluster
from .engine import Generation
from .nodes import Topology, run_node, run_torchrun_rank, torchrun_env
from .options import RunOptions
from .results import DriverStats, DriverTimeline, Output, RunResult
from .work import Work


@dataclass(frozen=True)
class Request:
    """One generation request: prompt ids, a token budget, optional id and stop tokens."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    request_id: str | None = None
    stop_token_ids: tuple[int, ...] | None = None


def check_requests(requests: Sequence[Request], vocab_size: int | None = None) -> None:
    seen: set[str] = set()
    for i, req in enumerate(requests):
        if not req.prompt_token_ids:
            raise RequestStateError(f"request {i} has an empty prompt")
        if req.max_new_tokens < 1:
            raise RequestStateError(f"request {i}: max_new_tokens must be at least 1")
        if vocab_size is not None:
            bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise RequestStateError(
                    f"request {i}: token id {bad[0]} is outside the vocabulary "
                    f"(0..{vocab_size - 1})"
                )
        rid = req.request_id or f"req-{i}"
        if rid in seen:
            raise RequestStateError(f"request id {rid!r} is used twice")
        seen.add(rid)


class OfflineDriver:
    """Admission, token history and per-request timing for one run over a :class:`Cluster`."""

    def __init__(
        self, cluster: Cluster, requests: Sequence[Request], default_stops: Iterable[int]
    ) -> None:
        check_requests(requests)
        stops = frozenset(default_stops)
        self.cluster = cluster
        self.placement = cluster.placement
        self.generations = [
            Generation(
                r.request_id or f"req-{i}",
                list(r.prompt_token_ids),
                r.max_new_tokens,
                stops if r.stop_token_ids is None else frozenset(r.stop_token_ids),
            )
            for i, r in enumerate(requests)
        ]
        self.waiting: deque[Generation] = deque(self.generations)
        self.slots: list[Generation | None] = [None] * self.placement.global_batch
        self.token_times: dict[str, list[float]] = {g.request_id: [] for g in self.generations}
        self.started: float | None = None
        self.max_active = 0
        self.drive_s = 0.0  # bookkeeping between a microbatch's result and its next work
        self.timeline: dict[str, list[float]] = {"end_s": [], "drive_s": []}
        self.iterations = 0
        self.works_ahead = 0
        m = self.placement.microbatches
        # per microbatch: the works submitted whose results are not in yet (two while ahead),
        # and the requests that finished since its last work (the next one frees them)
        self._pending: dict[int, deque[Work]] = {k: deque() for k in range(m)}
        self._free: dict[int, list[str]] = {k: [] for k in range(m)}
        self._dropped: set[str] = set()  # finished requests with one more step in flight
        self._freed_ahead: set[str] = set()  # freed by a work submitted before their last token
        self.carry = cluster.static_decode  # tokens stay on the ranks between decode steps

    def run(self) -> None:
        """Generate until every request finished."""
        m = self.placement.microbatches
        parts = {k: self.cluster.result_parts(k) for k in range(m)}
        got: dict[tuple[int, int], list[tuple[Sequence[str], Sequence[int]]]] = {}
        live = set(range(m))
        self.started = time.perf_counter()
        first = self.cluster.first_iteration  # after the cluster's warm-up, if it had one
        for k in range(m):
            self._advance(k, first)
        while live:
            msg = self.cluster.result()
            k, i = msg.microbatch, msg.iteration
            # with the driver ahead, another replica's part of the next iteration may come first
            got.setdefault((i, k), []).append((msg.request_ids, msg.token_ids))
            if len(got[(i, k)]) < parts[k]:
                continue
            start = time.perf_counter()
            done = self._pending[k].popleft()
            if done.iteration != i:
                raise RequestStateError(
                    f"microbatch {k}: a result for iteration {i} came while {done.iteration} "
                    "was due"
                )
            for rids, tokens in got.pop((i, k)):
                self._collect(k, rids, tokens)
            if done.final:
                live.discard(k)
            else:
                self._advance(k, i + 1)
            self.iterations = max(self.iterations, i + 1 - first)
            self.drive_s += time.perf_counter() - start
            self.timeline["end_s"].append(time.perf_counter() - self.started)
            self.timeline["drive_s"].append(self.drive_s)

    def _advance(self, k: int, i: int) -> None:
        """Microbatch ``k``'s results are in up to iteration ``i - 1``: submit iteration ``i``
        unless it went ahead already, then the one after it if it can go ahead."""
        pending = self._pending[k]
        if not pending:
            pending.append(self._submit(k, i))
        if len(pending) == 1 and (ahead := self._carried(k, pending[0])) is not None:
            self.cluster.submit(ahead)
            pending.append(ahead)
            self.works_ahead += 1

    def _submit(self, k: int, i: int) -> Work:
        mb = self.placement.microbatch_slots(k)
        for slot in mb:
            if self.slots[slot] is None and self.waiting:
                self.slots[slot] = self.waiting.popleft()
        active = [(s, g) for s in mb if (g := self.slots[s]) is not None]
        self.max_active = max(self.max_active, sum(g is not None for g in self.slots))
        final = not active and not self.waiting
        feeds = [g.token_ids[-1:] if g.token_ids else g.prompt_token_ids for _, g in active]
        query_lens = tuple(len(f) for f in feeds)
        context_lens = tuple(g.context_len for _, g in active)
        work = Work(
            iteration=i,
            microbatch=k,
            request_ids=tuple(g.request_id for _, g in active),
            slots=tuple(s for s, _ in active),
            context_lens=context_lens,
            query_lens=query_lens,
            sample=(True,) * len(active),
            token_ids=tuple(t for f in feeds for t in f),
            free=self._take_free(k),
            final=final,
            forward=self.carry and one_new_token_each(query_lens, context_lens),
        )
        self.cluster.submit(work)
        return work

    def _carried(self, k: int, prev: Work) -> Work | None:
        """The work after ``prev`` (whose result is not in yet) if it can go now: ``prev``
        forwards its tokens and no waiting request could take a slot it leaves. Its requests are
        ``prev``'s that go on (not finished, and ``prev`` does not yield their last token)."""
        if not prev.forward:
            return None
        go_on, last = [], []
        for rid, slot, ctx in zip(prev.request_ids, prev.slots, prev.context_lens, strict=True):
            g = self.slots[slot]
            if g is None or g.request_id != rid:  # it stopped: prev's token for it is dropped
                continue
            if len(g.token_ids) + 1 < g.max_new_tokens:
                go_on.append((slot, rid, ctx + 1))
            else:
                last.append(rid)
        if self.waiting and len(go_on) < len(self.placement.microbatch_slots(k)):
            return None
        self._freed_ahead.update(last)  # freed here: their last token is prev's
        n = len(go_on)
        return Work(
            iteration=prev.iteration + 1,
            microbatch=k,
            request_ids=tuple(rid for _, rid, _ in go_on),
            slots=tuple(slot for slot, _, _ in go_on),
            context_lens=tuple(ctx for _, _, ctx in go_on),
            query_lens=(1,) * n,
            sample=(True,) * n,
            token_ids=None if n else (),
            free=self._take_free(k) + tuple(last),
            final=not n and not self.waiting,
            forward=bool(n),
            carried=bool(n),
        )

    def _take_free(self, k: int) -> tuple[str, ...]:
        free, self._free[k] = tuple(self._free[k]), []
        return free

    def _collect(self, k: int, rids: Sequence[str], tokens: Sequence[int]) -> None:
        now = time.perf_counter()
        by_id = {g.request_id: (s, g) for s, g in enumerate(self.slots) if g is not None}
        for rid, token in zip(rids, tokens, strict=True):
            if rid in self._dropped:  # a step it ran after its stop token
                self._dropped.discard(rid)
                continue
            if rid not in by_id:
                raise RequestStateError(f"a token came back for unknown request {rid!r}")
            slot, gen = by_id[rid]
            gen.token_ids.append(int(token))
            self.token_times[rid].append(now)
            if token in gen.stop_token_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= gen.max_new_tokens:
                gen.finish_reason = "length"
            if gen.finish_reason is not None:
                self.slots[slot] = None
                if rid in self._freed_ahead:
                    self._freed_ahead.discard(rid)
                else:
                    self._free[k].append(rid)
                if any(rid in w.request_ids for w in self._pending[k]):
                    self._dropped.add(rid)

    def tpot_s(self) -> float | None:
        """Mean over requests of (last token time - first token time) / (tokens - 1)."""
        per_request = [
            (times[-1] - times[0]) / (len(times) - 1)
            for times in self.token_times.values()
            if len(times) > 1
        ]
        return sum(per_request) / len(per_request) if per_request else None

    def outputs(self) -> tuple[Output, ...]:
        start = self.started or 0.0
        return tuple(
            Output(
                request_id=g.request_id,
                prompt_token_ids=tuple(g.prompt_token_ids),
                token_ids=tuple(g.token_ids),
                finish_reason=g.finish_reason,
                token_times_s=tuple(t - start for t in self.token_times[g.request_id]),
            )
            for g in self.generations
        )


def run_plan(
    plan: Plan,
    model_dir: str | Path,
    requests: Sequence[Request],
    options: RunOptions | None = None,
    *,
    ranks: int | None = None,
    topology: Topology | None = None,
    start_method: str = "auto",
) -> RunResult | None:
    """Run ``requests`` under ``plan``; the result on node 0, ``None`` on the other nodes.

    ``options`` configure the run (device, timeouts, kernels, decode step, ...: every rank
    gets them); ``topology`` says which node this is of how many (default: one node).

    The :class:`RunResult` holds the ``outputs`` (per request its prompt, generated token ids,
    finish reason and token arrival times), the measured ``tpot_s``, ``iterations``, ``wall_s``,
    the driver's own time, and per rank its :class:`RankStats`: stages, weight bytes read and
    resident, time in operators (``busy_s``), blocked in transfers (``comm_s``) and elsewhere in
    the loop (``overhead_s``).
    """
    from opweave.costmodel import load_model

    from .graph import check_runtime_support
    from .placement import check_plan, total_ranks

    options = options or RunOptions()
    topology = topology or Topology()
    model: ModelSpec = load_model(model_dir)
    check_runtime_support(model)
    world = total_ranks(plan)
    check_plan(plan, model, world if ranks is None else ranks)
    check_requests(requests, model.vocab_size)
    torchrun = torchrun_env()
    if torchrun is not None and torchrun["RANK"] != "0":
        run_torchrun_rank(plan, model, model_dir, options)
        return None
    if topology.node_rank > 0:
        run_node(plan, model, model_dir, options, topology)
        return None
    cluster = Cluster(
        plan,
        model,
        model_dir,
        options,
        topology=topology,
        start_method=start_method,
        torchrun=torchrun is not None,
    )
    try:
        driver = OfflineDriver(cluster, requests, model.arch.eos_token_ids)
        driver.run()
        wall_s = time.perf_counter() - (driver.started or time.perf_counter())
        stats = cluster.shutdown()
    finally:
        cluster.close()
    return RunResult(
        outputs=driver.outputs(),
        tpot_s=driver.tpot_s(),
        iterations=driver.iterations,
        wall_s=wall_s,
        max_active=driver.max_active,
        driver=DriverStats(
            drive_s=driver.drive_s,
            microbatches_per_iteration=plan.microbatches,
            start_method=cluster.start_method,
            timeline=DriverTimeline.model_validate(driver.timeline),
            works_ahead=driver.works_ahead,
        ),
        ranks=tuple(stats),
    )
