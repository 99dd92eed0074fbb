"""Expert parallelism and data-parallel attention: volumes, memory and estimates against
computations written here from the models' shapes, and against DeepEP's published timings."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from opweave.costmodel import (
    ConfigError,
    HardwareSpec,
    MoESpec,
    Owner,
    Parallelism,
    Plan,
    RooflineLatency,
    alltoall_bytes_per_gpu,
    alltoall_s,
    canonical_plan,
    default_catalog,
    dispatch_bytes_per_token,
    estimate_step,
    expert_load_imbalance,
    load_model,
    memory_bytes_per_gpu,
    parallel_op_terms_s,
    parallelism_problem,
    plan_groups,
    plan_nodes,
    weight_bytes_per_gpu,
    weight_share,
)
from opweave.costmodel._private.models import builtin_config
from opweave.costmodel._private.parallelism import dispatch_element_bytes

US = 1e-6


@pytest.fixture(scope="module")
def moe():
    return load_model("qwen3-30b-a3b")


@pytest.fixture(scope="module")
def h200() -> HardwareSpec:
    return default_catalog().get("h200")


def test_dispatch_volume_per_token_and_per_step(moe, h200) -> None:
    """Qwen3-30B-A3B: 8 of 128 experts per token, hidden 2048. A token dispatches 8 BF16 copies
    (32 KiB); on 8 GPUs 7 in 8 copies leave the GPU; the busiest GPU receives the expected
    maximum of uniform routing."""
    cfg = builtin_config("qwen3-30b-a3b")
    k, hidden, experts = cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["num_experts"]
    assert (k, hidden, experts) == (8, 2048, 128)
    spec = MoESpec(num_experts=experts, top_k=k, expert_weight_bytes=1)
    assert dispatch_bytes_per_token(spec, hidden, 2.0) == 8 * 2048 * 2
    # per step: 256 tokens spread over 8 GPUs, each GPU receives 1/8 of all copies, less its own
    tokens, ep = 256, 8
    mean_in = tokens * k * hidden * 2 / ep
    nvl, net = alltoall_bytes_per_gpu(tokens, k * hidden * 2, ep, 8)
    assert net == 0.0 and nvl == pytest.approx(mean_in * 7 / 8)
    # across two 8-GPU nodes: from 7 of 16 peers over NVLink, 8 over the network
    nvl, net = alltoall_bytes_per_gpu(tokens, k * hidden * 2, 16, 8)
    assert nvl == pytest.approx(tokens * k * hidden * 2 / 16 * 7 / 16)
    assert net == pytest.approx(tokens * k * hidden * 2 / 16 * 8 / 16)
    # busiest GPU: 2048 copies over 8 GPUs, mean 256, sd sqrt(2048 / 8 * 7 / 8), Blom's z for 8
    sd = math.sqrt(2048 * (1 / 8) * (7 / 8))
    z = 1.4338  # Phi^-1((8 - 0.375) / 8.25), from a normal table
    assert expert_load_imbalance(spec, tokens, ep) == pytest.approx((256 + z * sd) / 256, rel=1e-4)
    assert expert_load_imbalance(spec, tokens, 1) == 1.0
    # a measured skew multiplies it, but never past every copy on one GPU's experts
    assert expert_load_imbalance(spec, 1, 8, skew=100.0) == pytest.approx(8.0)


def test_fp8_experts_dispatch_fp8_with_block_scales() -> None:
    """DeepSeek-V3 §3.3 / DeepEP: FP8 e4m3 plus one FP32 scale per 128 channels, where the
    experts' GEMMs take FP8 inputs (FP8 or FP4 weights on tensor cores for them); BF16 where
    they run weight-only (no FP8 tensor cores) or unquantised."""
    catalog = default_catalog()
    h200, a100, b200 = catalog.get("h200"), catalog.get("a100"), catalog.get("b200")

    def dispatch(quant: str | None, hw: HardwareSpec) -> float:
        model = load_model("qwen3-30b-a3b", quant=quant)
        experts = next(op for op in model.operators if op.moe is not None)
        return dispatch_element_bytes(model, experts, hw)

    fp8 = (128 + 4) / 128
    assert dispatch(None, h200) == 2.0
    assert dispatch("fp8-block", h200) == pytest.approx(fp8)
    assert dispatch("fp8", a100) == 2.0  # weight-only FP8: BF16 activations
    assert dispatch("nvfp4", b200) == pytest.approx(fp8)
    assert dispatch("nvfp4", h200) == 2.0  # no FP4 tensor cores: weight-only
    assert dispatch("int4-wo", h200) == 2.0


# DeepEP V1 low-latency kernels, H800 + CX7 400 Gb/s, 128 tokens per GPU, hidden 7168, top-8,
# FP8 dispatch, BF16 combine (deepseek-ai/DeepEP docs/legacy.md): EP -> (dispatch, combine) us
DEEPEP_LL = {16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}
H800 = HardwareSpec(
    id="h800",
    name="NVIDIA H800 SXM",
    memory_bytes=80e9,
    mem_bandwidth_bytes_per_s=3.35e12,
    dense_flops_per_s=989e12,
    intra_node_bandwidth_bytes_per_s=200e9,  # 400 GB/s bidirectional NVLink
    link_efficiency=0.8,  # DeepEP: ~160 GB/s achievable
    network_bandwidth_bytes_per_s=50e9,  # CX7 400 Gb/s
)


@pytest.mark.parametrize("ep", sorted(DEEPEP_LL))
def test_all_to_all_reproduces_deepeps_published_low_latency_table(ep: int) -> None:
    r1 = MoESpec(num_experts=256, top_k=8, expert_weight_bytes=1)
    tokens = 128 * ep
    imbalance = expert_load_imbalance(r1, tokens, ep)
    fp8 = 8 * 7168 * (1 + 4 / 128)
    bf16 = 8 * 7168 * 2
    for per_token, measured in zip((fp8, bf16), DEEPEP_LL[ep], strict=True):
        floor, payload = alltoall_s(
            H800, *alltoall_bytes_per_gpu(tokens, per_token, ep, 8, imbalance)
        )
        assert floor + payload == pytest.approx(measured * US, rel=0.12)


def test_memory_per_gpu_with_expert_and_data_parallelism(moe) -> None:
    """tp 1, ep 8, dp 8, 256 requests at 4K: every GPU holds the non-expert weights whole, an
    eighth of the experts (16 of 128 per layer), and the KV cache of its DP rank's 32 requests."""
    cfg = builtin_config("qwen3-30b-a3b")
    layers, hidden, inter = (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["moe_intermediate_size"],
    )
    experts = layers * cfg["num_experts"] * 3 * hidden * inter * 2
    kv_per_token = layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert sum(o.weight_bytes for o in moe.operators if o.name == "experts") == experts
    others = moe.weight_bytes - experts
    # activations: the two largest live tensors of a step, per request, for 32 requests
    sizes = sorted((o.boundary_bytes_per_token for o in moe.operators), reverse=True)[:2]
    expected = others + experts / 8 + 32 * (4096 * kv_per_token + sum(sizes))
    par = Parallelism(tp=1, ep=8, dp=8)
    assert memory_bytes_per_gpu(moe.operators, par, 256, 4096) == pytest.approx(expected)
    # the same GPUs as one TP-8 replica: 4 KV heads over 8 GPUs, each GPU holds one head (a
    # quarter of the KV) of all 256 requests, twice DP 8's whole KV of 32 requests
    tp8 = memory_bytes_per_gpu(moe.operators, Parallelism(tp=8), 256, 4096)
    dp8 = memory_bytes_per_gpu(moe.operators, par, 256, 4096)
    assert tp8 > dp8
    # a DP rank holds ceil(batch / dp) requests
    assert memory_bytes_per_gpu(moe.operators, par, 250, 4096) == pytest.approx(expected)


