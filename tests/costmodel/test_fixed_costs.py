"""The fixed costs a roofline leaves out (fixed_costs.py), against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.costmodel import (
    HardwareSpec,
    OrchestrationProfile,
    ProfiledLatency,
    RooflineLatency,
    analyze,
    default_catalog,
    estimate_step,
    fit_efficiency_report,
    load_hardware_file,
    model_spec_from_config,
    synthesize_profile,
)
from opweave.costmodel._private.fixed_costs import SMALL_COLLECTIVE_MAX_BYTES
from tests.helpers import TINY_LLAMA

US = 1e-6
# Round numbers, so each term can be computed by hand.
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
    link_efficiency=1.0,
    usable_memory_fraction=1.0,
    usd_per_hour=3.6,
    kernel_overhead_s=2 * US,
    allreduce_latency_s=5 * US,
    allreduce_bandwidth_bytes_per_s=5e10,
    step_overhead_s=100 * US,
    step_overhead_per_request_s=1 * US,
    expert_fixed_latency_s=20 * US,
    expert_overhead_s=1 * US,
)
ZERO = GPU.model_copy(
    update={
        "kernel_overhead_s": 0.0,
        "allreduce_latency_s": 0.0,
        "allreduce_bandwidth_bytes_per_s": None,
        "step_overhead_s": 0.0,
        "step_overhead_per_request_s": 0.0,
        "expert_fixed_latency_s": 0.0,
        "expert_overhead_s": 0.0,
    }
)
TINY_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 100,
    "torch_dtype": "float32",
}


def _op(spec, name):
    return next(o for o in spec.operators if o.name == name)


def test_kernel_launches_add_per_kernel() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    op = _op(spec, "gate_up_proj")  # GEMM + SiLU-and-mul: two kernels
    full = RooflineLatency(GPU).op_latency_s(spec, op, spec.layers[0], 1, 4, 10)
    plain = RooflineLatency(ZERO).op_latency_s(spec, op, spec.layers[0], 1, 4, 10)
    assert op.kernels == 2
    assert full - plain == pytest.approx(2 * 2 * US)


def test_collective_floor_and_decode_size_bandwidth() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    o_proj = _op(spec, "o_proj")  # all-reduce of 64 float32 per token = 256 bytes
    lat = RooflineLatency(GPU)
    # 10 tokens at TP 4: 5 us + 2 * 3/4 * 2560 bytes / 50 GB/s
    assert lat.collective_s(o_proj, 4, 10) == pytest.approx(5 * US + 1.5 * 2560 / 5e10)
    assert lat.collective_terms_s(o_proj, 4, 10) == pytest.approx((5 * US, 1.5 * 2560 / 5e10))
    # Beyond 1 MiB the marginal bytes move at the link's 100 GB/s.
    tokens = 3 * SMALL_COLLECTIVE_MAX_BYTES / 256
    expected = 5 * US + 1.5 * (
        SMALL_COLLECTIVE_MAX_BYTES / 5e10 + 2 * SMALL_COLLECTIVE_MAX_BYTES / 1e11
    )
    assert lat.collective_s(o_proj, 4, tokens) == pytest.approx(expected)
    # No TP group, no collective.
    assert lat.collective_s(o_proj, 1, 10) == 0.0
    # Without a measured collective bandwidth the link's is used, as before.
    plain = GPU.model_copy(update={"allreduce_bandwidth_bytes_per_s": None})
    assert RooflineLatency(plain).collective_s(o_proj, 2, 10) == pytest.approx(
        5 * US + 1.0 * 2560 / 1e11
    )


def test_moe_experts_pay_startup_and_per_expert_cost_not_launches() -> None:
    spec = model_spec_from_config(TINY_MOE)
    experts = _op(spec, "experts")
    layer = spec.layers[0]
    e, k = 16, 4
    for batch in (1, 3, 64):
        touched = e * (1 - (1 - k / e) ** batch)
        full = RooflineLatency(GPU).op_latency_s(spec, experts, layer, 1, batch, 10)
        plain = RooflineLatency(ZERO).op_latency_s(spec, experts, layer, 1, batch, 10)
        # 20 us start-up + 1 us per expert touched, and no per-kernel launches for experts
        assert full - plain == pytest.approx(20 * US + touched * US)
    # At batch 1 exactly top-k experts are read; at a large batch all of them.
    assert float(experts.weight_bytes_read(1)) == k * experts.moe.expert_weight_bytes
    assert float(experts.weight_bytes_read(10_000)) == pytest.approx(experts.weight_bytes)


def test_shared_experts_launch_beside_the_routed_ones() -> None:
    """[SHARED-STREAM]: a shared expert's kernels run on a second stream beside the routed
    experts, so a decode step pays no launches for them (DeepSeek-V3: 58 MoE layers), while
    its bytes still count; timed alone (a profile's fit), its launches are in its time."""
    from opweave.costmodel import load_model
    from opweave.costmodel._private.fixed_costs import launches

    spec = load_model("deepseek-v3")
    shared = [op for op in spec.operators if op.name == "shared_expert"]
    assert len(shared) == 58 and all(op.side_stream and op.kernels == 3 for op in shared)
    op = shared[0]
    full = RooflineLatency(GPU).op_terms_s(op, 1, 4, 10)
    assert full["kernel_launch"] == 0.0
    assert full["roofline"] == RooflineLatency(ZERO).op_terms_s(op, 1, 4, 10)["roofline"] > 0
    assert launches(op, overlapped=False) == 3
    # ROCm engines run them inline (vLLM #30085; SGLang's second stream is CUDA-only)
    mi300x = default_catalog().get("mi300x")
    inline_launch = RooflineLatency(mi300x).op_terms_s(op, 1, 4, 10)["kernel_launch"]
    assert inline_launch == pytest.approx(3 * mi300x.kernel_overhead_s) and inline_launch > 0
    # the step: 58 x 3 launches fewer than the same model with the shared experts inline
    dumped = spec.model_dump()
    for layer in dumped["layers"]:
        for o in layer["ops"]:
            o["side_stream"] = False
    inline = type(spec).model_validate(dumped)
    h100 = default_catalog().get("h100")
    fast = estimate_step(spec, h100, tp=8, batch=16, context=2048)
    slow = estimate_step(inline, h100, tp=8, batch=16, context=2048)
    saved = slow.step_latency_s - fast.step_latency_s
    assert saved == pytest.approx(58 * 3 * h100.kernel_overhead_s)


def test_step_overhead_is_paid_once_per_step_on_sample() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    sample = spec.post_ops[-1]
    assert sample.name == "sample"
    full = RooflineLatency(GPU).op_latency_s(spec, sample, None, 1, 8, 10)
    plain = RooflineLatency(ZERO).op_latency_s(spec, sample, None, 1, 8, 10)
    # 100 us per step + 1 us per request of the 8, and the sampling kernel's own launch
    assert full - plain == pytest.approx(100 * US + 8 * 1 * US + 1 * 2 * US)
    lm_head = _op(spec, "lm_head")
    diff = RooflineLatency(GPU).op_latency_s(spec, lm_head, None, 1, 8, 10) - RooflineLatency(
        ZERO
    ).op_latency_s(spec, lm_head, None, 1, 8, 10)
    assert diff == pytest.approx(1 * 2 * US)  # only its own launch


def test_estimate_breakdown_shows_each_term() -> None:
    spec = model_spec_from_config(TINY_MOE)
    b, tp = 3, 2
    est = estimate_step(spec, GPU, tp=tp, batch=b, context=100)
    plain = estimate_step(spec, ZERO, tp=tp, batch=b, context=100)
    br = est.breakdown_s
    assert {"attention", "gemm", "small", "communication"} <= set(br)
    launches = sum(op.kernels for op in spec.operators if op.name != "experts")
    assert br["kernel_launch"] == pytest.approx(launches * 2 * US)
    touched = 16 * (1 - (1 - 4 / 16) ** b)
    assert br["moe_experts"] == pytest.approx(2 * (20 * US + touched * US))  # two MoE layers
    assert br["step_overhead"] == pytest.approx(100 * US + b * US)
    collectives = sum(1 for op in spec.operators if op.tp_collective != "none")
    assert collectives == 2 * 2 + 2  # embed, lm_head, and o_proj + experts per layer
    assert br["allreduce_latency"] == pytest.approx(collectives * 5 * US)
    # The roofline terms are those of the plain roofline, the fixed costs come on top.
    for key in ("attention", "gemm", "small"):
        assert br[key] == pytest.approx(plain.breakdown_s[key])
    assert est.step_latency_s == pytest.approx(sum(br.values()))
    fixed = sum(br[k] for k in ("kernel_launch", "moe_experts", "step_overhead"))
    fixed += br["allreduce_latency"]
    comm_extra = br["communication"] - plain.breakdown_s["communication"]
    assert est.step_latency_s == pytest.approx(plain.step_latency_s + fixed + comm_extra)


def test_a_hardware_file_overrides_the_per_gpu_values(tmp_path) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(
        '[[gpus]]\nid = "h100"\nstep_overhead_s = 0.0009\nstep_overhead_per_request_s = 29e-6\n'
        "kernel_overhead_s = 0.0\n"
    )
    custom = load_hardware_file(path).get("h100")
    stock = default_catalog().get("h100")
    spec = model_spec_from_config(TINY_LLAMA)
    a = estimate_step(spec, stock, tp=1, batch=10, context=64).breakdown_s
    b = estimate_step(spec, custom, tp=1, batch=10, context=64).breakdown_s
    assert a["step_overhead"] == pytest.approx(stock.step_overhead_s)
    assert b["step_overhead"] == pytest.approx(0.0009 + 10 * 29e-6)
    assert b["kernel_launch"] == 0.0 and a["kernel_launch"] > 0


def test_a_synthesised_profile_holds_every_term() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    profile = synthesize_profile(spec, GPU, batches=(4,), contexts=(64,))
    est = estimate_step(spec, GPU, tp=1, batch=4, context=64, latency=ProfiledLatency(profile))
    br = est.breakdown_s
    # its operator latencies are the roofline's, fixed costs and the step included
    assert br["kernel_launch"] == br["step_overhead"] == br["moe_experts"] == 0.0
    direct = estimate_step(spec, GPU, tp=1, batch=4, context=64)
    assert est.step_latency_s == pytest.approx(direct.step_latency_s)


def _measured(spec, **update):
    """A profile as the profiler measures one on GPU: each operator's kernels timed alone (so
    ``sample`` without the step around it), no collectives, no runtime loop."""
    kernels_only = GPU.model_copy(
        update={"step_overhead_s": 0.0, "step_overhead_per_request_s": 0.0}
    )
    profile = synthesize_profile(
        spec, kernels_only, tp_degrees=(1, 2), batches=(4,), contexts=(64,)
    )
    provenance = profile.provenance.model_copy(update={"source": "measured"})
    return profile.model_copy(update={"device": GPU, "provenance": provenance, **update})


def test_a_measured_profile_keeps_the_step_and_the_collectives_of_the_model() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    measured = ProfiledLatency(_measured(spec))
    for tp in (1, 2):
        est = estimate_step(spec, GPU, tp=tp, batch=4, context=64, latency=measured)
        direct = estimate_step(spec, GPU, tp=tp, batch=4, context=64)
        br = est.breakdown_s
        # the profile holds launches; the step is charged once, per request too: 100 + 4 x 1 us
        assert br["kernel_launch"] == br["moe_experts"] == 0.0
        assert br["step_overhead"] == pytest.approx(104 * US)
        assert est.step_latency_s == pytest.approx(direct.step_latency_s)
        for term in ("allreduce_latency", "communication"):
            assert br[term] == pytest.approx(direct.breakdown_s[term])
        assert (br["allreduce_latency"] > 0) == (tp == 2)
    # a profile that measured the runtime's own loop: the planner charges that loop instead
    looped = ProfiledLatency(_measured(spec, orchestration=OrchestrationProfile(drive_s=1e-4)))
    est = estimate_step(spec, GPU, tp=1, batch=4, context=64, latency=looped)
    assert est.breakdown_s["step_overhead"] == 0.0


def test_an_imported_engine_profile_overlaps_the_shared_experts() -> None:
    """[SHARED-STREAM] with profiles: NVIDIA's database times a shared expert alone, launches and
    all, where the engines run it beside the routed experts, so an imported profile charges it
    its bytes only; the runtime's own measured profile runs it inline and keeps its time."""
    from tests.planner.conftest import TINY_DEEPSEEK

    spec = model_spec_from_config(TINY_DEEPSEEK)
    dumped = spec.model_dump()
    for layer in dumped["layers"]:
        for o in layer["ops"]:
            o["side_stream"] = False
    inline = type(spec).model_validate(dumped)
    timed = synthesize_profile(inline, GPU, batches=(4,), contexts=(64,))  # launches included
    layer = next(la for la in spec.layers if any(o.side_stream for o in la.ops))
    shared = next(o for o in layer.ops if o.side_stream)
    alone = ProfiledLatency(timed).op_latency_s(spec, shared, layer, 1, 4, 64)
    roof = RooflineLatency(GPU).op_terms_s(shared, 1, 4, 64)
    assert alone == pytest.approx(roof["roofline"] + 3 * GPU.kernel_overhead_s)
    for source, expected in (("aiconfigurator", roof["roofline"]), ("measured", alone)):
        provenance = timed.provenance.model_copy(update={"source": source})
        profile = timed.model_copy(update={"provenance": provenance})
        got = ProfiledLatency(profile).op_latency_s(spec, shared, layer, 1, 4, 64)
        assert got == pytest.approx(expected), source


def test_fitting_a_measured_profile_leaves_the_step_out_of_sample() -> None:
    spec = model_spec_from_config(TINY_LLAMA)
    start = _measured(spec).model_copy(
        update={"device": ZERO.model_copy(update={"step_overhead_s": 100 * US})}
    )
    report = fit_efficiency_report(start, spec)
    assert report.max_error_factor < 1.01, report.worst_op


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 512),
    context=st.integers(1, 65536),
    tp=st.sampled_from([1, 2, 4, 8]),
    gpu=st.sampled_from(["h100", "a100", "h200", "l40s", "mi300x"]),
    moe=st.booleans(),
)
def test_fixed_costs_only_add(batch, context, tp, gpu, moe) -> None:
    hw = default_catalog().get(gpu)
    spec = model_spec_from_config(TINY_MOE if moe else TINY_LLAMA)
    zero = hw.model_copy(update={k: v for k, v in ZERO.model_dump().items() if k in FIELDS})
    full = estimate_step(spec, hw, tp=tp, batch=batch, context=context)
    plain = estimate_step(spec, zero, tp=tp, batch=batch, context=context)
    assert full.step_latency_s >= plain.step_latency_s
    for key in ("attention", "gemm", "small"):
        assert full.breakdown_s[key] == pytest.approx(plain.breakdown_s[key])


FIELDS = {
    "kernel_overhead_s",
    "allreduce_latency_s",
    "allreduce_bandwidth_bytes_per_s",
    "step_overhead_s",
    "step_overhead_per_request_s",
    "expert_fixed_latency_s",
    "expert_overhead_s",
}


def test_the_section_3_analysis_is_the_roofline_regime() -> None:
    """The theorems bound the roofline cost lines; the fixed costs do not enter them."""
    cat = default_catalog()
    spec = model_spec_from_config(TINY_LLAMA | {"num_hidden_layers": 8, "hidden_size": 256})
    s = np.geomspace(64, 8192, 8)
    stock = analyze(spec, [cat.get("h100"), cat.get("a100")], s)
    zeroed = [
        cat.get(g).model_copy(update={k: v for k, v in ZERO.model_dump().items() if k in FIELDS})
        for g in ("h100", "a100")
    ]
    plain = analyze(spec, zeroed, s)
    for a, b in zip(stock.gpus, plain.gpus, strict=True):
        np.testing.assert_array_equal(a.cost_homogeneous, b.cost_homogeneous)
        np.testing.assert_array_equal(a.gain_homogeneous, b.gain_homogeneous)
