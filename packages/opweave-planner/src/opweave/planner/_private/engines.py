"""Sizing whole engines for a workload: how many replicas of an aggregated engine (prefill and
decode in one, chunked prefill) or of a prefill-only engine (P/D) a workload needs to meet its
SLOs, for one GPU type and parallelism.

The figures come from the cost model's engine simulation (:func:`opweave.costmodel.
estimate_serving`, :class:`opweave.costmodel.PrefillEngine`). A simulation costs milliseconds to
a second, so the search evaluates few: options are visited cheapest bound first and dropped
once their bound is above the best found, and the replica count of an option is found by
doubling and bisection, taking the SLO figures as monotone in the load per replica (less load
per replica never makes a TTFT or TPOT worse).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from opweave.costmodel import (
    EngineStepCost,
    ModelSpec,
    Parallelism,
    PrefillEngine,
    PrefillPoolEstimate,
    ServingEstimate,
    Workload,
    estimate_serving,
    parallelism_problem,
)
from opweave.costmodel.errors import ConfigError, InfeasibleError

from .devices import Device
from .space import candidate_parallelisms

Statistic = Literal["mean", "p90", "p99"]
STATISTICS: tuple[Statistic, ...] = ("mean", "p90", "p99")
# Most replicas of one engine a deployment is sized to; past it the workload is beyond any
# cluster the planner is meant for (and the search's doubling stops).
MAX_ENGINE_REPLICAS = 4096


@dataclass(frozen=True)
class Slos:
    """The deployment's SLOs and the statistic of the simulated figures they bound."""

    tpot_s: float
    ttft_s: float | None = None
    statistic: Statistic = "p90"

    def pick(self, mean: float, p90: float, p99: float) -> float:
        """The SLOs' statistic of a simulated figure."""
        return {"mean": mean, "p90": p90, "p99": p99}[self.statistic]


@dataclass(frozen=True)
class EngineOption:
    """One replica shape of an engine: a GPU type and its parallelism."""

    device: Device
    par: Parallelism

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineOption):
            return NotImplemented
        return (self.device.id, self.par) == (other.device.id, other.par)

    def __hash__(self) -> int:
        # a device's id names it within a search (its profile's tables are not hashable)
        return hash((self.device.id, self.par))

    @property
    def gpus(self) -> int:
        return self.par.gpus

    @property
    def usd_per_hour(self) -> float:
        return self.device.usd_per_hour * self.par.gpus

    def __str__(self) -> str:
        return f"{self.device.id} {self.par}"


@dataclass(frozen=True)
class AggregatedSizing:
    """Aggregated engines of one option serving the whole workload."""

    option: EngineOption
    replicas: int
    estimate: ServingEstimate  # of one replica, at its share of the workload
    tokens_per_s: float  # all replicas

    @property
    def usd_per_hour(self) -> float:
        return self.option.usd_per_hour * self.replicas


@dataclass(frozen=True)
class PrefillSizing:
    """A prefill pool of one option taking ``rate_per_s`` prompts per second in all."""

    option: EngineOption
    replicas: int
    estimate: PrefillPoolEstimate  # of one replica at its share of the rate

    @property
    def usd_per_hour(self) -> float:
        return self.option.usd_per_hour * self.replicas


def engine_options(
    model: ModelSpec, devices: Sequence[Device], max_group_gpus: int
) -> list[EngineOption]:
    """Every replica shape an engine of ``model`` may take on ``devices``: the planner's owner
    parallelisms (TP within a scale-up domain; for MoE models, EP with DP attention) under which
    the whole model splits."""
    out = []
    for device in devices:
        for par in candidate_parallelisms(device, model.operators, max_group_gpus):
            if parallelism_problem(model, par, device.hardware) is None:
                out.append(EngineOption(device, par))
    return out


def room_for(limits: Mapping[str, int], used: Mapping[str, int], option: EngineOption) -> int:
    """Replicas of ``option`` the inventory has GPUs for beside ``used``."""
    gpu = option.device.id
    if gpu not in limits:
        return 1 << 30
    return max(0, limits[gpu] - used.get(gpu, 0)) // option.gpus