def test_wide_ep_against_tensor_parallel_experts_on_h200(moe, h200) -> None:
    """Qwen3-30B-A3B on 8 H200, 4K context: TP 8 against DP 8 attention with EP 8 experts.

    The terms by hand: DP 8 runs each rank's attention as one GPU with 32 requests; each of
    the 48 MoE layers pays a dispatch and a combine floor (42 us each) instead of an all-reduce;
    TP 8 holds 4 KV heads on 8 GPUs, so each GPU reads one head of all 256 requests: twice the
    KV bytes of DP 8's 4 heads of 32 requests.
    """
    layers = 48
    tp = estimate_step(moe, h200, tp=8, batch=256, context=4096)
    ep = estimate_step(moe, h200, tp=1, ep=8, dp=8, batch=256, context=4096)
    one = estimate_step(moe, h200, tp=1, batch=32, context=4096)
    assert ep.breakdown_s["attention"] == pytest.approx(one.breakdown_s["attention"])
    assert ep.breakdown_s["alltoall_latency"] == pytest.approx(layers * 2 * 42 * US)
    assert ep.breakdown_s["allreduce_latency"] == 0.0
    assert tp.breakdown_s["alltoall_latency"] == 0.0
    # per layer, TP 8 all-reduces after o_proj and after the experts, plus embed and lm_head,
    # each at the H200's CUDA-graph floor (3.0 us)
    assert tp.breakdown_s["allreduce_latency"] == pytest.approx((2 * layers + 2) * 3.0 * US)
    assert tp.breakdown_s["attention"] == pytest.approx(2 * ep.breakdown_s["attention"], rel=0.05)
    # the all-to-all payload: per layer the busiest GPU receives 7/8 of its share of 256 x 8
    # BF16 copies of 2048 values, twice (dispatch, combine), over NVLink at 450 x 0.84 GB/s
    imbalance = ep.expert_imbalance
    assert imbalance == pytest.approx(1.084, abs=1e-3)
    per_layer = 2 * 256 * 8 * 2048 * 2 / 8 * imbalance * 7 / 8 / (450e9 * 0.84)
    assert ep.breakdown_s["alltoall"] == pytest.approx(layers * per_layer)
    assert ep.expert_imbalance_basis is not None and "assumed" in ep.expert_imbalance_basis
    # at 256 requests DP attention wins; at 8 the all-to-all floors cost more than it saves
    assert ep.step_latency_s < 0.9 * tp.step_latency_s
    assert ep.usd_per_million_tokens < tp.usd_per_million_tokens
    small_tp = estimate_step(moe, h200, tp=8, batch=8, context=4096)
    small_ep = estimate_step(moe, h200, tp=1, ep=8, dp=8, batch=8, context=4096)
    assert small_ep.step_latency_s > small_tp.step_latency_s
    assert (
        small_ep.step_latency_s - small_tp.step_latency_s < small_ep.breakdown_s["alltoall_latency"]
    )
    # the same GPUs, prices and batch: cost per token follows the step
    assert ep.usd_per_million_tokens == pytest.approx(
        h200.usd_per_hour * 8 * ep.step_latency_s / 256 / 3600 * 1e6
    )


