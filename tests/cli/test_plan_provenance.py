"""A plan carries what it was made with: the GPU specs (a --hardware file's, a profile's
device) and its latency sources. Re-simulating or deploying it reproduces them, says where it
does not, and refuses to swap a measured profile for the roofline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fuzzing import invoke, one_line_error
from tests.helpers import IMAGE, TINY_LLAMA

PLAN = ["plan", "qwen3-32b", "--gpus", "h100", "--context", "4K", "--tpot-slo-ms", "50"]


def _ok(args: list[str]) -> tuple[str, str]:
    code, out, err, _ = invoke(args)
    assert code == 0, (code, out, err)
    return out, err


def _hardware(tmp_path: Path, name: str, **fields: object) -> Path:
    path = tmp_path / f"{name}.toml"
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    path.write_text(f'[[gpus]]\nid = "h100-sxm"\n{body}')
    return path


@pytest.fixture
def tiny(write_config) -> Path:
    return write_config(TINY_LLAMA, "tiny")


def test_simulate_uses_the_specs_the_plan_was_made_with(tmp_path: Path) -> None:
    cheap = _hardware(tmp_path, "cheap", usd_per_hour=1.0)
    plan_file = tmp_path / "p.json"
    _ok([*PLAN, "--hardware", str(cheap), "-o", str(plan_file), "--json"])
    plan = json.loads(plan_file.read_text())
    assert [hw["id"] for hw in plan["hardware"]] == ["h100-sxm"]
    assert plan["hardware"][0]["usd_per_hour"] == 1.0
    planned = plan["prediction"]["usd_per_million_tokens"]

    out, err = _ok(["simulate", str(plan_file), "--json"])
    assert json.loads(out)["usd_per_million_tokens"] == pytest.approx(planned, rel=1e-12)
    assert json.loads(out)["notes"] == [] and err == ""

    # a what-if with other specs is simulated with them, and says so
    dear = _hardware(tmp_path, "dear", usd_per_hour=3.0)
    out, err = _ok(["simulate", str(plan_file), "--hardware", str(dear), "--json"])
    doc = json.loads(out)
    assert doc["usd_per_million_tokens"] == pytest.approx(3 * planned, rel=1e-9)
    assert doc["notes"] == ["h100-sxm: usd_per_hour 1.0 -> 3.0"]
    assert "note: simulating other specs than the plan was made with" in err


def test_deploy_lays_nodes_out_with_the_planned_node_size(tmp_path: Path) -> None:
    small_nodes = _hardware(tmp_path, "nodes", gpus_per_node=2)
    plan_file = tmp_path / "p.json"
    _ok([*PLAN, "--hardware", str(small_nodes), "-o", str(plan_file)])
    doc = json.loads(plan_file.read_text())
    owner = doc["owners"][0]
    assert doc["hardware"][0]["gpus_per_node"] == 2 and owner["tp"] <= 2
    # twice the replica sets: more GPUs than one node
    doc["owners"] = [{**o, "replicas": 2 * o["replicas"]} for o in doc["owners"]]
    plan_file.write_text(json.dumps(doc))
    out, _ = _ok(["deploy", str(plan_file), "-o", str(tmp_path / "dep"), *IMAGE, "--json"])
    nodes = json.loads(out)["nodes"]
    assert sum(n["gpus"] for n in nodes) == sum(
        o["replicas"] * o["tp"] * o["dp"] for o in doc["owners"]
    )
    assert sum(n["gpus"] for n in nodes) > 2
    assert max(n["gpus"] for n in nodes) <= 2  # the built-in h100-sxm has 8 per node


def test_a_profiled_plan_needs_its_profile(tmp_path: Path, tiny: Path) -> None:
    from opweave.costmodel import default_catalog, load_model, synthesize_profile

    spec = load_model(tiny)
    profile = synthesize_profile(spec, default_catalog().get("l4"), batches=(1, 4, 16))
    path = tmp_path / "l4.json"
    path.write_text(profile.model_dump_json())
    plan_file = tmp_path / "p.json"
    base = ["plan", str(tiny), "--gpus", "l4", "--context", "256", "--tpot-slo-ms", "50"]
    out, _ = _ok([*base, "--profile", str(path), "-o", str(plan_file)])
    assert not json.loads(plan_file.read_text())["profiles"][0].endswith(":roofline")
    # the plan and its re-simulation say where the latencies came from
    said = f"l4 latencies: synthesised on {profile.device.name} ({profile.provenance.date})"
    assert f"  - {said}, " in out, out
    message = one_line_error(["simulate", str(plan_file), "--model", str(tiny)])
    assert "the plan's l4 latencies come from a measured profile" in message
    assert "pass that profile with --profile" in message
    out, err = _ok(["simulate", str(plan_file), "--model", str(tiny), "--profile", str(path)])
    assert err == ""
    assert f"l4 latencies: {path}, synthesised on {profile.device.name}" in out, out


def test_a_profile_naming_a_catalog_gpu_by_its_alias(tmp_path: Path, tiny: Path) -> None:
    from opweave.costmodel import default_catalog, load_model, synthesize_profile

    spec = load_model(tiny)
    profile = synthesize_profile(spec, default_catalog().get("h100-sxm"), batches=(1, 4, 16))
    doc = json.loads(profile.model_dump_json())
    doc["device"]["id"] = "H100"  # an alias of h100-sxm, in another case
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(doc))
    plan_file = tmp_path / "p.json"
    for gpus in ("h100-sxm", "h100"):
        _ok(
            [
                *["plan", str(tiny), "--gpus", gpus, "--context", "256", "--tpot-slo-ms", "50"],
                *["--profile", str(path), "-o", str(plan_file)],
            ]
        )
        plan = json.loads(plan_file.read_text())
        assert {o["gpu"] for o in plan["owners"]} == {"h100-sxm"}
        # the profile's tables were used, not the catalog's roofline
        assert plan["profiles"][0].startswith("h100-sxm:")
        assert not plan["profiles"][0].endswith(":roofline")


def test_planning_beyond_a_profiles_grid_says_so(tmp_path: Path, tiny: Path) -> None:
    from opweave.costmodel import default_catalog, load_model, synthesize_profile

    spec = load_model(tiny)
    hw = default_catalog().get("l4")
    profile = synthesize_profile(spec, hw, batches=(1, 2), contexts=(16, 64))
    path = tmp_path / "l4.json"
    path.write_text(profile.model_dump_json())
    base = ["plan", str(tiny), "--gpus", "l4", "--tpot-slo-ms", "50", "--profile", str(path)]
    out, _ = _ok([*base, "--context", "1024", "--batch", "8", "--microbatches", "2", "--json"])
    notes = [a for a in json.loads(out)["assumptions"] if "extrapolated" in a]
    assert len(notes) == 1, json.loads(out)["assumptions"]
    assert "context 1024 (measured 16-64 tokens)" in notes[0]
    assert "microbatches of 4 requests (measured 1-2)" in notes[0]
    out, _ = _ok([*base, "--context", "32", "--batch", "2", "--microbatches", "1", "--json"])
    assert not [a for a in json.loads(out)["assumptions"] if "extrapolated" in a]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"usd_per_hour": "2.0"}, "field 'usd_per_hour': Input should be a valid number"),
        ({"gpus_per_node": 8.0}, "field 'gpus_per_node': Input should be a valid integer"),
        ({"mem_bandwidth_bytes_per_s": 1e300}, "field 'mem_bandwidth_bytes_per_s'"),
        ({"memory_bytes": 1e16}, "field 'memory_bytes'"),
        ({"step_overhead_s": 5.0}, "field 'step_overhead_s'"),
        ({"usd_per_hour": 1e9}, "field 'usd_per_hour'"),
        ({"memory_efficiency": True}, "field 'memory_efficiency'"),
    ],
)
def test_hardware_numbers_are_numbers_within_reason(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    path = _hardware(tmp_path, "bad", **fields)
    assert message in one_line_error(["gpus", "--hardware", str(path)])


def test_plan_files_are_read_strictly(tmp_path: Path) -> None:
    plan_file = tmp_path / "p.json"
    _ok([*PLAN, "-o", str(plan_file)])
    doc = json.loads(plan_file.read_text())
    for field, value in (("context_tokens", "4096"), ("microbatches", 1.0)):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**doc, field: value}))
        message = one_line_error(["simulate", str(bad)])
        assert f"is not a valid plan ({field}:" in message
    stray = {**doc, "hardware": [{**doc["hardware"][0], "id": "a100-sxm-80gb"}]}
    (tmp_path / "stray.json").write_text(json.dumps(stray))
    assert "hardware describes a100-sxm-80gb, which no owner uses" in one_line_error(
        ["simulate", str(tmp_path / "stray.json")]
    )


def test_deploy_refuses_an_edited_precision_and_says_what_it_did_not_check(
    tmp_path: Path,
) -> None:
    """deploy checks a built-in model's plan as simulate does: a precision edited beside the
    built-in's fingerprint is refused (it wrote launch scripts for it), and a plan of another
    config of that name is deployed with a note that its memory was not re-checked."""
    plan_file = tmp_path / "p.json"
    _ok([*PLAN, "-o", str(plan_file)])
    doc = json.loads(plan_file.read_text())
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**doc, "model": {**doc["model"], "quant": "fp8"}}))
    message = one_line_error(["deploy", str(edited), "-o", str(tmp_path / "a"), *IMAGE])
    assert message.endswith("the file was edited; plan again"), message
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**doc, "model": {**doc["model"], "config_sha256": "0" * 64}}))
    _, err = _ok(["deploy", str(other), "-o", str(tmp_path / "b"), *IMAGE])
    assert "config other than the built-in one" in err and "not re-checked" in err
    _, err = _ok(["deploy", str(plan_file), "-o", str(tmp_path / "c"), *IMAGE])
    assert err == ""
