"""Theorems 3.1 and 3.2 as properties over random models (four families) and random GPUs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from opweave.costmodel import HardwareSpec, InfeasibleError, ModelSpec, model_spec_from_config
from opweave.costmodel._private.analysis import Analysis, analyze

REL = 1e-9
FAMILIES = ["llama", "qwen3", "gemma3_text", "qwen3_next"]
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)


@st.composite
def configs(draw: st.DrawFn, family: str) -> dict[str, Any]:
    nkv = draw(st.sampled_from([1, 2, 4, 8]))
    nq = nkv * draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    hidden = draw(st.integers(4, 64)) * 64
    cfg: dict[str, Any] = {
        "model_type": family,
        "num_hidden_layers": draw(st.integers(1, 48)),
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "head_dim": head_dim,
        "hidden_size": hidden,
        "intermediate_size": draw(st.integers(1, 4 * hidden // 64)) * 64,
        "vocab_size": draw(st.integers(1000, 160_000)),
        "torch_dtype": draw(st.sampled_from(["bfloat16", "float32"])),
    }
    if family == "llama":
        cfg["hidden_size"] = nq * head_dim  # Llama derives head_dim from hidden / heads
        del cfg["head_dim"]
    elif family == "gemma3_text":
        cfg["sliding_window"] = draw(st.sampled_from([256, 512, 1024, 4096]))
        cfg["sliding_window_pattern"] = draw(st.integers(2, 6))
    elif family == "qwen3_next":
        nk = draw(st.sampled_from([2, 4, 8, 16]))
        cfg |= {
            "full_attention_interval": draw(st.integers(2, 4)),
            "linear_num_key_heads": nk,
            "linear_num_value_heads": nk * draw(st.sampled_from([1, 2])),
            "linear_key_head_dim": draw(st.sampled_from([64, 128])),
            "linear_value_head_dim": draw(st.sampled_from([64, 128])),
            "linear_conv_kernel_dim": 4,
            "num_experts": draw(st.sampled_from([8, 16, 32, 64])),
            "num_experts_per_tok": draw(st.integers(1, 8)),
            "moe_intermediate_size": draw(st.integers(2, 16)) * 64,
            "shared_expert_intermediate_size": draw(st.sampled_from([0, 256, 512])),
            "decoder_sparse_step": 1,
        }
    return cfg


@st.composite
def gpus(draw: st.DrawFn, gpu_id: str) -> HardwareSpec:
    return HardwareSpec(
        id=gpu_id,
        name=gpu_id,
        memory_bytes=draw(st.floats(24e9, 192e9)),
        mem_bandwidth_bytes_per_s=draw(st.floats(0.3e12, 8e12)),
        dense_flops_per_s=draw(st.floats(50e12, 2500e12)),
        intra_node_bandwidth_bytes_per_s=100e9,
        network_bandwidth_bytes_per_s=50e9,
        usd_per_hour=draw(st.floats(0.3, 10.0)),
        memory_efficiency=draw(st.floats(0.5, 1.0)),
        compute_efficiency=draw(st.floats(0.4, 1.0)),
    )


@st.composite
def contexts(draw: st.DrawFn) -> np.ndarray:
    low = draw(st.floats(16, 8192))
    return np.geomspace(low, low * draw(st.floats(4, 4096)), draw(st.integers(8, 64)))


def _model(family: str, data: st.DataObject) -> ModelSpec:
    cfg = data.draw(configs(family), label="config")
    return model_spec_from_config(cfg, name=f"random-{family}")


def _analyze(
    model: ModelSpec, devices: list[HardwareSpec], s: np.ndarray, tp: int | None
) -> Analysis:
    try:
        return analyze(model, devices, s, tp=tp)
    except InfeasibleError:
        assume(False)
        raise


def _unimodal(values: np.ndarray) -> bool:
    """Non-decreasing up to the maximum, non-increasing after it (within REL)."""
    if values.size < 3:
        return True
    peak = int(np.argmax(values))
    steps = np.diff(values)
    tol = REL * np.abs(values[:-1])
    return bool(np.all(steps[:peak] >= -tol[:peak]) and np.all(steps[peak:] <= tol[peak:]))


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(data=st.data(), gpu=gpus("x"), s=contexts(), tp=st.sampled_from([None, None, None, 2, 4, 8]))
def test_theorem_3_1_homogeneous_gain(family, data, gpu, s, tp):
    res = _analyze(_model(family, data), [gpu], s, tp)
    g = res.gpus[0]
    ok = g.feasible
    # b_max falls with context, so the feasible contexts are a prefix of the sorted grid.
    assert np.all(ok[: int(ok.sum())])
    assert np.all(np.isnan(g.gain_homogeneous[~ok]))
    gain, compute_bound = g.gain_homogeneous[ok], g.compute_bound[ok]
    event(
        f"compute-bound contexts: {compute_bound.any()}, memory-bound: "
        f"{(~compute_bound).any()}, infeasible: {(~ok).any()}"
    )
    # Colocation already compute-bound: disaggregation gains nothing.
    np.testing.assert_allclose(gain[compute_bound], 1.0, rtol=REL)
    # Memory-bound: a strict gain, growing with context, below M / (M - W).
    assert np.all(gain[~compute_bound] > 1.0)
    assert np.all(np.diff(gain) >= -REL * gain[:-1])
    assert np.all(gain <= g.bound * (1 + REL))
    # The integer batch can only cost more than the relaxed one.
    assert np.all(g.gain_homogeneous_int[ok] >= gain * (1 - REL))


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(data=st.data(), x=gpus("x"), y=gpus("y"), s=contexts())
def test_theorem_3_2_heterogeneous_gain(family, data, x, y, s):
    res = _analyze(_model(family, data), [x, y], s, None)
    het = res.heterogeneous
    assert het is not None
    ok = het.feasible
    assume(ok.any())
    cost = het.cost_heterogeneous[ok]
    for g in res.gpus:
        assert np.all(cost <= g.cost_homogeneous[ok] * (1 + REL))
    gain = het.gain_heterogeneous[ok]
    assert np.all(gain >= 1 - REL)
    assert np.all(het.gain_heterogeneous_vs_colocated[ok] >= gain * (1 - REL))
    # Unimodal along increasing context (a(s) is non-decreasing in s) ...
    assert np.all(np.diff(res.attention_bytes_per_request) >= 0)
    assert _unimodal(gain)
    # ... peaking where the two homogeneous cost lines cross, when that lies in range.
    event(f"dominated: {het.dominated}, crossing in range: {het.crossing_in_range}")
    if het.peak_gain is not None:
        assert het.crossing_in_range
        assert np.all(gain <= het.peak_gain * (1 + REL))
    elif not het.dominated:
        steps = np.diff(gain)
        tol = REL * gain[:-1]
        assert np.all(steps >= -tol) or np.all(steps <= tol)


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(
    data=st.data(),
    x=gpus("x"),
    s=contexts(),
    price=st.floats(1.0, 4.0),
    bandwidth=st.floats(0.25, 0.99),
    flops=st.floats(0.25, 0.99),
    memory=st.floats(24e9, 192e9),
)
def test_theorem_3_2_no_gain_when_one_gpu_dominates(
    family, data, x, s, price, bandwidth, flops, memory
):
    # y costs more per byte/s and per FLOP/s than x: x takes both operator classes.
    y = x.model_copy(
        update={
            "id": "y",
            "name": "y",
            "memory_bytes": memory,
            "usd_per_hour": x.usd_per_hour * price,
            "mem_bandwidth_bytes_per_s": x.mem_bandwidth_bytes_per_s * bandwidth,
            "dense_flops_per_s": x.dense_flops_per_s * flops,
        }
    )
    res = _analyze(_model(family, data), [y, x], s, None)
    het = res.heterogeneous
    assert het is not None and het.dominated
    assert het.attention_gpu == het.gemm_gpu == "x"
    ok = het.feasible
    np.testing.assert_allclose(het.gain_heterogeneous[ok], 1.0, rtol=REL)
    np.testing.assert_allclose(
        het.cost_heterogeneous[ok], res.gpu("x").cost_homogeneous[ok], rtol=REL
    )


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(
    data=st.data(),
    x=gpus("x"),
    s=contexts(),
    bandwidth=st.floats(1.2, 4.0),
    flops=st.floats(0.1, 0.8),
)
def test_theorem_3_2_peak_at_the_crossing(family, data, x, s, bandwidth, flops):
    # y: same price, more bandwidth, fewer FLOP/s -- a genuine trade-off.
    y = x.model_copy(
        update={
            "id": "y",
            "name": "y",
            "mem_bandwidth_bytes_per_s": x.mem_bandwidth_bytes_per_s * bandwidth,
            "dense_flops_per_s": x.dense_flops_per_s * flops,
        }
    )
    res = _analyze(_model(family, data), [x, y], s, None)
    het = res.heterogeneous
    assert het is not None and not het.dominated
    assert (het.attention_gpu, het.gemm_gpu) == ("y", "x")
    a_star = het.crossing_attention_bytes
    assert a_star is not None and a_star > 0
    f = res.gemm_flops_per_token
    gx, gy = res.gpu("x"), res.gpu("y")
    line_x = gx.usd_per_byte * a_star + gx.usd_per_flop * f
    line_y = gy.usd_per_byte * a_star + gy.usd_per_flop * f
    np.testing.assert_allclose(line_x, line_y, rtol=1e-9)
    peak = line_x / (gy.usd_per_byte * a_star + gx.usd_per_flop * f)
    ok = het.feasible
    gain = het.gain_heterogeneous[ok]
    assert np.all(gain <= peak * (1 + REL))
    traffic = res.attention_bytes_per_request[ok]
    event(f"crossing in range: {het.crossing_in_range}")
    if traffic.size:
        rising, falling = traffic <= a_star, traffic >= a_star
        assert np.all(np.diff(gain[rising]) >= -REL * gain[rising][:-1])
        assert np.all(np.diff(gain[falling]) <= REL * gain[falling][:-1])
