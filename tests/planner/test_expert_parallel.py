"""The planner with expert parallelism and data-parallel attention: frontiers that prune (its
exactness against exhaustive enumeration is in test_exactness.py), and plans whose owners say
their (TP, EP, DP)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opweave.costmodel import (
    HardwareCatalog,
    default_catalog,
    load_model,
    plan_nodes,
)
from opweave.planner import plan, simulate_plan

from .conftest import random_profile, toy_gpu


@pytest.fixture(scope="module")
def moe_plans():
    """Qwen3-30B-A3B on H200 at 4K with a 30 ms TPOT SLO, with and without frontiers."""
    model = load_model("qwen3-30b-a3b")
    on = plan(model, ["h200"], context=4096, tpot_slo_s=0.03)
    off = plan(model, ["h200"], context=4096, tpot_slo_s=0.03, frontier_pruning=False)
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


def test_the_planner_offers_only_splits_the_runtime_serves() -> None:
    """gpt-oss-120b's MXFP4 experts (90 scale blocks of 32) split evenly over TP 1 and 2 only;
    engines also run TP 4 and 8 with uneven whole-block shards, and estimates cost those, but
    the runtime does not, so plain TP owners stop at 2. Attention splits over 4 and 8, and under
    expert parallelism each GPU holds whole experts: those owners are offered."""
    from pathlib import Path

    from opweave.costmodel import Parallelism, load_model, parallelism_problem, tp_problem
    from opweave.planner import resolve_devices

    config = Path(__file__).parents[1] / "costmodel" / "checkpoints" / "gpt-oss-120b.json"
    model = load_model(config)
    (b200,) = resolve_devices(["b200"], model)
    assert (b200.tps, b200.plain_tps) == ((1, 2, 4, 8), (1, 2))
    assert all(tp_problem(model, tp, engine_splits=True) is None for tp in (4, 8))
    assert parallelism_problem(model, Parallelism(tp=8), b200.hardware) is not None
    assert parallelism_problem(model, Parallelism(tp=8, ep=8), b200.hardware) is None
    result = plan(model, ["b200"], context=4096, tpot_slo_s=0.05)
    for p in [result.best, *result.baselines.values()]:
        for o in [] if p is None else p.owners:
            assert o.tp in (1, 2) or o.ep > 1, o


def test_block_fp8_experts_that_do_not_split_over_tp8_are_offered_tp8_with_ep8() -> None:
    """Qwen3-235B-A22B-FP8's experts (1536 channels) are not whole 128-wide blocks over TP 8;
    with EP 8 every GPU holds whole experts (vLLM's --enable-expert-parallel at TP 8)."""
    from pathlib import Path

    from opweave.costmodel import load_model
    from opweave.planner import resolve_devices
    from opweave.planner._private.space import candidate_parallelisms

    config = Path(__file__).parents[1] / "costmodel" / "checkpoints" / "qwen3-235b-a22b-fp8.json"
    model = load_model(config)
    (h100,) = resolve_devices(["h100"], model)
    assert (h100.tps, h100.plain_tps) == ((1, 2, 4, 8), (1, 2, 4))
    offered = candidate_parallelisms(h100, model.operators)
    assert any((p.tp, p.ep, p.dp) == (8, 8, 1) for p in offered)
    result = plan(model, ["h100"], context=4096, tpot_slo_s=0.08)
    owners = [o for p in [result.best, *result.baselines.values()] if p for o in p.owners]
    assert owners and not any(o.tp == 8 and o.ep == 1 for o in owners)


def test_shared_experts_split_from_the_routed_ones_pay_their_launches(tiny_deepseek) -> None:
    """[SHARED-STREAM] holds where a segment runs a layer's routed and shared experts together;
    a cut between them puts the shared experts on an owner of their own, launches charged."""
    from opweave.costmodel import Parallelism, StageTemplate
    from opweave.planner import resolve_devices
    from opweave.planner._private.structure import OpTables, build_structure

    model = tiny_deepseek
    names = model.block.op_names
    tables = OpTables(model, 512)
    h100 = resolve_devices(["h100"], model)[0]
    lat = tables.latency(h100, Parallelism(tp=1), [8.0])[:, 0]
    kernel = h100.hardware.kernel_overhead_s

    def shared_cost(cuts: tuple[int, ...]) -> list[float]:
        st = build_structure(model, tables, StageTemplate(cuts=cuts), len(cuts))
        out = []
        for j, ops in enumerate(st.owner_ops):
            if any(op.name == "shared_expert" for op in ops):
                # the owner's seconds for its shared experts: classes it counts beyond the rest
                counts = st.counts[j].sum(axis=0)
                keys = {tables.index[op.key] for op in ops if op.name == "shared_expert"}
                keys |= {tables.split_index[op.key] for op in ops if op.name == "shared_expert"}
                out.append(float(sum(counts[k] * lat[k] for k in keys)))
        return out

    together = shared_cost((0, names.index("router")))  # attention | router, experts, shared
    apart = shared_cost((0, names.index("shared_expert")))  # ... experts | shared, attention
    layers = sum(1 for op in model.operators if op.name == "shared_expert")
    assert len(together) == len(apart) == 1
    assert apart[0] - together[0] == pytest.approx(layers * 3 * kernel)