def test_tensor_parallelism_alone_is_unchanged(moe, h200) -> None:
    plain = estimate_step(moe, h200, tp=4, batch=64, context=8192)
    same = estimate_step(moe, h200, tp=4, ep=1, dp=1, batch=64, context=8192)
    assert plain == same
    assert plain.expert_imbalance is None and plain.breakdown_s["alltoall"] == 0.0


@pytest.mark.parametrize(
    ("model", "par", "message"),
    [
        ("qwen3-30b-a3b", Parallelism(tp=2, ep=3, dp=4), "ep 3 does not divide tp x dp = 8"),
        (
            "qwen3-30b-a3b",
            Parallelism(tp=1, ep=256, dp=256),
            "ep 256 is more than the 128 routed experts",
        ),
        ("qwen3-32b", Parallelism(tp=1, ep=2, dp=2), "qwen3-32b has no routed experts"),
        ("qwen3-30b-a3b", Parallelism(tp=1, ep=4, dp=12), "spans part of an NVLink domain of 8"),
        ("qwen3-30b-a3b", Parallelism(tp=1, ep=1, dp=2048), "at most 1024 are supported"),
        ("qwen3-32b", Parallelism(tp=1, dp=3), "intermediate size"),
    ],
)
def test_illegal_combinations_say_why(model: str, par: Parallelism, message: str) -> None:
    problem = parallelism_problem(load_model(model), par, default_catalog().get("h100"))
    assert problem is not None and message in problem
    with pytest.raises(ConfigError, match=message.split(":")[0]):
        estimate_step(
            load_model(model),
            default_catalog().get("h100"),
            tp=par.tp,
            ep=par.ep,
            dp=par.dp,
            batch=16,
            context=1024,
        )


