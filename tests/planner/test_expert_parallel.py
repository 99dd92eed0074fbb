"""The planner with expert parallelism and data-parallel attention: exact against exhaustive
enumeration, frontiers that prune, and plans whose owners say their (TP, EP, DP)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.costmodel import (
    GROUP_GPUS,
    HardwareCatalog,
    ModelSpec,
    Parallelism,
    default_catalog,
    load_model,
    memory_bytes_per_gpu,
    model_spec_from_config,
    parallelism_problem,
    plan_nodes,
)
from opweave.planner import candidate_templates, plan, resolve_devices, simulate_plan
from opweave.planner._private.evaluate import OwnerChoice, evaluate
from opweave.planner._private.structure import OpTables, build_structure

from .conftest import random_profile, toy_gpu

TINY_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}
U_SMALL = (2, 4)
MBS = (1, 2)
CONTEXT = 256
MAX_GROUP = 4


@pytest.fixture(scope="module")
def tiny_moe() -> ModelSpec:
    return model_spec_from_config(TINY_MOE, name="tiny-moe")


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


def brute_force(model: ModelSpec, catalog: HardwareCatalog) -> list[tuple[float, float, str, bool]]:
    """(USD per Mtok, TPOT, strategy, whether an owner has EP or DP) of every memory-feasible
    point of the space, written from
    the space's definition: owners that run routed experts take a replica of ``tp x dp`` GPUs
    (``dp`` from the group sizes, at most ``MAX_GROUP``) with ``ep`` 1 or ``tp x dp``, every
    legal one; a microbatch a multiple of ``dp``."""
    devices = resolve_devices(["dev0", "dev1"], model, catalog=catalog)
    tables = OpTables(model, CONTEXT)
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
                        for u in U_SMALL
                        if u % p.dp == 0
                        and memory_bytes_per_gpu(ops, p, m * u, CONTEXT)
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


def run_plan(model: ModelSpec, catalog: HardwareCatalog, slo: float, **kwargs: bool):
    return plan(
        model,
        ["dev0", "dev1"],
        context=CONTEXT,
        tpot_slo_s=slo,
        catalog=catalog,
        microbatches=MBS,
        u_grid=U_SMALL,
        max_group_gpus=MAX_GROUP,
        **kwargs,
    )


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.05, 1.0))
def test_branch_and_bound_matches_exhaustive_enumeration_with_ep_dp(
    tiny_moe: ModelSpec, seed: int, quantile: float
) -> None:
    catalog = random_gpus(seed)
    rows = brute_force(tiny_moe, catalog)
    if not rows:
        assert run_plan(tiny_moe, catalog, 1.0).best is None
        return
    assert any(wide for *_, wide in rows)  # the space holds EP/DP owners
    tpots = sorted(t for _, t, *_ in rows)
    at = tpots[round(quantile * (len(tpots) - 1))]
    above = [t for t in tpots if t > at * (1 + 1e-9)]
    slo = (at + above[0]) / 2 if above else at * 1.01  # never on a point's TPOT
    result = run_plan(tiny_moe, catalog, slo)
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
        other = run_plan(tiny_moe, catalog, slo, **flags)
        assert other.best == result.best


@pytest.fixture(scope="module")
def moe_plans():
    """Qwen3-30B-A3B on H200 at 4K with a 50 ms TPOT SLO, with and without frontiers."""
    model = load_model("qwen3-30b-a3b")
    on = plan(model, ["h200"], context=4096, tpot_slo_s=0.05)
    off = plan(model, ["h200"], context=4096, tpot_slo_s=0.05, frontier_pruning=False)
    return model, on, off


def test_frontier_prunes_a_moe_model_and_keeps_the_optimum(moe_plans) -> None:
    _, on, off = moe_plans
    assert on.search.frontier_removed > 0 and off.search.frontier_removed == 0
    assert on.search.candidates < off.search.candidates
    strip = [{k: v for k, v in r.to_json().items() if k != "search"} for r in (on, off)]
    assert strip[0] == strip[1]


def test_plan_owners_carry_tp_ep_dp_and_count_their_gpus(moe_plans) -> None:
    model, on, _ = moe_plans
    doc = json.loads(json.dumps(on.to_json()))
    best = doc["best"]
    assert any(o["dp"] > 1 for o in best["owners"])  # attention-DP pays on this MoE model
    entries = [best, *(e for e in doc["baselines"].values() if e.get("strategy"))]
    for entry in entries:
        for owner, place in zip(entry["owners"], entry["placement"], strict=True):
            for key in ("tp", "ep", "dp"):
                assert owner[key] == place[key] >= 1
            assert owner["gpus"] == owner["replicas"] * owner["tp"] * owner["dp"]
            assert (owner["tp"] * owner["dp"]) % owner["ep"] == 0
        assert sum(entry["gpus_used"].values()) == sum(n["gpus"] for n in entry["nodes"])
        assert sum(entry["gpus_used"].values()) == sum(o["gpus"] for o in entry["owners"])
    # the plan file re-simulates to its prediction, on tp x dp GPUs per replica
    assert on.best is not None and on.best.prediction is not None
    sim = simulate_plan(on.best, model)
    assert sim.tpot_s == pytest.approx(on.best.prediction.tpot_s, rel=1e-9)
    nodes = plan_nodes(on.best, default_catalog())
    assert sum(n.gpus for n in nodes) == sum(
        o.replicas * o.gpus_per_replica for o in on.best.owners
    )
    assert any("expert-parallel load" in a for a in doc["assumptions"]) == any(
        o["ep"] > 1 for e in entries for o in e["owners"]
    )


def test_dense_models_and_profiled_devices_keep_tensor_parallelism(tiny_moe) -> None:
    dense = plan(load_model("qwen3-32b"), ["h100"], context=8192, tpot_slo_s=0.05)
    # a measured profile times tensor parallelism only
    profile = random_profile(np.random.default_rng(0), tiny_moe, toy_gpu("dev0", memory_bytes=1e7))
    measured = plan(
        tiny_moe,
        ["dev0"],
        context=32,
        tpot_slo_s=1.0,
        catalog=HardwareCatalog(()),
        profiles=[profile],
        microbatches=(1,),
        u_grid=(1, 2, 4),
    )
    assert measured.best is not None
    for result in (dense, measured):
        for p in [result.best, *result.baselines.values()]:
            assert p is None or all(o.ep == o.dp == 1 for o in p.owners)
