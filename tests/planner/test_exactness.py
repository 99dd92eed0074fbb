"""Exactness: frontiers + branch-and-bound find the optimum of exhaustive enumeration.

Small random spaces: the tiny Llama, two synthetic device types with random prices, memories,
links and *noisy* latency profiles (latency is not monotone in batch, so the Pareto frontiers
really prune), random TPOT SLOs between infeasible and loose; and a tiny MoE on two random
roofline GPU types, whose owners also take expert and data-parallel degrees.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from opweave.costmodel import (
    GROUP_GPUS,
    HardwareCatalog,
    IdleSlowdown,
    ModelSpec,
    OrchestrationProfile,
    Parallelism,
    memory_bytes_per_gpu,
    memory_bytes_per_rank,
    parallelism_problem,
)
from opweave.planner import candidate_templates, plan, resolve_devices
from opweave.planner._private.evaluate import OwnerChoice, evaluate
from opweave.planner._private.structure import OpTables, build_structure

from .conftest import random_profile, toy_gpu

U_SMALL = (1, 2, 3)
MBS = (1, 2)
CONTEXT = 32


def random_space(seed: int, model: ModelSpec):
    rng = np.random.default_rng(seed)
    devices = []
    for i in range(2):
        hw = toy_gpu(
            f"dev{i}",
            memory_bytes=float(rng.uniform(2.2e5, 6e5)),
            usd_per_hour=float(rng.uniform(0.5, 4.0)),
            network_bandwidth_bytes_per_s=float(rng.uniform(1e8, 1e10)),
            intra_node_bandwidth_bytes_per_s=float(rng.uniform(1e9, 1e11)),
            network_latency_s=float(rng.uniform(1e-6, 3e-5)),
            gpus_per_node=int(rng.choice([2, 4])),
        )
        profile = random_profile(rng, model, hw)
        # host work and cold caches as CPU profiles carry them, scaled to the toy latencies
        scale = float(np.median([t.latency_s[0][0] for t in profile.ops]))
        loop = OrchestrationProfile(
            stage_s=scale * float(rng.uniform(0.1, 1.0)),
            stage_per_request_s=scale * float(rng.uniform(0.0, 0.2)),
            drive_s=scale * float(rng.uniform(0.1, 2.0)),
            drive_per_request_s=scale * float(rng.uniform(0.0, 0.5)),
        )
        cold = IdleSlowdown(
            s_per_byte=scale / 1e5 * float(rng.uniform(0.0, 1.0)),
            time_constant_s=scale * float(rng.uniform(1.0, 20.0)),
        )
        devices.append(
            profile.model_copy(
                update={"orchestration": loop, "idle_slowdown": cold if i == 0 else None}
            )
        )
    return rng, devices


def brute_force(model: ModelSpec, profiles) -> list[tuple[float, float, str]]:
    """(USD per Mtok, TPOT, strategy) of every memory-feasible point of the space."""
    devices = resolve_devices(
        ["dev0", "dev1"], model, catalog=HardwareCatalog(()), profiles=profiles
    )
    tables = OpTables(model, CONTEXT)
    rows = []
    for cand in candidate_templates(model):
        n = cand.num_owners
        structure = build_structure(model, tables, cand.template, n)
        for m, assign in itertools.product(MBS, itertools.product(devices, repeat=n)):
            per_owner = [
                [
                    (tp, u)
                    for tp in dev.tps
                    for u in U_SMALL
                    if memory_bytes_per_rank(list(structure.owner_ops[j]), tp, m * u, CONTEXT)
                    <= dev.hardware.usable_memory_bytes
                ]
                for j, dev in enumerate(assign)
            ]
            for combo in itertools.product(*per_owner):
                owners = [
                    OwnerChoice(dev, tp, m * u) for dev, (tp, u) in zip(assign, combo, strict=True)
                ]
                ev = evaluate(structure, tables, owners, m)
                rows.append((ev.usd_per_million_tokens, ev.tpot_s, cand.baseline or "opweave"))
    return rows


def slo_near(tpots: list[float], quantile: float) -> float:
    """A TPOT SLO near ``quantile`` of the points' sorted TPOTs (below the fastest when the
    quantile is under 5%), halfway between the TPOT there and the next larger one: never
    within float rounding of a point's TPOT, where the planner's simulation and this
    enumeration (which sum a schedule in different orders) could disagree in the last bit on
    whether the point meets it."""
    if quantile < 0.05:
        return tpots[0] * 0.98
    at = tpots[round(quantile * (len(tpots) - 1))]
    above = [t for t in tpots if t > at * (1 + 1e-9)]
    return (at + above[0]) / 2 if above else at * 1.01


def run_plan(
    model: ModelSpec,
    profiles,
    slo: float,
    *,
    frontier_pruning: bool = True,
    branch_and_bound: bool = True,
):
    return plan(
        model,
        ["dev0", "dev1"],
        context=CONTEXT,
        tpot_slo_s=slo,
        catalog=HardwareCatalog(()),
        profiles=profiles,
        microbatches=MBS,
        u_grid=U_SMALL,
        frontier_pruning=frontier_pruning,
        branch_and_bound=branch_and_bound,
    )


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
@example(16422, 0.279296875)  # the quantile falls on a point's TPOT (see slo_near)
def test_branch_and_bound_matches_exhaustive_enumeration(
    tiny_llama: ModelSpec, seed: int, quantile: float
) -> None:
    _, profiles = random_space(seed, tiny_llama)
    rows = brute_force(tiny_llama, profiles)
    if not rows:
        result = run_plan(tiny_llama, profiles, 1.0)
        assert result.best is None and result.tightest is None
        return
    tpots = sorted(t for _, t, _ in rows)
    slo = slo_near(tpots, quantile)
    result = run_plan(tiny_llama, profiles, slo)
    feasible = [r for r in rows if r[1] <= slo]
    if not feasible:
        assert result.best is None
        assert result.tightest is not None and result.tightest.prediction is not None
        assert result.tightest.prediction.tpot_s == pytest.approx(tpots[0], rel=1e-9)
        return
    assert result.best is not None and result.best.prediction is not None
    assert result.best.prediction.usd_per_million_tokens == pytest.approx(
        min(u for u, _, _ in feasible), rel=1e-9
    )
    assert result.best.prediction.tpot_s <= slo
    for name in ("colocated", "afd", "cad"):
        mine = [u for u, t, s in feasible if s == name]
        got = result.baselines[name]
        if not mine:
            assert got is None and name in result.reasons
        else:
            assert got is not None and got.prediction is not None
            assert got.prediction.usd_per_million_tokens == pytest.approx(min(mine), rel=1e-9)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_branch_and_bound_is_exact_on_a_model_with_a_dense_prefix(
    tiny_deepseek: ModelSpec, seed: int, quantile: float
) -> None:
    """MLA, a dense first layer tiled with the MoE block's cuts, shared + routed experts."""
    assert (tiny_deepseek.block.prefix_layers, tiny_deepseek.block.period_layers) == (1, 1)
    _, profiles = random_space(seed, tiny_deepseek)
    rows = brute_force(tiny_deepseek, profiles)
    if not rows:
        assert run_plan(tiny_deepseek, profiles, 1.0).best is None
        return
    tpots = sorted(t for _, t, _ in rows)
    slo = slo_near(tpots, quantile)
    result = run_plan(tiny_deepseek, profiles, slo)
    feasible = [r for r in rows if r[1] <= slo]
    if not feasible:
        assert result.best is None
        return
    assert result.best is not None and result.best.prediction is not None
    assert result.best.prediction.usd_per_million_tokens == pytest.approx(
        min(u for u, _, _ in feasible), rel=1e-9
    )


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.1, 1.0))
def test_reductions_off_give_the_identical_plan(
    tiny_llama: ModelSpec, seed: int, quantile: float
) -> None:
    _, profiles = random_space(seed, tiny_llama)
    loose = run_plan(tiny_llama, profiles, 1.0)
    if loose.best is None:
        return
    slo = loose.best.prediction.tpot_s * (0.5 + quantile)  # type: ignore[union-attr]
    runs = [
        run_plan(tiny_llama, profiles, slo, frontier_pruning=f, branch_and_bound=b)
        for f in (True, False)
        for b in (True, False)
    ]
    shapes = [{k: v for k, v in r.to_json().items() if k != "search"} for r in runs]
    assert all(s == shapes[0] for s in shapes[1:])
    if runs[0].best is not None:
        assert all(r.best == runs[0].best for r in runs)
    # the reductions reduce work
    assert runs[0].search.candidates <= runs[-1].search.candidates
    assert runs[0].search.simulator_calls <= runs[-1].search.simulator_calls


