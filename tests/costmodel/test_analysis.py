"""The §3 analysis against hand computations from the published config and datasheet figures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from opweave.costmodel import (
    ConfigError,
    HardwareSpec,
    InfeasibleError,
    default_catalog,
    load_model,
)
from opweave.costmodel._private.analysis import analyze

REL = 1e-9

# Llama-3.3-70B config.json (meta-llama/Llama-3.3-70B-Instruct), bf16.
H, INTER, LAYERS, NQ, NKV, HEAD, VOCAB, P = 8192, 28672, 80, 64, 8, 128, 128256, 2
# Published parameter count of Llama-3.3-70B (safetensors metadata).
LLAMA_PARAMS = 70_553_706_496


def _llama_by_hand() -> tuple[float, float, float, float]:
    """Weight bytes, FLOPs per token outside attention, KV bytes per token, rest weights/layer."""
    qkv = H * (NQ * HEAD + 2 * NKV * HEAD)
    o_proj = NQ * HEAD * H
    mlp = 3 * H * INTER
    norms = 2 * H  # attention and FFN RMSNorm weights
    layer_params = qkv + o_proj + mlp + norms
    params = LAYERS * layer_params + 2 * VOCAB * H + H  # untied embed + lm_head, final norm
    assert params == LLAMA_PARAMS
    # 2 FLOPs per weight of every GEMM; RMSNorm (with fused residual add) 4 FLOPs per element;
    # RoPE 6 per rotated q/k element; greedy sampling one pass over the logits.
    per_layer_flops = 2 * (qkv + o_proj + mlp) + 2 * 4 * H + 6 * (NQ + NKV) * HEAD
    flops = LAYERS * per_layer_flops + 4 * H + 2 * VOCAB * H + VOCAB
    kv_per_token = LAYERS * 2 * NKV * HEAD * P  # K and V of every layer
    return params * P, float(flops), float(kv_per_token), float(layer_params * P)


def _unit(gpu: HardwareSpec, tp: int) -> tuple[float, float, float, float]:
    """M, B, F and USD per second of ``tp`` GPUs, from the datasheet fields."""
    return (
        tp * gpu.memory_bytes * gpu.usable_memory_fraction,
        tp * gpu.mem_bandwidth_bytes_per_s * gpu.memory_efficiency,
        tp * gpu.dense_flops_per_s * gpu.compute_efficiency,
        tp * gpu.usd_per_hour / 3600,
    )


@pytest.fixture(scope="module")
def llama():
    return load_model("llama-3.3-70b")


@pytest.fixture(scope="module")
def h100():
    return default_catalog().get("h100")


@pytest.fixture(scope="module")
def a100():
    return default_catalog().get("a100")


def test_colocated_and_homogeneous_costs_match_hand_computation(llama, h100):
    weights, flops, kv_per_token, _ = _llama_by_hand()
    mem, bw, fl, usd_per_s = _unit(h100, 4)
    s = 8192
    kv = kv_per_token * s
    b_max = (mem - weights) / kv
    b_star = weights * fl / (bw * flops)
    assert b_max < b_star  # memory-bound: the regime where ODS helps
    col = usd_per_s * (kv / bw + weights / (bw * b_max)) * 1e6
    col_int = usd_per_s * (kv / bw + weights / (bw * math.floor(b_max))) * 1e6
    hom = usd_per_s * (kv / bw + flops / fl) * 1e6

    res = analyze(llama, [h100], [s], tp=4)
    g = res.gpus[0]
    assert res.weight_bytes == weights
    assert res.gemm_flops_per_token == pytest.approx(flops, rel=REL)
    assert res.state_bytes_per_request[0] == pytest.approx(kv, rel=REL)
    assert g.tp == 4
    assert g.b_max[0] == pytest.approx(b_max, rel=REL)
    assert g.b_max_int[0] == math.floor(b_max) == 62
    assert g.b_star == pytest.approx(b_star, rel=REL)
    assert g.bound == pytest.approx(mem / (mem - weights), rel=REL)
    assert g.cost_colocated[0] == pytest.approx(col, rel=REL)
    assert g.cost_colocated_int[0] == pytest.approx(col_int, rel=REL)
    assert g.cost_homogeneous[0] == pytest.approx(hom, rel=REL)
    assert g.gain_homogeneous[0] == pytest.approx(col / hom, rel=REL)
    assert 1.0 < g.gain_homogeneous[0] < g.bound
    assert res.heterogeneous is None


def test_cad_feasibility_matches_hand_computation(llama, h100):
    _, _, kv_per_token, rest_per_layer = _llama_by_hand()
    mem, bw, _, _ = _unit(h100, 4)
    contexts = np.array([1024.0, 8192.0, 262144.0])
    b_cap = np.floor(mem / (kv_per_token * contexts))
    t_attn_max = b_cap / 2 * (2 * NKV * HEAD * P * contexts) / bw
    t_rest_min = rest_per_layer / bw

    cad = analyze(llama, [h100], contexts, tp=4).gpus[0].cad
    assert cad.attention_kind == "full" and cad.microbatches == 2
    np.testing.assert_allclose(cad.b_cap, b_cap, rtol=REL)
    np.testing.assert_allclose(cad.t_attn_max_s, t_attn_max, rtol=REL)
    assert cad.t_rest_min_s == pytest.approx(t_rest_min, rel=REL)
    # Balance needs about M_attn / 2 >= W (the attention group streams half its KV per
    # microbatch while the rest loads its weights): 308 GB just exceeds 2 x 141 GB, until at
    # 256K the group holds only floor(308 / 85.9) = 3 requests and the stages cannot balance.
    assert b_cap[2] == 3
    assert cad.feasible.tolist() == (t_attn_max >= t_rest_min).tolist() == [True, True, False]


def test_default_tp_leaves_half_the_memory_for_state(llama, h100):
    weights, *_ = _llama_by_hand()
    usable = h100.memory_bytes * h100.usable_memory_fraction
    # 141 GB of weights: 2 x 72 GB would hold them with ~2.9 GB to spare, but the default
    # keeps at least half the group for KV: 4 x 72 GB = 288 GB >= 2 x 141 GB.
    assert 2 * usable < 2 * weights <= 4 * usable
    assert analyze(llama, [h100], [1024, 65536]).gpus[0].tp == 4
    assert analyze(llama, [h100], [1024], tp=2).gpus[0].tp == 2
    # Qwen3-Next (159 GB) needs 8 x H100 to keep half free.
    assert analyze(load_model("qwen3-next-80b-a3b"), [h100], [1024]).gpus[0].tp == 8


def test_infeasible_contexts_are_nan_and_masked_not_dropped(llama, h100, a100):
    contexts = [8192, 1 << 20, 4096]  # 1M tokens of KV (344 GB) exceed 4 x 72 GB
    res = analyze(llama, [h100, a100], contexts, tp=4)
    assert res.contexts.tolist() == contexts
    for g in res.gpus:
        assert g.feasible.tolist() == [True, False, True]
        assert 0 < g.b_max[1] < 1 and g.b_max_int[1] == 0
        for arr in (g.cost_colocated, g.cost_colocated_int, g.cost_homogeneous, g.gain_homogeneous):
            assert np.isnan(arr[1]) and np.isfinite(arr[[0, 2]]).all()
    het = res.heterogeneous
    assert het is not None and het.feasible.tolist() == [True, False, True]
    assert np.isnan(het.cost_heterogeneous[1]) and np.isnan(het.gain_heterogeneous[1])
    doc = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert doc["gpus"][0]["cost_colocated"][1] is None
    assert doc["gpus"][0]["feasible"] == [True, False, True]
    assert doc["heterogeneous"]["attention_gpu"] == "a100-sxm-80gb"


def test_heterogeneous_puts_attention_on_cheapest_bytes(llama, h100, a100):
    weights, flops, kv_per_token, _ = _llama_by_hand()
    per_byte = {
        g.id: g.usd_per_hour / (g.mem_bandwidth_bytes_per_s * g.memory_efficiency)
        for g in (h100, a100)
    }
    per_flop = {
        g.id: g.usd_per_hour / (g.dense_flops_per_s * g.compute_efficiency) for g in (h100, a100)
    }
    # A100 is cheaper per byte/s, H100 per FLOP/s: the paper's H100 + A100 trade-off.
    assert per_byte["a100-sxm-80gb"] < per_byte["h100-sxm"]
    assert per_flop["h100-sxm"] < per_flop["a100-sxm-80gb"]
    s = 4096
    kv = kv_per_token * s
    het_cost = (per_byte["a100-sxm-80gb"] * kv + per_flop["h100-sxm"] * flops) / 3600 * 1e6
    hom = {g: (per_byte[g] * kv + per_flop[g] * flops) / 3600 * 1e6 for g in per_byte}

    for order in ([h100, a100], [a100, h100]):
        het = analyze(llama, order, [s], tp=4).heterogeneous
        assert het is not None
        assert (het.attention_gpu, het.gemm_gpu) == ("a100-sxm-80gb", "h100-sxm")
        assert not het.dominated
        assert het.cost_heterogeneous[0] == pytest.approx(het_cost, rel=REL)
        assert het.gain_heterogeneous[0] == pytest.approx(min(hom.values()) / het_cost, rel=REL)
        assert het.gain_heterogeneous[0] > 1.0
        assert het.cad.attention_gpu == "a100-sxm-80gb" and het.cad.gemm_gpu == "h100-sxm"
        # Homogeneous lines cross where (p_H - p_A) a = q_A - q_H.
        crossing = (
            (per_flop["a100-sxm-80gb"] - per_flop["h100-sxm"])
            * flops
            / (per_byte["h100-sxm"] - per_byte["a100-sxm-80gb"])
        )
        assert het.crossing_attention_bytes == pytest.approx(crossing, rel=REL)
    del weights


def test_dominating_gpu_takes_both_operator_classes(llama, h100):
    better = h100.model_copy(
        update={"id": "h100-cheap", "name": "cheaper H100", "usd_per_hour": h100.usd_per_hour / 2}
    )
    het = analyze(llama, [h100, better], [2048, 8192], tp=4).heterogeneous
    assert het is not None and het.dominated
    assert het.attention_gpu == het.gemm_gpu == "h100-cheap"
    np.testing.assert_allclose(het.gain_heterogeneous, 1.0, rtol=1e-12)
    assert het.crossing_attention_bytes is None and het.peak_gain is None


def test_weights_that_fit_no_unit_raise_one_line_error(llama, h100):
    small = HardwareSpec(
        id="tiny-16gb",
        name="16 GB card",
        memory_bytes=16e9,
        mem_bandwidth_bytes_per_s=1e12,
        dense_flops_per_s=100e12,
        intra_node_bandwidth_bytes_per_s=64e9,
        network_bandwidth_bytes_per_s=25e9,
        usd_per_hour=1.0,
    )
    with pytest.raises(InfeasibleError) as err:
        analyze(llama, [small], [4096])
    message = str(err.value)
    assert "\n" not in message
    assert "tiny-16gb" in message and "141.1 GB" in message and "do not fit 8" in message
    with pytest.raises(InfeasibleError, match="do not fit 1 x h100-sxm"):
        analyze(llama, [h100], [4096], tp=1)


def test_bad_inputs_are_config_errors(llama, h100, a100):
    cat = default_catalog()
    with pytest.raises(ConfigError, match="no price"):
        analyze(llama, [cat.get("l4").model_copy(update={"usd_per_hour": None})], [4096])
    with pytest.raises(ConfigError, match="one or two GPU types"):
        analyze(llama, [h100, a100, cat.get("h200")], [4096])
    with pytest.raises(ConfigError, match=">= 1"):
        analyze(llama, [h100], [0, 4096])
    with pytest.raises(ConfigError, match="tp must be one of"):
        analyze(llama, [h100], [4096], tp=3)
    with pytest.raises(ConfigError, match="two different"):
        analyze(llama, [h100, h100], [4096])


def test_hybrid_model_reports_cad_per_attention_kind(h100):
    qwen_next = load_model("qwen3-next-80b-a3b")
    res = analyze(qwen_next, [h100], [4096, 131072])
    g = res.gpus[0]
    assert set(g.cad_by_kind) == {"full", "linear"}
    assert g.cad.attention_kind == "full"
    # Linear attention moves a fixed state per request, so its feasible latency only falls as
    # long contexts shrink the attention group's batch (§3.4: one rest stage cannot fit both).
    linear = g.cad_by_kind["linear"].t_attn_max_s
    full = g.cad_by_kind["full"].t_attn_max_s
    assert linear[1] < linear[0] and full[1] > linear[1]


def test_result_is_read_only_and_summarises(llama, h100, a100):
    res = analyze(llama, [h100, a100], [4096, 1 << 20], tp=4)
    with pytest.raises(ValueError):
        res.gpus[0].cost_colocated[0] = 0.0
    text = res.summary()
    assert "h100-sxm" in text and "attention on a100-sxm-80gb" in text
    assert text.splitlines()[-1].split()[2] == "-"  # infeasible context shows a dash


def test_capacity_and_traffic_terms_differ_for_recurrent_state(h100):
    """Qwen3-Next: b_max divides by the state held, attention cost by the state moved."""
    # 12 full-attention layers (every 4th of 48): K and V of 2 heads x 256, bf16.
    kv_per_token = 12 * 2 * 2 * 256 * 2
    # 36 Gated DeltaNet layers: a 128 x 128 state per value head (32) plus the conv window
    # (3 past positions of q, k (16 heads x 128) and v (32 x 128) channels), bf16.
    recurrent = 36 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2
    s = 32768
    held = kv_per_token * s + recurrent
    moved = kv_per_token * s + 2 * recurrent  # the recurrent state is read and written
    model = load_model("qwen3-next-80b-a3b")
    res = analyze(model, [h100], [s], tp=4)
    g = res.gpus[0]
    mem, bw, fl, usd_per_s = _unit(h100, 4)
    assert res.state_bytes_per_request[0] == held
    assert res.attention_bytes_per_request[0] == moved
    assert g.b_max[0] == pytest.approx((mem - res.weight_bytes) / held, rel=REL)
    # the routed experts' GEMMs (512 channels wide) at the fused-MoE kernels' measured
    # fraction of the dense rate on Hopper ([AIC-MOE]: 0.60), everything else at the dense rate
    experts = sum(op.flops_per_token for op in model.operators if op.moe is not None)
    gemm_s = (res.gemm_flops_per_token - experts) / fl + experts / (fl * 0.60)
    hom = usd_per_s * (moved / bw + gemm_s) * 1e6
    assert g.cost_homogeneous[0] == pytest.approx(hom, rel=REL)
