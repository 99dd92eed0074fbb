"""Precision: weight formats read from checkpoints, their bytes, the KV-cache dtype and the GEMM
rate each format gets on a GPU.

Every weight count below is written out from the config's shapes and the format's layout
(values, scales, zeros), independently of the cost model's operators: block FP8 stores one FP32
scale per 128x128 block, NVFP4 an FP8 scale per 16 values and two FP32 scalars per tensor, MXFP4
an 8-bit scale per 32 values; norms, embeddings, routers, biases and lm_head stay in BF16.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from opweave.costmodel import (
    SUPPORTED_FAMILIES,
    ConfigError,
    Parallelism,
    RooflineLatency,
    UnsupportedPrecisionError,
    check_runs,
    default_catalog,
    estimate_step,
    gemm_rate,
    load_model,
    model_spec_from_config,
)
from opweave.costmodel._private.kernel_rates import grouped_gemm_fraction
from opweave.costmodel._private.models import builtin_config
from opweave.costmodel._private.parallelism import parallel_op_terms_s

CHECKPOINTS = Path(__file__).with_name("checkpoints")
CAT = default_catalog()
# H100 SXM with its datasheet dense FP8 peak (1979 TFLOPS, NVIDIA H100 datasheet), B200 with
# FP8 and FP4 (4.5 and 9 PFLOPS dense, DGX B200 datasheet / 8), given here so that the tests do
# not depend on what the catalog fills in.
H100_FP8 = CAT.get("h100")  # FP8 tensor cores: 1979 dense TFLOPS, 71% reached ([MAMF])
B200_FP4 = CAT.get("b200")  # FP8 4.5 and FP4 9 dense PFLOPS
A100 = CAT.get("a100")


def block_fp8(n_in: int, n_out: int) -> float:
    """An FP8 E4M3 weight and its FP32 scale per 128x128 block."""
    return n_in * n_out + 4 * math.ceil(n_out / 128) * math.ceil(n_in / 128)


def nvfp4(n_in: int, n_out: int) -> float:
    """FP4 values, an FP8 scale per 16, FP32 weight_scale_2 and input_scale."""
    return n_in * n_out / 2 + n_in * n_out / 16 + 8


def mxfp4(n_in: int, n_out: int) -> float:
    """FP4 values and an E8M0 scale per 32."""
    return n_in * n_out / 2 + n_in * n_out / 32


def bf16(*params: int) -> int:
    return 2 * sum(params)


def config(name: str) -> dict[str, Any]:
    return json.loads((CHECKPOINTS / name).read_text())


# -- weight bytes of the reference checkpoints -------------------------------------------------
def test_qwen3_32b_fp8_weight_bytes() -> None:
    h, layers, nq, nkv, d, inter, vocab = 5120, 64, 64, 8, 128, 25600, 151936
    layer = (
        block_fp8(h, nq * d)
        + 2 * block_fp8(h, nkv * d)
        + block_fp8(nq * d, h)
        + 2 * block_fp8(h, inter)
        + block_fp8(inter, h)
        + bf16(h, h, d, d)  # input / post-attention norms, q_norm, k_norm
    )
    expected = layers * layer + bf16(vocab * h, vocab * h, h)  # embed, lm_head, final norm
    spec = load_model(CHECKPOINTS / "qwen3-32b-fp8.json")
    assert spec.precision.quant == "fp8-block"
    assert spec.weight_bytes == pytest.approx(expected, abs=layers)
    # half the BF16 checkpoint's bytes, less the embeddings that stay in BF16
    assert spec.weight_bytes / load_model("qwen3-32b").weight_bytes == pytest.approx(
        0.524, abs=1e-3
    )


def test_qwen3_235b_fp8_keeps_routers_and_lm_head_in_bf16() -> None:
    cfg = config("qwen3-235b-a22b-fp8.json")
    h, layers, nq, nkv, d = 4096, 94, 64, 4, 128
    experts, inter, vocab = 128, 1536, 151936
    layer = (
        block_fp8(h, nq * d)
        + 2 * block_fp8(h, nkv * d)
        + block_fp8(nq * d, h)
        + bf16(h * experts)  # mlp.gate: modules_to_not_convert
        + experts * (2 * block_fp8(h, inter) + block_fp8(inter, h))
        + bf16(h, h, d, d)
    )
    expected = layers * layer + bf16(vocab * h, vocab * h, h)
    spec = model_spec_from_config(cfg)
    assert spec.weight_bytes == pytest.approx(expected, abs=layers * 2)
    router = next(op for op in spec.layers[0].ops if op.name == "router")
    experts_op = next(op for op in spec.layers[0].ops if op.name == "experts")
    assert (router.weight_format, experts_op.weight_format) == (None, "fp8-block")
    assert experts_op.moe is not None
    one_expert = 2 * block_fp8(h, inter) + block_fp8(inter, h)
    assert experts_op.moe.expert_weight_bytes == round(one_expert)


def test_gpt_oss_120b_quantises_only_its_experts() -> None:
    h, layers, nq, nkv, d, experts, inter, vocab = 2880, 36, 64, 8, 64, 128, 2880, 201088
    attention = bf16(
        h * nq * d + nq * d,  # q_proj and bias
        2 * (h * nkv * d + nkv * d),  # k, v
        nq * d * h + h,  # o_proj and bias
        nq,  # attention sinks
    )
    router = bf16(h * experts + experts)
    expert = mxfp4(h, 2 * inter) + mxfp4(inter, h) + bf16(2 * inter + h)  # biases in bf16
    layer = attention + router + experts * expert + bf16(h, h)
    expected = layers * layer + bf16(vocab * h, vocab * h, h)
    spec = load_model(CHECKPOINTS / "gpt-oss-120b.json")
    assert spec.precision.quant == "mxfp4"
    assert spec.weight_bytes == pytest.approx(expected, abs=layers)
    # OpenAI's gpt-oss model card: the 120b checkpoint is 60.8 GiB
    assert spec.weight_bytes / 2**30 == pytest.approx(60.8, abs=0.05)


# deepseek_v3 and minimax_m2 come with the families of issue 37 (another branch); these counts
# run once they are supported, and skip until then.
def _needs(family: str) -> None:
    if family not in SUPPORTED_FAMILIES:
        pytest.skip(f"{family} is not a supported family on this branch yet")


def _deepseek(weight: Any, attention_weight: Any) -> float:
    h, layers, dense, vocab = 7168, 61, 3, 129280
    heads, q_rank, kv_rank, nope, rope, v = 128, 1536, 512, 128, 64, 128
    experts, inter, moe_inter = 256, 18432, 2048
    attention = (
        attention_weight(h, q_rank)
        + attention_weight(q_rank, heads * (nope + rope))
        + attention_weight(h, kv_rank + rope)
        + attention_weight(kv_rank, heads * (nope + v))
        + weight(heads * v, h)
        + bf16(q_rank, kv_rank)  # q_a_layernorm, kv_a_layernorm
    )
    mlp = 2 * weight(h, inter) + weight(inter, h)
    expert = 2 * weight(h, moe_inter) + weight(moe_inter, h)
    moe = bf16(h * experts) + 4 * experts + (experts + 1) * expert  # router, fp32 bias, shared
    return (
        layers * (attention + bf16(h, h))
        + dense * mlp
        + (layers - dense) * moe
        + bf16(vocab * h, vocab * h, h)
    )


def test_deepseek_v3_block_fp8_weight_bytes() -> None:
    _needs("deepseek_v3")
    spec = load_model(CHECKPOINTS / "deepseek-v3.json")
    assert spec.weight_bytes == pytest.approx(_deepseek(block_fp8, block_fp8), rel=1e-5)


def test_deepseek_v31_nvfp4_weight_bytes_and_fp8_kv() -> None:
    _needs("deepseek_v3")
    spec = load_model(CHECKPOINTS / "deepseek-v3.1-nvfp4.json")
    # ModelOpt leaves the MLA projections but o_proj in bf16 (exclude_modules)
    expected = _deepseek(nvfp4, lambda n_in, n_out: bf16(n_in * n_out))
    assert spec.weight_bytes == pytest.approx(expected, rel=1e-5)
    assert spec.precision.kv_cache_dtype == "fp8"  # kv_cache_quant_algo FP8, --kv-cache-dtype auto
    # the compressed latent and the rope key, one byte each, per layer
    assert float(spec.state_bytes_per_request(1)) == (512 + 64) * 61


def test_minimax_m25_block_fp8_weight_bytes() -> None:
    _needs("minimax_m2")
    h, layers, nq, nkv, d, experts, inter, vocab = 3072, 62, 48, 8, 128, 256, 1536, 200064
    attention = (
        block_fp8(h, nq * d)
        + 2 * block_fp8(h, nkv * d)
        + block_fp8(nq * d, h)
        + bf16(nq * d, nkv * d)  # per-layer q_norm and k_norm
    )
    moe = (
        bf16(h * experts) + 4 * experts + experts * (2 * block_fp8(h, inter) + block_fp8(inter, h))
    )
    expected = layers * (attention + moe + bf16(h, h)) + bf16(vocab * h, vocab * h, h)
    spec = load_model(CHECKPOINTS / "minimax-m2.5.json")
    assert spec.weight_bytes == pytest.approx(expected, rel=1e-5)


def test_modelopt_exclusions_follow_the_checkpoint() -> None:
    """DeepSeek-V3.1-NVFP4's hf_quant_config: its exclude_modules and FP8 KV cache, read by
    name (the deepseek_v3 family is not needed to read its precision)."""
    from opweave.costmodel._private.quant_config import checkpoint_precision

    arch = load_model("qwen3-32b").arch
    hf_quant = config("deepseek-v3.1-nvfp4.hf_quant_config.json")
    precision = checkpoint_precision(config("deepseek-v3.1-nvfp4.json"), arch, hf_quant)
    assert (precision.quant, precision.kv_cache_dtype, precision.method) == (
        "nvfp4",
        "fp8",
        "modelopt-nvfp4",
    )

    def fmt(path: str) -> str | None:
        scheme = precision.scheme_for((path,), router=False, expert=".experts." in path)
        return None if scheme is None else scheme.format

    assert fmt("model.layers.5.self_attn.q_a_proj") is None  # listed
    assert fmt("model.layers.5.self_attn.kv_b_proj") is None
    assert fmt("model.layers.5.self_attn.o_proj") == "nvfp4"  # not listed
    assert fmt("model.layers.5.mlp.experts.0.down_proj") == "nvfp4"
    assert fmt("model.layers.61.mlp.experts.0.down_proj") is None  # model.layers.61*
    assert fmt("lm_head") is None


def _qwen3_32b_config(quantization_config: dict[str, Any]) -> dict[str, Any]:
    config = builtin_config("qwen3-32b")
    return config | {"quantization_config": quantization_config}


def test_modelopt_export_without_quant_method_is_read_by_its_producer() -> None:
    """ModelOpt's FP8 static per-tensor export (Qwen3-32B-FP8-Static-PerTensor, as NVIDIA's
    aiconfigurator ships its config) names no quant_method: its producer and quant_algo say
    what it is, and its KV scheme is the algorithm's name."""
    qc = {
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}},
        "ignore": ["lm_head"],
        "quant_algo": "FP8",
        "kv_cache_scheme": "FP8",
        "producer": {"name": "modelopt", "version": "0.31.0"},
    }
    spec = model_spec_from_config(_qwen3_32b_config(qc))
    assert (spec.precision.quant, spec.precision.method) == ("fp8", "modelopt-fp8")
    assert spec.precision.kv_cache_dtype == "fp8"
    # FP8 values, an FP32 weight scale and an FP32 input scale per tensor (static activations)
    assert spec.weight_bytes == pytest.approx(_qwen3_32b(lambda i, o: i * o + 8), abs=64)
    with pytest.raises(ConfigError, match="^quantization_config.quant_method: missing"):
        model_spec_from_config(_qwen3_32b_config({k: v for k, v in qc.items() if k != "producer"}))


