"""plan(): JSON contract, cost formula, memory, SLO handling, baselines, round trips."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from opweave.costmodel import (
    ConfigError,
    HardwareCatalog,
    InfeasibleError,
    Owner,
    Plan,
    RooflineLatency,
    UnknownGPUError,
    canonical_plan,
    default_catalog,
    load_model,
    memory_bytes_per_rank,
    segments,
)
from opweave.planner import SearchProgress, gantt, plan, simulate_plan

from .conftest import random_profile, toy_gpu

SUMMARY_KEYS = {
    "strategy",
    "usd_per_million_tokens",
    "tpot_s",
    "tokens_per_s",
    "usd_per_hour",
    "gpus_used",
    "nodes",
    "replica_sets",
    "stages_per_token",
    "owners",
    "placement",
    "microbatches",
    "global_batch",
    "template_cuts",
    "internode_bytes_per_token",
    "compute_occupancy",
}
OWNER_KEYS = {
    "gpu",
    "tp",
    "ep",
    "dp",
    "quant",
    "kv_cache_dtype",
    "replicas",
    "resident_batch",
    "gpus",
    "memory_bytes_per_gpu",
    "memory_capacity_bytes_per_gpu",
}


@pytest.fixture(scope="module")
def qwen32():
    return load_model("qwen3-32b")


# long enough that KV capacity, not weights, bounds a colocated batch: there splitting attention
# from the rest pays (at 32K a colocated A100 TP 8 batch of 64 fits and ties the best split)
CONTEXT = 40960


@pytest.fixture(scope="module")
def hetero_result(qwen32):
    return plan(qwen32, ["h100", "a100"], context=CONTEXT, tpot_slo_s=0.1)


def all_plans(result):
    return [p for p in [result.best, *result.baselines.values()] if p is not None]


def test_every_entry_adds_up(hetero_result, qwen32) -> None:
    """GPUs, dollars per hour, tokens per second and cost per token of each entry agree with
    each other and with the catalog's prices; the placement names every operator once."""
    cat = default_catalog()
    doc = hetero_result.to_json()
    entries = [doc["best"], *(e for e in doc["baselines"].values() if e.get("strategy"))]
    for e in entries:
        used: dict[str, int] = {}
        for o in e["owners"]:
            used[o["gpu"]] = used.get(o["gpu"], 0) + o["replicas"] * o["tp"] * o["dp"]
            assert o["gpus"] == o["replicas"] * o["tp"] * o["dp"]
            assert 0 < o["memory_bytes_per_gpu"] <= o["memory_capacity_bytes_per_gpu"]
            assert o["replicas"] * o["resident_batch"] == e["global_batch"]
        assert e["gpus_used"] == used
        assert sum(n["gpus"] for n in e["nodes"]) == sum(used.values())
        assert e["usd_per_hour"] == pytest.approx(
            sum(n * cat.get(g).usd_per_hour for g, n in used.items())
        )
        assert e["tokens_per_s"] == pytest.approx(e["global_batch"] / e["tpot_s"])
        assert e["usd_per_million_tokens"] == pytest.approx(
            e["usd_per_hour"] / 3600 / e["tokens_per_s"] * 1e6
        )
        assert e["replica_sets"] is None  # no inventory
        # every (operator, layer kind) of the model runs somewhere, each layer exactly once
        counts: dict[tuple[str, str | None], int] = {}
        for owner in e["placement"]:
            for op in owner["operators"]:
                key = (op["name"], op["layer_kind"])
                counts[key] = counts.get(key, 0) + (op["layers"] or 1)
        expected: dict[tuple[str, str | None], int] = {}
        for op in qwen32.operators:
            kind = None if op.layer is None else qwen32.layers[op.layer].attention.value
            expected[(op.name, kind)] = expected.get((op.name, kind), 0) + 1
        assert counts == expected


