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
    assert set(best) >= DEPLOYMENT_KEYS
    for kind, dep in doc["baselines"].items():
        assert set(dep) >= DEPLOYMENT_KEYS, kind
        if dep["pools"] is None:
            assert dep["reason"], kind
            continue
        expected = {"aggregated"} if kind == "aggregated" else {"prefill", "decode"}
        assert set(dep["pools"]) == expected, kind
        for pool in dep["pools"].values():
            assert set(pool) >= POOL_KEYS
        assert dep["gpus_used"] == sum(p["gpus_used"] for p in dep["pools"].values())
        assert best["usd_per_million_tokens"] <= dep["usd_per_million_tokens"]
    # the fleet: copies of the best, and every GPU of the inventory accounted for
    fleet = doc["fleet"]
    assert fleet["deployments"] >= 1
    assert fleet["tokens_per_s"] == pytest.approx(fleet["deployments"] * best["tokens_per_s"])
    assert set(fleet["gpus_left"]) == {"h100-sxm", "a100-sxm-80gb"}
    assert fleet["leftover_deployment"] is not None or fleet["idle_reason"]


def test_rate_with_ttft_slo_writes_a_plan_deploy_launches_with_both_pools(
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
        deployed = cli_json("deploy", str(out), "-o", str(tmp_path / "k8s"), *IMAGE)
        ranks = sorted(r for n in deployed["nodes"] for r in n["ranks"])
        assert ranks == list(range(dec["gpus_used"] + pre["gpus_used"]))  # both pools launched
        scripts = [
            (tmp_path / "k8s" / "launch" / f"node-{r}.sh").read_text()
            for r in range(len(deployed["nodes"]))
        ]
        assert any("Prefill pool ranks here" in s for s in scripts)
        sim = cli_json("simulate", str(out))
        assert sim["prefill"]["replicas"] == pre["replicas"]
        assert sim["prefill"]["gpus"] == pre["gpus_used"]
    else:
        assert plan.get("prefill") is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--context", "4K"),
            "--context (decode-only planning at --context) cannot be combined with --isl and "
            "--osl and --concurrency",
        ),
        (("--max-owners", "5"), "--max-owners must be 1, 2 or 3, got 5"),
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