def _mixed(layers: int = 64) -> dict[str, Any]:
    """A ModelOpt MIXED_PRECISION config as NVIDIA's Qwen3.6 NVFP4 checkpoints write it:
    attention in FP8 (W8A8), the MLP and lm_head in W4A16 NVFP4 (weight-only)."""
    quantized: dict[str, Any] = {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    for i in range(layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            quantized[f"model.layers.{i}.self_attn.{name}"] = {"quant_algo": "FP8"}
        for name in ("gate_proj", "up_proj", "down_proj"):
            quantized[f"model.layers.{i}.mlp.{name}"] = {
                "quant_algo": "W4A16_NVFP4",
                "group_size": 16,
            }
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": quantized,
        "ignore": ["mtp*"],
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": {"name": "modelopt", "version": "0.45.0"},
    }


def test_modelopt_mixed_precision_reads_each_layers_format() -> None:
    spec = model_spec_from_config(_qwen3_32b_config(_mixed()))
    h, layers, vocab = QWEN3_32B["h"], QWEN3_32B["layers"], QWEN3_32B["vocab"]
    # attention in FP8 (values, FP32 weight and input scales), the MLP and lm_head in NVFP4
    expected = _qwen3_32b(lambda i, o: i * o + 8, mlp=nvfp4, head=nvfp4(h, vocab))
    assert spec.weight_bytes == pytest.approx(expected, abs=4 * layers)
    assert (spec.precision.quant, spec.precision.method) == ("fp8+nvfp4", "modelopt-mixed")
    assert spec.precision.kv_cache_dtype == "fp8"
    # the W4A16 MLP runs at the BF16 rate (weight-only), the FP8 attention at the FP8 rate
    gate_up = next(op for op in spec.layers[0].ops if op.name == "gate_up_proj")
    qkv = next(op for op in spec.layers[0].ops if op.name == "qkv_proj")
    assert gate_up.weight_format == "nvfp4" and gate_up.quantized_flops_per_token == 0
    assert qkv.weight_format == "fp8" and qkv.quantized_flops_per_token > 0
    runs = check_runs(spec.precision, B200_FP4)
    assert "fp8 tensor cores (W8A8)" in runs
    assert "weight-only: nvfp4 weights dequantised to bf16 math" in runs
    with pytest.raises(UnsupportedPrecisionError, match="ModelOpt FP8 kernels"):
        estimate_step(spec, A100, tp=1, batch=1, context=1024)


def test_weight_only_experts_dispatch_their_bf16_activations() -> None:
    """Under expert parallelism a W4A16 NVFP4 expert takes BF16 inputs (2 bytes an element),
    an NVFP4 (W4A4) one its FP4 values and scales on Blackwell."""
    from opweave.costmodel._private.parallelism import dispatch_element_bytes

    moe = load_model("qwen3-30b-a3b")
    w4a16 = _mixed(0) | {
        "quantized_layers": {
            f"model.layers.{i}.mlp.experts.{e}.{name}": {"quant_algo": "W4A16_NVFP4"}
            for i in range(48)
            for e in range(128)
            for name in ("gate_proj", "up_proj", "down_proj")
        }
    }
    spec = model_spec_from_config(builtin_config("qwen3-30b-a3b") | {"quantization_config": w4a16})
    experts = next(op for op in spec.operators if op.moe is not None)
    assert experts.weight_format == "nvfp4" and experts.quantized_flops_per_token == 0
    assert dispatch_element_bytes(spec, experts, B200_FP4) == 2.0
    fp4 = load_model("qwen3-30b-a3b", quant="nvfp4")
    fp4_experts = next(op for op in fp4.operators if op.moe is not None)
    assert dispatch_element_bytes(fp4, fp4_experts, B200_FP4) < 2.0
    assert moe.arch.moe is not None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantized_layers": {}}, "quantized_layers: missing"),
        (
            {"quantized_layers": {"lm_head": {"quant_algo": "MXFP8"}}},
            r"quantized_layers.lm_head.quant_algo 'MXFP8' is not modelled",
        ),
        ({"quantized_layers": {"lm_head": "FP8"}}, "quantized_layers.lm_head: expected an object"),
        (
            {"quantized_layers": {"visual.blocks.0.attn.qkv": {"quant_algo": "FP8"}}},
            "it quantises none of this qwen3 model's linears \\(none of its quantized_layers",
        ),
        ({"kv_cache_scheme": "INT8"}, r"quantization_config.kv_cache_scheme 'INT8'"),
    ],
)
def test_malformed_mixed_precision(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_spec_from_config(_qwen3_32b_config(_mixed(2) | change))


# -- --quant and --kv-cache-dtype ------------------------------------------------------------
QWEN3_32B = dict(h=5120, layers=64, nq=64, nkv=8, d=128, inter=25600, vocab=151936)


def _qwen3_32b(weight: Any, *, mlp: Any = None, head: float | None = None) -> float:
    """Qwen3-32B's bytes: attention linears in ``weight``, the MLP's in ``mlp`` (default the
    same), lm_head ``head`` bytes (default BF16); norms and embeddings in BF16."""
    h, layers, nq, nkv, d, inter, vocab = QWEN3_32B.values()
    mlp = mlp or weight
    layer = (
        weight(h, nq * d)
        + 2 * weight(h, nkv * d)
        + weight(nq * d, h)
        + 2 * mlp(h, inter)
        + mlp(inter, h)
        + bf16(h, h, d, d)
    )
    head = bf16(vocab * h) if head is None else head
    return layers * layer + head + bf16(vocab * h, h)


@pytest.mark.parametrize(
    ("quant", "weight"),
    [
        ("fp8", lambda i, o: i * o + 4),  # one FP32 scale per tensor
        ("fp8-block", block_fp8),
        ("nvfp4", nvfp4),
        # INT4, a bf16 scale per 128 inputs of each row, weight_shape (2 x int64) per tensor
        ("int4-wo", lambda i, o: i * o / 2 + 2 * o * math.ceil(i / 128) + 16),
    ],
)
def test_quant_override_converts_every_decoder_linear(quant: str, weight: Any) -> None:
    spec = load_model("qwen3-32b", quant=quant)
    assert spec.precision.quant == quant
    assert spec.weight_bytes == pytest.approx(_qwen3_32b(weight), abs=64)
    lm_head = next(op for op in spec.post_ops if op.name == "lm_head")
    assert lm_head.weight_format is None  # lm_head stays in the compute dtype


def test_quant_that_contradicts_the_checkpoint_is_an_error() -> None:
    contradiction = r"--quant nvfp4: this checkpoint is already quantised \(fp8-block, config.json"
    with pytest.raises(ConfigError, match=contradiction):
        load_model(CHECKPOINTS / "qwen3-32b-fp8.json", quant="nvfp4")
    same = load_model(CHECKPOINTS / "qwen3-32b-fp8.json", quant="fp8-block")
    assert same == load_model(CHECKPOINTS / "qwen3-32b-fp8.json")
    with pytest.raises(ConfigError, match="--quant mxfp4 quantises routed experts only"):
        load_model("qwen3-32b", quant="mxfp4")
    with pytest.raises(ConfigError, match="--quant 'int8': use one of bf16, fp8"):
        load_model("qwen3-32b", quant="int8")
    assert load_model("qwen3-32b", quant="bf16") == load_model("qwen3-32b")


def test_mxfp4_override_quantises_experts_of_a_moe_model() -> None:
    plain, quant = load_model("qwen3-30b-a3b"), load_model("qwen3-30b-a3b", quant="mxfp4")
    h, inter, experts = 2048, 768, 128
    per_expert = 3 * mxfp4(h, inter)  # gate, up (h -> inter) and down (inter -> h): same size
    for a, b in zip(plain.layers[0].ops, quant.layers[0].ops, strict=True):
        if a.name == "experts":
            assert b.weight_bytes == round(experts * per_expert)
        else:
            assert b.weight_bytes == a.weight_bytes  # attention and router stay bf16


def test_fp8_kv_cache_halves_the_state_bytes_per_token() -> None:
    h, nkv, d, layers = 5120, 8, 128, 64
    del h
    bf16_kv = load_model("qwen3-32b")
    fp8_kv = load_model("qwen3-32b", kv_cache_dtype="fp8")
    assert float(bf16_kv.state_bytes_per_request(1)) == 2 * nkv * d * 2 * layers
    assert float(fp8_kv.state_bytes_per_request(1)) == 2 * nkv * d * 1 * layers
    assert fp8_kv.weight_bytes == bf16_kv.weight_bytes  # weights untouched
    assert fp8_kv.precision.kv_cache_dtype == "fp8" and bf16_kv.precision.kv_cache_dtype == "bf16"
    # Qwen3-Next: the full-attention layers' KV halves; the DeltaNet state stays in bf16
    # (vLLM's mamba_cache_dtype is apart from kv_cache_dtype, "auto" = the model's dtype)
    nxt, nxt8 = (
        load_model("qwen3-next-80b-a3b"),
        load_model("qwen3-next-80b-a3b", kv_cache_dtype="fp8"),
    )
    fixed = float(nxt.state_bytes_per_request(0))
    assert fixed > 0 and float(nxt8.state_bytes_per_request(0)) == fixed
    per_token = float(nxt.state_bytes_per_request(1)) - fixed
    assert float(nxt8.state_bytes_per_request(1)) - fixed == per_token / 2
    with pytest.raises(ConfigError, match="--kv-cache-dtype 'int8': use one of auto, fp8"):
        load_model("qwen3-32b", kv_cache_dtype="int8")


def test_precision_is_part_of_the_model_identity() -> None:
    digests = {
        load_model("qwen3-32b").config_sha256,
        load_model("qwen3-32b", quant="fp8").config_sha256,
        load_model("qwen3-32b", quant="fp8-block").config_sha256,
        load_model("qwen3-32b", kv_cache_dtype="fp8").config_sha256,
    }
    assert len(digests) == 4


# -- compute ---------------------------------------------------------------------------------
def _gemm_s(spec: Any, hw: Any, batch: float) -> float:
    op = next(o for o in spec.layers[0].ops if o.name == "gate_up_proj")
    return RooflineLatency(hw).op_terms_s(op, 1, batch, 1024)["roofline"]


def test_fp8_gemm_runs_at_the_fp8_rate_where_the_gpu_has_one() -> None:
    bf, fp8 = load_model("qwen3-32b"), load_model("qwen3-32b", quant="fp8")
    flops = 2 * 5120 * 25600 * 2  # gate and up, per token
    batch = 8192  # compute-bound for both
    assert _gemm_s(bf, H100_FP8, batch) == pytest.approx(batch * flops / (989e12 * 0.80))
    assert _gemm_s(fp8, H100_FP8, batch) == pytest.approx(batch * flops / (1979e12 * 0.71))
    # without FP8 tensor cores (A100): FP8 weights, BF16 math: the same rate once compute-bound,
    # half the bytes while weight-bound
    assert _gemm_s(fp8, A100, batch) == pytest.approx(_gemm_s(bf, A100, batch))
    assert _gemm_s(fp8, A100, 1) == pytest.approx(_gemm_s(bf, A100, 1) / 2, rel=0.01)
    # an estimate says which path the GPU takes
    assert estimate_step(fp8, A100, tp=1, batch=8, context=1024).gemm_path == (
        "weight-only: fp8 weights dequantised to bf16 math"
    )
    est = estimate_step(fp8, H100_FP8, tp=1, batch=512, context=1024)
    assert (est.gemm_path, est.quant, est.kv_cache_dtype) == (
        "fp8 tensor cores (W8A8)",
        "fp8",
        "bf16",
    )
    slow = estimate_step(bf, H100_FP8, tp=1, batch=512, context=1024)
    assert est.breakdown_s["gemm"] < slow.breakdown_s["gemm"]


def test_nvfp4_runs_w4a4_on_blackwell_and_weight_only_elsewhere() -> None:
    # no measured FP4 efficiency for the B200: its BF16 one
    assert gemm_rate("nvfp4", B200_FP4).flops_per_s == 9e15 * B200_FP4.compute_efficiency
    assert (
        gemm_rate("nvfp4", H100_FP8).path == "weight-only: nvfp4 weights dequantised to bf16 math"
    )
    assert gemm_rate("nvfp4", H100_FP8).flops_per_s == gemm_rate("bf16", H100_FP8).flops_per_s
    # vLLM's MXFP4 MoE kernels take BF16 activations by default, even on Blackwell
    assert gemm_rate("mxfp4", B200_FP4).flops_per_s == gemm_rate("bf16", B200_FP4).flops_per_s
    assert (
        gemm_rate("int4-wo", B200_FP4).path
        == "weight-only: int4-wo weights dequantised to bf16 math"
    )


def _experts_s(spec: Any, hw: Any, tokens: float, tp: int = 1, ep: int = 1) -> float:
    op = next(o for o in spec.operators if o.name == "experts")
    par = Parallelism(tp=tp // ep if ep > 1 else tp, ep=ep, dp=ep if ep > 1 else 1)
    return parallel_op_terms_s(hw, spec, op, par, tokens, 1024)["roofline"]


def test_routed_experts_run_at_the_fused_moe_kernels_measured_rate() -> None:
    """[AIC-MOE]: NVIDIA's database measures the engines' fused-MoE GEMMs on Hopper at 0.60 of
    the dense BF16 rate and 0.36 of the block-FP8 one where each GPU holds >= 512 channels of an
    expert (Blackwell's block FP8: 0.23), less on narrower slices (0.70 of that at 384 channels,
    0.42 at 128)."""
    bf = load_model("qwen3-235b-a22b")  # 128 experts of 4096 x 1536, top 8
    fp8 = load_model("qwen3-235b-a22b", quant="fp8-block")
    tokens = 16384  # compute-bound
    flops = tokens * 8 * 3 * 2 * 4096 * 1536
    bf16_rate, fp8_rate = 989e12 * 0.80, 1979e12 * 0.71
    assert _experts_s(bf, H100_FP8, tokens) == pytest.approx(flops / (bf16_rate * 0.60))
    assert _experts_s(fp8, H100_FP8, tokens) == pytest.approx(flops / (fp8_rate * 0.36))
    b200_fp8 = 4.5e15 * B200_FP4.fp8_compute_efficiency
    assert _experts_s(fp8, B200_FP4, tokens) == pytest.approx(flops / (b200_fp8 * 0.23))
    # TP 4: 384 channels a GPU; TP 8 with EP 8: whole experts, each GPU a sixteenth of them
    assert _experts_s(bf, H100_FP8, tokens, tp=4) == pytest.approx(
        flops / 4 / (bf16_rate * 0.60 * 0.70)
    )
    per_gpu = _experts_s(bf, H100_FP8, tokens, tp=8, ep=8)
    assert per_gpu == pytest.approx(flops / 8 / (bf16_rate * 0.60), rel=0.1)  # routing skew
    # a dense model's FFN is no fused-MoE kernel; nor is a CPU rank's expert
    dense = load_model("qwen3-32b")
    ffn = next(o for o in dense.layers[0].ops if o.name == "gate_up_proj")
    assert grouped_gemm_fraction(ffn, H100_FP8, 64) == 1.0
    cpu = H100_FP8.model_copy(update={"engine_kernels": False})
    assert _experts_s(bf, cpu, tokens) == pytest.approx(flops / bf16_rate)


def _modelopt_fp8(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen3-32b-modelopt-fp8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(builtin_config("qwen3-32b")))
    quant = {
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        }
    }
    (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    return folder


def test_a_format_a_gpu_cannot_run_is_an_error(tmp_path: Path) -> None:
    spec = load_model(_modelopt_fp8(tmp_path))
    # per-tensor FP8 with a static input scale: 4 + 4 bytes per tensor
    assert spec.weight_bytes == pytest.approx(_qwen3_32b(lambda i, o: i * o + 8), abs=64)
    assert estimate_step(spec, H100_FP8, tp=1, batch=8, context=1024).quant == "fp8"
    with pytest.raises(UnsupportedPrecisionError) as err:
        estimate_step(spec, A100, tp=1, batch=8, context=1024)
    assert str(err.value) == (
        "fp8 weights (hf_quant_config.json: ModelOpt FP8) cannot run on a100-sxm-80gb: vLLM's "
        "ModelOpt FP8 kernels need compute capability 8.9 (Ada, Hopper, Blackwell); choose "
        "another GPU or checkpoint"
    )
    with pytest.raises(UnsupportedPrecisionError, match="cannot run on mi300x"):
        estimate_step(spec, CAT.get("mi300x"), tp=1, batch=8, context=1024)


# -- other checkpoint formats --------------------------------------------------------------------
TINY = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
}


def _tiny(weight: Any) -> float:
    h, inter, nq, nkv, d, vocab = 256, 512, 4, 2, 64, 1000
    layer = (
        weight(h, nq * d)
        + 2 * weight(h, nkv * d)
        + weight(nq * d, h)
        + 2 * weight(h, inter)
        + weight(inter, h)
        + bf16(h, h, d, d)
    )
    return 2 * layer + bf16(vocab * h, vocab * h, h)


@pytest.mark.parametrize(
    ("quantization_config", "weight"),
    [
        # AutoAWQ GEMM: int32-packed values and zeros, fp16 scales per group of 128 inputs
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
            lambda i, o: i * o / 2 + (2 + 0.5) * o * (i // 128),
        ),
        # GPTQ: the same plus g_idx (int32 per input)
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False},
            lambda i, o: i * o / 2 + (2 + 0.5) * o * (i // 64) + 4 * i,
        ),
        # compressed-tensors W4A16, symmetric: no zero points, bf16 scales, weight_shape
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "group_size": 128,
                            "symmetric": True,
                        },
                    }
                },
                "ignore": ["lm_head"],
            },
            lambda i, o: i * o / 2 + 2 * o * (i // 128) + 16,
        ),
        # compressed-tensors FP8 W8A8 per channel: vLLM holds the scales in FP32
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                    }
                },
                "ignore": ["lm_head"],
            },
            lambda i, o: i * o + 4 * o,
        ),
    ],
)
def test_checkpoint_formats(quantization_config: dict[str, Any], weight: Any) -> None:
    spec = model_spec_from_config(dict(TINY, quantization_config=quantization_config))
    assert spec.weight_bytes == pytest.approx(_tiny(weight), abs=2)


