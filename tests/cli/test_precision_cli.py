"""``--quant`` and ``--kv-cache-dtype`` on ``estimate``/``plan``: the JSON contract (DESIGN.md:
``estimate --json`` carries ``quant``, ``kv_cache_dtype``, ``weight_bytes_per_gpu``; every owner
of ``plan --json`` carries ``quant``), plan files that re-derive the same model, and bad values
as one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.costmodel.test_precision import CHECKPOINTS, _qwen3_32b, block_fp8
from tests.helpers import cli_json, run_cli


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("Qwen3-32B-FP8")
    shutil.copy(CHECKPOINTS / "qwen3-32b-fp8.json", folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def fp8_h100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An H100 with its datasheet dense FP8 peak (1979 TFLOPS)."""
    path = tmp_path_factory.mktemp("hw") / "h100-fp8.toml"
    path.write_text('[[gpus]]\nid = "h100-sxm"\nfp8_flops_per_s = 1979e12\n')
    return path


def test_estimate_json_says_its_precision(fp8_folder: Path) -> None:
    doc = cli_json("estimate", str(fp8_folder), "--gpu", "h100", "--batch", "8")
    assert (doc["quant"], doc["kv_cache_dtype"]) == ("fp8-block", "bf16")
    assert doc["weight_bytes_per_gpu"] == pytest.approx(_qwen3_32b(block_fp8), abs=64)
    two = cli_json("estimate", str(fp8_folder), "--gpu", "h100", "--batch", "8", "--tp", "2")
    assert two["weight_bytes_per_gpu"] < doc["weight_bytes_per_gpu"] * 0.51
    kv8 = cli_json(
        "estimate", str(fp8_folder), "--gpu", "h100", "--batch", "8", "--kv-cache-dtype", "fp8"
    )
    assert kv8["kv_cache_dtype"] == "fp8"
    # 8 requests of 4096 tokens: the KV cache (2 x 8 heads x 128 x 64 layers per token) halves
    kv_bf16 = 8 * 4096 * 2 * 8 * 128 * 64 * 2
    saved = doc["memory_bytes_per_gpu"] - kv8["memory_bytes_per_gpu"]
    assert saved == pytest.approx(kv_bf16 / 2)


def test_fp8_gemms_run_at_the_fp8_rate(fp8_h100: Path) -> None:
    args = ("estimate", "qwen3-32b", "--gpu", "h100", "--batch", "512", "--context", "1K")
    bf16 = cli_json(*args, "--hardware", str(fp8_h100))
    fp8 = cli_json(*args, "--hardware", str(fp8_h100), "--quant", "fp8")
    a100 = cli_json(*args[:3], "a100", *args[4:], "--quant", "fp8")
    assert fp8["gemm_path"] == "fp8 tensor cores (W8A8)" and fp8["quant"] == "fp8"
    assert bf16["gemm_path"] == "bf16 tensor cores" and bf16["quant"] == "bf16"
    assert a100["gemm_path"] == "weight-only: fp8 weights dequantised to bf16 math"
    assert fp8["breakdown_s"]["gemm"] < 0.6 * bf16["breakdown_s"]["gemm"]


def test_plan_owners_carry_the_precision_and_the_file_rederives_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    doc = cli_json(
        "plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "50",
        "--quant", "fp8", "--kv-cache-dtype", "fp8", "-o", str(out),
    )  # fmt: skip
    entries = [doc["best"], *(e for e in doc["baselines"].values() if "owners" in e)]
    for entry in entries:
        assert {o["quant"] for o in entry["owners"]} == {"fp8"}
        assert {o["kv_cache_dtype"] for o in entry["owners"]} == {"fp8"}
        assert {p["quant"] for p in entry["placement"]} == {"fp8"}
    assert any(a.startswith("precision: weights fp8 (--quant fp8") for a in doc["assumptions"])
    plan = json.loads(out.read_text())
    assert (plan["model"]["quant"], plan["model"]["kv_cache_dtype"]) == ("fp8", "fp8")
    sim = cli_json("simulate", str(out))
    assert sim["tpot_s"] == pytest.approx(doc["best"]["tpot_s"], rel=1e-6)
    assert (sim["quant"], sim["kv_cache_dtype"]) == ("fp8", "fp8")
    text = run_cli("simulate", str(out)).stdout
    assert "(fp8 weights, fp8 KV cache)" in text


def test_plan_text_says_which_precision_it_assumed(fp8_folder: Path) -> None:
    out = run_cli(
        "plan", str(fp8_folder), "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "50"
    ).stdout
    assert "fp8-block weights," in out  # each owner line
    assert "precision: weights fp8-block (config.json quantization_config: fp8, 128x128" in out


