"""The published serving reference of ``tools/bench/serving_accuracy.py``: its P/D rows carry
the decode workers' batch caps, and a P/D replay holds the clients the caps do not admit in
their TTFT by Little's law."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from opweave.costmodel import default_catalog, estimate_step, host_profile, load_model
from tests.helpers import load_script

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture(scope="module")
def serving() -> ModuleType:
    return load_script(BENCH / "serving_accuracy.py")


def test_every_pd_row_names_its_decode_batch_cap() -> None:
    rows = tomllib.loads((BENCH / "serving_accuracy_data.toml").read_text())["rows"]
    pd = [r for r in rows if r["deployment"] == "pd" and r.get("in_scope", True)]
    assert len(pd) >= 50
    for r in pd:
        assert isinstance(r["decode_max_batch"], int) and r["decode_max_batch"] >= 1, r
        assert (
            "nvidia-master.yaml" in r["decode_max_batch_source"]
            or "@" in (r["decode_max_batch_source"])
        ), r


def _row(concurrency: int, cap: int) -> dict:
    """A Dynamo + TensorRT-LLM P/D row: 2 decode workers of TP 8 (attention TP, no DP)."""
    return {
        "model": "llama-3.3-70b",
        "gpu": "h100-sxm",
        "engine": "dynamo+tensorrt-llm",
        "deployment": "pd",
        "isl": 1000,
        "osl": 500,
        "concurrency": concurrency,
        "prefill_pool": {"gpus": 8, "workers": 1, "tp": 8, "ep": 1, "dp_attention": False},
        "decode_pool": {"gpus": 16, "workers": 2, "tp": 8, "ep": 1, "dp_attention": False},
        "decode_max_batch": cap,
    }


def test_clients_beyond_the_decode_slots_wait_in_their_ttft(serving: ModuleType) -> None:
    model = load_model("llama-3.3-70b")
    # 2 workers x 16 = 32 slots; 96 clients: 64 wait
    capped = serving._pd(_row(96, 16), model)
    ttft_ms, tpot_ms = capped.ttft_ms, capped.tpot_ms
    step = estimate_step(
        model,
        default_catalog().get("h100-sxm"),
        tp=8,
        batch=16,
        context=900 + 450 // 2,
        host=host_profile("overlapped"),
    ).step_latency_s
    assert tpot_ms == pytest.approx(step * 1e3)  # the batch is the cap, not 48
    rate = 32 / (450 * step)  # requests/s the decode slots complete (mean osl 450)
    # the clients beyond the slots wait (Little's law) through the prefill and the hand-off
    assert ttft_ms == pytest.approx((96 - 32) / rate * 1e3)
    # uncapped, the same clients all decode at once: a larger step, no slot wait
    free = serving._pd(_row(96, 1000), model)
    assert free.tpot_ms > tpot_ms
    assert free.ttft_ms < 0.1 * ttft_ms


class _Recorder:
    """Stands in for ``aic_estimator.AicEstimator``: records what each row asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def decode_step_ms(self, d, batch: int, context: int) -> float:
        self.calls.append(("decode", d, batch, context))
        return 1.0

    def serving_ms(self, d, batch: int, isl: int, osl: int, budget: int) -> tuple[float, float]:
        self.calls.append(("serving", d, batch, isl, osl, budget))
        return 2.0, 3.0


@pytest.fixture(scope="module")
def aic() -> ModuleType:
    # serving_accuracy imports its sibling by name, as costmodel_accuracy.py puts it on the path
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        return load_script(BENCH / "aic_estimator.py")
    finally:
        sys.path.remove(str(BENCH))