def test_json_has_exactly_the_contract_fields(hetero_result) -> None:
    doc = json.loads(json.dumps(hetero_result.to_json()))
    assert set(doc) == {
        "tpot_slo_s",
        "context_tokens",
        "inventory",
        "best",
        "baselines",
        "search",
        "assumptions",
    }
    assert doc["inventory"] == {"h100-sxm": None, "a100-sxm-80gb": None}
    assert any("decode only" in a for a in doc["assumptions"])
    assert set(doc["best"]) == SUMMARY_KEYS
    assert set(doc["baselines"]) == {
        "colocated",
        "afd",
        "cad",
        "opweave_homogeneous",
        "opweave_heterogeneous",
    }
    for entry in doc["baselines"].values():
        assert set(entry) == SUMMARY_KEYS or set(entry) == {"plan", "reason"}
    assert set(doc["search"]) == {"simulator_calls", "candidates", "wall_s"}
    assert doc["search"]["simulator_calls"] > 0 and doc["search"]["candidates"] > 0
    for owner in doc["best"]["owners"]:
        assert set(owner) == OWNER_KEYS
        assert (owner["quant"], owner["kv_cache_dtype"]) == ("bf16", "bf16")
    for entry in (doc["best"], *doc["baselines"].values()):
        for place in entry.get("placement", []):
            assert {"tp", "ep", "dp", "quant"} <= set(place)
            assert place["quant"] == "bf16"
    assert doc["best"]["usd_per_million_tokens"] <= min(
        e["usd_per_million_tokens"] for e in doc["baselines"].values() if e.get("strategy")
    )


def test_homogeneous_cluster_has_no_heterogeneous_entry(qwen32) -> None:
    result = plan(qwen32, ["h100"], context=8192, tpot_slo_s=0.05)
    assert set(result.to_json()["baselines"]) == {"colocated", "afd", "cad", "opweave_homogeneous"}
    assert all(o.gpu == "h100-sxm" for p in all_plans(result) for o in p.owners)


def test_cost_per_token_matches_an_independent_computation(hetero_result) -> None:
    cat = default_catalog()
    for p in all_plans(hetero_result):
        pred = p.prediction
        g = p.global_batch
        assert all(o.replicas * o.resident_batch == g for o in p.owners)
        assert math.gcd(*(o.replicas for o in p.owners)) == 1  # smallest balancing replicas
        usd_per_s = (
            sum(o.replicas * o.gpus_per_replica * cat.get(o.gpu).usd_per_hour for o in p.owners)
            / 3600
        )
        tokens_per_s = g / pred.tpot_s
        assert pred.usd_per_million_tokens == pytest.approx(
            usd_per_s / tokens_per_s * 1e6, rel=1e-12
        )


def test_colocated_tpot_is_microbatches_times_the_sum_of_operator_latencies(
    hetero_result, qwen32
) -> None:
    p = hetero_result.baselines["colocated"]
    owner = p.owners[0]
    lat = RooflineLatency(default_catalog().get(owner.gpu))
    layer_of = {op.key: layer for layer in qwen32.layers for op in layer.ops}
    b = owner.resident_batch / p.microbatches
    step = sum(
        lat.op_latency_s(qwen32, op, layer_of.get(op.key), owner.tp, b, CONTEXT)
        + lat.collective_s(op, owner.tp, b)
        for op in qwen32.operators
    )
    assert p.prediction.tpot_s == pytest.approx(p.microbatches * step, rel=1e-9)
    assert p.prediction.stages_per_token == 1


def test_every_owner_of_every_plan_fits_in_memory(hetero_result, qwen32) -> None:
    cat = default_catalog()
    for p in all_plans(hetero_result):
        segs = segments(qwen32, p.template, len(p.owners))
        for j, o in enumerate(p.owners):
            ops = [op for s in segs if s.owner == j for op in s.ops]
            need = memory_bytes_per_rank(ops, o.tp, o.resident_batch, CONTEXT)
            assert need <= cat.get(o.gpu).usable_memory_bytes


def test_heterogeneous_plan_puts_attention_on_the_gpu_cheaper_per_byte(
    hetero_result, qwen32
) -> None:
    cat = default_catalog()
    per_byte = {
        g: cat.get(g).require_price() / cat.get(g).mem_bandwidth_bytes_per_s
        for g in ("h100-sxm", "a100-sxm-80gb")
    }
    cheap_bw = min(per_byte, key=lambda g: per_byte[g])  # A100: more bandwidth per dollar
    best = hetero_result.best
    segs = segments(qwen32, best.template, len(best.owners))
    attention = {best.owners[s.owner].gpu for s in segs if s.holds_state}
    ffn = {best.owners[s.owner].gpu for s in segs if any(op.name == "gate_up_proj" for op in s.ops)}
    assert attention == {cheap_bw}
    assert ffn == {"h100-sxm"}  # cheaper per FLOP
    assert hetero_result.baselines["opweave_heterogeneous"] == best
    homo = hetero_result.baselines["opweave_homogeneous"]
    assert best.prediction.usd_per_million_tokens < homo.prediction.usd_per_million_tokens