def test_a_plan_file_for_another_precision_is_refused(fp8_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    run_cli(
        "plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "50",
        "--quant", "nvfp4", "-o", str(out),
    )  # fmt: skip
    proc = run_cli("simulate", str(out), "--model", str(fp8_folder), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: plan {out} assumed nvfp4 weights, but {fp8_folder} stores fp8-block "
        "(config.json quantization_config: fp8, 128x128 blocks); pass --model with the config "
        "it was planned for"
    )


def _modelopt_fp8(folder: Path) -> Path:
    config = json.loads((CHECKPOINTS / "qwen3-32b-fp8.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}})
    )
    return folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quant", "int8"], "--quant 'int8': use one of bf16, fp8, fp8-block, nvfp4, mxfp4"),
        (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype 'fp16': use one of auto, fp8"),
        (["--quant", "mxfp4"], "--quant mxfp4 quantises routed experts only"),
    ],
)
def test_bad_precision_flags_are_one_line_errors(args: list[str], message: str) -> None:
    for command in (["estimate", "qwen3-32b", "--gpu", "h100"],
                    ["plan", "qwen3-32b", "--gpus", "h100", "--context", "1K",
                     "--tpot-slo-ms", "50"]):  # fmt: skip
        proc = run_cli(*command, *args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: ") and message in lines[0]


def test_checkpoint_conflicts_and_gpus_that_cannot_run_a_format(
    fp8_folder: Path, tmp_path: Path
) -> None:
    proc = run_cli("estimate", str(fp8_folder), "--gpu", "h100", "--quant", "nvfp4", check=False)
    assert proc.returncode == 2
    assert "--quant nvfp4: this checkpoint is already quantised (fp8-block" in proc.stderr
    modelopt = _modelopt_fp8(tmp_path)
    assert cli_json("estimate", str(modelopt), "--gpu", "h100")["quant"] == "fp8"
    for command in (["estimate", str(modelopt), "--gpu", "a100"],
                    ["plan", str(modelopt), "--gpus", "h100,a100", "--context", "1K",
                     "--tpot-slo-ms", "50"]):  # fmt: skip
        proc = run_cli(*command, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(
            "error: fp8 weights (hf_quant_config.json: ModelOpt FP8) cannot run on a100-sxm-80gb"
        )


def test_analyze_takes_the_precision_flags() -> None:
    args = ("analyze", "qwen3-32b", "--gpus", "h100", "--contexts", "8K")
    doc = cli_json(*args, "--quant", "fp8", "--kv-cache-dtype", "fp8")
    assert (doc["quant"], doc["kv_cache_dtype"]) == ("fp8", "fp8")
    assert doc["weight_bytes"] == pytest.approx(_qwen3_32b(lambda i, o: i * o + 4), abs=64)
    plain = cli_json(*args)
    # the FP8 KV cache holds half the bytes per request
    assert doc["state_bytes_per_request"][0] == plain["state_bytes_per_request"][0] / 2


def test_a_float32_checkpoint_is_costed_as_engines_serve_it(tmp_path: Path) -> None:
    """vLLM's and SGLang's ``--dtype auto`` serve float32 weights in bfloat16 on GPUs: so does
    ``estimate`` without ``--quant``; ``--quant fp32`` keeps float32, ``--quant bf16|fp16``
    name the dtype. Weights and KV cache counted from the config here: a tiny Llama's linears,
    embedding and untied head, and 2 layers x 2 KV heads x 16 x (K, V) per token."""
    from tests.helpers import TINY_LLAMA

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    h, inter, vocab, layers = 64, 128, 100, 2
    params = layers * (h * h + 2 * h * 32 + h * h + 3 * h * inter + 2 * h) + 2 * vocab * h + h
    kv_per_token = layers * 2 * 2 * 16
    args = ("estimate", str(tmp_path), "--gpu", "h100", "--batch", "4", "--context", "1K")
    by_flag = {
        flag: cli_json(*args, *(("--quant", flag) if flag else ()))
        for flag in (None, "bf16", "fp16", "fp32")
    }
    for flag, (quant, size) in {
        None: ("bf16", 2), "bf16": ("bf16", 2), "fp16": ("fp16", 2), "fp32": ("fp32", 4)
    }.items():  # fmt: skip
        doc = by_flag[flag]
        assert (doc["quant"], doc["kv_cache_dtype"]) == (quant, quant), flag
        assert doc["weight_bytes_per_gpu"] == params * size, flag
        kv = doc["memory_bytes_per_gpu"] - by_flag["fp32"]["memory_bytes_per_gpu"]
        assert kv == pytest.approx((size - 4) * (4 * 1024 * kv_per_token + params), rel=0.05)
    text = run_cli(*args).stdout
    assert "weights bf16 (a float32 checkpoint served in bf16: as vLLM's and SGLang's" in text
    # quantised online, the rest of a float32 checkpoint is served in bf16 too
    fp8 = cli_json(*args, "--quant", "fp8")
    assert (fp8["quant"], fp8["kv_cache_dtype"]) == ("fp8", "bf16")
    linears = layers * (h * h + 2 * h * 32 + h * h + 3 * h * inter)
    # FP8 linears with an FP32 scale each (7 per layer), the rest (norms, embeddings) in bf16
    assert fp8["weight_bytes_per_gpu"] == linears + 7 * layers * 4 + (params - linears) * 2


def test_fp16_is_refused_where_vllm_refuses_it() -> None:
    proc = run_cli("estimate", "gemma-3-27b", "--gpu", "h100", "--quant", "fp16", check=False)
    assert proc.returncode == 2
    assert "--quant fp16: vLLM does not serve gemma3_text models in float16" in proc.stderr


def test_float32_math_runs_at_the_gpus_fp32_rate() -> None:
    """A compute-bound step of Qwen3-8B (1,024 requests): its GEMMs are 2 FLOPs per linear
    weight per token (36 layers of q, k, v, o, gate, up, down, and the LM head at one position
    per request). bf16 runs them on the H100's tensor cores (989 TFLOPS), fp32 without them (67
    TFLOPS: vLLM's float32 matmul precision is 'highest', no TF32), both at its 80%."""
    h, inter, kv, vocab, layers, batch = 4096, 12288, 8 * 128, 151936, 36, 1024
    linears = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * vocab
    flops = 2 * linears * batch
    args = ("estimate", "qwen3-8b", "--gpu", "h100", "--batch", str(batch), "--context", "1K")
    for quant, peak, path in (
        ("bf16", 989e12, "bf16 tensor cores"),
        ("fp32", 67e12, "fp32 math (no tensor cores)"),
    ):
        doc = cli_json(*args, "--quant", quant)
        assert doc["gemm_path"] == path
        assert doc["breakdown_s"]["gemm"] == pytest.approx(flops / (0.80 * peak), rel=1e-3)