def test_compressed_tensors_ignore_and_kv_scheme() -> None:
    qc = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "targets": ["re:.*mlp.*"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            }
        },
        "ignore": ["re:.*layers.1.mlp.down_proj$"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
    spec = model_spec_from_config(dict(TINY, quantization_config=qc))
    formats = {(op.layer, op.name): op.weight_format for op in spec.operators if op.linears}
    assert formats[(0, "qkv_proj")] is None  # not targeted
    assert formats[(0, "down_proj")] == formats[(1, "gate_up_proj")] == "fp8"
    assert formats[(1, "down_proj")] is None  # ignored
    assert spec.precision.kv_cache_dtype == "fp8"
    assert spec.block.period_layers == 2  # layer 1 differs from layer 0 now


def test_compressed_tensors_ignore_names_modules_exactly() -> None:
    """A compressed-tensors ``ignore`` entry names one module, as vLLM matches it (equal name
    or ``re:``), not its subtree: an ignored ``self_attn`` (a parent, no linear of its own)
    leaves q/k/v/o quantised, as llm-compressor stores them (Qwen3.6-27B INT4's ignored
    ``linear_attn`` modules were costed in bf16: +46% of its weight bytes). A linear's own
    name, in the checkpoint's multimodal spelling too, still keeps it in bf16."""
    int4 = _ct_groups(w4=["Linear"])
    fp8_bytes = model_spec_from_config(dict(TINY, quantization_config=int4)).weight_bytes
    parents = int4 | {"ignore": ["model.layers.0.self_attn", "model.layers.1.mlp", "lm_head"]}
    spec = model_spec_from_config(dict(TINY, quantization_config=parents))
    assert spec.weight_bytes == fp8_bytes
    assert {op.weight_format for op in spec.operators if op.layer == 0 and op.linears} == {
        "int4-wo"
    }
    own = int4 | {"ignore": ["model.language_model.layers.1.mlp.down_proj"]}
    formats = {
        (op.layer, op.name): op.weight_format
        for op in model_spec_from_config(dict(TINY, quantization_config=own)).operators
        if op.linears
    }
    assert formats[(1, "down_proj")] is None and formats[(0, "down_proj")] == "int4-wo"


def _ct_groups(**groups: list[str]) -> dict[str, Any]:
    """compressed-tensors config groups: an INT4 group-16 W4A16 group per name, on its
    targets (``w8``: an FP8 group)."""
    int4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}
    fp8 = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {
            name: {"targets": targets, "weights": fp8 if name.startswith("w8") else int4}
            for name, targets in groups.items()
        },
    }