def _decode_ceiling(
    model: ModelSpec, option: EngineOption, workload: Workload, tpot_slo_s: float
) -> float:
    """Output tokens/s one replica cannot exceed while its decode steps stay within the TPOT
    SLO. Each request costs the engine its prompt's prefill, at least the compute-bound
    marginal time of ``isl`` tokens in a full step (the slope of the GEMM time past the token
    budget: the weights' read is shared with the step), plus its share of ``osl - 1`` decode
    steps at the batch ``b`` that makes ``step(b) / b`` least, over batches the engine runs
    (``max_num_seqs``), the KV cache holds at the mean decode context, and whose decode-only
    step is within the SLO. 0 when not even one request's step is."""
    hw = option.device.hardware
    cost = EngineStepCost.build(model, hw, option.par)
    tokens, seqs = workload.batch_limits(hw, option.par.dp)
    context = workload.mean_decode_context
    per_request = float(cost.kv_bytes(context))
    try:
        budget = workload.cache_budget(hw, option.par.gpus, option.par.dp)
    except InfeasibleError:  # the engine's default memory split leaves it nothing
        return 0.0
    capacity = cost.kv_capacity_bytes(tokens, seqs, budget)
    held = capacity / per_request if per_request > 0 else math.inf
    dp = option.par.dp
    top = int(min(seqs, max(held, 0.0))) * dp
    if top < 1:
        return 0.0
    batches = np.unique(np.geomspace(1, top, num=min(top, 48)).astype(int))
    steps = np.array(
        [cost.decode_run_s(np.full(max(1, math.ceil(b / dp)), context), 1)[0] for b in batches]
    )
    ok = steps <= tpot_slo_s
    if not ok.any():
        return 0.0
    decode_per_token = float(np.min(steps[ok] / batches[ok]))
    prefill_per_token = (cost.tokens_s(2 * tokens, 1) - cost.tokens_s(tokens, 1)) / tokens / dp
    per_request = workload.isl.mean * prefill_per_token + (
        max(1.0, workload.osl.mean - 1) * decode_per_token
    )
    return workload.osl.mean / per_request


def _smallest(feasible: Callable[[int], bool], low: int, high: int) -> int | None:
    """Smallest ``n`` in ``[low, high]`` with ``feasible(n)``, taking feasibility as monotone:
    doubling from ``low``, then bisection."""
    if low > high:
        return None
    n = low
    last_bad = low - 1
    while not feasible(n):
        last_bad = n
        if n >= high:
            return None
        n = min(high, 2 * n)
    while n - last_bad > 1:
        mid = (n + last_bad) // 2
        if feasible(mid):
            n = mid
        else:
            last_bad = mid
    return n


class AggregatedSearch:
    """The cheapest aggregated deployment of a workload over engine options."""

    def __init__(
        self,
        model: ModelSpec,
        workload: Workload,
        slos: Slos,
    ) -> None:
        self.model = model
        self.workload = workload
        self.slos = slos
        self.calls = 0
        self._ceilings: dict[EngineOption, float] = {}

    def ceiling(self, option: EngineOption) -> float:
        if option not in self._ceilings:
            self._ceilings[option] = _decode_ceiling(
                self.model, option, self.workload, self.slos.tpot_s
            )
        return self._ceilings[option]

    def _estimate(self, option: EngineOption, replicas: int) -> ServingEstimate | None:
        self.calls += 1
        par = option.par
        try:
            return estimate_serving(
                self.model,
                option.device.hardware,
                tp=par.tp,
                ep=par.ep,
                dp=par.dp,
                workload=self.workload.per_replica(replicas),
            )
        except (InfeasibleError, ConfigError):
            return None

    def meets(self, est: ServingEstimate | None) -> bool:
        if est is None or est.saturated:
            return False
        s = self.slos
        tpot = s.pick(est.tpot_s, est.tpot_p90_s, est.tpot_p99_s)
        if tpot > s.tpot_s:
            return False
        return s.ttft_s is None or s.pick(est.ttft_s, est.ttft_p90_s, est.ttft_p99_s) <= s.ttft_s

    def _tokens_per_s(self, est: ServingEstimate, replicas: int) -> float:
        w = self.workload
        if w.rate_per_s is not None:
            return w.rate_per_s * w.osl.mean  # not saturated: it serves what arrives
        assert w.concurrency is not None
        share = w.per_replica(replicas).concurrency
        assert share is not None
        return est.tokens_per_s * w.concurrency / share

    def size(self, option: EngineOption, most: int) -> AggregatedSizing | None:
        """Fewest replicas of ``option`` (at most ``most``) that meet the SLOs, or ``None``."""
        w = self.workload
        ceiling = self.ceiling(option)
        if ceiling <= 0:
            return None
        low = 1
        if w.rate_per_s is not None:
            low = max(1, math.ceil(w.rate_per_s * w.osl.mean / ceiling))
        elif w.concurrency is not None:
            low = 1
        high = min(most, MAX_ENGINE_REPLICAS)
        if w.concurrency is not None:
            high = min(high, w.concurrency)
        seen: dict[int, ServingEstimate | None] = {}

        def feasible(n: int) -> bool:
            if n not in seen:
                seen[n] = self._estimate(option, n)
            return self.meets(seen[n])

        n = _smallest(feasible, low, high)
        if n is None:
            return None
        est = seen[n]
        assert est is not None
        return AggregatedSizing(option, n, est, self._tokens_per_s(est, n))

    def lower_bound_usd_per_mtok(self, option: EngineOption) -> float:
        """No deployment of ``option`` costs less per million output tokens than its replicas
        running at their decode ceiling."""
        ceiling = self.ceiling(option)
        if ceiling <= 0:
            return math.inf
        return option.usd_per_hour / 3600 / ceiling * 1e6