def test_another_estimator_is_given_the_rows_deployment(
    serving: ModuleType, aic: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "aic_estimator", aic)
    rec = _Recorder()
    # a DP-attention decode pool: 2 workers of 8 GPUs, attention DP 8, experts over 8; cap 16
    # per rank: 2 x 8 x 16 = 256 slots for 200 clients, 100 per worker, 12.5 per rank
    row = _row(200, 16) | {
        "model": "deepseek-v3",
        "quant": "fp8-block",
        "gpu": "gb200",
        "kv_cache_dtype": "fp8",
        "decode_pool": {"gpus": 16, "workers": 2, "tp": 8, "ep": 8, "dp_attention": True},
    }
    assert serving.other_estimate(row, rec) == (None, 1.0)
    kind, d, batch, context = rec.calls[-1]
    assert kind == "decode"
    assert (d.tp, d.ep, d.dp, d.kv_cache_dtype) == (8, 8, 8, "fp8")
    assert batch == round(100 / 8)
    assert context == 900 + 450 // 2
    # an aggregated InferenceX row: lengths uniform in [0.8 L, L], SGLang's default budget on a
    # B200 (16384 tokens from 160 GiB of GPU memory, sglang/srt/server_args.py)
    agg = {
        "model": "deepseek-v3",
        "quant": "fp8-block",
        "gpu": "b200",
        "engine": "sglang",
        "deployment": "aggregated",
        "source": "InferenceX run",
        "tp": 8,
        "ep": 1,
        "dp": 1,
        "isl": 1024,
        "osl": 1024,
        "concurrency": 64,
    }
    assert serving.other_estimate(agg, rec) == (2.0, 3.0)
    kind, d, batch, isl, osl, budget = rec.calls[-1]
    assert (kind, d.tp, d.ep, d.dp, d.kv_cache_dtype) == ("serving", 8, 1, 1, "auto")
    assert (batch, isl, osl, budget) == (64, 922, 922, 16384)
    # the serve command's own budget and sequence cap win
    capped = agg | {"serve_command": "--chunked-prefill-size 4096 --max-running-requests 32"}
    serving.other_estimate(capped, rec)
    assert rec.calls[-1][2] == 32 and rec.calls[-1][5] == 4096
    # DP attention: the requests of one attention rank
    serving.other_estimate(agg | {"ep": 8, "dp": 8}, rec)
    kind, d, batch, *_ = rec.calls[-1]
    assert (d.tp, d.ep, d.dp, batch) == (8, 8, 8, 8)


def test_the_other_estimator_names_what_it_cannot_estimate(aic: ModuleType) -> None:
    d = aic.Deployment("llama-3.3-70b", "fp8", "h100-sxm", "nim", 2, 1, 1, "auto")
    with pytest.raises(aic.NotCovered, match="no config of it in the package"):
        aic.AicEstimator.__new__(aic.AicEstimator)._inputs(d)
    with pytest.raises(aic.NotCovered, match="mi300x: no system"):
        aic.AicEstimator.__new__(aic.AicEstimator)._inputs(d.__class__(
            "deepseek-v3", "fp8-block", "mi300x", "sglang", 8, 8, 8, "auto"
        ))  # fmt: skip
    with pytest.raises(aic.NotCovered, match="engine nim"):
        aic.engine_backend("nim")
    # what it is told: attention TP/DP, expert TP/EP, the KV dtype the engine ran ("auto" on an
    # FP8 checkpoint is the model dtype; left out, the package would take FP8)
    est = aic.AicEstimator.__new__(aic.AicEstimator)
    for kv, mode in (("auto", "bfloat16"), ("fp8", "fp8")):
        d = aic.Deployment("deepseek-v3", "fp8-block", "h200-sxm", "dynamo+sglang", 8, 8, 8, kv)
        checkpoint, system, backend, kwargs = est._inputs(d)
        assert (checkpoint, system, backend) == ("deepseek-ai/DeepSeek-R1", "h200_sxm", "sglang")
        assert kwargs == {
            "tp_size": 1,
            "attention_dp_size": 8,
            "moe_tp_size": 1,
            "moe_ep_size": 8,
            "kvcache_quant_mode": mode,
        }


