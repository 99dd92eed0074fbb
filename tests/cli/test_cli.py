"""The CLI contract of DESIGN.md: --json documents and one-line errors."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.fuzzing import one_line_error
from tests.helpers import TINY_LLAMA, cli_json, run_cli


def test_models_and_gpus_json() -> None:
    models = {m["name"]: m for m in cli_json("models")["models"]}
    assert set(models) == {
        "gemma-3-27b",
        "qwen3-next-80b-a3b",
        "llama-3.3-70b",
        "qwen3-32b",
        "qwen3-30b-a3b",
        "deepseek-v3",
        "kimi-k2",
        "qwen3.5-397b-a17b",
        "minimax-m2.5",
        "minimax-m2",
        "qwen3-8b",
        "qwen3-235b-a22b",
        "qwen3-coder-480b-a35b",
    }
    assert models["gemma-3-27b"]["block_layers"] == 6
    assert models["kimi-k2"]["family"] == "deepseek_v3"
    deepseek = models["deepseek-v3"]
    assert (deepseek["block_prefix_layers"], deepseek["block_layers"]) == (3, 1)
    gpus = {g["id"]: g for g in cli_json("gpus")["gpus"]}
    assert gpus["h100-sxm"]["mem_bandwidth_bytes_per_s"] == 3.35e12
    assert gpus["l4"]["usd_per_hour"] == 0.44
    assert "RunPod Community Cloud" in gpus["l4"]["price_source"]


def test_gpus_json_lists_the_rack_scale_and_new_gpus_with_their_fields() -> None:
    gpus = {g["id"]: g for g in cli_json("gpus")["gpus"]}
    assert {"b300", "gb200", "gb300", "h20", "rtx-pro-6000"} <= set(gpus)
    gb200 = gpus["gb200"]
    assert gb200["fp8_flops_per_s"] == 5e15 and gb200["fp4_flops_per_s"] == 1e16
    assert (gb200["gpus_per_node"], gb200["nvlink_domain_gpus"]) == (4, 72)
    assert gb200["fp4_compute_efficiency"] == 0.76
    assert gpus["gb300"]["fp4_flops_per_s"] == 1.5e16 and gpus["gb300"]["usd_per_hour"] is None
    assert gpus["b300"]["memory_bytes"] == 275040 * 2**20  # as nvidia-smi reports it
    assert gpus["b300"]["nvlink_domain_gpus"] is None
    assert gpus["h20"]["fp4_flops_per_s"] is None and gpus["h20"]["fp8_flops_per_s"] == 296e12
    assert gpus["rtx-pro-6000"]["intra_node_link"] == "PCIe Gen5 x16"
    assert gpus["a100-sxm-80gb"]["fp8_flops_per_s"] is None


def test_a_gpu_without_a_price_is_refused_by_plan_with_the_field_to_give(tmp_path) -> None:
    base = ["plan", "qwen3-32b", "--context", "8K", "--tpot-slo-ms", "50"]
    result = run_cli(*base, "--gpus", "gb300", check=False)
    assert result.returncode == 2
    assert "GPU gb300 has no price; give usd_per_hour" in result.stderr
    hw = tmp_path / "hw.toml"
    hw.write_text('[[gpus]]\nid = "gb300"\nusd_per_hour = 7.5\n')
    doc = cli_json(*base, "--gpus", "gb300", "--hardware", str(hw))
    assert doc["best"]["gpus_used"].keys() == {"gb300"}


def test_gpus_table_says_where_each_price_comes_from() -> None:
    out = run_cli("gpus").stdout
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    assert "RunPod Community Cloud on-demand, 2026-09-25" in rows["h100-sxm"]
    assert "other basis: DigitalOcean" in rows["mi300x"]
    assert "Override with --hardware" in out


def test_estimate_json_fields() -> None:
    doc = cli_json(
        "estimate",
        "llama-3.3-70b",
        "--gpu",
        "h100",
        "--tp",
        "4",
        "--batch",
        "32",
        "--context",
        "8K",
    )
    assert {"step_latency_s", "breakdown_s", "memory_bytes_per_gpu", "fits"} <= set(doc)
    assert doc["context_tokens"] == 8192 and doc["fits"] is True
    assert doc["step_latency_s"] == pytest.approx(sum(doc["breakdown_s"].values()))
    # The fixed costs are their own terms: 80 layers x 10 kernels + 4 at 3.7 us each, 160
    # collectives (+ embed, lm_head) at the H100's 3.0 us floor, one 160 us step, no MoE.
    br = doc["breakdown_s"]
    assert br["kernel_launch"] == pytest.approx(804 * 3.7e-6)
    assert br["allreduce_latency"] == pytest.approx(162 * 3.0e-6)
    assert br["step_overhead"] == pytest.approx(160e-6)
    assert br["moe_experts"] == 0.0
    # 70B in bf16 does not fit one 80 GB GPU.
    assert cli_json("estimate", "llama-3.3-70b", "--gpu", "h100", "--tp", "1")["fits"] is False


def test_estimate_expert_and_data_parallel_json() -> None:
    args = ("estimate", "qwen3-30b-a3b", "--gpu", "h200", "--batch", "256", "--context", "4K")
    tp = cli_json(*args, "--tp", "8")
    ep = cli_json(*args, "--tp", "1", "--ep", "8", "--dp", "8")
    # the contract's keys, and the terms and figures EP/DP add
    for doc in (tp, ep):
        assert {"step_latency_s", "breakdown_s", "memory_bytes_per_gpu", "fits"} <= set(doc)
        assert {"tp", "ep", "dp", "expert_imbalance", "expert_imbalance_basis"} <= set(doc)
        assert {"alltoall", "alltoall_latency"} <= set(doc["breakdown_s"])
        assert doc["step_latency_s"] == pytest.approx(sum(doc["breakdown_s"].values()))
    assert (tp["tp"], tp["ep"], tp["dp"]) == (8, 1, 1) and tp["expert_imbalance"] is None
    assert (ep["tp"], ep["ep"], ep["dp"]) == (1, 8, 8)
    assert ep["breakdown_s"]["alltoall_latency"] == pytest.approx(48 * 2 * 42e-6)
    assert ep["expert_imbalance"] > 1 and ep["expert_imbalance_basis"].startswith("assumed")
    assert ep["usd_per_million_tokens"] < tp["usd_per_million_tokens"]
    measured = cli_json(*args, "--tp", "1", "--ep", "8", "--dp", "8", "--expert-imbalance", "2")
    assert measured["expert_imbalance"] == pytest.approx(2 * ep["expert_imbalance"])
    assert measured["expert_imbalance_basis"].startswith("measured")
    text = run_cli(*args, "--tp", "1", "--ep", "8", "--dp", "8").stdout
    assert (
        "8 x h200-sxm (attention in 8 data-parallel ranks of TP1, experts EP8 over the 8 GPUs)"
        in text
    )
    assert "busiest expert GPU: 1.08x the mean load (assumed" in text
    # no GPU takes more than every token's copies its experts can: 8 of 16 experts per GPU at
    # EP8 take all 8 of a token's, 8 times the mean (1e6 was printed as 8x without a word)
    flags = ("--tp", "1", "--ep", "8", "--dp", "8")
    message = one_line_error([*args, *flags, "--expert-imbalance", "8.5"])
    assert message == (
        "error: --expert-imbalance 8.5 is more than a busiest expert GPU can carry with --ep 8: "
        "at most 8 times the mean, when it holds as many of each token's 8 experts as it can"
    )
    assert cli_json(*args, *flags, "--expert-imbalance", "8")["expert_imbalance"] == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep", "3", "--dp", "8"], "--tp 1 --ep 3 --dp 8: ep 3 does not divide tp x dp = 8"),
        (["--ep", "256", "--dp", "256"], "ep 256 is more than the 128 routed experts"),
        (["--ep", "4", "--dp", "12"], "spans part of an NVLink domain of 8"),
        (["--dp", "2048"], "--dp must be from 1 to 1024"),
        (["--ep", "0"], "--ep must be from 1 to 1024"),
        (["--expert-imbalance", "2"], "--expert-imbalance applies to expert parallelism"),
        (["--ep", "8", "--dp", "8", "--expert-imbalance", "0.5"], "at least 1"),
    ],
)
def test_estimate_refuses_illegal_parallelism(args: list[str], message: str) -> None:
    proc = run_cli("estimate", "qwen3-30b-a3b", "--gpu", "h200", *args, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_estimate_refuses_expert_parallelism_on_a_dense_model() -> None:
    proc = run_cli("estimate", "qwen3-32b", "--gpu", "h100", "--ep", "2", "--dp", "2", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --tp 1 --ep 2 --dp 2: ep 2: qwen3-32b has no routed experts (a dense model); "
        "use ep 1"
    )


def test_expert_parallelism_frees_fp8_experts_from_the_tp_block_check() -> None:
    """Qwen3-235B-A22B-FP8's experts (1536 channels) do not split into whole 128-wide FP8 blocks
    over TP 8, so TP 8 alone is refused, as vLLM refuses it; with --ep 8 every GPU holds whole
    experts and the deployment (vLLM's --enable-expert-parallel) estimates."""
    config = Path(__file__).parents[1] / "costmodel/checkpoints/qwen3-235b-a22b-fp8.json"
    args = ("estimate", str(config), "--gpu", "h100")
    proc = run_cli(*args, "--tp", "8", check=False)
    assert proc.returncode == 2
    assert "shards of 192 are not whole 128x128 FP8 scale blocks at tp 8" in proc.stderr
    doc = cli_json(*args, "--tp", "8", "--ep", "8", "--batch", "16")
    assert (doc["tp"], doc["ep"], doc["quant"]) == (8, 8, "fp8-block") and doc["fits"]


def test_estimate_host_profile() -> None:
    args = ("estimate", "qwen3-32b", "--gpu", "a100", "--batch", "4")
    stock = cli_json(*args)
    v04 = cli_json(*args, "--host", "vllm-0.4")
    # vLLM 0.4's engine: 1.71 ms a step + 0.103 ms per request of output processing, in place
    # of the GPU's 160 us; every other term unchanged.
    assert v04["breakdown_s"]["step_overhead"] == pytest.approx(1.71e-3 + 4 * 3.2e-3 / 31)
    assert stock["breakdown_s"]["step_overhead"] == pytest.approx(160e-6)
    assert {k: v for k, v in v04["breakdown_s"].items() if k != "step_overhead"} == {
        k: v for k, v in stock["breakdown_s"].items() if k != "step_overhead"
    }
    proc = run_cli(*args, "--host", "vllm-9", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown host profile 'vllm-9'; known: overlapped, sglang, sglang-sync, "
        "tensorrt-llm, vllm-0.6, vllm-0.4"
    ]


def test_estimate_any_config_path(write_config) -> None:
    folder = write_config(TINY_LLAMA, "tiny-llama")
    doc = cli_json("estimate", str(folder), "--gpu", "a100", "--batch", "4")
    assert doc["model"] == "tiny-llama" and doc["fits"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate", "nope", "--gpu", "h100"], "unknown model 'nope'"),
        (["estimate", "qwen3-32b", "--gpu", "h900"], "unknown GPU 'h900'"),
        (["estimate", "qwen3-32b", "--gpu", "h100", "--tp", "3"], "does not split over tp 3"),
        (["estimate", "qwen3-32b", "--gpu", "h100", "--tp", "16"], "8 GPUs per NVLink domain"),
        (["estimate", "qwen3-32b", "--gpu", "h100", "--tp", "0"], "--tp must be from 1"),
        (["estimate", "qwen3-32b", "--gpu", "h100", "--context", "lots"], "not a token count"),
        (["estimate", "qwen3-32b"], "Missing option '--gpu'"),
        (["analyze", "qwen3-32b", "--gpus", "h100,a100,l40s"], "one or two GPU ids"),
        (["gpus", "--hardware", "/nonexistent.toml"], "does not exist"),
    ],
)
def test_bad_input_gets_one_line_error(args: list[str], message: str) -> None:
    proc = run_cli(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_unsupported_family_and_malformed_config(write_config, tmp_path) -> None:
    folder = write_config({"model_type": "bert", "hidden_size": 8}, "bert")
    proc = run_cli("estimate", str(folder), "--gpu", "h100", check=False)
    assert proc.returncode == 2 and "model_type 'bert' is not supported" in proc.stderr
    broken = tmp_path / "broken" / "config.json"
    broken.parent.mkdir()
    broken.write_text("{")
    proc = run_cli("estimate", str(broken), "--gpu", "h100", check=False)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr


def test_json_output_is_only_json() -> None:
    proc = run_cli("estimate", "gemma-3-27b", "--gpu", "h200", "--batch", "8", "--json")
    json.loads(proc.stdout)
    assert proc.stderr == ""


def test_commands_of_a_missing_library_say_which_package_they_need() -> None:
    """Without opweave-runtime installed, `opweave run` names the package instead of failing
    as an unknown command (simulated by hiding the library from the CLI's import check)."""
    import subprocess
    import sys

    code = (
        "import importlib.util as u\n"
        "real = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name == 'opweave.runtime' else real(name, *a)\n"
        "from opweave.cli.app import main\n"
        "raise SystemExit(main(['run', 'plan.json', '--model-path', 'm', '--port', '1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: opweave run needs opweave-runtime, which is not")
    assert proc.stderr.count("\n") == 1


def test_estimate_serving_json_contract() -> None:
    """``estimate --isl --osl --concurrency --json``: TTFT, TPOT and tokens/s of aggregated
    serving; TPOT above the bare decode step (prefill chunks mixed in), tokens/s = requests/s
    x osl."""
    out = cli_json(
        "estimate",
        "qwen3-32b",
        "--gpu",
        "h100",
        "--tp",
        "4",
        "--isl",
        "4096",
        "--osl",
        "1024",
        "--concurrency",
        "64",
    )
    assert out["ttft_s"] > 0 and out["tpot_s"] > out["decode_step_s"] > 0
    assert out["tokens_per_s"] == pytest.approx(out["requests_per_s"] * 1024)
    assert out["max_num_batched_tokens"] == 8192  # vLLM's API-server default on an H100
    assert any("closed loop, 64 concurrent" in a for a in out["assumptions"])
    rate = cli_json(
        "estimate",
        "qwen3-32b",
        "--gpu",
        "h100",
        "--tp",
        "4",
        "--isl",
        "1K",
        "--osl",
        "256",
        "--rate",
        "1.5",
    )
    assert any("Poisson arrivals at 1.5 requests/s" in a for a in rate["assumptions"])
    assert rate["ttft_p99_s"] >= rate["ttft_s"]


def test_estimate_takes_an_engines_defaults() -> None:
    """``--engine sglang`` is SGLang's defaults in one flag: prefill-first steps, its chunk size
    and running-request cap on the GPU (8192 and 2048 on an H100) and its host profile (eager
    steps with prompt chunks); each default can still be given on its own."""
    args = ("estimate", "qwen3-32b", "--gpu", "h100", "--tp", "4", "--isl", "1K", "--osl", "256")
    args += ("--concurrency", "16")
    sglang = cli_json(*args, "--engine", "sglang")
    spelled = cli_json(
        *args,
        "--scheduling",
        "prefill-first",
        "--host",
        "sglang",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "2048",
    )
    assert (sglang["max_num_batched_tokens"], sglang["max_num_seqs"]) == (8192, 2048)
    for key in ("ttft_s", "tpot_s", "tokens_per_s"):
        assert sglang[key] == pytest.approx(spelled[key], rel=1e-12)
    assert any(a.startswith("engine: SGLang") for a in sglang["assumptions"])
    assert any("outside CUDA graphs (host profile sglang)" in a for a in sglang["assumptions"])
    vllm = cli_json(*args)
    assert any(a.startswith("engine: vLLM V1") for a in vllm["assumptions"])
    assert not any("outside CUDA graphs" in a for a in vllm["assumptions"])
    proc = run_cli(*args, "--engine", "lmdeploy", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown engine 'lmdeploy'; known: vllm, sglang, tensorrt-llm (or trtllm)"
    ]
    trtllm = cli_json(*args, "--engine", "TRTLLM")
    assert any(a.startswith("engine: TensorRT-LLM") for a in trtllm["assumptions"])


def test_estimate_takes_sglangs_receive_interval() -> None:
    """``--scheduler-recv-interval N`` (SGLang's): prompts arriving while the engine decodes
    wait for its next receive point, so the TTFT grows, and the estimate says what it assumed;
    lengths drawn from a range so that the clients do not finish in lockstep."""
    workload = Path(tempfile.mkdtemp()) / "w.toml"
    workload.write_text(
        'isl = {kind = "uniform", low_tokens = 800, high_tokens = 1200}\n'
        'osl = {kind = "uniform", low_tokens = 800, high_tokens = 1200}\nconcurrency = 16\n'
    )
    args = ("estimate", "qwen3-32b", "--gpu", "h100", "--tp", "4", "--workload", str(workload))
    every = cli_json(*args, "--scheduling", "prefill-first")
    sparse = cli_json(*args, "--scheduling", "prefill-first", "--scheduler-recv-interval", "30")
    assert sparse["ttft_s"] > every["ttft_s"] + 5 * every["decode_step_s"]
    assert any("every 30 decode steps" in a for a in sparse["assumptions"])
    assert not any("decode steps and after" in a for a in every["assumptions"])


def test_estimate_takes_the_engines_memory_fraction() -> None:
    """``--memory-fraction`` (vLLM's --gpu-memory-utilization, SGLang's --mem-fraction-static)
    sizes the KV cache: on 2 x H100, Qwen3-32B's 32.8 GB of BF16 weights per GPU leave SGLang
    0.7 x 85.5 GB - weights for the cache; the estimate says which setting it took."""
    args = ("estimate", "qwen3-32b", "--gpu", "h100", "--tp", "2", "--isl", "2K", "--osl")
    given = cli_json(
        *args, "256", "--concurrency", "8", "--engine", "sglang", "--memory-fraction", "0.7"
    )
    default = cli_json(*args, "256", "--concurrency", "8", "--engine", "sglang")
    assert any("--mem-fraction-static 0.7 (given)" in a for a in given["assumptions"])
    assert any("SGLang's default for the GPU" in a for a in default["assumptions"])
    assert given["kv_capacity_tokens"] < default["kv_capacity_tokens"]
    for value in ("0", "1.5", "nan"):
        proc = run_cli(*args, "256", "--concurrency", "8", "--memory-fraction", value, check=False)
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1
        assert "--memory-fraction" in proc.stderr
    proc = run_cli(
        "estimate",
        "qwen3-32b",
        "--gpu",
        "h100",
        "--batch",
        "4",
        "--memory-fraction",
        "0.8",
        check=False,
    )
    assert proc.returncode == 2
    assert "cannot be combined with --memory-fraction" in proc.stderr


def test_estimate_serving_table_says_what_it_assumed() -> None:
    proc = run_cli(
        "estimate",
        "qwen3-32b",
        "--gpu",
        "h100",
        "--tp",
        "4",
        "--isl",
        "2K",
        "--osl",
        "512",
        "--concurrency",
        "16",
    )
    for words in (
        "TTFT",
        "TPOT",
        "output tokens/s",
        "statistic: mean",
        "chunked prefill",
        "8192 tokens per step",
    ):
        assert words in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--isl", "1K", "--osl", "1K", "--concurrency", "8", "--batch", "8"],
            "--batch (a decode step) cannot be combined with --isl and --osl and --concurrency",
        ),
        (
            ["--isl", "1K", "--osl", "1K", "--concurrency", "8", "--context", "4K"],
            "--context (a decode step) cannot be combined",
        ),
        (["--isl", "1K", "--concurrency", "8"], "serving needs --osl"),
        (["--isl", "1K", "--osl", "1K"], "serving needs the arrivals: --concurrency C"),
        (
            ["--isl", "1K", "--osl", "1K", "--concurrency", "8", "--rate", "2"],
            "one of --concurrency C or --rate R",
        ),
        (["--isl", "1K", "--osl", "1K", "--rate", "-1"], "--rate must be from 1e-6 to 1e6"),
        (["--isl", "40K", "--osl", "1K", "--rate", "1"], "beyond qwen3-32b's context"),
        (["--isl", "0", "--osl", "1K", "--rate", "1"], "must be at least 1"),
    ],
)
def test_estimate_serving_refuses_bad_input(args: list[str], message: str) -> None:
    proc = run_cli("estimate", "qwen3-32b", "--gpu", "h100", "--tp", "4", *args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_estimate_costs_an_engine_split_the_runtime_does_not_serve_and_says_so() -> None:
    """gpt-oss-120b at TP 8: vLLM and SGLang load its MXFP4 experts in uneven whole blocks;
    the estimate costs that, and says the runtime (and so plan) leaves the split out."""
    from pathlib import Path

    config = Path(__file__).parents[1] / "costmodel" / "checkpoints" / "gpt-oss-120b.json"
    args = ["estimate", str(config), "--gpu", "b200", "--batch", "4", "--context", "1000"]
    out = run_cli(*args, "--tp", "8").stdout
    assert "sharding: L0.experts: mlp.experts.down_proj shards of 360 are not whole" in out
    assert "OpWeave's runtime does not serve this split" in out
    assert "sharding:" not in run_cli(*args, "--tp", "2").stdout


def test_estimate_takes_a_tp_group_across_a_rack_scale_nvlink_domain() -> None:
    # GB200 NVL72: 72 GPUs share one NVLink fabric, so TP16 is one group (docs/support.md)
    doc = cli_json("estimate", "qwen3-32b", "--gpu", "gb200", "--tp", "16", "--batch", "8")
    assert doc["tp"] == 16 and doc["fits"] is True
