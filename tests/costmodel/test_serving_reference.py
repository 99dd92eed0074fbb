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
    ttft_ms, tpot_ms = serving._pd(_row(96, 16), model)
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
    assert ttft_ms == pytest.approx((96 - 32) / rate * 1e3)
    # uncapped, the same clients all decode at once: a larger step, no slot wait
    ttft_free, tpot_free = serving._pd(_row(96, 1000), model)
    assert tpot_free > tpot_ms
    assert ttft_free < 0.1 * ttft_ms