def test_frontier_prunes_dominated_configurations_on_noisy_profiles(tiny_llama: ModelSpec) -> None:
    removed = 0
    for seed in range(5):
        _, profiles = random_space(seed, tiny_llama)
        on = run_plan(tiny_llama, profiles, 1.0)
        off = run_plan(tiny_llama, profiles, 1.0, frontier_pruning=False)
        removed += on.search.frontier_removed
        assert off.search.frontier_removed == 0
        assert (on.summary(on.best) if on.best else None) == (
            off.summary(off.best) if off.best else None
        )
    assert removed > 0


def test_pareto_mask_prunes_only_at_equal_tp_and_when_comparable() -> None:
    from opweave.planner._private.frontier import pareto_mask

    tp = np.array([1, 1, 1, 2, 1])
    rate = np.array([1.0, 2.0, 0.5, 0.1, 2.0])
    latency = np.array([[1.0, 1.0, 2.0, 0.1, 1.0]])  # one occurrence
    links = np.array([[1.0, 1.0, 1.0, 0.1, 1.0]])
    comparable = np.ones(5, dtype=bool)
    # 0 dominates 1 (cheaper, same latency); 4 duplicates 1 (first kept, then dominated by 0);
    # 2 is cheaper but slower (kept); 3 is better in everything but has another TP (kept).
    assert pareto_mask(tp, rate, latency, links, comparable).tolist() == [
        True,
        False,
        True,
        True,
        False,
    ]
    # slower links protect a configuration
    assert pareto_mask(
        tp, rate, latency, np.array([[1.0, 0.5, 1.0, 0.1, 1.0]]), comparable
    ).tolist() == [True, True, True, True, False]
    # configurations whose link kind depends on the partner are never pruned
    assert pareto_mask(tp, rate, latency, links, np.array([False, False, True, True, True])).all()


