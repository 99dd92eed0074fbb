"""P/D deployments: a prefill pool beside a decode pool of one of the planner's decode plans
(colocated: ``pd``; ``afd``, ``cad``; the best: ``opweave``).

The decode pool is as many replica sets of the plan as the requests decoding at once fill
(Little's law: arrivals times the time each decodes); the prefill pool the cheapest engines
that take the arrivals within the TTFT SLO less the hand-off to the decode pool: the KV
transfer between the pools ([NIXL] in :mod:`opweave.costmodel`'s serving module) at the decode
steps' boundaries, and the step that samples the first token ([PD-FIRST] there). In a closed
loop the arrivals are the clients over each request's time, of which the TTFT is a part: the
pool is sized for the most arrivals (no TTFT), then again at its mean TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from opweave.costmodel import (
    ModelSpec,
    Plan,
    Workload,
    decode_handoff_s,
    decode_samples_first,
    decode_slot_steps,
    fits_inventory,
    kv_transfer_s,
)

from .deployment_result import Deployment, Pool
from .devices import Device
from .engines import EngineOption, PrefillSearch, PrefillSizing, Slos, room_for
from .result import PlanResult, gpus_used
from .space import U_GRID

if TYPE_CHECKING:
    from .deployment import Query

# P/D kinds and the decode plan of plan()'s result each takes (None: its best).
DECODE_PLANS: dict[str, str | None] = {
    "pd": "colocated",
    "afd": "afd",
    "cad": "cad",
    "opweave": None,
}
# A decode plan whose global batch is more than this many times the requests decoding at once
# is re-planned with smaller batches (its replica set would idle most of its slots).
UNDERFILLED = 2


def disaggregated_kinds(
    query: Query,
    decode: PlanResult,
    prefill: PrefillSearch,
    options: Sequence[EngineOption],
    devices: Mapping[str, Device],
    limits: Mapping[str, int],
    per_node: Mapping[str, int],
) -> tuple[dict[str, Deployment | None], dict[str, str]]:
    """The cheapest P/D deployment of each kind (its decode plan from ``decode``, or one of
    smaller batches where few requests decode at once), and why a kind has none."""
    workload = query.workload
    found: dict[str, Deployment | None] = {}
    reasons: dict[str, str] = {}
    small: PlanResult | None = None
    for kind, key in DECODE_PLANS.items():
        chosen = _decode_plan(decode, key)
        if chosen is None:
            found[kind] = None
            reasons[kind] = "decode pool: " + _decode_reason(decode, key)
            continue
        candidates = [chosen]
        if chosen.global_batch > UNDERFILLED * _decoding(chosen, workload, ttft_s=0.0):
            # few requests decode at once: smaller batches may leave fewer slots idle
            if small is None:
                small = query.decode_plans(u_grid=_small_grid(chosen, workload))
            other = _decode_plan(small, key)
            if other is not None:
                candidates.append(other)
        best: Deployment | None = None
        for decode_plan in candidates:
            dep, why = _disaggregated(
                query, kind, decode_plan, prefill, options, devices, limits, per_node
            )
            if dep is None:
                reasons.setdefault(kind, why)
            elif best is None or dep.usd_per_million_tokens < best.usd_per_million_tokens:
                best = dep
        found[kind] = best
        if best is not None:
            reasons.pop(kind, None)
    # OpWeave's decode space holds the colocated, AFD and CAD plans: at a partial load a
    # plan cheaper at full batch may need more replica sets, so its best is the least of all
    fixed = [d for k in ("pd", "afd", "cad") if (d := found[k]) is not None]
    cheapest = min(fixed, key=lambda d: d.usd_per_million_tokens, default=None)
    own = found["opweave"]
    if cheapest is not None and (
        own is None or cheapest.usd_per_million_tokens < own.usd_per_million_tokens
    ):
        found["opweave"] = replace(cheapest, kind="opweave")
        reasons.pop("opweave", None)
    return found, reasons


def _decode_plan(result: PlanResult, key: str | None) -> Plan | None:
    return result.best if key is None else result.baselines.get(key)


def _decode_reason(result: PlanResult, key: str | None) -> str:
    if key is None:
        return result.message()
    return result.reasons.get(key, result.message())


def _decoding(decode_plan: Plan, workload: Workload, ttft_s: float) -> float:
    """Requests decoding at once (Little's law): arrivals times the time each holds a slot."""
    pred = decode_plan.prediction
    assert pred is not None
    decode_s = _decode_s(workload, pred.tpot_s)
    return _holding(workload, _arrivals(workload, ttft_s, decode_s), pred.tpot_s)


def _holding(workload: Workload, rate: float, step_s: float) -> float:
    """Requests holding a decode slot at once (Little's law: arrivals times the time each holds
    one), at most a closed loop's clients."""
    held = rate * _held_s(workload, step_s)
    return held if workload.concurrency is None else min(held, workload.concurrency)


def _decode_s(workload: Workload, step_s: float) -> float:
    """A request's time after its first token: the rest of its answer, a step a token."""
    return max(1.0, workload.osl.mean - 1) * step_s


def _held_s(workload: Workload, step_s: float) -> float:
    """Time a request holds a decode slot ([PD-FIRST] in :mod:`opweave.costmodel`'s serving)."""
    return decode_slot_steps(workload.osl.mean, decode_samples_first(workload.engine)) * step_s


def _arrivals(workload: Workload, ttft_s: float, decode_s: float) -> float:
    """Requests per second the deployment takes: the rate, or (closed loop) the clients over
    the time each request takes."""
    if workload.rate_per_s is not None:
        return workload.rate_per_s
    assert workload.concurrency is not None
    return workload.concurrency / (ttft_s + decode_s)


def _small_grid(decode_plan: Plan, workload: Workload) -> list[int]:
    top = max(1.0, _decoding(decode_plan, workload, ttft_s=0.0))
    return [u for u in U_GRID if u <= top] or [U_GRID[0]]


def _link(
    option: EngineOption, decode_plan: Plan, devices: Mapping[str, Device], one_node: bool
) -> str:
    """``nvlink`` when the prefill and decode GPUs share one node (``one_node``) or one
    rack-scale NVLink domain (one type with a scale-up domain beyond a node, e.g. GB200
    NVL72), else the ``network``."""
    if one_node:
        return "nvlink"
    hw = option.device.hardware
    same = all(o.gpu == option.device.id for o in decode_plan.owners)
    return "nvlink" if same and hw.scale_up_gpus > hw.gpus_per_node else "network"


def _transfer_s(
    model: ModelSpec,
    option: EngineOption,
    decode_plan: Plan,
    devices: Mapping[str, Device],
    tokens: float,
    one_node: bool,
) -> float:
    """One request's KV transfer to the decode pool, at its slowest receiving GPU type."""
    link = _link(option, decode_plan, devices, one_node)
    return max(
        kv_transfer_s(
            model,
            tokens,
            tp=option.par.tp,
            link=link,  # type: ignore[arg-type]
            prefill=option.device.hardware,
            decode=devices[gpu].hardware,
        )
        for gpu in gpus_used(decode_plan)
    )


def _disaggregated(
    query: Query,
    kind: str,
    decode_plan: Plan,
    prefill: PrefillSearch,
    options: Sequence[EngineOption],
    devices: Mapping[str, Device],
    limits: Mapping[str, int],
    per_node: Mapping[str, int],
    one_node: bool = False,
) -> tuple[Deployment | None, str]:
    """The cheapest prefill pool beside ``decode_plan``'s decode pool, or why there is none.

    A deployment that lies on one node moves its KV cache over the node's NVLink, not the
    network: where the network-costed one does, it is sized again with that link
    (``one_node``) and taken if it still lies on one node."""
    workload, slos, model = query.workload, query.slos, query.model
    pred = decode_plan.prediction
    assert pred is not None
    prices = {d.id: d.usd_per_hour for d in devices.values()}
    # a request's time after its first token, and the time it holds a decode slot
    decode_s = _decode_s(workload, pred.tpot_s)
    transfers = {
        o: _transfer_s(model, o, decode_plan, devices, workload.isl.mean, one_node) for o in options
    }
    # what a request's TTFT holds beside the prefill pool's: the decode pool taking it in, its
    # KV transfer and the first token, at the decode steps' boundaries (their means)
    handoffs = {o: decode_handoff_s(transfers[o], pred.tpot_s, workload.engine) for o in options}

    def budget(option: EngineOption) -> float | None:
        return None if slos.ttft_s is None else slos.ttft_s - handoffs[option]

    def decode_sets(rate: float) -> int:
        """Replica sets of the decode plan the requests holding slots at ``rate`` fill."""
        return max(1, math.ceil(_holding(workload, rate, pred.tpot_s) / decode_plan.global_batch))

    def sized(rate: float) -> PrefillSizing | None:
        used = Pool.of_plan(decode_plan, decode_sets(rate), prices).gpus_by_type
        return prefill.cheapest(options, rate, budget, lambda o: room_for(limits, used, o))

    # closed loop: the arrivals are the clients over each request's time, which the TTFT is
    # part of: size for the most arrivals (no TTFT), then settle on the mean TTFT (the prefill
    # pool's and the hand-off; Little's law), once
    rate = _arrivals(workload, 0.0, decode_s)
    sizing = sized(rate)
    if sizing is not None and workload.concurrency is not None:
        rate = _arrivals(workload, sizing.estimate.ttft_s + handoffs[sizing.option], decode_s)
        sizing = sized(rate)
    if sizing is None:
        return None, _prefill_reason(prefill, options, handoffs, slos, bool(limits))
    transfer, handoff = transfers[sizing.option], handoffs[sizing.option]
    if workload.concurrency is not None:
        rate = _arrivals(workload, sizing.estimate.ttft_s + handoff, decode_s)
    sets = decode_sets(rate)
    est = sizing.estimate
    dep = Deployment(
        kind=kind,
        pools=(
            Pool.of_engine("prefill", sizing.option, sizing.replicas),
            Pool.of_plan(decode_plan, sets, prices),
        ),
        ttft_s=est.ttft_s + handoff,
        ttft_p90_s=est.ttft_p90_s + handoff,
        ttft_p99_s=est.ttft_p99_s + handoff,
        tpot_s=pred.tpot_s,
        tpot_p90_s=pred.tpot_s,
        tpot_p99_s=pred.tpot_s,
        tokens_per_s=rate * workload.osl.mean,
        requests_per_s=rate,
        kv_transfer_s=transfer,
        handoff_s=handoff,
    )
    if limits and not fits_inventory(dep.nodes(per_node), limits, per_node):
        return None, "its prefill and decode pools together do not fit the inventory"
    if not one_node and dep.on_one_node(per_node):
        near, _ = _disaggregated(
            query, kind, decode_plan, prefill, options, devices, limits, per_node, one_node=True
        )
        if near is not None and near.on_one_node(per_node):
            return near, ""
    return dep, ""


def _prefill_reason(
    prefill: PrefillSearch,
    options: Sequence[EngineOption],
    handoffs: Mapping[EngineOption, float],
    slos: Slos,
    bounded: bool,
) -> str:
    alone = [
        (engine.prefill_s + handoffs[o], o)
        for o in options
        if (engine := prefill.engine(o)) is not None
    ]
    if not alone:
        return "the model fits no prefill engine of these GPU types"
    quickest, option = min(alone, key=lambda t: t[0])
    if slos.ttft_s is not None and quickest > slos.ttft_s:
        return (
            f"a prompt alone reaches its first token in {quickest:.3g} s at best ({option}, "
            "its hand-off to the decode pool included: the KV transfer and the decode steps "
            f"that take it in and emit the first token), beyond the {slos.ttft_s * 1e3:g} ms "
            "TTFT SLO"
        )
    if slos.ttft_s is None:
        where = " in the GPUs the inventory leaves beside the decode pool" if bounded else ""
        return f"no prefill pool{where} takes the arrivals"
    where = " within the inventory" if bounded else ""
    return f"no prefill pool takes the arrivals{where} within the TTFT SLO"
