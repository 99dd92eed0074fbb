"""Whole deployments for a workload (``plan_deployment``): each figure checked against the cost
model's own engine estimates called directly, the sizing against one replica fewer, the decode
pool against Little's law, the choice against every kind's cost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opweave.costmodel import (
    ConfigError,
    Lengths,
    Workload,
    default_catalog,
    estimate_serving,
    kv_transfer_s,
    load_model,
    model_spec_from_config,
    prefill_pool,
)
from opweave.planner import DeploymentResult, plan_deployment
from tests.helpers import TINY_LLAMA
from tests.planner.conftest import random_profile, toy_gpu

CATALOG = default_catalog()


@pytest.fixture(scope="module")
def qwen32():
    return load_model("qwen3-32b")


def _workload(**arrival: float | int) -> Workload:
    return Workload(isl=Lengths.fixed(4096), osl=Lengths.fixed(1024), **arrival)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def by_rate(qwen32) -> DeploymentResult:
    return plan_deployment(qwen32, ["h100"], workload=_workload(rate_per_s=8.0), tpot_slo_s=0.015)


@pytest.fixture(scope="module")
def closed_loop(qwen32) -> DeploymentResult:
    return plan_deployment(
        qwen32, ["h100"], workload=_workload(concurrency=64), tpot_slo_s=0.05, ttft_slo_s=1.0
    )


def _price(gpu: str) -> float:
    price = CATALOG.get(gpu).usd_per_hour
    assert price is not None
    return price


@pytest.mark.parametrize("name", ["by_rate", "closed_loop"])
def test_best_is_the_cheapest_kind_and_pd_only_where_cheaper(name, request) -> None:
    result: DeploymentResult = request.getfixturevalue(name)
    assert result.best is not None
    costs = {k: d.usd_per_million_tokens for k, d in result.baselines.items() if d is not None}
    assert result.best.usd_per_million_tokens == min(costs.values())
    agg = result.baselines["aggregated"]
    if result.best.kind != "aggregated" and agg is not None:
        # a disaggregated deployment is chosen only when strictly cheaper
        assert result.best.usd_per_million_tokens < agg.usd_per_million_tokens


@pytest.mark.parametrize("name", ["by_rate", "closed_loop"])
def test_cost_is_the_gpus_at_catalog_prices_over_the_tokens(name, request) -> None:
    result: DeploymentResult = request.getfixturevalue(name)
    for dep in result.baselines.values():
        if dep is None:
            continue
        usd_hour = sum(n * _price(gpu) for gpu, n in dep.gpus_by_type.items())
        assert dep.usd_per_hour == pytest.approx(usd_hour)
        assert dep.usd_per_million_tokens == pytest.approx(usd_hour / 3600 / dep.tokens_per_s * 1e6)
        assert dep.gpus_used == sum(p.gpus_used for p in dep.pools)


def test_by_rate_every_kind_serves_the_rate_within_its_slos(by_rate) -> None:
    w = by_rate.workload
    for kind, dep in by_rate.baselines.items():
        if dep is None:
            continue
        assert dep.tokens_per_s == pytest.approx(8.0 * 1024), kind
        assert dep.tpot_p90_s <= 0.015 + 1e-12, kind
    assert by_rate.best is not None and w.rate_per_s == 8.0


def test_aggregated_replicas_are_the_fewest_meeting_the_slos(by_rate, qwen32) -> None:
    dep = by_rate.baselines["aggregated"]
    if dep is None:
        pytest.skip("no aggregated deployment meets this SLO")
    (pool,) = dep.pools
    par = pool.engine.par
    hw = pool.engine.device.hardware

    def p90_tpot(replicas: int) -> float:
        est = estimate_serving(
            qwen32, hw, tp=par.tp, ep=par.ep, dp=par.dp,
            workload=_workload(rate_per_s=8.0 / replicas),
        )  # fmt: skip
        return math.inf if est.saturated else est.tpot_p90_s

    assert p90_tpot(pool.replicas) == pytest.approx(dep.tpot_p90_s)
    if pool.replicas > 1:
        assert p90_tpot(pool.replicas - 1) > 0.015


def test_prefill_pool_is_the_fewest_engines_and_decode_sets_follow_littles_law(
    closed_loop, qwen32
) -> None:
    for kind in ("pd", "afd", "cad", "opweave"):
        dep = closed_loop.baselines[kind]
        if dep is None:
            continue
        pre, dec = dep.pool("prefill"), dep.pool("decode")
        assert pre is not None and dec is not None and dec.plan is not None
        option = pre.engine
        hw = option.device.hardware
        # the KV transfer: every prefill GPU sends its shard over the network, or over NVLink
        # where the whole deployment lies on one node of 8 H100s (one GPU type)
        link = "nvlink" if dep.gpus_used <= hw.gpus_per_node else "network"
        transfer = kv_transfer_s(qwen32, 4096, tp=option.par.tp, link=link, prefill=hw,
                                 decode=hw)  # fmt: skip
        assert dep.kv_transfer_s == pytest.approx(transfer)
        rate = dep.requests_per_s
        step = dec.plan.prediction.tpot_s
        # closed loop: the clients over each request's time (TTFT, then osl - 1 decode steps)
        assert rate == pytest.approx(64 / (dep.ttft_s + 1023 * step), rel=0.05)
        # a decode slot is held for the step that samples the first token and 1023 more, by
        # at most the 64 clients
        holding = min(rate * 1024 * step, 64)
        assert dec.replicas == max(1, math.ceil(holding / dec.plan.global_batch))

        # the hand-off at vLLM's decode step boundaries: half a step to be taken in, the read
        # in whole steps (at least one: this transfer is under a step), the step that samples
        assert transfer < step
        assert dep.handoff_s == pytest.approx(2.5 * step)
        pool = prefill_pool(
            qwen32, hw, tp=option.par.tp, workload=_workload(rate_per_s=1.0),
            rate_per_s=rate / pre.replicas,
        )  # fmt: skip
        assert dep.ttft_s == pytest.approx(pool.ttft_s + 2.5 * step, rel=1e-3)
        assert dep.ttft_p90_s == pytest.approx(pool.ttft_p90_s + 2.5 * step, rel=1e-3)
        assert pool.ttft_p90_s + 2.5 * step <= 1.01
        if pre.replicas > 1:
            fewer = _prefill_p90(qwen32, hw, option.par.tp, rate / (pre.replicas - 1))
            assert fewer + 2.5 * step > 0.99


def _prefill_p90(model, hw, tp: int, rate_per_s: float) -> float:
    """p90 TTFT of one prefill engine at ``rate_per_s`` (inf when it cannot keep up)."""
    pool = prefill_pool(model, hw, tp=tp, workload=_workload(rate_per_s=1.0), rate_per_s=rate_per_s)
    return math.inf if pool.saturated else pool.ttft_p90_s


def test_ttft_slo_binds_every_kind(closed_loop) -> None:
    for kind, dep in closed_loop.baselines.items():
        if dep is not None:
            assert dep.ttft_p90_s <= 1.0 + 1e-9, kind


def test_a_ttft_slo_counts_the_handoff_to_the_decode_pool(qwen32) -> None:
    """One client (no queueing) and a TTFT SLO 5 ms above the quickest prompt alone plus its KV
    transfer: the decode pool's hand-off (at least 1.5 decode steps more) misses it, so no P/D
    deployment meets it, and the reason says what the figure includes."""
    h100 = CATALOG.get("h100")
    w = _workload(concurrency=1)
    quickest = min(
        prefill_pool(qwen32, h100, tp=tp, workload=_workload(rate_per_s=1.0)).prefill_s
        + kv_transfer_s(qwen32, 4096, tp=tp, link="network", prefill=h100, decode=h100)
        for tp in (1, 2, 4, 8)
    )
    slo = quickest + 0.005
    result = plan_deployment(qwen32, ["h100"], workload=w, tpot_slo_s=0.05, ttft_slo_s=slo)
    for kind in ("pd", "afd", "cad", "opweave"):
        assert result.baselines[kind] is None, kind
    assert "hand-off to the decode pool included" in result.reasons["pd"]


def test_long_answers_make_aggregated_tpot_the_decode_step(qwen32) -> None:
    """With answers far longer than prompts, an aggregated engine's TPOT is its decode step:
    the prefill chunks mixed in are a vanishing share."""
    w = Workload(isl=Lengths.fixed(128), osl=Lengths.fixed(8192), concurrency=16)
    result = plan_deployment(qwen32, ["h100"], workload=w, tpot_slo_s=0.05)
    dep = result.baselines["aggregated"]
    assert dep is not None
    (pool,) = dep.pools
    par = pool.engine.par
    est = estimate_serving(qwen32, pool.engine.device.hardware, tp=par.tp, workload=w)
    assert dep.tpot_s == pytest.approx(est.tpot_s)
    assert est.tpot_s == pytest.approx(est.decode_step_s, rel=0.1)


def test_fleet_accounts_for_every_gpu(qwen32) -> None:
    inventory = {"h100": 16, "a100": 8}
    result = plan_deployment(
        qwen32, ["h100", "a100"], workload=_workload(concurrency=64), tpot_slo_s=0.05,
        inventory=inventory,
    )  # fmt: skip
    fleet = result.fleet
    assert result.best is not None and fleet is not None and fleet.deployments >= 1
    counts = {"h100-sxm": 16, "a100-sxm-80gb": 8}
    used = {g: fleet.deployments * result.best.gpus_by_type.get(g, 0) for g in counts}
    second = fleet.second
    if second is not None and second.best is not None:
        for g, n in second.best.gpus_by_type.items():
            used[g] += fleet.second_copies * n
        left = second.fleet.gpus_left if second.fleet is not None else {}
    else:
        left = fleet.gpus_left
    for gpu, total in counts.items():
        assert used[gpu] + left.get(gpu, 0) == total, gpu
        assert left.get(gpu, 0) >= 0


def test_inventory_bounds_every_deployment(qwen32) -> None:
    result = plan_deployment(
        qwen32, ["h100"], workload=_workload(rate_per_s=8.0), tpot_slo_s=0.015,
        inventory={"h100": 12},
    )  # fmt: skip
    for kind, dep in result.baselines.items():
        if dep is not None:
            assert dep.gpus_used <= 12, kind
        else:
            assert result.reasons[kind]


def test_a_pd_deployment_shares_one_node_and_moves_its_kv_over_nvlink() -> None:
    # single-node P/D (prefill and decode engines on the GPUs of one node, as vLLM's and
    # Dynamo's disaggregated examples run them): the pools share the node, so KV moves over
    # NVLink, and a closed loop of 4 clients never holds more than 4 decode slots
    qwen8 = load_model("qwen3-8b")
    workload = Workload(isl=Lengths.fixed(1024), osl=Lengths.fixed(256), concurrency=4)
    result = plan_deployment(
        qwen8, ["h100"], workload=workload, tpot_slo_s=0.05, inventory={"h100": 2}
    )
    dep = result.baselines["pd"]
    assert dep is not None, result.reasons
    pre, dec = dep.pool("prefill"), dep.pool("decode")
    assert pre is not None and dec is not None and dec.plan is not None
    assert dep.gpus_used == 2 and dep.nodes({"h100-sxm": 8}) == [("h100-sxm", 2)]
    hw = CATALOG.get("h100")
    nvlink = kv_transfer_s(qwen8, 1024, tp=1, link="nvlink", prefill=hw, decode=hw)
    assert dep.kv_transfer_s == pytest.approx(nvlink)
    assert dep.kv_transfer_s < kv_transfer_s(qwen8, 1024, tp=1, link="network", prefill=hw)
    assert dec.replicas * dec.plan.global_batch >= 4 and dec.replicas == 1
    # no TTFT SLO was given: a kind without room for its prefill pool does not blame one
    for kind, why in result.reasons.items():
        assert "TTFT" not in why, (kind, why)


def test_bad_settings_are_named(qwen32) -> None:
    with pytest.raises(ConfigError, match="TTFT SLO"):
        plan_deployment(qwen32, ["h100"], workload=_workload(concurrency=4), tpot_slo_s=0.05,
                        ttft_slo_s=-1.0)  # fmt: skip
    with pytest.raises(ConfigError, match="statistic"):
        plan_deployment(qwen32, ["h100"], workload=_workload(concurrency=4), tpot_slo_s=0.05,
                        statistic="p50")  # type: ignore[arg-type]  # fmt: skip
    long = Workload(isl=Lengths.fixed(40_000), osl=Lengths.fixed(1024), concurrency=4)
    with pytest.raises(ConfigError, match="beyond qwen3-32b's context"):
        plan_deployment(qwen32, ["h100"], workload=long, tpot_slo_s=0.05)


def test_a_profiled_device_plans_a_workload_and_says_what_its_profile_covers() -> None:
    # a profiled device's latency model holds the profile's tables (not hashable): the engine
    # search keys its options by device id
    model = model_spec_from_config(TINY_LLAMA)
    prof = random_profile(np.random.default_rng(0), model, toy_gpu("cpu", memory_bytes=64e9))
    workload = Workload(isl=Lengths.fixed(32), osl=Lengths.fixed(16), concurrency=4)
    result = plan_deployment(model, ["cpu"], workload=workload, tpot_slo_s=1.0, profiles=[prof])
    assert result.best is not None
    assert result.baselines["aggregated"] is not None
    assert any(
        a.startswith("profiles (cpu) hold decode steps only") and "roofline" in a
        for a in result.assumptions
    )


def test_the_engine_simulations_report_their_progress(qwen32) -> None:
    """Many clients make each engine simulation take seconds: after the decode search, the
    aggregated engines report one by one (their count, the simulations so far, the cheapest
    deployment so far), then the P/D phase; the result is the same as without a callback."""
    reports = []
    workload = _workload(concurrency=64)
    result = plan_deployment(
        qwen32, ["h100"], workload=workload, tpot_slo_s=0.05, progress=reports.append
    )
    engines = [r for r in reports if r.phase == "aggregated engines"]
    assert engines and engines[0].done == 0 and engines[0].simulator_calls == 0
    assert all(r.done < r.total == engines[0].total for r in engines)
    assert [r.done for r in engines] == list(range(len(engines)))
    calls = [r.simulator_calls for r in engines]
    assert calls == sorted(calls) and calls[-1] > 0
    assert reports[-1].phase == "prefill pools and P/D deployments"
    aggregated = result.baselines["aggregated"]
    assert aggregated is not None
    assert reports[-1].best_usd_per_million_tokens == aggregated.usd_per_million_tokens
    quiet = plan_deployment(qwen32, ["h100"], workload=workload, tpot_slo_s=0.05)
    assert quiet.best == result.best
