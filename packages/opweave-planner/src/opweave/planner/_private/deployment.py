"""``plan_deployment()``: whole deployments for a workload, compared.

A deployment serves the whole workload (prompt and answer lengths, an arrival rate or a number
of concurrent clients) within a TPOT and optionally a TTFT SLO. Compared, each at its cheapest:

- *aggregated*: replicas of one engine that prefills and decodes (chunked prefill, vLLM's
  default); its TPOT includes the prefill chunks mixed into the decode steps;
- *pd*: a prefill pool and a decode pool of colocated decode plans (Dynamo's, llm-d's P/D);
- *afd*, *cad*, *opweave*: a prefill pool and a decode pool of the planner's AFD, CAD or best
  operator-disaggregated plan.

Decode pools are :func:`~.api.plan`'s plans at the workload's mean decode context, as many
replica sets as the requests decoding at once (Little's law) fill; prefill pools and aggregated
engines are sized by :mod:`.engines`. Each pool takes any GPU type of the fleet, within the
inventory when counts are given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from opweave.costmodel import (
    GROUP_GPUS,
    HardwareCatalog,
    Lengths,
    ModelSpec,
    Profile,
    ProfiledLatency,
    Workload,
    decode_samples_first,
    engine_host,
    fits_inventory,
)
from opweave.costmodel.errors import ConfigError, OpWeaveError

from .api import plan
from .deployment_result import KINDS, Deployment, DeploymentResult, Fleet, Pool
from .engines import (
    STATISTICS,
    AggregatedSearch,
    EngineOption,
    PrefillSearch,
    Slos,
    Statistic,
    engine_options,
    room_for,
)
from .pd import disaggregated_kinds
from .result import PlanResult
from .search import SearchProgress
from .space import U_GRID


@dataclass(frozen=True)
class Query:
    """Everything one deployment search is asked."""

    model: ModelSpec
    gpus: tuple[str, ...]
    workload: Workload
    slos: Slos
    catalog: HardwareCatalog | None
    profiles: tuple[Profile, ...]
    inventory: Mapping[str, int] | None
    max_owners: int
    max_group_gpus: int
    expert_skew: float

    def decode_plans(
        self,
        progress: Callable[[SearchProgress], None] | None = None,
        u_grid: Sequence[int] = U_GRID,
    ) -> PlanResult:
        """Decode plans at the workload's mean decode context."""
        return plan(
            self.model,
            self.gpus,
            context=max(1, round(self.workload.mean_decode_context)),
            tpot_slo_s=self.slos.tpot_s,
            catalog=self.catalog,
            profiles=self.profiles,
            inventory=self.inventory,
            max_owners=self.max_owners,
            max_group_gpus=self.max_group_gpus,
            expert_skew=self.expert_skew,
            progress=progress,
            u_grid=u_grid,
        )


