"""``plan()``: search the plan space for the cheapest plan meeting a TPOT SLO, and baselines.

Phases (all in the same machinery, each exact over its part of the space):

1. baselines colocated, AFD, CAD: their canonical template, best TP, batch and microbatches,
   any GPU type per owner (homogeneous and, with two types, heterogeneous);
2. OpWeave homogeneous: every structured template on one GPU type, seeded with the best
   homogeneous baseline (a plan of the same space, so the seed is safe);
3. OpWeave heterogeneous (two GPU types): owners of different types, seeded with everything
   found so far, so its result is the optimum of the whole space.

When a phase finds nothing that meets the SLO, a second search of the same kind minimises TPOT
instead to name the tightest plan.

An ``inventory`` bounds the GPUs of some types: every phase keeps only plans whose replica set,
laid out on nodes (:func:`opweave.costmodel.node_layout`), fits it. When none does, a search
for the fewest GPUs that meet the SLO without the bound says what the smallest plan needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from opweave.costmodel import (
    GROUP_GPUS,
    MAX_MICROBATCHES,
    HardwareCatalog,
    ModelSpec,
    Plan,
    Profile,
)
from opweave.costmodel.errors import ConfigError

from .devices import Device, resolve_devices
from .evaluate import OwnerChoice, make_plan
from .owners import Job
from .result import BASELINES, PlanResult, describe_plan
from .search import (
    Leaf,
    Searcher,
    SearchProgress,
    SearchStats,
    assignments,
    lexmin,
    make_jobs,
)
from .space import MICROBATCHES, U_GRID, candidate_templates
from .structure import OpTables, Structure, build_structure


def _leaf_plan(
    model: ModelSpec, tables: OpTables, devices: Sequence[Device], leaf: Leaf, slo: float
) -> Plan:
    m = leaf.job.microbatches
    owners = [
        OwnerChoice(devices[d], tp, u * m, ep=ep, dp=dp)
        for d, (tp, ep, dp, u) in zip(leaf.job.assign, leaf.configs, strict=True)
    ]
    return make_plan(model, leaf.job.st, tables, owners, m, tpot_slo_s=slo)


def plan(
    model: ModelSpec,
    gpus: Sequence[str],
    *,
    context: int,
    tpot_slo_s: float,
    catalog: HardwareCatalog | None = None,
    profiles: Sequence[Profile] = (),
    frontier_pruning: bool = True,
    branch_and_bound: bool = True,
    progress: Callable[[SearchProgress], None] | None = None,
    max_owners: int = 2,
    microbatches: Sequence[int] = MICROBATCHES,
    u_grid: Sequence[int] = U_GRID,
    inventory: Mapping[str, int] | None = None,
    max_group_gpus: int = GROUP_GPUS[-1],
    expert_skew: float = 1.0,
) -> PlanResult:
    """Cheapest plan (USD per token) whose steady-state TPOT meets ``tpot_slo_s``.

    ``gpus`` are GPU ids or aliases of ``catalog`` (default: the built-in one) or device ids of
    ``profiles``; at most two types are combined in one plan. ``progress`` is called after each
    sub-search. ``frontier_pruning`` / ``branch_and_bound`` switch off the two reductions (for
    ablations: the optimum is the same). ``max_owners``, ``microbatches`` and ``u_grid``
    (per-replica microbatch sizes; the resident batch is ``microbatches * u``) shape the space.
    ``inventory`` maps some of ``gpus`` to the number of GPUs of that type available (the
    others are unbounded): every plan returned, best and baselines, fits it on whole nodes.
    ``max_group_gpus`` bounds the GPUs of one replica (``tp x dp``) searched for owners that
    run routed experts; ``expert_skew`` is the router's measured busiest-over-mean expert load
    (default 1.0: balanced, an assumption the result states).
    """
    started = time.perf_counter()
    if context < 1:
        raise ConfigError(f"context must be at least 1 token, got {context}")
    if context > model.max_context_tokens:
        raise ConfigError(
            f"context {context} exceeds {model.name}'s maximum of "
            f"{model.max_context_tokens} tokens; use a shorter --context"
        )
    if not (tpot_slo_s > 0 and math.isfinite(tpot_slo_s)):
        raise ConfigError(f"the TPOT SLO must be a positive number of seconds, got {tpot_slo_s}")
    if not microbatches or any(int(m) != m or not 1 <= m <= MAX_MICROBATCHES for m in microbatches):
        raise ConfigError(
            f"microbatch counts must be integers from 1 to {MAX_MICROBATCHES}, got "
            f"{list(microbatches)}"
        )
    if not u_grid or any(int(u) != u or u < 1 for u in u_grid):
        raise ConfigError(f"microbatch sizes must be positive integers, got {list(u_grid)}")
    if max_owners not in (1, 2, 3):
        raise ConfigError(f"max_owners must be 1, 2 or 3, got {max_owners}")
    if max_group_gpus not in GROUP_GPUS:
        raise ConfigError(
            f"the largest replica must be one of {', '.join(map(str, GROUP_GPUS))} GPUs, "
            f"got {max_group_gpus}"
        )
    if not (expert_skew >= 1.0 and math.isfinite(expert_skew)):
        raise ConfigError(f"the expert imbalance must be a ratio of at least 1, got {expert_skew}")
    devices = resolve_devices(gpus, model, catalog=catalog, profiles=profiles)
    if len(devices) < len(gpus):
        ids = [resolve_devices([g], model, catalog=catalog, profiles=profiles)[0].id for g in gpus]
        twice = next(i for i in ids if ids.count(i) > 1)
        given = ", ".join(g for g, i in zip(gpus, ids, strict=True) if i == twice)
        raise ConfigError(f"GPU type {twice} is given more than once ({given}); name it once")
    limits = _inventory_limits(inventory, devices, model, catalog, profiles)
    if len(devices) > 2:
        raise ConfigError(
            f"at most two GPU types per plan, got {len(devices)} "
            f"({', '.join(d.id for d in devices)}); pass one or two with --gpus"
        )
    tables = OpTables(model, context, expert_skew)
    ranked: list[tuple[int, Structure]] = []
    kind_of: dict[int, str | None] = {}
    names: dict[tuple[int, ...], str] = {}
    for cand in candidate_templates(model):
        counts = [cand.num_owners] if cand.baseline else list(range(2, max_owners + 1))
        names.setdefault(cand.template.cuts, cand.name)
        for n in counts:
            try:
                st = build_structure(model, tables, cand.template, n)
            except ValueError:
                continue
            kind_of[len(ranked)] = cand.baseline
            ranked.append((len(ranked), st))
    hetero = len(devices) > 1
    mbs = tuple(sorted({int(m) for m in microbatches}))

    def jobs(baseline: str | None, het: bool) -> list[Job]:
        chosen = [(r, st) for r, st in ranked if kind_of[r] == baseline]
        assigns = sorted(
            {a for _, st in chosen for a in assignments(len(devices), st.n, heterogeneous=het)}
        )
        return make_jobs(chosen, assigns, mbs)

    stats = SearchStats()
    cache: dict[tuple[object, ...], object] = {}
    searcher = Searcher(
        tables,
        devices,
        slo_s=tpot_slo_s,
        frontier=frontier_pruning,
        bnb=branch_and_bound,
        stats=stats,
        progress=progress,
        cache=cache,
        u_grid=sorted({int(u) for u in u_grid}),
        inventory=limits,
        max_group_gpus=max_group_gpus,
    )
    phase_jobs = {
        (b, het): jobs(b, het)
        for b in (*BASELINES, None)
        for het in ((False, True) if hetero else (False,))
    }
    searcher.total = sum(len(v) for v in phase_jobs.values())

    found: dict[tuple[str | None, bool], Leaf | None] = {}
    for b in BASELINES:
        for het in (False, True) if hetero else (False,):
            found[(b, het)] = searcher.run(phase_jobs[(b, het)], None, b)
    homo_seed = lexmin(*(found[(b, False)] for b in BASELINES))
    found[(None, False)] = searcher.run(phase_jobs[(None, False)], homo_seed, "opweave homogeneous")
    results: dict[str, Leaf | None] = {
        b: lexmin(*(found[(b, h)] for h in (False, True) if (b, h) in found)) for b in BASELINES
    }
    results["opweave_homogeneous"] = found[(None, False)]
    if hetero:
        het_seed = lexmin(found[(None, False)], *(found[(b, True)] for b in BASELINES))
        results["opweave_heterogeneous"] = searcher.run(
            phase_jobs[(None, True)], het_seed, "opweave heterogeneous"
        )
    best_leaf = results["opweave_heterogeneous" if hetero else "opweave_homogeneous"]

    # Infeasible phases: minimise TPOT instead, to say how close they came.
    tight = Searcher(
        tables,
        devices,
        slo_s=math.inf,
        objective="tpot",
        frontier=frontier_pruning,
        bnb=branch_and_bound,
        stats=stats,
        progress=None,
        cache=cache,
        u_grid=sorted({int(u) for u in u_grid}),
        inventory=limits,
        max_group_gpus=max_group_gpus,
    )
    reasons: dict[str, str] = {}
    tight_found: dict[str, Leaf | None] = {}
    all_jobs = [j for v in phase_jobs.values() for j in v]
    for name, leaf in results.items():
        if leaf is not None:
            continue
        if name in BASELINES:
            pool = [j for het in (False, True) for j in phase_jobs.get((name, het), [])]
        elif name == "opweave_homogeneous":
            pool = [j for (_, het), v in phase_jobs.items() if not het for j in v]
        else:
            pool = all_jobs
        t = tight_found[name] = tight.run(pool, None, f"tightest {name}")
        label = name.replace("_", " ")
        if t is None and limits:
            reasons[name] = (
                f"no {label} plan fits the inventory ({inventory_text(limits, devices)}) "
                f"at context {context}"
            )
        elif t is None:
            reasons[name] = (
                f"{label} does not fit in memory on {', '.join(d.id for d in devices)}"
                f" at context {context} with any TP degree and batch"
            )
        else:
            tp = _leaf_plan(model, tables, devices, t, tpot_slo_s)
            reasons[name] = (
                f"{label} cannot meet the {tpot_slo_s * 1e3:g} ms TPOT SLO: its "
                f"tightest TPOT is {t.tpot_s * 1e3:.2f} ms with {describe_plan(tp)}"
            )
    best_name = "opweave_heterogeneous" if hetero else "opweave_homogeneous"
    tightest_leaf = tight_found.get(best_name) if best_leaf is None else None
    smallest_leaf = None
    if best_leaf is None and limits:
        # what the SLO needs without the inventory: the fewest GPUs of any plan meeting it
        smallest_leaf = Searcher(
            tables,
            devices,
            slo_s=tpot_slo_s,
            objective="gpus",
            frontier=frontier_pruning,
            bnb=branch_and_bound,
            stats=stats,
            cache=cache,
            u_grid=sorted({int(u) for u in u_grid}),
            max_group_gpus=max_group_gpus,
        ).run(all_jobs, None, "smallest plan")

    plans = {
        name: (_leaf_plan(model, tables, devices, leaf, tpot_slo_s) if leaf else None)
        for name, leaf in results.items()
    }
    best = plans[best_name]
    stats.wall_s = time.perf_counter() - started
    return PlanResult(
        model=model.name,
        gpus=tuple(d.id for d in devices),
        context_tokens=context,
        tpot_slo_s=tpot_slo_s,
        best=best,
        baselines=plans,
        reasons=reasons,
        search=stats,
        tightest=(
            _leaf_plan(model, tables, devices, tightest_leaf, tpot_slo_s)
            if tightest_leaf is not None
            else None
        ),
        template_names=names,
        inventory={d.id: limits.get(d.id) for d in devices},
        smallest=(
            _leaf_plan(model, tables, devices, smallest_leaf, tpot_slo_s)
            if smallest_leaf is not None
            else None
        ),
        spec=model,
        devices=tuple(devices),
        expert_skew=expert_skew,
        fewest_microbatches=mbs[0],
    )


def inventory_text(limits: Mapping[str, int | None], devices: Sequence[Device]) -> str:
    """``h100-sxm:16, a100-sxm-80gb`` (unbounded types without a count)."""
    return ", ".join(
        d.id if limits.get(d.id) is None else f"{d.id}:{limits[d.id]}" for d in devices
    )


def _inventory_limits(
    inventory: Mapping[str, int] | None,
    devices: Sequence[Device],
    model: ModelSpec,
    catalog: HardwareCatalog | None,
    profiles: Sequence[Profile],
) -> dict[str, int]:
    """Device id -> GPU count of the bounded types, checked against the chosen devices."""
    limits: dict[str, int] = {}
    ids = {d.id for d in devices}
    for name, count in (inventory or {}).items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(
                f"inventory count of {name} must be a positive whole number of GPUs, got {count!r}"
            )
        gpu = resolve_devices([name], model, catalog=catalog, profiles=profiles)[0].id
        if gpu not in ids:
            raise ConfigError(f"the inventory names {name}, which is not one of the GPU types")
        if gpu in limits:
            raise ConfigError(f"the inventory gives GPU type {gpu} more than once")
        limits[gpu] = count
    return limits
