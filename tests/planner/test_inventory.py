"""Inventories: plans for the GPUs a user has (counts per GPU type, whole TP groups on nodes).

Small random spaces as in ``test_exactness``: the optimum under an inventory equals brute force
over every memory-feasible point that fits it, every returned plan (best and baselines) fits
it, and when none fits, the smallest plan meeting the SLO is the brute-force smallest.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from opweave.costmodel import (
    ConfigError,
    HardwareCatalog,
    ModelSpec,
    fits_inventory,
    load_model,
    memory_bytes_per_rank,
    node_layout,
    plan_nodes,
    replica_counts,
)
from opweave.planner import candidate_templates, plan, resolve_devices
from opweave.planner._private.evaluate import OwnerChoice, evaluate
from opweave.planner._private.structure import OpTables, build_structure

from .test_exactness import CONTEXT, MBS, U_SMALL, random_space, slo_near

counts = st.one_of(st.none(), st.integers(1, 6))


def fits(owners: list[tuple[str, int, int]], inventory, per_node) -> bool:
    """Independent of the planner: replicas from the batches, TP groups in rank order, nodes."""
    reps = replica_counts([b for _, _, b in owners])
    groups = [(g, tp) for (g, tp, _), r in zip(owners, reps, strict=True) for _ in range(r)]
    layout = node_layout(groups, per_node)
    return fits_inventory([(g, n) for g, _, n in layout], inventory, per_node)


def brute_force(model: ModelSpec, profiles, inventory):
    """(USD per Mtok, TPOT, strategy, GPUs, fits) of every memory-feasible point of the space."""
    devices = resolve_devices(
        ["dev0", "dev1"], model, catalog=HardwareCatalog(()), profiles=profiles
    )
    per_node = {d.id: d.hardware.gpus_per_node for d in devices}
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
                spec = [(ch.device.id, ch.tp, ch.resident_batch) for ch in owners]
                reps = replica_counts([b for _, _, b in spec])
                gpus = sum(tp * r for (_, tp, _), r in zip(spec, reps, strict=True))
                rows.append(
                    (
                        ev.usd_per_million_tokens,
                        ev.tpot_s,
                        cand.baseline or "opweave",
                        gpus,
                        fits(spec, inventory, per_node),
                    )
                )
    return rows, per_node


def run(model, profiles, slo, inventory, **kw):
    return plan(
        model,
        ["dev0", "dev1"],
        context=CONTEXT,
        tpot_slo_s=slo,
        catalog=HardwareCatalog(()),
        profiles=profiles,
        microbatches=MBS,
        u_grid=U_SMALL,
        inventory={k: v for k, v in inventory.items() if v is not None},
        **kw,
    )


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), counts, counts)
@example(4320, 0.5, None, None)  # the quantile falls on the cheapest point's TPOT
def test_inventory_optimum_equals_brute_force(
    tiny_llama: ModelSpec, seed: int, quantile: float, n0: int | None, n1: int | None
) -> None:
    _, profiles = random_space(seed, tiny_llama)
    inventory = {"dev0": n0, "dev1": n1}
    rows, per_node = brute_force(tiny_llama, profiles, inventory)
    if not rows:
        return
    tpots = sorted(r[1] for r in rows)
    slo = slo_near(tpots, quantile)
    result = run(tiny_llama, profiles, slo, inventory)
    ok = [r for r in rows if r[1] <= slo and r[4]]
    # every plan returned fits the inventory as laid out on nodes
    for p in [result.best, *result.baselines.values(), result.tightest]:
        if p is None:
            continue
        nodes = [(n.gpu, n.gpus) for n in plan_nodes(p, per_node)]
        assert fits_inventory(nodes, inventory, per_node)
        for gpu, limit in inventory.items():
            used = sum(o.replicas * o.gpus_per_replica for o in p.owners if o.gpu == gpu)
            assert limit is None or used <= limit
    if not ok:
        assert result.best is None
        meets = [r for r in rows if r[1] <= slo]
        if any(v is not None for v in inventory.values()) and meets:
            # the error names the smallest plan that meets the SLO without the bound
            assert result.smallest is not None
            got = sum(o.replicas * o.gpus_per_replica for o in result.smallest.owners)
            assert got == min(r[3] for r in meets)
            assert "the smallest plan that meets it needs" in result.message()
        return
    assert result.best is not None and result.best.prediction is not None
    assert result.best.prediction.usd_per_million_tokens == pytest.approx(
        min(r[0] for r in ok), rel=1e-9
    )
    for name in ("colocated", "afd", "cad"):
        mine = [r[0] for r in ok if r[2] == name]
        got = result.baselines[name]
        if not mine:
            assert got is None and name in result.reasons
        else:
            assert got is not None and got.prediction is not None
            assert got.prediction.usd_per_million_tokens == pytest.approx(min(mine), rel=1e-9)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(1, 4))
def test_reductions_off_give_the_identical_plan_under_an_inventory(
    tiny_llama: ModelSpec, seed: int, n0: int, n1: int
) -> None:
    _, profiles = random_space(seed, tiny_llama)
    inventory = {"dev0": n0, "dev1": n1}
    runs = [
        run(tiny_llama, profiles, 1.0, inventory, frontier_pruning=f, branch_and_bound=b)
        for f in (True, False)
        for b in (True, False)
    ]
    shapes = [{k: v for k, v in r.to_json().items() if k != "search"} for r in runs]
    assert all(s == shapes[0] for s in shapes[1:])


def test_an_inventory_too_small_says_what_the_smallest_plan_needs() -> None:
    model = load_model("qwen3-next-80b-a3b")
    result = plan(model, ["h100"], context=32768, tpot_slo_s=0.05, inventory={"h100": 1})
    assert result.best is None and result.smallest is not None
    msg = result.message()
    assert "\n" not in msg
    assert msg.startswith("no plan that fits the inventory h100-sxm:1 meets the 50 ms TPOT SLO")
    need = sum(o.replicas * o.gpus_per_replica for o in result.smallest.owners)
    assert f"needs {need} x h100-sxm" in msg and need > 1
    # and the plan it names does meet the SLO with that many GPUs
    again = plan(model, ["h100"], context=32768, tpot_slo_s=0.05, inventory={"h100": need})
    assert again.best is not None
    assert sum(o.replicas * o.gpus_per_replica for o in again.best.owners) <= need


def test_inventory_keeps_tp_groups_on_whole_nodes() -> None:
    """12 GPUs of 8 per node are a node of 8 and a node of 4: two TP8 groups do not fit."""
    model = load_model("llama-3.3-70b")
    result = plan(
        model, ["h100"], context=8192, tpot_slo_s=0.05, inventory={"h100": 12}, max_owners=2
    )
    assert result.best is not None
    per_node = {"h100-sxm": 8}
    for p in [result.best, *result.baselines.values()]:
        if p is None:
            continue
        nodes = sorted((n.gpus for n in plan_nodes(p, per_node)), reverse=True)
        assert len(nodes) <= 2 and nodes[0] <= 8 and (len(nodes) == 1 or nodes[1] <= 4)
    doc = result.to_json()["best"]
    assert doc["replica_sets"] >= 1
    assert doc["replica_sets"] * sum(doc["gpus_used"].values()) <= 12


@pytest.mark.parametrize(
    ("inventory", "message"),
    [
        ({"h100": 0}, "positive whole number"),
        ({"h100": -1}, "positive whole number"),
        ({"h100": 2.5}, "positive whole number"),
        ({"a100": 4}, "not one of the GPU types"),
        ({"h100": 4, "h100-sxm": 4}, "more than once"),
    ],
)
def test_bad_inventories_are_config_errors(inventory, message) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(load_model("qwen3-32b"), ["h100"], context=8192, tpot_slo_s=0.05, inventory=inventory)


def test_a_gpu_type_given_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match="h100-sxm is given more than once"):
        plan(load_model("qwen3-32b"), ["h100", "h100-sxm"], context=8192, tpot_slo_s=0.05)