class PrefillSearch:
    """Prefill pools (P/D) sized for an arrival rate and a TTFT budget."""

    def __init__(self, model: ModelSpec, workload: Workload, slos: Slos) -> None:
        self.model = model
        self.workload = workload
        self.slos = slos
        self.calls = 0
        self._engines: dict[EngineOption, PrefillEngine | None] = {}
        self._memo: dict[tuple[EngineOption, float | None], PrefillPoolEstimate] = {}
        self._bounds: dict[EngineOption, float] = {}

    def engine(self, option: EngineOption) -> PrefillEngine | None:
        """``option``'s prefill engine (a prompt alone, its capacity), ``None`` where the model
        does not fit it."""
        if option not in self._engines:
            self.calls += 2
            par = option.par
            try:
                self._engines[option] = PrefillEngine(
                    self.model,
                    option.device.hardware,
                    tp=par.tp,
                    ep=par.ep,
                    dp=par.dp,
                    workload=self.workload,
                )
            except (InfeasibleError, ConfigError):
                self._engines[option] = None
        return self._engines[option]

    def estimate(self, option: EngineOption, rate_per_s: float) -> PrefillPoolEstimate | None:
        engine = self.engine(option)
        if engine is None:
            return None
        key = (option, float(f"{rate_per_s:.4g}"))
        if key not in self._memo:
            self.calls += 1
            self._memo[key] = engine.at(key[1])
        return self._memo[key]

    def size(
        self, option: EngineOption, rate_per_s: float, ttft_budget_s: float | None, most: int
    ) -> PrefillSizing | None:
        """Fewest replicas of ``option`` (at most ``most``) taking ``rate_per_s`` prompts/s
        without saturating, each prompt's TTFT (the SLOs' statistic) within ``ttft_budget_s``."""
        engine = self.engine(option)
        if engine is None or (ttft_budget_s is not None and engine.prefill_s > ttft_budget_s):
            return None
        low = max(1, math.ceil(rate_per_s / engine.capacity_requests_per_s))
        high = min(most, MAX_ENGINE_REPLICAS)

        def feasible(n: int) -> bool:
            est = self.estimate(option, rate_per_s / n)
            if est is None or est.saturated:
                return False
            ttft = self.slos.pick(est.ttft_s, est.ttft_p90_s, est.ttft_p99_s)
            return ttft_budget_s is None or ttft <= ttft_budget_s

        n = _smallest(feasible, low, high)
        if n is None:
            return None
        est = self.estimate(option, rate_per_s / n)
        assert est is not None
        return PrefillSizing(option, n, est)

    def capacity_bound(self, option: EngineOption) -> float:
        """Prompts/s one replica cannot exceed, without simulating: each DP rank's steps of a
        full token budget take at least their GEMMs' time."""
        if option not in self._bounds:
            hw = option.device.hardware
            cost = EngineStepCost.build(self.model, hw, option.par)
            budget, _ = self.workload.batch_limits(hw, option.par.dp)
            step = cost.tokens_s(budget, 1)
            self._bounds[option] = (
                option.par.dp * budget / self.workload.isl.mean / step if step > 0 else math.inf
            )
        return self._bounds[option]

    def cheapest(
        self,
        options: Sequence[EngineOption],
        rate_per_s: float,
        budget: Callable[[EngineOption], float | None],
        most: Callable[[EngineOption], int],
    ) -> PrefillSizing | None:
        """The cheapest prefill pool over ``options`` taking ``rate_per_s`` within each
        option's TTFT ``budget`` and replica bound ``most``: options in order of the cost their
        capacity bound allows, until that bound is above the best found."""

        def floor(o: EngineOption) -> float:
            return o.usd_per_hour * max(1, math.ceil(rate_per_s / self.capacity_bound(o)))

        best: PrefillSizing | None = None
        for option in sorted(options, key=floor):
            if best is not None and floor(option) >= best.usd_per_hour:
                break
            sizing = self.size(option, rate_per_s, budget(option), most(option))
            if sizing is not None and (best is None or sizing.usd_per_hour < best.usd_per_hour):
                best = sizing
        return best