def test_workload_file_gives_length_distributions(tmp_path: Path) -> None:
    from opweave.costmodel import (
        Lengths,
        Workload,
        default_catalog,
        estimate_serving,
        load_model,
    )

    path = tmp_path / "chat.toml"
    path.write_text(
        'isl = {kind = "uniform", low_tokens = 1000, high_tokens = 3000}\nosl = 512\n'
        "concurrency = 8\n"
    )
    doc = cli_json("estimate", "qwen3-32b", "--gpu", "h100", "--tp", "4", "--workload", str(path))
    expected = estimate_serving(
        load_model("qwen3-32b"),
        default_catalog().get("h100"),
        tp=4,
        workload=Workload(isl=Lengths.uniform(1000, 3000), osl=Lengths.fixed(512), concurrency=8),
    )
    assert doc["ttft_s"] == pytest.approx(expected.ttft_s)
    assert doc["tpot_s"] == pytest.approx(expected.tpot_s)
    # --rate replaces the file's arrival
    plan = cli_json(
        "plan", "qwen3-32b", "--gpus", "h100", "--workload", str(path), "--rate", "2",
        "--tpot-slo-ms", "50",
    )  # fmt: skip
    assert plan["workload"]["rate_per_s"] == 2 and "concurrency" not in plan["workload"]
    assert plan["best"]["tokens_per_s"] == pytest.approx(2 * 512)


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        ("isl = 100\nosl = 5\nrate = 3\n", (), "rate: Extra inputs are not permitted"),
        ("isl = 100\nosl = 5\n", (), "give either rate_per_s"),
        ("isl = 100\nosl = 5\nconcurrency = 2\n", ("--isl", "5"), "--workload gives the lengths"),
        ('isl = {kind = "uniform", low_tokens = 9, high_tokens = 3}\nosl = 5\nconcurrency = 2\n',
         (), "above high_tokens"),
        ("isl = [\n", (), "is malformed"),
        ('isl = 100\nosl = 5\nconcurrency = 2\nengine = "foo"\n', (),
         "engine: unknown engine 'foo'; known: vllm, sglang, tensorrt-llm (or trtllm)"),
    ],
)  # fmt: skip
def test_bad_workload_files_are_one_line_errors(
    tmp_path: Path, text: str, extra: tuple[str, ...], message: str
) -> None:
    path = tmp_path / "w.toml"
    path.write_text(text)
    proc = run_cli(
        "plan", "qwen3-32b", "--gpus", "h100", "--workload", str(path), "--tpot-slo-ms", "50",
        *extra, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_dense_dp_estimates_an_sglang_dp_attention_layout() -> None:
    """DeepSeek-V3's dense FFN (18432 wide, FP8 128x128 blocks) cannot split over 32 GPUs; with
    --dense-dp each GPU holds it whole, as SGLang's --moe-dense-tp-size 1 runs it."""
    base = ("estimate", "deepseek-v3", "--gpu", "gb300", "--tp", "1", "--ep", "32", "--dp", "32")
    split = run_cli(*base, "--batch", "256", "--context", "4K", check=False)
    assert split.returncode == 2 and "128x128 FP8 scale blocks" in split.stderr
    step = cli_json(*base, "--dense-dp", "--batch", "256", "--context", "4K")
    serving = cli_json(*base, "--dense-dp", *WORKLOAD, "--concurrency", "256")
    assert step["dense_dp"] and serving["dense_dp"]
    assert serving["tpot_s"] > 0 and serving["ttft_s"] > 0
    proc = run_cli("estimate", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--dense-dp",
                   check=False)  # fmt: skip
    assert proc.returncode == 2 and "--dense-dp applies to data-parallel attention" in proc.stderr


@pytest.mark.parametrize(
    ("model", "gpus", "slo_ms"),
    [
        ("qwen3-30b-a3b", "h200", "30"),
        ("deepseek-v3", "h200", "60"),
        ("qwen3-32b", "h100,a100", "30"),
    ],
)
def test_every_plan_opweave_plan_writes_is_one_the_runtime_serves(
    model: str, gpus: str, slo_ms: str, tmp_path: Path
) -> None:
    """The best deployment and each baseline, written as plan files, pass the runtime's own
    check (its decode owners' (TP, EP, DP), the prefill pool's, and their TP degrees):
    whatever the planner chose for either pool, `opweave run` starts it."""
    from opweave.costmodel import Plan, load_model
    from opweave.runtime import check_plan

    spec = load_model(model)
    out = tmp_path / "plan.json"
    doc = cli_json(
        "plan", model, "--gpus", gpus, *WORKLOAD, "--rate", "4", "--tpot-slo-ms", slo_ms,
        "-o", str(out),
    )  # fmt: skip
    written = sorted(tmp_path.glob("*.json"))
    assert written, doc
    for path in written:
        plan = Plan.model_validate_json(path.read_text())
        check_plan(plan, spec)  # raises with the reason otherwise


def test_plan_costs_the_pools_as_the_named_engine_runs_them() -> None:
    """``--engine sglang`` costs the aggregated engines and prefill pools as SGLang runs them
    (its step policy, limits and eager prompt steps), and the plan says so, and that the
    runtime serves it with vLLM's engine."""
    args = ("plan", "qwen3-32b", "--gpus", "h100", *WORKLOAD, "--concurrency", "64")
    args += ("--tpot-slo-ms", "50")
    vllm, sglang = cli_json(*args), cli_json(*args, "--engine", "sglang")
    assert sglang["workload"]["engine"] == "sglang"
    said = " ".join(sglang["assumptions"])
    assert "SGLang's scheduler simulated" in said and "8192 tokens and 2048 requests" in said
    assert "opweave run serves a plan with vLLM's engine" in said
    assert "vLLM V1's scheduler simulated" in " ".join(vllm["assumptions"])
    assert "--mem-fraction-static as SGLang derives it" in said
    assert "--gpu-memory-utilization 0.9 of the GPU" in " ".join(vllm["assumptions"])
    # a smaller memory fraction leaves SGLang less cache: the plan says so and costs no less
    tight = cli_json(*args, "--engine", "sglang", "--memory-fraction", "0.7")
    assert "--mem-fraction-static 0.7 (given)" in " ".join(tight["assumptions"])
    assert tight["workload"]["memory_fraction"] == 0.7
    best = sglang["best"]["usd_per_million_tokens"]
    assert tight["best"]["usd_per_million_tokens"] >= best * (1 - 1e-9)
    # SGLang's decode steps carry no prompt chunks (those run in steps of their own, while the
    # decodes wait): its aggregated TPOT is the shorter, its TTFT the longer
    agg_v, agg_s = vllm["baselines"]["aggregated"], sglang["baselines"]["aggregated"]
    assert agg_v["pools"] is not None and agg_s["pools"] is not None
    assert agg_s["tpot_s"] < agg_v["tpot_s"] and agg_s["ttft_s"] > agg_v["ttft_s"]


def test_sglang_plans_of_a_moe_model_skip_layouts_its_defaults_cannot_start() -> None:
    """With --engine sglang an MoE model's candidates include DP attention over many ranks,
    where SGLang's default memory fraction is negative: the planner skips them (it was a
    pydantic traceback on this ordinary command) and plans the rest."""
    doc = cli_json(
        "plan", "qwen3-30b-a3b", "--gpus", "h100", "--isl", "1K", "--osl", "64",
        "--concurrency", "4", "--engine", "sglang", "--tpot-slo-ms", "100",
    )  # fmt: skip
    assert doc["best"]["usd_per_million_tokens"] > 0
    assert doc["best"]["tpot_s"] <= 0.1