def test_without_the_package_the_comparison_is_a_one_line_error(
    aic: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    def absent(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(aic.metadata, "version", absent)
    monkeypatch.setitem(__import__("sys").modules, "aic_estimator", aic)
    accuracy = load_script(BENCH / "costmodel_accuracy.py")
    with pytest.raises(SystemExit) as exit_:
        accuracy.main(["--other", "aiconfigurator"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "pip install 'opweave-profiler[aiconfigurator]'" in err


def test_rows_are_grouped_by_their_publisher(serving: ModuleType) -> None:
    rows = tomllib.loads((BENCH / "serving_accuracy_data.toml").read_text())["rows"]
    names = {serving.source_name(r) for r in rows}
    assert {"InferenceX", "gpustack/gpustack", "sgl-project/sgl-cookbook"} <= names
    assert serving.source_name({"source": "docs.nvidia.com/nim/x (table 3)"}) == "docs.nvidia.com"
    assert all("/" not in n or n.count("/") == 1 for n in names), names


def test_sglang_random_rows_draw_their_lengths_as_the_client_does(serving: ModuleType) -> None:
    """sglang.bench_serving's random dataset: prompts uniform in [max(int(I r), 1), I], answers
    in [int(O r), O], r = --random-range-ratio (default 0)."""
    client = "sglang.bench_serving --dataset-name random --random-input-len 1000"
    row = {"note": f"{client} --random-output-len 8000 --num-prompts 80 --max-concurrency 16"}
    isl, osl = serving.sglang_random_lengths(row)
    assert (isl.low_tokens, isl.high_tokens, osl.low_tokens, osl.high_tokens) == (1, 1000, 1, 8000)
    half = {"note": f"{client} --random-output-len 100 --random-range-ratio 0.5"}
    isl, osl = serving.sglang_random_lengths(half)
    assert (isl.low_tokens, isl.high_tokens, osl.low_tokens, osl.high_tokens) == (
        500,
        1000,
        50,
        100,
    )
    assert serving.sglang_random_lengths({"note": "sglang.bench_serving on ShareGPT"}) is None
    with pytest.raises(serving.ConfigError, match="without lengths"):
        serving.sglang_random_lengths({"note": "sglang.bench_serving --dataset-name random"})


def test_rows_take_their_engines_defaults(serving: ModuleType) -> None:
    """Each row's workload names its engine, whose defaults the cost model applies: SGLang's
    chunk size by GPU memory and its prefill-first steps, eager prompt steps for SGLang and
    TensorRT-LLM; NIM's TensorRT engines keep the overlapped host profile."""
    cat = default_catalog()
    row = {"engine": "sglang", "gpu": "h200-sxm", "isl": 1000, "osl": 1000, "concurrency": 8}
    row |= {"source": "x", "deployment": "aggregated"}
    w = serving.workload_for(row, 1)
    assert (w.engine, w.step_policy) == ("sglang", "prefill-first")
    assert w.batch_limits(cat.get("h200")) == (8192, 2048)
    assert w.batch_limits(cat.get("b200")) == (16384, 2048)
    assert serving.engine_limits(row) == ({}, "sglang defaults")
    mixed = serving.workload_for(row | {"serve_command": "x --enable-mixed-chunk"}, 1)
    assert mixed.step_policy == "mixed"
    hosts = {e: serving.engine_host({"engine": e}) for e in ("sglang", "dynamo+tensorrt-llm")}
    assert {e: h.name for e, h in hosts.items()} == {
        "sglang": "sglang",
        "dynamo+tensorrt-llm": "tensorrt-llm",
    }
    assert serving.engine_host({"engine": "vllm"}) is None  # the hardware's own: overlapped
    assert serving.engine_host({"engine": "nim"}).name == "overlapped"
    assert serving.row_engine({"engine": "nim"}) == "tensorrt-llm"
    with pytest.raises(serving.ConfigError, match="unknown engine 'lmdeploy'"):
        serving.row_engine({"engine": "lmdeploy"})