def test_memory_constraint_rejects_a_model_that_fits_nowhere() -> None:
    small = toy_gpu("small", memory_bytes=5e9, usd_per_hour=1.0, gpus_per_node=8)
    result = plan(
        load_model("llama-3.3-70b"),
        ["small"],
        context=4096,
        tpot_slo_s=1.0,
        catalog=HardwareCatalog([small]),
    )
    assert result.best is None and result.tightest is None
    assert "does not fit" in result.message()
    assert all("does not fit in memory" in r for r in result.reasons.values())
    assert result.to_json()["baselines"]["afd"]["plan"] is None
    with pytest.raises(InfeasibleError, match="does not fit"):
        result.raise_if_infeasible()


def test_simulate_plan_rejects_a_resident_batch_beyond_memory(qwen32) -> None:
    p = canonical_plan(qwen32, "colocated", gpu="h100-sxm", batch=4096, context_tokens=32768)
    with pytest.raises(InfeasibleError, match="resident batch 4096"):
        simulate_plan(p, qwen32)
    assert simulate_plan(p, qwen32, check_memory=False).tpot_s > 0


def test_infeasible_slo_names_the_tightest_plan(qwen32) -> None:
    result = plan(qwen32, ["h100"], context=32768, tpot_slo_s=0.001)
    assert result.best is None and result.tightest is not None
    assert result.tightest.prediction is not None
    tight = result.tightest.prediction.tpot_s
    assert tight > 0.001
    msg = result.message()
    assert "no plan meets the 1 ms TPOT SLO" in msg and f"{tight * 1e3:.2f} ms" in msg
    assert "\n" not in msg
    doc = result.to_json()
    assert doc["best"] is None and doc["tightest"]["tpot_s"] == tight and doc["reason"] == msg
    with pytest.raises(InfeasibleError, match="tightest TPOT"):
        result.raise_if_infeasible()
    # the tightest plan is the fastest of the space: every baseline's tightest is no faster
    for reason in result.reasons.values():
        got = float(reason.split("tightest TPOT is ")[1].split(" ms")[0])
        assert got >= round(tight * 1e3, 2) - 1e-9


def test_baseline_that_misses_the_slo_gets_a_reason() -> None:
    llama = load_model("llama-3.3-70b")
    # colocated at TP 8 reaches 10.7 ms (its fixed costs included), AFD and CAD 12.7-12.8 ms
    result = plan(llama, ["h100"], context=32768, tpot_slo_s=0.011)
    assert result.best is not None
    assert result.baselines["colocated"] is not None
    for name in ("afd", "cad"):
        assert result.baselines[name] is None
        assert "cannot meet the 11 ms TPOT SLO" in result.reasons[name]
        assert result.to_json()["baselines"][name] == {"plan": None, "reason": result.reasons[name]}


def test_reductions_off_give_the_same_optimum_on_a_real_model() -> None:
    model = load_model("qwen3-30b-a3b")
    runs = [
        plan(
            model,
            ["h100", "a100"],
            context=16384,
            tpot_slo_s=0.03,
            frontier_pruning=f,
            branch_and_bound=b,
        )
        for f in (True, False)
        for b in (True, False)
    ]
    docs = [{k: v for k, v in r.to_json().items() if k != "search"} for r in runs]
    assert all(d == docs[0] for d in docs[1:])
    assert runs[0].search.candidates < runs[1].search.candidates  # B&B off: more candidates


def test_plan_file_round_trips_through_the_plan_schema(
    hetero_result, qwen32, tmp_path: Path
) -> None:
    best = hetero_result.best
    path = tmp_path / "plan.json"
    path.write_text(best.model_dump_json(indent=2))
    loaded = Plan.model_validate_json(path.read_text())
    assert loaded == best
    sim = simulate_plan(loaded, qwen32)
    assert sim.tpot_s == pytest.approx(best.prediction.tpot_s, rel=1e-9)
    assert sim.usd_per_million_tokens == pytest.approx(
        best.prediction.usd_per_million_tokens, rel=1e-9
    )
    assert sim.event_periods_s[-1] == pytest.approx(sim.tpot_s, rel=1e-6)
    assert loaded.tpot_slo_s == 0.1 and loaded.context_tokens == CONTEXT


def test_progress_callback_reports_the_search(qwen32) -> None:
    seen: list[SearchProgress] = []
    result = plan(qwen32, ["h100"], context=8192, tpot_slo_s=0.05, progress=seen.append)
    assert seen and [p.done for p in seen] == sorted(p.done for p in seen)
    assert seen[-1].done == seen[-1].total
    assert {p.phase for p in seen} >= {"colocated", "afd", "cad", "opweave homogeneous"}
    assert result.best is not None and result.best.prediction is not None
    assert seen[-1].best_usd_per_million_tokens == pytest.approx(
        result.best.prediction.usd_per_million_tokens
    )


