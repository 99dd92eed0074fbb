"""Offline generation: a small scheduler that feeds a list of requests to the driver.

:class:`OfflineDriver` plays the part vLLM's scheduler plays for the engine, over the same
:class:`~.stepping.StepDriver`: it keeps the waiting requests, their token histories and stop
rules, and steps each microbatch of the plan on its own: when the tokens of microbatch ``k``'s
step are in, it retires finished requests (the driver frees their state with the microbatch's
next work), admits waiting requests into the microbatch's free slots, and submits the
microbatch's next step at once. Microbatches thus pipeline through the stages across
iterations, and prefill (a new request's whole prompt) mixes with decode.

A microbatch whose slots are all empty while nobody waits is stepped once more as ``final`` and
then never again; the run ends when every microbatch went final.

Over static decode steps the scheduler runs one step ahead of the tokens, as vLLM's
asynchronous scheduling does: once a microbatch's decode step is submitted, its next step, if it
only continues the same requests, is submitted at once, naming the tokens still in flight; the
driver makes it a carried work, so the ranks never wait for the driver between decode steps. A
request that samples a stop token has one more step in flight, whose token is dropped. A slot
that frees up while requests wait stops the running ahead until the microbatch's last tokens are
in, so the new request is admitted with its prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from opweave.costmodel import ModelSpec, Plan

from ..errors import RequestStateError
from .cluster import Cluster
from .engine import Generation
from .nodes import Topology, run_node, run_torchrun_rank, torchrun_env
from .options import RunOptions
from .results import DriverStats, DriverTimeline, Output, PoolTransfer, RunResult
from .stepping import Ranks, Step, StepDriver, StepItem


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
    """Admission, token history and per-request timing for one run, fed to a
    :class:`~.stepping.StepDriver` one microbatch step at a time."""

    def __init__(
        self, cluster: Ranks, requests: Sequence[Request], default_stops: Iterable[int]
    ) -> None:
        check_requests(requests)
        stops = frozenset(default_stops)
        self.driver = StepDriver(cluster)
        self.driver.carry = cluster.static_decode  # tokens stay on the ranks, run ahead
        self.microbatches = cluster.microbatches
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
        self.running: dict[str, Generation] = {}
        self.token_times: dict[str, list[float]] = {g.request_id: [] for g in self.generations}
        self.started: float | None = None
        self.max_active = 0
        self.drive_s = 0.0  # bookkeeping between a microbatch's tokens and its next step
        self.timeline: dict[str, list[float]] = {"end_s": [], "drive_s": []}
        self.iterations = 0
        self.works_ahead = 0
        self._first = cluster.first_iteration  # after the cluster's warm-up, if it had one
        # per microbatch: its steps whose tokens are not in yet (two while ahead)
        self._pending: dict[int, deque[Step]] = {k: deque() for k in range(self.microbatches)}

    def run(self) -> None:
        """Generate until every request finished."""
        live = set(range(self.microbatches))
        self.started = time.perf_counter()
        for k in range(self.microbatches):
            self._advance(k)
        while live:
            step = self.driver.next_done()
            start = time.perf_counter()
            ((k, i),) = step.iterations.items()
            due = self._pending[k].popleft()
            if due is not step:
                raise RequestStateError(
                    f"microbatch {k}: tokens of iteration {i} came while "
                    f"{due.iterations[k]} was due"
                )
            self._collect(step)
            if step.final:
                live.discard(k)
            else:
                self._advance(k)
            self.iterations = max(self.iterations, i + 1 - self._first)
            self.drive_s += time.perf_counter() - start
            self.timeline["end_s"].append(time.perf_counter() - self.started)
            self.timeline["drive_s"].append(self.drive_s)

    def _advance(self, k: int) -> None:
        """Microbatch ``k``'s tokens are in up to its last step: submit its next step unless it
        went ahead already, then the one after it if it can go ahead."""
        pending = self._pending[k]
        if not pending:
            pending.append(self._submit(k))
        if len(pending) == 1 and (ahead := self._ahead(k, pending[0])) is not None:
            pending.append(ahead)
            self.works_ahead += 1

    def _submit(self, k: int) -> Step:
        """Admit waiting requests into ``k``'s free slots; step every request it holds."""
        driver = self.driver
        while self.waiting and driver.free_slots(k):
            gen = self.waiting.popleft()
            driver.add(gen.request_id, gen.prompt_token_ids, microbatch=k)
            self.running[gen.request_id] = gen
        self.max_active = max(self.max_active, len(driver.requests))
        items = []
        for rid, gen in self.running.items():
            if driver.microbatch_of(rid) != k:
                continue
            known = len(driver.requests[rid].token_ids)
            start = 0 if not gen.token_ids else known - 1  # the prompt, or the last token
            items.append(StepItem(rid, start, known - start))
        final = not items and not self.waiting
        return driver.submit(items, microbatches=(k,), final=final)

    def _ahead(self, k: int, previous: Step) -> Step | None:
        """The step after ``previous`` (whose tokens are not in yet) if it can go now: its
        requests each run the token ``previous`` samples for them, and no waiting request
        could take a slot. Requests ``previous`` yields their last token for are dropped (the
        step frees them)."""
        driver = self.driver
        if not driver.forwards(k) or not previous.sampling:
            return None
        go_on, last = [], []
        for rid in previous.sampling:
            gen = self.running.get(rid)
            if gen is None:  # it stopped: previous's token for it is dropped
                continue
            (go_on if len(gen.token_ids) + 1 < gen.max_new_tokens else last).append(rid)
        if self.waiting and len(go_on) < len(driver.cluster.placement.microbatch_slots(k)):
            return None
        for rid in last:  # their last token is previous's: freed now, collected then
            driver.drop(rid)
        items = [StepItem(rid, len(driver.requests[rid].token_ids), 1) for rid in go_on]
        return driver.submit(items, microbatches=(k,), final=not go_on and not self.waiting)

    def _collect(self, step: Step) -> None:
        now = time.perf_counter()
        assert step.tokens is not None
        for rid, token in step.tokens.items():
            gen = self.running.get(rid)
            if gen is None:  # a step it ran after its stop token
                continue
            gen.token_ids.append(token)
            self.token_times[rid].append(now)
            if token in gen.stop_token_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= gen.max_new_tokens:
                gen.finish_reason = "length"
            if gen.finish_reason is not None:
                del self.running[rid]
                self.driver.drop(rid)  # (a no-op where the step ahead dropped it already)

    def tpot_s(self) -> float | None:
        """Mean over requests of (last token time - first token time) / (tokens - 1)."""
        per_request = [
            (times[-1] - times[0]) / (len(times) - 1)
            for times in self.token_times.values()
            if len(times) > 1
        ]
        return sum(per_request) / len(per_request) if per_request else None

    def ttft_s(self) -> float | None:
        """Mean over requests of their first token's time since the start."""
        start = self.started or 0.0
        firsts = [times[0] - start for times in self.token_times.values() if times]
        return sum(firsts) / len(firsts) if firsts else None

    def transfer(self) -> PoolTransfer | None:
        """What the plan's prefill pool sent the decode ranks (None: the plan has none)."""
        if not self.driver.prefill_pool:
            return None
        sent = self.driver.transfer
        return PoolTransfer(
            prefills=len(self.driver.transfer_bytes), bytes=sent["bytes"], messages=sent["messages"]
        )

    def outputs(self) -> tuple[Output, ...]:
        start = self.started or 0.0
        pool = bool(self.driver.prefill_pool)
        out = []
        for g in self.generations:
            times = self.token_times[g.request_id]
            out.append(
                Output(
                    request_id=g.request_id,
                    prompt_token_ids=tuple(g.prompt_token_ids),
                    token_ids=tuple(g.token_ids),
                    finish_reason=g.finish_reason,
                    token_times_s=tuple(t - start for t in times),
                    ttft_s=times[0] - start if times else None,
                    tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
                    transfer_bytes=self.driver.transfer_bytes.get(g.request_id) if pool else None,
                )
            )
        return tuple(out)


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

    from .graph import check_runtime_support
    from .placement import check_plan, plan_model, total_ranks
    from .stop_tokens import stop_token_ids

    options = options or RunOptions()
    topology = topology or Topology()
    model: ModelSpec = plan_model(plan, model_dir)
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
        driver = OfflineDriver(cluster, requests, stop_token_ids(model.arch, model_dir))
        driver.run()
        wall_s = time.perf_counter() - (driver.started or time.perf_counter())
        stats = cluster.shutdown()
    finally:
        cluster.close()
    return RunResult(
        outputs=driver.outputs(),
        tpot_s=driver.tpot_s(),
        ttft_s=driver.ttft_s(),
        transfer=driver.transfer(),
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