def test_groups_beyond_a_node_use_the_network_in_whole_domains(moe) -> None:
    h100 = default_catalog().get("h100")
    assert parallelism_problem(moe, Parallelism(tp=1, ep=32, dp=32), h100) is None
    nvl72 = h100.model_copy(update={"id": "nvl72", "gpus_per_node": 4, "nvlink_domain_gpus": 72})
    # 24 GPUs: within one 72-GPU NVLink domain although beyond a 4-GPU node
    assert parallelism_problem(moe, Parallelism(tp=1, ep=8, dp=24), nvl72) is None
    # a TP group spans trays of one NVLink domain (GB200 NVL72: TP 8 over two 4-GPU trays) ...
    assert parallelism_problem(moe, Parallelism(tp=8), nvl72) is None
    # ... but not a node without one
    quad = h100.model_copy(update={"id": "quad", "gpus_per_node": 4})
    assert parallelism_problem(moe, Parallelism(tp=8), quad) == (
        "tp 8: quad has 4 GPUs per NVLink domain and a TP group stays within one"
    )
    # over NVLink in the domain: no network bytes
    nvl, net = alltoall_bytes_per_gpu(24, 1000.0, 24, nvl72.scale_up_gpus)
    assert net == 0.0 and nvl == pytest.approx(24 * 1000 / 24 * 23 / 24)


def test_owner_schema_defaults_and_validation() -> None:
    old = Owner.model_validate({"gpu": "h100-sxm", "tp": 2, "replicas": 1, "resident_batch": 4})
    assert (old.ep, old.dp, old.gpus_per_replica) == (1, 1, 2)
    wide = Owner(gpu="h100-sxm", tp=2, ep=8, dp=4, replicas=3, resident_batch=64)
    assert wide.gpus_per_replica == 8 and str(wide.parallelism) == "tp2 ep8 dp4"
    with pytest.raises(ValidationError, match="ep 3 must divide tp x dp = 8"):
        Owner(gpu="h100-sxm", tp=2, ep=3, dp=4, replicas=1, resident_batch=4)
    with pytest.raises(ValidationError, match="at most 1024"):
        Owner(gpu="h100-sxm", tp=8, dp=256, replicas=1, resident_batch=4)


def test_plans_count_tp_x_dp_gpus_per_replica(moe) -> None:
    plan = canonical_plan(moe, "afd", gpu="h100-sxm", batch=64, tp=2, ep=8, dp=4, replicas=3)
    assert all(o.gpus_per_replica == 8 for o in plan.owners)
    # one TP group per DP rank, per replica, per owner: 2 owners x 3 replicas x 4 DP ranks
    assert plan_groups(plan) == [("h100-sxm", 2)] * 24
    nodes = plan_nodes(plan, {"h100-sxm": 8})
    assert sum(n.gpus for n in nodes) == 48 and [n.gpus for n in nodes] == [8] * 6
    doc = plan.model_dump()
    doc["owners"] = [dict(o, replicas=8192) for o in doc["owners"]]
    with pytest.raises(ValidationError, match="131072 GPUs"):
        Plan.model_validate(doc)


def test_experts_that_do_not_split_evenly_fill_redundant_slots() -> None:
    """EP 48 over DeepSeek-V3's 256 experts: ceil(256 / 48) = 6 expert slots per GPU, the 32
    spare ones redundant copies (EPLB), so each GPU holds 6 experts' weights, not 256 / 48."""
    r1 = load_model("deepseek-v3")
    experts = [op for op in r1.operators if op.moe is not None]
    per_expert = sum(op.weight_bytes for op in experts) / 256
    par = Parallelism(tp=1, ep=48, dp=48)
    assert parallelism_problem(r1, par) is None
    share = [weight_share(op, par) for op in experts]
    assert sum(op.weight_bytes * w for op, w in zip(experts, share, strict=True)) == (
        pytest.approx(6 * per_expert)
    )
    even = Parallelism(tp=1, ep=32, dp=32)
    assert sum(op.weight_bytes * weight_share(op, even) for op in experts) == pytest.approx(
        8 * per_expert
    )