def test_a_compressed_tensors_group_targeting_no_linear_of_the_model() -> None:
    """A group that names none of the model's linears (a vision tower's) leaves the label:
    the weights are what the groups that apply store. Groups that together quantise nothing
    are refused: the config does not describe these weights (before: labelled int4-wo, and
    costed as bf16 bytes)."""
    partly = _ct_groups(w8=["Linear"], w4=["re:visual\\..*"])
    spec = model_spec_from_config(dict(TINY, quantization_config=partly))
    assert spec.precision.quant == "fp8"
    # every linear fp8 but lm_head, which compressed-tensors leaves in bf16
    formats = {op.name: op.weight_format for op in spec.operators if op.linears}
    assert formats.pop("lm_head") is None and set(formats.values()) == {"fp8"}
    for groups in (_ct_groups(w4=["Conv2d"]), _ct_groups(w4=["re:visual\\..*"])):
        with pytest.raises(ConfigError, match="it quantises none of this qwen3 model's linears"):
            model_spec_from_config(dict(TINY, quantization_config=groups))
    everything = _ct_groups(w4=["Linear"]) | {"ignore": ["re:.*"]}
    with pytest.raises(ConfigError, match="or its ignore list holds them all"):
        model_spec_from_config(dict(TINY, quantization_config=everything))


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        (
            {"quant_method": "bitsandbytes"},
            "quantization_config.quant_method 'bitsandbytes' is not",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: expected two"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt 'e5m2'"),
        ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "expected a list"),
        ({"quant_method": "awq", "bits": 8}, "quantization_config.bits: 8-bit AWQ is not"),
        ({"quant_method": "gptq", "group_size": True}, "group_size: expected an integer"),
        ({"quant_method": "compressed-tensors"}, "config_groups: missing"),
        ({"bits": 4}, "quant_method: missing"),
        ("fp8", "quantization_config: expected an object"),
    ],
)
def test_malformed_quantization_config(quantization_config: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_spec_from_config(dict(TINY, quantization_config=quantization_config))


def test_block_fp8_shards_hold_whole_scale_blocks() -> None:
    """vLLM refuses a TP degree whose shards of a 128x128 block-FP8 weight are not whole blocks:
    Qwen3-235B-A22B-FP8's 1536 expert channels split into 384 (TP 4) but not 192 (TP 8)."""
    from opweave.costmodel import tp_problem

    spec = model_spec_from_config(config("qwen3-235b-a22b-fp8.json"))
    assert [tp for tp in (1, 2, 4) if tp_problem(spec, tp)] == []
    assert tp_problem(spec, 8) == (
        "L0.experts: mlp.experts.gate_proj shards of 192 are not whole 128x128 FP8 scale blocks "
        "at tp 8"
    )
    # per-tensor FP8 has no blocks; four KV heads over eight ranks keep whole 128-wide heads
    assert tp_problem(load_model("qwen3-30b-a3b", quant="fp8"), 8) is None
    assert tp_problem(load_model("qwen3-32b", quant="fp8-block"), 8) is None


def test_block_fp8_experts_split_by_their_own_gpus_under_expert_parallelism() -> None:
    """Under EP each expert is split over tp x dp / ep GPUs, not the group: Qwen3-235B-A22B-FP8
    on 8 GPUs cannot run its experts at TP 8 (192-channel shards) but can at EP 8 (whole
    experts) or EP 2 (384-channel shards); TP 8 x EP 1 with DP 1 is the TP case."""
    from opweave.costmodel import Parallelism, parallelism_problem

    spec = model_spec_from_config(config("qwen3-235b-a22b-fp8.json"))
    assert "shards of 192" in (parallelism_problem(spec, Parallelism(tp=8)) or "")
    assert parallelism_problem(spec, Parallelism(tp=1, ep=8, dp=8)) is None
    assert parallelism_problem(spec, Parallelism(tp=1, ep=2, dp=8)) is None
    assert "shards of 192" in (parallelism_problem(spec, Parallelism(tp=1, ep=1, dp=8)) or "")


def test_mxfp4_experts_split_in_whole_scale_blocks_as_engines_load_them() -> None:
    """vLLM and SGLang shard gpt-oss-120b's MXFP4 experts (2880 channels, 90 blocks of 32) in
    whole blocks, ceil(90 / tp) on the busiest rank: 12 blocks = 384 channels at TP 8, 23 = 736
    at TP 4. Estimates cost that busiest rank; the runtime's (and so the planner's) rule still
    refuses shards that are not whole blocks, so no plan asks the runtime for one."""
    from opweave.costmodel import Parallelism, estimate_step, parallelism_problem, tp_problem
    from opweave.costmodel._private.roofline import shard_fraction

    spec = model_spec_from_config(config("gpt-oss-120b.json"))
    experts = next(op for op in spec.operators if op.name == "experts")
    assert shard_fraction(experts, 8) == 384 / 2880
    assert shard_fraction(experts, 4) == 736 / 2880
    assert shard_fraction(experts, 2) == 1 / 2  # whole blocks: the even split, as before
    for tp, shard in ((8, 360), (4, 720)):
        strict = f"L0.experts: mlp.experts.down_proj shards of {shard} are not whole 1x32 MXFP4"
        assert (tp_problem(spec, tp) or "").startswith(strict)
        assert (parallelism_problem(spec, Parallelism(tp=tp)) or "").startswith(strict)
        assert tp_problem(spec, tp, engine_splits=True) is None
        assert parallelism_problem(spec, Parallelism(tp=tp), engine_splits=True) is None
    # one rank's experts at TP 8: 128 experts of gate_up (2 x 384 x 2880) and down (2880 x 384)
    # in MXFP4 (half a byte a value, a one-byte scale per 32), and BF16 biases
    values = 128 * 3 * 384 * 2880 * (0.5 + 1 / 32)
    bias_bound = 128 * (5760 + 2880) * 2
    rank = experts.weight_bytes * shard_fraction(experts, 8)
    assert abs(rank - values) <= bias_bound
    assert rank > experts.weight_bytes / 8 + bias_bound  # more than the even split's 360
    # the decode step's weights per GPU: norms and router whole, the experts' busiest 384 of
    # 2880 channels, the rest (vocabulary, 64 query and 8 KV heads) an even eighth
    at8 = estimate_step(spec, default_catalog().get("b200"), tp=8, batch=1, context=1024)
    expected = sum(
        op.weight_bytes * (384 / 2880 if op.moe else 1 / 8 if op.tp_sharded else 1)
        for op in spec.operators
    )
    assert at8.weight_bytes_per_gpu == pytest.approx(expected, rel=1e-9)


def test_hf_quant_config_is_found_beside_the_config(tmp_path: Path) -> None:
    """In the model folder, beside a config.json, or as NAME.hf_quant_config.json beside a
    config file NAME.json (how the reference configs are stored); config.json's own
    quantization_config wins over it, as in vLLM."""
    quant = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}}
    config_text = json.dumps(builtin_config("qwen3-32b"))
    (tmp_path / "m.json").write_text(config_text)
    (tmp_path / "m.hf_quant_config.json").write_text(json.dumps(quant))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    for path in (tmp_path / "m.json", folder, folder / "config.json"):
        assert load_model(path).precision.quant == "nvfp4", path
    both = tmp_path / "both"  # a new path: load_model caches by path
    both.mkdir()
    fp8 = dict(builtin_config("qwen3-32b"), quantization_config={"quant_method": "fp8"})
    (both / "config.json").write_text(json.dumps(fp8))
    (both / "hf_quant_config.json").write_text(json.dumps(quant))
    assert load_model(both).precision.quant == "fp8"