def test_a_profile_names_a_new_device(tiny_llama) -> None:
    cpu = random_profile(
        np.random.default_rng(0), tiny_llama, toy_gpu("cpu", memory_bytes=64e9, usd_per_hour=0.5)
    )
    with pytest.raises(UnknownGPUError, match="cpu"):
        plan(tiny_llama, ["cpu"], context=32, tpot_slo_s=1.0)
    result = plan(tiny_llama, ["cpu"], context=32, tpot_slo_s=1.0, profiles=[cpu])
    assert result.best is not None
    assert {o.gpu for o in result.best.owners} == {"cpu"}
    assert all(o.tp in (1, 2) for o in result.best.owners)  # the TPs the profile covers
    assert result.best.profiles == ("cpu:measured:2026-01-01",)
    unpriced = cpu.model_copy(
        update={"device": toy_gpu("cpu", memory_bytes=64e9, usd_per_hour=None)}
    )
    with pytest.raises(ConfigError, match="no price"):
        plan(tiny_llama, ["cpu"], context=32, tpot_slo_s=1.0, profiles=[unpriced])
    priced = HardwareCatalog([toy_gpu("cpu", usd_per_hour=0.25)])
    result = plan(
        tiny_llama, ["cpu"], context=32, tpot_slo_s=1.0, profiles=[unpriced], catalog=priced
    )
    assert result.best is not None
    other = random_profile(np.random.default_rng(1), load_model("qwen3-32b"), toy_gpu("cpu"))
    with pytest.raises(ConfigError, match="measured on model"):
        plan(tiny_llama, ["cpu"], context=32, tpot_slo_s=1.0, profiles=[other])


def test_bad_requests_raise_one_line_errors(qwen32) -> None:
    cases = [
        (dict(gpus=["h100", "a100", "l40s"]), "at most two GPU types"),
        (dict(context=10**7), "exceeds"),
        (dict(tpot_slo_s=-1.0), "positive"),
        (dict(gpus=["nope"]), "unknown GPU"),
    ]
    for change, match in cases:
        args = dict(gpus=["h100"], context=4096, tpot_slo_s=0.05) | change
        with pytest.raises((ConfigError, UnknownGPUError), match=match) as info:
            plan(qwen32, args.pop("gpus"), **args)
        assert "\n" not in str(info.value)


def test_simulate_and_gantt_show_one_iteration_per_resource(
    hetero_result, qwen32, tmp_path: Path
) -> None:
    sim = simulate_plan(hetero_result.baselines["afd"], qwen32)
    resources = {e.resource for e in sim.trace}
    assert any(r.endswith("compute") for r in resources)
    assert any(r.endswith("send") for r in resources) and any(r.endswith("recv") for r in resources)
    t0, t1 = sim.window_s
    assert t1 - t0 == pytest.approx(sim.tpot_s)
    assert all(t0 <= e.start_s <= e.end_s <= t1 for e in sim.trace)
    for name, busy in sim.busy_s.items():
        assert sim.occupancy[name] == pytest.approx(busy / sim.tpot_s)
        assert sim.occupancy[name] <= 1 + 1e-9
    out = gantt(sim, tmp_path / "gantt.png")
    assert out.stat().st_size > 10_000
    assert json.dumps(sim.to_json())


def test_simulate_plan_accepts_hand_written_plans(qwen32) -> None:
    p = canonical_plan(
        qwen32, "afd", gpu="h100-sxm", batch=10, microbatches=3, context_tokens=8192, tp=2
    )  # 10 / 3: fractional microbatches
    sim = simulate_plan(p, qwen32)
    assert sim.stages_per_token == 2 * qwen32.num_layers
    alias = p.model_copy(
        update={"owners": (Owner(gpu="h100", tp=2, replicas=1, resident_batch=10),) * 2}
    )
    assert simulate_plan(alias, qwen32).tpot_s == sim.tpot_s  # aliases resolve like ids
    other = canonical_plan(load_model("llama-3.3-70b"), "colocated", gpu="h100-sxm", batch=1)
    with pytest.raises(ConfigError, match="made for model"):
        simulate_plan(other, qwen32)


def test_importing_the_planner_pulls_no_plotting_or_torch() -> None:
    code = (
        "import sys, opweave.planner; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_only_tensor_parallel_degrees_the_runtime_can_shard() -> None:
    """6 attention heads split over 2 ranks, not 4 or 8: the planner never proposes those."""
    from opweave.costmodel import model_spec_from_config
    from opweave.planner._private.devices import resolve_devices

    config = {
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    }
    (device,) = resolve_devices(["h100"], model_spec_from_config(config))
    assert device.tps == (1, 2)