def test_dense_ffn_data_parallel_holds_it_whole_and_runs_it_on_local_tokens() -> None:
    """DeepSeek-V3 (FP8 128x128 blocks) under attention DP: its 3 dense FFN layers (18432
    channels) do not split over 32 GPUs in whole scale blocks (576 channels); held whole on
    every GPU (SGLang's --moe-dense-tp-size 1, TensorRT-LLM's attention DP) they run, on each
    GPU's own tokens, with no collective of their own."""
    cfg = builtin_config("deepseek-v3")
    hidden, inter, dense = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["first_k_dense_replace"],
    )
    assert (hidden, inter, dense) == (7168, 18432, 3)
    # per layer: gate, up, down in FP8 (1 byte) plus one FP32 scale per 128x128 block of each
    per_layer = 3 * hidden * inter + 3 * (hidden // 128) * (inter // 128) * 4
    model = load_model("deepseek-v3")
    dense_ops = [o for o in model.operators if o.name in ("gate_up_proj", "down_proj")]
    assert sum(o.weight_bytes for o in dense_ops) == dense * per_layer
    catalog = default_catalog()
    gb300, h200 = catalog.get("gb300"), catalog.get("h200")
    wide = Parallelism(tp=1, ep=32, dp=32)
    problem = parallelism_problem(model, wide, gb300)
    assert problem is not None and "576 are not whole 128x128 FP8 scale blocks at tp 32" in problem
    whole = Parallelism(tp=1, ep=32, dp=32, dense_dp=True)
    assert parallelism_problem(model, whole, gb300) is None
    # memory: the dense FFN whole instead of an eighth of it, all else the same
    ep8, ep8_dense = Parallelism(tp=1, ep=8, dp=8), Parallelism(tp=1, ep=8, dp=8, dense_dp=True)
    assert weight_bytes_per_gpu(model.operators, ep8_dense) - weight_bytes_per_gpu(
        model.operators, ep8
    ) == pytest.approx(dense * per_layer * (1 - 1 / 8))
    # latency: 16 requests per DP rank; at 16 tokens the FP8 GEMMs are weight-bound, so each
    # dense layer reads its whole weights (activations: 16 x (7168 + 2 x 18432) BF16 values
    # more, 0.5%); no gather/scatter over the group
    est = estimate_step(model, gb300, tp=1, ep=32, dp=32, dense_dp=True, batch=512, context=4096)
    assert est.dense_dp and est.weight_bytes_per_gpu == weight_bytes_per_gpu(model.operators, whole)
    for op in dense_ops:
        terms = parallel_op_terms_s(gb300, model, op, whole, 512, 4096)
        assert terms["collective"] == terms["collective_latency"] == 0.0
        assert terms["roofline"] == pytest.approx(
            op.weight_bytes / gb300.effective_bandwidth, rel=0.01
        )
        over_group = parallel_op_terms_s(h200, model, op, ep8, 512, 4096)
        if op.name == "down_proj":
            assert over_group["collective_latency"] > 0.0
    # tp 2 x dp 4: a DP rank's 16 requests scattered over its 2 attention-TP GPUs, 8 each
    four = Parallelism(tp=2, ep=8, dp=4, dense_dp=True)
    down = next(o for o in dense_ops if o.name == "down_proj")
    eight = RooflineLatency(h200).op_terms_s(down, 1, 8, 4096)
    assert parallel_op_terms_s(h200, model, down, four, 64, 4096)["roofline"] == eight["roofline"]
    # only with data-parallel attention
    problem = parallelism_problem(model, Parallelism(tp=8, ep=8, dense_dp=True), h200)
    assert problem == "dense FFN data-parallel needs data-parallel attention (dp > 1)"
    with pytest.raises(ConfigError, match="needs data-parallel attention"):
        estimate_step(model, h200, tp=8, ep=8, dense_dp=True, batch=16, context=1024)