# -- expert parallelism and data-parallel attention ------------------------------------------
EP_U = (2, 4)
EP_CONTEXT = 256
MAX_GROUP = 4


def random_gpus(seed: int) -> HardwareCatalog:
    """Two roofline GPU types with random memories, rates, links, prices and node sizes."""
    rng = np.random.default_rng(seed)
    return HardwareCatalog(
        toy_gpu(
            f"dev{i}",
            memory_bytes=float(rng.uniform(2e5, 2e6)),
            mem_bandwidth_bytes_per_s=float(rng.uniform(1e10, 1e12)),
            dense_flops_per_s=float(rng.uniform(1e12, 1e14)),
            usd_per_hour=float(rng.uniform(0.5, 4.0)),
            network_bandwidth_bytes_per_s=float(rng.uniform(1e8, 1e10)),
            intra_node_bandwidth_bytes_per_s=float(rng.uniform(1e9, 1e11)),
            network_latency_s=float(rng.uniform(1e-6, 3e-5)),
            alltoall_latency_s=float(rng.uniform(1e-6, 6e-5)),
            gpus_per_node=int(rng.choice([2, 4])),
        )
        for i in range(2)
    )


def brute_force_ep_dp(
    model: ModelSpec, catalog: HardwareCatalog
) -> list[tuple[float, float, str, bool]]:
    """(USD per Mtok, TPOT, strategy, whether an owner has EP or DP) of every memory-feasible
    point of the space, written from
    the space's definition: owners that run routed experts take a replica of ``tp x dp`` GPUs
    (``dp`` from the group sizes, at most ``MAX_GROUP``) with ``ep`` 1 or ``tp x dp``, every
    legal one; a microbatch a multiple of ``dp``."""
    devices = resolve_devices(["dev0", "dev1"], model, catalog=catalog)
    tables = OpTables(model, EP_CONTEXT)
    rows = []
    for cand in candidate_templates(model):
        n = cand.num_owners
        structure = build_structure(model, tables, cand.template, n)
        for m, assign in itertools.product(MBS, itertools.product(devices, repeat=n)):
            per_owner = []
            for j, dev in enumerate(assign):
                ops = list(structure.owner_ops[j])
                pars = [Parallelism(tp=tp) for tp in dev.tps]
                if any(op.moe is not None for op in ops):
                    pars = [
                        Parallelism(tp=tp, ep=ep, dp=g // tp)
                        for tp in dev.tps
                        for g in GROUP_GPUS
                        if g % tp == 0 and g <= MAX_GROUP
                        for ep in sorted({1, g})
                    ]
                    pars = [
                        p for p in pars if parallelism_problem(model, p, dev.hardware, ops) is None
                    ]
                per_owner.append(
                    [
                        (p, u)
                        for p in pars
                        for u in EP_U
                        if u % p.dp == 0
                        and memory_bytes_per_gpu(ops, p, m * u, EP_CONTEXT)
                        <= dev.hardware.usable_memory_bytes
                    ]
                )
            for combo in itertools.product(*per_owner):
                owners = [
                    OwnerChoice(dev, p.tp, m * u, ep=p.ep, dp=p.dp)
                    for dev, (p, u) in zip(assign, combo, strict=True)
                ]
                ev = evaluate(structure, tables, owners, m)
                wide = any(not p.plain for p, _ in combo)
                rows.append(
                    (ev.usd_per_million_tokens, ev.tpot_s, cand.baseline or "opweave", wide)
                )
    return rows


def run_plan_ep_dp(model: ModelSpec, catalog: HardwareCatalog, slo: float, **kwargs: bool):
    return plan(
        model,
        ["dev0", "dev1"],
        context=EP_CONTEXT,
        tpot_slo_s=slo,
        catalog=catalog,
        microbatches=MBS,
        u_grid=EP_U,
        max_group_gpus=MAX_GROUP,
        **kwargs,
    )


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.05, 1.0))
# two optima whose simulated TPOTs differ in the last bit only (EP1 and EP2 over one DP2
# replica): the same plan with and without the frontiers, by the tie-break key
@example(10884, 1.0)
def test_branch_and_bound_matches_exhaustive_enumeration_with_ep_dp(
    tiny_moe: ModelSpec, seed: int, quantile: float
) -> None:
    catalog = random_gpus(seed)
    rows = brute_force_ep_dp(tiny_moe, catalog)
    if not rows:
        assert run_plan_ep_dp(tiny_moe, catalog, 1.0).best is None
        return
    assert any(wide for *_, wide in rows)  # the space holds EP/DP owners
    tpots = sorted(t for _, t, *_ in rows)
    at = tpots[round(quantile * (len(tpots) - 1))]
    above = [t for t in tpots if t > at * (1 + 1e-9)]
    slo = (at + above[0]) / 2 if above else at * 1.01  # never on a point's TPOT
    result = run_plan_ep_dp(tiny_moe, catalog, slo)
    feasible = [r for r in rows if r[1] <= slo]
    assert result.best is not None and result.best.prediction is not None
    assert result.best.prediction.usd_per_million_tokens == pytest.approx(
        min(u for u, *_ in feasible), rel=1e-9
    )
    for name in ("colocated", "afd", "cad"):
        mine = [u for u, _, s, _ in feasible if s == name]
        got = result.baselines[name]
        assert (got is None) == (not mine)
        if got is not None and got.prediction is not None:
            assert got.prediction.usd_per_million_tokens == pytest.approx(min(mine), rel=1e-9)
    # the same optimum without either reduction
    for flags in ({"frontier_pruning": False}, {"branch_and_bound": False}):
        other = run_plan_ep_dp(tiny_moe, catalog, slo, **flags)
        assert other.best == result.best