def plan_deployment(
    model: ModelSpec,
    gpus: Sequence[str],
    *,
    workload: Workload,
    tpot_slo_s: float,
    ttft_slo_s: float | None = None,
    statistic: Statistic = "p90",
    catalog: HardwareCatalog | None = None,
    profiles: Sequence[Profile] = (),
    inventory: Mapping[str, int] | None = None,
    max_owners: int = 2,
    max_group_gpus: int = GROUP_GPUS[-1],
    expert_skew: float = 1.0,
    progress: Callable[[SearchProgress], None] | None = None,
    fleet: bool = True,
) -> DeploymentResult:
    """The cheapest whole deployment (USD per million output tokens) of ``model`` on ``gpus``
    serving ``workload`` within ``tpot_slo_s`` (and ``ttft_slo_s``), and the cheapest of each
    kind: aggregated, pd, afd, cad, opweave (see the module doc).

    ``statistic`` is what the SLOs bound of the simulated figures (``mean``, ``p90``, ``p99``
    over requests; a decode plan's TPOT is one steady-state figure). With ``inventory`` every
    deployment fits it, and (``fleet``) the result says how many copies the inventory holds
    and what the GPUs left over can run.
    """
    started = time.perf_counter()
    _check(model, workload, tpot_slo_s, ttft_slo_s, statistic)
    query = Query(
        model=model,
        gpus=tuple(gpus),
        workload=workload,
        slos=Slos(tpot_slo_s, ttft_slo_s, statistic),
        catalog=catalog,
        profiles=tuple(profiles),
        inventory=inventory,
        max_owners=max_owners,
        max_group_gpus=max_group_gpus,
        expert_skew=expert_skew,
    )
    decode = query.decode_plans(progress)
    devices = decode.devices
    by_id = {d.id: d for d in devices}
    per_node = {d.id: d.hardware.gpus_per_node for d in devices}
    limits = {g: n for g, n in decode.inventory.items() if n is not None}
    options = engine_options(model, devices, max_group_gpus)
    reasons: dict[str, str] = {}

    agg = AggregatedSearch(model, workload, query.slos)
    prefill = PrefillSearch(model, workload, query.slos)

    def report(phase: str, done: int, total: int, best: Deployment | None) -> None:
        # engine simulations: seconds each where many clients share an engine
        if progress is not None:
            usd = None if best is None else best.usd_per_million_tokens
            calls = agg.calls + prefill.calls
            progress(
                SearchProgress(phase, done, total, calls, calls, usd, time.perf_counter() - started)
            )

    found: dict[str, Deployment | None] = {
        "aggregated": _aggregated(agg, options, limits, per_node, report)
    }
    if found["aggregated"] is None:
        reasons["aggregated"] = _aggregated_reason(agg, options, query.slos)

    report("prefill pools and P/D deployments", 0, 1, found["aggregated"])
    pd_found, pd_reasons = disaggregated_kinds(
        query, decode, prefill, options, by_id, limits, per_node
    )
    found |= pd_found
    reasons |= pd_reasons

    feasible = [d for d in found.values() if d is not None]
    best = min(feasible, key=lambda d: d.usd_per_million_tokens, default=None)
    result = DeploymentResult(
        model=model.name,
        gpus=tuple(d.id for d in devices),
        workload=workload,
        slos=query.slos,
        best=best,
        baselines={k: found[k] for k in KINDS},
        reasons=reasons,
        decode=decode,
        inventory=dict(decode.inventory),
        assumptions=_assumptions(query, decode),
        simulations=agg.calls + prefill.calls,
    )
    usage = None
    if best is not None and limits:
        usage = _fleet(query, result, best, limits, per_node, second=fleet)
    return replace(result, fleet=usage, wall_s=time.perf_counter() - started)


def _check(
    model: ModelSpec,
    workload: Workload,
    tpot_slo_s: float,
    ttft_slo_s: float | None,
    statistic: str,
) -> None:
    if not (tpot_slo_s > 0 and math.isfinite(tpot_slo_s)):
        raise ConfigError(f"the TPOT SLO must be a positive number of seconds, got {tpot_slo_s}")
    if ttft_slo_s is not None and not (ttft_slo_s > 0 and math.isfinite(ttft_slo_s)):
        raise ConfigError(f"the TTFT SLO must be a positive number of seconds, got {ttft_slo_s}")
    if statistic not in STATISTICS:
        raise ConfigError(
            f"the SLO statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}"
        )
    if workload.num_requests is not None:
        raise ConfigError(
            "a deployment is planned for the steady state; give the workload no num_requests"
        )
    if workload.max_context_tokens > model.max_context_tokens:
        raise ConfigError(
            f"isl + osl reaches {workload.max_context_tokens} tokens, beyond {model.name}'s "
            f"context of {model.max_context_tokens}; shorten the prompts or the answers"
        )


