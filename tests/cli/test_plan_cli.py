"""``opweave plan`` and ``opweave simulate``: the JSON contract and bad input."""

from __future__ import annotations

import json

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.costmodel import ConfigError
from tests.helpers import cli_json, run_cli

# DESIGN's CLI contract: every plan entry (best and each baseline) carries these
PLAN_FIELDS = {
    "strategy",
    "usd_per_million_tokens",
    "tpot_s",
    "tokens_per_s",
    "usd_per_hour",
    "gpus_used",
    "stages_per_token",
    "owners",
    "placement",
}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    doc = cli_json(
        "plan",
        "qwen3-32b",
        "--gpus",
        "h100,a100",
        "--context",
        "8K",
        "--tpot-slo-ms",
        "40",
        "-o",
        str(out),
    )
    return doc, out


def test_plan_json_has_the_design_fields(planned) -> None:
    doc, _ = planned
    assert set(doc["best"]) >= PLAN_FIELDS
    assert doc["best"]["tpot_s"] <= 0.040
    for name in ("colocated", "afd", "cad"):
        entry = doc["baselines"][name]
        assert set(entry) >= PLAN_FIELDS or (entry["plan"] is None and entry["reason"])
        if "usd_per_million_tokens" in entry:
            # the best plan is never more expensive than a feasible baseline
            assert doc["best"]["usd_per_million_tokens"] <= entry["usd_per_million_tokens"] + 1e-12
    assert {"simulator_calls", "candidates", "wall_s"} <= set(doc["search"])
    assert doc["search"]["simulator_calls"] >= 1


def test_plan_file_resimulates_to_the_same_tpot(planned, tmp_path) -> None:
    doc, path = planned
    sim = cli_json("simulate", str(path), "--gantt", str(tmp_path / "g.png"))
    assert sim["tpot_s"] == pytest.approx(doc["best"]["tpot_s"], rel=1e-6)
    assert sim["usd_per_million_tokens"] == pytest.approx(
        doc["best"]["usd_per_million_tokens"], rel=1e-6
    )
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    plan = json.loads(path.read_text())
    assert plan["schema_version"] == 1 and plan["model"]["name"] == "qwen3-32b"


def test_infeasible_slo_names_the_tightest_plan() -> None:
    proc = run_cli(
        "plan",
        "gemma-3-27b",
        "--gpus",
        "h100",
        "--context",
        "32K",
        "--tpot-slo-ms",
        "1",
        check=False,
    )
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith("error: no plan meets the 1 ms TPOT SLO")
    assert "tightest TPOT found is" in line and "\n" not in line


