"""Roofline latencies, TP and memory against independent hand computations."""

from __future__ import annotations

import pytest

from opweave.costmodel import (
    ConfigError,
    HardwareSpec,
    RooflineLatency,
    UnknownGPUError,
    default_catalog,
    estimate_step,
    load_hardware_file,
    max_batch,
    model_spec_from_config,
)
from tests.helpers import TINY_LLAMA

GPU = HardwareSpec(
    id="toy",
    name="toy",
    memory_bytes=1e9,
    mem_bandwidth_bytes_per_s=1e12,
    dense_flops_per_s=1e14,
    intra_node_bandwidth_bytes_per_s=1e11,
    network_bandwidth_bytes_per_s=1e10,
    memory_efficiency=0.5,
    compute_efficiency=0.5,
    kernel_overhead_s=0.0,
    usd_per_hour=3.6,
    usable_memory_fraction=1.0,
    link_efficiency=1.0,
    allreduce_latency_s=0.0,
)


def test_gemm_latency_is_weight_bound_then_compute_bound() -> None:
    h, inter = 4096, 16384
    spec = model_spec_from_config(
        dict(
            TINY_LLAMA,
            hidden_size=h,
            intermediate_size=inter,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    )
    op = next(o for o in spec.layers[0].ops if o.name == "gate_up_proj")
    lat = RooflineLatency(GPU)
    params = 2 * h * inter
    # batch 1: weights (4 bytes each) + activations (h + 3*inter floats) over 0.5 TB/s.
    expected = (params * 4 + (h + 3 * inter) * 4) / 0.5e12
    assert lat.op_latency_s(spec, op, spec.layers[0], 1, 1, 10) == pytest.approx(expected)
    # large batch: 2 * params FLOPs per token over 50 TFLOP/s dominates.
    b = 10**5
    assert lat.op_latency_s(spec, op, spec.layers[0], 1, b, 10) == pytest.approx(
        2 * params * b / 0.5e14
    )


def test_attention_reads_kv_and_tp_shards_heads() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    layer = spec.layers[0]
    attn = next(o for o in layer.ops if o.name == "core_attn")
    lat = RooflineLatency(GPU)
    s, b = 4000, 8
    kv = 2 * 2 * 16 * 4 * s  # k+v, 2 kv heads of 16, fp32
    act = (2 * 4 * 16 + 2 * 2 * 16) * 4
    one = lat.op_latency_s(spec, attn, layer, 1, b, s)
    assert one == pytest.approx(b * (kv + act) / 0.5e12)
    # 2 kv heads split over 2 ranks halve the traffic; over 4 ranks heads are replicated.
    assert lat.op_latency_s(spec, attn, layer, 2, b, s) == pytest.approx(one / 2)
    assert lat.op_latency_s(spec, attn, layer, 4, b, s) == pytest.approx(one / 2)


def test_allreduce_cost_and_estimate_totals() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    o_proj = next(o for o in spec.layers[0].ops if o.name == "o_proj")
    lat = RooflineLatency(GPU)
    # ring all-reduce: 2 (t-1)/t x payload over the link.
    assert lat.collective_s(o_proj, 4, 10) == pytest.approx(2 * 3 / 4 * 10 * 64 * 4 / 1e11)
    assert lat.collective_s(o_proj, 1, 10) == 0.0
    est = estimate_step(spec, GPU, tp=2, batch=4, context=100)
    assert est.step_latency_s == pytest.approx(sum(est.breakdown_s.values()))
    assert est.usd_per_million_tokens == pytest.approx(
        3.6 * 2 / 3600 * est.step_latency_s / 4 * 1e6
    )


def test_memory_feasibility_flips_at_capacity() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    b = max_batch(spec.operators, 1, GPU, 4096)
    assert b > 0
    assert estimate_step(spec, GPU, tp=1, batch=b, context=4096).fits
    assert not estimate_step(spec, GPU, tp=1, batch=b + 1, context=4096).fits


def test_catalog_aliases_and_override_file(tmp_path) -> None:
    cat = default_catalog()
    assert cat.get("h100").id == "h100-sxm" and cat.get("A100").id == "a100-sxm-80gb"
    with pytest.raises(UnknownGPUError, match="unknown GPU 'h900'.*h100-sxm"):
        cat.get("h900")
    path = tmp_path / "hw.toml"
    path.write_text(
        '[[gpus]]\nid = "h100"\nusd_per_hour = 2.0\n\n[[gpus]]\nid = "my-gpu"\n'
        "memory_bytes = 32e9\nmem_bandwidth_bytes_per_s = 1e12\n"
        "dense_flops_per_s = 2e14\nintra_node_bandwidth_bytes_per_s = 5e10\n"
        "network_bandwidth_bytes_per_s = 1e10\nusd_per_hour = 0.5\n"
    )
    custom = load_hardware_file(path)
    assert custom.get("h100").usd_per_hour == 2.0
    assert custom.get("h100").memory_bytes == cat.get("h100").memory_bytes
    assert custom.get("my-gpu").usd_per_hour == 0.5
    # a price the file gives is attributed to the file, not to the catalog's basis
    given = f"given in {path}"
    assert custom.get("h100").price_source == custom.get("my-gpu").price_source == given
    path.write_text('[[gpus]]\nid = "half"\nmemory_bytes = 1e9\n')
    with pytest.raises(ConfigError, match="GPU 'half' field 'mem_bandwidth_bytes_per_s'"):
        load_hardware_file(path)
    path.write_text("gpus = 3")
    with pytest.raises(ConfigError, match="needs a list 'gpus'"):
        load_hardware_file(path)
    with pytest.raises(ConfigError, match="has no price"):
        cat.get("l4").model_copy(update={"usd_per_hour": None}).require_price()


def test_every_builtin_gpu_is_priced_on_a_named_dated_basis() -> None:
    import re

    cat = default_catalog()
    # no dated public on-demand price was found for these two: they say so and how to give one
    unpriced = {g.id for g in cat if g.usd_per_hour is None}
    assert unpriced == {"h20", "gb300"}
    for gpu_id in unpriced:
        assert "usd_per_hour in a --hardware file" in cat.get(gpu_id).price_source
    for gpu in cat:
        if gpu.id not in unpriced:
            assert gpu.usd_per_hour is not None and gpu.usd_per_hour > 0, gpu.id
            assert re.search(r"\d{4}-\d{2}-\d{2}", gpu.price_source), gpu.price_source
    # one basis: everything RunPod lists is RunPod Community Cloud; the MI300X and the GB200
    # (not on its list) say their other basis
    bases = {g.id for g in cat if "RunPod Community Cloud" in g.price_source}
    assert bases == set(cat.ids) - {"mi300x", "gb200"} - unpriced
    for gpu_id in ("mi300x", "gb200"):
        assert "other basis" in cat.get(gpu_id).price_source
    # within one basis, less memory of the same chip never costs more
    assert cat.get("a100-40gb").usd_per_hour < cat.get("a100").usd_per_hour