# -- aggregated ----------------------------------------------------------------------------------
def _aggregated(
    search: AggregatedSearch,
    options: Sequence[EngineOption],
    limits: Mapping[str, int],
    per_node: Mapping[str, int],
    report: Callable[[str, int, int, Deployment | None], None],
) -> Deployment | None:
    """The cheapest aggregated deployment: options in order of their cost bound, each sized,
    until the bound is above the best found (``report``: its progress)."""
    bounds = {o: search.lower_bound_usd_per_mtok(o) for o in options}
    ranked = [o for o in sorted(options, key=lambda o: bounds[o]) if math.isfinite(bounds[o])]
    best: Deployment | None = None
    for i, option in enumerate(ranked):
        report("aggregated engines", i, len(ranked), best)
        if best is not None and bounds[option] >= best.usd_per_million_tokens:
            break
        most = room_for(limits, {}, option)
        if best is not None and search.workload.rate_per_s is not None:
            # at a given rate the tokens are fixed: more replicas than cost the best are moot
            most = min(most, math.ceil(best.usd_per_hour / option.usd_per_hour) - 1)
        sizing = search.size(option, most)
        if sizing is None:
            continue
        est = sizing.estimate
        pool = Pool.of_engine("aggregated", option, sizing.replicas)
        dep = Deployment(
            kind="aggregated",
            pools=(pool,),
            ttft_s=est.ttft_s,
            ttft_p90_s=est.ttft_p90_s,
            ttft_p99_s=est.ttft_p99_s,
            tpot_s=est.tpot_s,
            tpot_p90_s=est.tpot_p90_s,
            tpot_p99_s=est.tpot_p99_s,
            tokens_per_s=sizing.tokens_per_s,
            requests_per_s=sizing.tokens_per_s / search.workload.osl.mean,
        )
        if not fits_inventory(dep.nodes(per_node), limits, per_node):
            continue
        if best is None or dep.usd_per_million_tokens < best.usd_per_million_tokens:
            best = dep
    return best


def _aggregated_reason(
    search: AggregatedSearch, options: Sequence[EngineOption], slos: Slos
) -> str:
    if not options:
        return "no engine layout of the model splits over these GPU types"
    if all(not math.isfinite(search.lower_bound_usd_per_mtok(o)) for o in options):
        return (
            f"no engine holds one request's decode step within the {slos.tpot_s * 1e3:g} ms "
            "TPOT SLO (or its KV cache) on these GPU types"
        )
    return (
        "no number of replicas of any engine layout meets the SLOs: the prefill chunks mixed "
        "into the decode steps (or the queueing before them) exceed them"
        + (" within the inventory" if search.calls else "")
    )


# -- the fleet -----------------------------------------------------------------------------------
def _fleet(
    query: Query,
    result: DeploymentResult,
    best: Deployment,
    limits: Mapping[str, int],
    per_node: Mapping[str, int],
    *,
    second: bool,
) -> Fleet:
    """Copies of ``best`` the inventory holds, and (closed loop, ``second``) what the GPUs
    left over run: the best deployment of their own, or why they stay idle."""
    inventory: dict[str, int | None] = dict(result.inventory)
    copies = best.copies_in(inventory, per_node)
    used = best.gpus_by_type
    left = {g: n - copies * used.get(g, 0) for g, n in limits.items()}
    fleet = Fleet(
        deployments=copies,
        tokens_per_s=copies * best.tokens_per_s,
        usd_per_hour=copies * best.usd_per_hour,
        gpus_left=left,
    )
    rest = {g: n for g, n in left.items() if n > 0}
    if not rest:
        return fleet
    if query.workload.rate_per_s is not None or not second:
        return replace(
            fleet,
            idle_reason="the deployment is sized for the rate; these GPUs are its headroom"
            if query.workload.rate_per_s is not None
            else "too few for another deployment meeting the SLOs",
        )
    try:
        other = plan_deployment(
            query.model,
            list(rest),
            workload=query.workload,
            tpot_slo_s=query.slos.tpot_s,
            ttft_slo_s=query.slos.ttft_s,
            statistic=query.slos.statistic,
            catalog=query.catalog,
            profiles=query.profiles,
            inventory=rest,
            max_owners=query.max_owners,
            max_group_gpus=query.max_group_gpus,
            expert_skew=query.expert_skew,
            fleet=False,
        )
    except OpWeaveError as exc:
        return replace(fleet, idle_reason=str(exc))
    if other.best is None:
        return replace(fleet, idle_reason=other.message())
    copies2 = other.best.copies_in(dict(rest), per_node)
    used2 = other.best.gpus_by_type
    after = {g: n - copies2 * used2.get(g, 0) for g, n in rest.items()}
    other = replace(
        other,
        fleet=Fleet(
            deployments=copies2,
            tokens_per_s=copies2 * other.best.tokens_per_s,
            usd_per_hour=copies2 * other.best.usd_per_hour,
            gpus_left=after,
        ),
    )
    return replace(fleet, second=other, second_copies=copies2)