@pytest.mark.parametrize(
    ("content", "message"),
    [("{", "not a valid plan"), ('{"schema_version": 7}', "not a valid plan")],
)
def test_malformed_plan_file(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    proc = run_cli("simulate", str(path), check=False)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plan_bad_gpu_and_missing_profile() -> None:
    proc = run_cli(
        "plan",
        "qwen3-32b",
        "--gpus",
        "h100,nope",
        "--context",
        "8K",
        "--tpot-slo-ms",
        "50",
        check=False,
    )
    assert proc.returncode == 2 and "unknown GPU 'nope'" in proc.stderr
    proc = run_cli(
        "plan",
        "qwen3-32b",
        "--gpus",
        "h100",
        "--context",
        "8K",
        "--tpot-slo-ms",
        "50",
        "--profile",
        "/nonexistent.json",
        check=False,
    )
    assert proc.returncode == 2 and "profile file /nonexistent.json does not exist" in proc.stderr


def _plan(*args: str, check: bool = True):
    return run_cli("plan", "qwen3-next-80b-a3b", "--context", "32K", *args, check=check)


def test_inventory_bounds_best_and_baselines() -> None:
    doc = json.loads(_plan("--gpus", "h100:16,a100:8", "--tpot-slo-ms", "50", "--json").stdout)
    assert doc["inventory"] == {"h100-sxm": 16, "a100-sxm-80gb": 8}
    entries = [doc["best"], *(e for e in doc["baselines"].values() if e.get("strategy"))]
    assert len(entries) >= 4
    for e in entries:
        assert set(e) >= PLAN_FIELDS
        assert e["gpus_used"].get("h100-sxm", 0) <= 16
        assert e["gpus_used"].get("a100-sxm-80gb", 0) <= 8
        assert e["replica_sets"] >= 1
        for o in e["owners"]:
            assert o["memory_bytes_per_gpu"] <= o["memory_capacity_bytes_per_gpu"]
        kinds = {op["layer_kind"] for p in e["placement"] for op in p["operators"]}
        assert kinds == {None, "full", "linear"}
    # unbounded, the same question needs more GPUs than the user has (the example)
    free = json.loads(_plan("--gpus", "h100,a100", "--tpot-slo-ms", "50", "--json").stdout)
    assert sum(free["best"]["gpus_used"].values()) > 24
    assert free["best"]["usd_per_million_tokens"] <= doc["best"]["usd_per_million_tokens"]


def test_text_output_says_it_in_plain_words() -> None:
    out = _plan("--gpus", "h100:16,a100:8", "--tpot-slo-ms", "50").stdout
    assert "attention-FFN disaggregation" in out and "core-attention disaggregation" in out
    assert "owner 0:" in out and "GB per GPU" in out and "full-attention layers" in out
    assert "tokens/s" in out and "/hour on" in out
    assert "holds 1 such deployment" in out or "such deployments" in out
    for words in ("decode only", "every request is at the 32768-token context", "full", "dated"):
        assert words in out


def test_an_inventory_too_small_is_one_line_naming_the_smallest_plan() -> None:
    proc = _plan("--gpus", "h100:1", "--tpot-slo-ms", "50", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in proc.stderr
    assert line.startswith("error: no plan that fits the inventory h100-sxm:1")
    assert "the smallest plan that meets it needs 3 x h100-sxm" in line


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ("h100:0", "must be a positive whole number of GPUs, got '0'"),
        ("h100:-1", "must be a positive whole number of GPUs, got '-1'"),
        ("h100:x", "must be a positive whole number of GPUs, got 'x'"),
        ("h100:", "must be a positive whole number of GPUs, got ''"),
        (":4", "has no GPU type"),
        ("h100,h100", "names h100 more than once"),
        ("h100:8,h100-sxm:8", "h100-sxm is given more than once"),
        ("h100,a100,l40s", "one or two GPU types"),
        ("h100:8,nope:2", "unknown GPU 'nope'"),
    ],
)
def test_bad_gpus_are_one_line_errors(gpus: str, message: str) -> None:
    proc = _plan("--gpus", gpus, "--tpot-slo-ms", "50", check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("slos", ["0", "-5", "x", "20,nan", "20,20", "inf"])
def test_bad_slos_are_one_line_errors(slos: str) -> None:
    proc = _plan("--gpus", "h100", "--tpot-slo-ms", slos, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--tpot-slo-ms" in proc.stderr


def test_slo_sweep_prints_the_frontier_and_plots_it(tmp_path) -> None:
    png, out = tmp_path / "frontier.png", tmp_path / "plan.json"
    args = ("--gpus", "h100,a100", "--tpot-slo-ms", "50,20,100", "--plot", str(png))
    doc = json.loads(_plan(*args, "-o", str(out), "--json").stdout)
    assert [r["tpot_slo_s"] for r in doc["sweep"]] == [0.02, 0.05, 0.1]
    front = doc["frontier"]
    assert set(front) == {"opweave", "colocated", "afd", "cad"}
    costs = [p["usd_per_million_tokens"] for p in front["opweave"]]
    assert costs == sorted(costs, reverse=True)  # a looser SLO never costs more
    for name in ("colocated", "afd", "cad"):
        for ours, theirs in zip(front["opweave"], front[name], strict=True):
            assert theirs is None or ours["usd_per_million_tokens"] <= theirs[
                "usd_per_million_tokens"
            ] * (1 + 1e-12)
    for point, r in zip(front["opweave"], doc["sweep"], strict=True):
        assert point["tpot_s"] <= r["tpot_slo_s"]
        assert point["usd_per_million_tokens"] == r["best"]["usd_per_million_tokens"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    for slo in ("20", "50", "100"):
        saved = json.loads((tmp_path / f"plan-{slo}ms.json").read_text())
        assert saved["tpot_slo_s"] == float(slo) / 1e3
    text = _plan(*args).stdout
    assert text.startswith("Cost per million tokens vs TPOT")
    assert "attention-FFN disaggregation" in text
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[3:6]] == ["20", "50", "100"]  # the table rows
    assert (
        sum(line.startswith(("20 ms: best", "50 ms: best", "100 ms: best")) for line in lines) == 3
    )


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="h10a:,-x 8l4s.²٣", max_size=24))
def test_gpus_parser_fuzz(text: str) -> None:
    """Any --gpus text parses to distinct names with positive counts, or is a one-line error."""
    from opweave.cli.planning import parse_gpus

    try:
        names, inventory = parse_gpus(text)
    except (ConfigError, typer.BadParameter) as exc:
        message = exc.format_message() if isinstance(exc, typer.BadParameter) else str(exc)
        assert message and "\n" not in message
        return
    assert 1 <= len(names) <= 2 and len({n.lower() for n in names}) == len(names)
    assert set(inventory) <= set(names)
    assert all(isinstance(n, int) and n >= 1 for n in inventory.values())


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.,-einfa ", max_size=16))
def test_slo_parser_fuzz(text: str) -> None:
    from opweave.cli.planning import parse_slos

    try:
        slos = parse_slos(text)
    except (ConfigError, typer.BadParameter) as exc:
        message = exc.format_message() if isinstance(exc, typer.BadParameter) else str(exc)
        assert message and "\n" not in message
        return
    assert slos == sorted(set(slos)) and all(0 < s < float("inf") for s in slos)
