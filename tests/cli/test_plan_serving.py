"""``opweave plan`` with a workload: the JSON contract scripts rely on, the plan file of a P/D
deployment, and one-line errors for settings that do not go together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import IMAGE, cli_json, run_cli

WORKLOAD = ("--isl", "4K", "--osl", "1K")
POOL_KEYS = {"gpu", "parallelism", "replicas", "gpus_used"}
DEPLOYMENT_KEYS = {"ttft_s", "tpot_s", "usd_per_million_tokens", "gpus_used", "pools"}


def test_json_contract_with_concurrency_and_an_inventory() -> None:
    doc = cli_json(
        "plan", "qwen3-32b", "--gpus", "h100:16,a100:8", *WORKLOAD, "--concurrency", "64",
        "--tpot-slo-ms", "50",
    )  # fmt: skip
    assert {"aggregated", "pd", "afd", "cad"} <= set(doc["baselines"])
    best = doc["best"]
    assert DEPLOYMENT_KEYS <= set(best)
    for kind, dep in doc["baselines"].items():
        assert DEPLOYMENT_KEYS <= set(dep), kind
        if dep["pools"] is None:
            assert dep["reason"], kind
            continue
        expected = {"aggregated"} if kind == "aggregated" else {"prefill", "decode"}
        assert set(dep["pools"]) == expected, kind
        for pool in dep["pools"].values():
            assert POOL_KEYS <= set(pool)
        assert dep["gpus_used"] == sum(p["gpus_used"] for p in dep["pools"].values())
        assert best["usd_per_million_tokens"] <= dep["usd_per_million_tokens"]
    # the fleet: copies of the best, and every GPU of the inventory accounted for
    fleet = doc["fleet"]
    assert fleet["deployments"] >= 1
    assert fleet["tokens_per_s"] == pytest.approx(fleet["deployments"] * best["tokens_per_s"])
    assert set(fleet["gpus_left"]) == {"h100-sxm", "a100-sxm-80gb"}
    assert fleet["leftover_deployment"] is not None or fleet["idle_reason"]


def test_rate_with_ttft_slo_writes_a_plan_the_runtime_refuses_only_for_prefill(
    tmp_path: Path,
) -> None:
    out = tmp_path / "pd.json"
    doc = cli_json(
        "plan", "qwen3-32b", "--gpus", "h100", *WORKLOAD, "--rate", "8", "--tpot-slo-ms", "15",
        "-o", str(out),
    )  # fmt: skip
    best = doc["best"]
    assert best["tokens_per_s"] == pytest.approx(8 * 1024)
    assert doc["slo_statistic"] == "p90" and doc["ttft_slo_s"] is None
    plan = json.loads(out.read_text())
    if "prefill" in best["pools"]:
        pre, dec = best["pools"]["prefill"], best["pools"]["decode"]
        assert plan["prefill"]["replicas"] == pre["replicas"]
        assert sum(o["replicas"] * o["tp"] * o["dp"] for o in plan["owners"]) == dec["gpus_used"]
        proc = run_cli("deploy", str(out), "-o", str(tmp_path / "k8s"), *IMAGE, check=False)
        assert proc.returncode == 2
        assert "prefill pool" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    else:
        assert plan.get("prefill") is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--context", "4K"), "--context belong to decode-only planning"),
        (("--tpot-slo-ms", "20,50"), "one --tpot-slo-ms"),
        (("--slo-statistic", "p50"), "--slo-statistic takes mean, p90 or p99"),
        (("--ttft-slo-ms", "0"), "--ttft-slo-ms must be a positive"),
        (("--rate", "2"), "one of --concurrency C or --rate R"),
    ],
)
def test_settings_that_do_not_go_together(args: tuple[str, ...], message: str) -> None:
    base = ["plan", "qwen3-32b", "--gpus", "h100", *WORKLOAD, "--concurrency", "8"]
    if "--tpot-slo-ms" not in args:
        base += ["--tpot-slo-ms", "50"]
    proc = run_cli(*base, *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_ttft_slo_without_lengths_names_them() -> None:
    proc = run_cli(
        "plan", "qwen3-32b", "--gpus", "h100", "--tpot-slo-ms", "50", "--ttft-slo-ms", "500",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--isl and --osl" in proc.stderr


def test_plan_without_context_or_workload_says_what_it_needs() -> None:
    proc = run_cli("plan", "qwen3-32b", "--gpus", "h100", "--tpot-slo-ms", "50", check=False)
    assert proc.returncode == 2
    assert "--context" in proc.stderr and "--isl" in proc.stderr