def _assumptions(query: Query, decode: PlanResult) -> tuple[str, ...]:
    w, s = query.workload, query.slos
    out = [
        f"arrivals: {w.arrival}"
        + (
            "; a P/D prefill pool takes the closed loop's requests as Poisson arrivals at its "
            "throughput"
            if w.concurrency is not None
            else ""
        ),
        f"lengths: isl {_lengths_text(w.isl)}, osl {_lengths_text(w.osl)}",
        f"SLOs bound the {s.statistic} over requests of the simulated engines' TTFT and TPOT; "
        "a decode plan's TPOT is its steady-state step, the same for every request",
        f"aggregated engines and prefill pools: {w.engine_name}'s scheduler simulated "
        f"({w.policy_text}; prompt chunks up to a token budget per step: "
        f"{_limits_text(w, decode)}), replicas sharing the arrivals evenly; their KV cache: "
        f"{w.cache_rule_text}, {w.preemption_text}",
        "decode pools: replica sets of a decode plan at the mean decode context "
        f"({max(1, round(w.mean_decode_context))} tokens), as many as the requests decoding at "
        "once fill (Little's law); each set's TPOT at its full batch",
        "KV cache moved from prefill to decode GPUs once per request, every prefill GPU "
        "sending its shard (NIXL), over NVLink where the whole deployment lies on one node "
        "or both pools share a rack-scale NVLink domain, else over the network; pools fill "
        f"each node before the next, as opweave deploy places them; {_handoff_text(w)}",
    ]
    out.extend(w.receive_note)
    profiled = [d.id for d in decode.devices if isinstance(d.latency, ProfiledLatency)]
    if profiled:
        out.append(
            f"profiles ({', '.join(profiled)}) hold decode steps only: decode pools take their "
            "latencies from them; aggregated engines and prefill pools on those devices are "
            "costed on the roofline of the profile's device"
        )
    if w.engine != "vllm":
        out.append(
            f"the pools are costed as {w.engine_name} runs them; opweave run serves a plan "
            "with vLLM's engine"
        )
    host = engine_host(w.engine)
    if host is not None and host.eager_launch_s > 0:
        which = "steps with prompt chunks"
        if w.eager_decode_text is not None:
            which += f" and {w.eager_decode_text}"
        out.append(
            f"{w.engine_name} runs {which} outside CUDA graphs: each takes at least the "
            f"forward's kernel launches x {host.eager_launch_s * 1e6:.0f} us of host time "
            f"(host profile {host.name})"
        )
    decode_notes = [a for a in decode.assumptions() if not a.startswith(("decode only", "every "))]
    return tuple(out + decode_notes)


def _limits_text(workload: Workload, decode: PlanResult) -> str:
    """``8192 tokens and 1024 requests on h100-sxm (vLLM's default), ...``."""
    given = workload.max_num_batched_tokens is not None or workload.max_num_seqs is not None
    parts = []
    for d in decode.devices:
        tokens, seqs = workload.batch_limits(d.hardware)
        parts.append(f"{tokens} tokens and {seqs} requests on {d.id}")
    text = ", ".join(parts) + (" (given)" if given else f" ({workload.engine_name}'s defaults)")
    if workload.engine == "sglang":
        text += ", the tokens divided among data-parallel attention ranks"
    return text


def _lengths_text(lengths: Lengths) -> str:
    if lengths.kind == "fixed":
        return f"{lengths.tokens} tokens"
    return f"uniform {lengths.low_tokens}-{lengths.high_tokens} tokens"


def _handoff_text(w: Workload) -> str:
    """How a P/D request reaches its first token at the decode pool ([PD-FIRST] in
    :mod:`opweave.costmodel`'s serving module)."""
    if decode_samples_first(w.engine):
        how = (
            f"{w.engine_name}'s decode pool takes a request in at its next step, reads its KV "
            "over whole steps (at least one) and samples its first token in the step after"
        )
    else:
        how = (
            f"{w.engine_name}'s decode pool receives the first token with the KV and sees the "
            "transfer done at its next step"
        )
    return how + " (the waits at their means, added to every TTFT percentile)"