def test_kimi_k2_5_wrapper_reads_its_text_models_int4_experts() -> None:
    """moonshotai/Kimi-K2.5: a kimi_k25 wrapper whose text_config (kimi_k2, DeepSeek-V3's
    architecture) carries the quantization_config: INT4 routed experts in groups of 32 with a
    BF16 scale each (and compressed-tensors' weight_shape per tensor); attention, the shared
    expert, the dense layer and lm_head stay in BF16 (its ignore list)."""
    _needs("deepseek_v3")
    spec = load_model(CHECKPOINTS / "kimi-k2.5.json")
    t = config("kimi-k2.5.json")["text_config"]
    assert spec.family == "deepseek_v3" and spec.precision.quant == "int4-wo"
    h, layers, dense, vocab = t["hidden_size"], t["num_hidden_layers"], 1, t["vocab_size"]
    heads, q_rank, kv_rank = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
    nope, rope, v = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    experts, inter, moe_inter = t["n_routed_experts"], t["intermediate_size"], 2048

    def int4(n_in: int, n_out: int) -> float:
        return n_in * n_out / 2 + 2 * n_out * math.ceil(n_in / 32) + 16

    attention = bf16(
        h * q_rank,
        q_rank * heads * (nope + rope),
        h * (kv_rank + rope),
        kv_rank * heads * (nope + v),
        heads * v * h,
        q_rank,
        kv_rank,
    )
    routed = 2 * int4(h, moe_inter) + int4(moe_inter, h)
    moe = bf16(h * experts, 3 * h * moe_inter) + 4 * experts + experts * routed
    expected = (
        layers * (attention + bf16(h, h))
        + dense * bf16(3 * h * inter)
        + (layers - dense) * moe
        + bf16(vocab * h, vocab * h, h)
    )
    assert (t["first_k_dense_replace"], t["moe_intermediate_size"]) == (dense, moe_inter)
    assert spec.weight_bytes == pytest.approx(expected, rel=1e-5)


def test_modelopt_export_of_a_wrapper_wins_over_its_text_configs_quantization(
    tmp_path: Path,
) -> None:
    """nvidia/Kimi-K2.5-NVFP4 keeps moonshotai's INT4 quantization_config in its text_config
    and ships ModelOpt's hf_quant_config.json beside it. vLLM promotes hf_quant_config.json to
    the top-level quantization_config before it looks into text_config, so it serves NVFP4;
    without that file the text_config's INT4 scheme is the checkpoint's, and says where it
    was read."""
    _needs("deepseek_v3")
    folder = tmp_path / "kimi-k2.5-nvfp4"
    folder.mkdir()
    (folder / "config.json").write_text((CHECKPOINTS / "kimi-k2.5.json").read_text())
    quant = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}}
    (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    precision = load_model(folder).precision
    assert (precision.quant, precision.source) == ("nvfp4", "hf_quant_config.json: ModelOpt NVFP4")
    source = load_model(CHECKPOINTS / "kimi-k2.5.json").precision.source
    assert source.startswith("config.json text_config.quantization_config: compressed-tensors")
