"""``opweave plan`` and ``opweave simulate``: the JSON contract and bad input."""

from __future__ import annotations

import json

import pytest

from tests.helpers import cli_json, run_cli

PLAN_FIELDS = {"strategy", "usd_per_million_tokens", "tpot_s", "stages_per_token", "owners"}


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
