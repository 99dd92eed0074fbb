"""DeepSeek-V3 (MLA), Qwen3.5 (MoE and dense), MiniMax-M2 and GLM-4.5: sizes against independent
counts and the published figures, MLA's cache and its tensor-parallel replication, family
resolution, configs that are not built in."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from opweave.costmodel import (
    ConfigError,
    ModelSpec,
    afd_template,
    analyze,
    cad_template,
    default_catalog,
    estimate_step,
    load_model,
    model_spec_from_config,
    segments,
    state_bytes_per_rank,
    weight_bytes_per_rank,
)
from opweave.costmodel._private.models import builtin_config
from tests.helpers import GLM_4_5, QWEN3_5_27B

CHECKPOINTS = Path(__file__).with_name("checkpoints")


def bf16(config: dict[str, Any]) -> ModelSpec:
    """The config as a BF16 checkpoint (parameter counts from weight bytes, whatever the
    checkpoint's own weight format)."""
    return model_spec_from_config(
        {k: v for k, v in config.items() if k != "quantization_config"}, dtype="bfloat16"
    )


def params(spec: ModelSpec) -> tuple[float, float]:
    """(total, active) parameters: every weight, and those one token reads -- its top-k
    routed experts instead of all of them (embeddings counted, as DeepSeek reports)."""
    total = spec.weight_bytes / 2
    idle = sum(
        (op.moe.num_experts - op.moe.top_k) * op.moe.expert_weight_bytes
        for op in spec.operators
        if op.moe is not None
    )
    return total, total - idle / 2


def deepseek_count(c: dict[str, Any]) -> tuple[int, int]:
    """DeepSeek-V3's parameters from its config, module by module (modeling_deepseek_v3.py)."""
    h, nq, lq, lkv = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    layers, dense_layers = c["num_hidden_layers"], c["first_k_dense_replace"]
    e, k, im = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    q = h * lq + lq + lq * nq * (nope + rope) if lq else h * nq * (nope + rope)
    attn = q + h * (lkv + rope) + lkv + lkv * nq * (nope + v) + nq * v * h
    dense = 3 * h * c["intermediate_size"]
    routed = 3 * h * im
    bias = e if c.get("topk_method", "noaux_tc") == "noaux_tc" else 0
    moe = e * routed + c["n_shared_experts"] * routed + e * h + bias
    total = (
        layers * (attn + 2 * h)
        + dense_layers * dense
        + (layers - dense_layers) * moe
        + 2 * c["vocab_size"] * h
        + h
    )
    return total, total - (layers - dense_layers) * (e - k) * routed


def test_deepseek_v3_is_671b_with_37b_active() -> None:
    config = builtin_config("deepseek-v3")
    total, active = params(bf16(config))
    assert (total, active) == deepseek_count(config)
    # DeepSeek-V3 technical report (arXiv:2412.19437): 671B total, 37B activated per token;
    # the MTP module (num_nextn_predict_layers) is not part of the decode model
    assert total == pytest.approx(671e9, rel=0.001)
    assert active == pytest.approx(37e9, rel=0.02)


def test_kimi_k2_resolves_by_architecture_and_is_1t_with_32b_active() -> None:
    config = builtin_config("kimi-k2")
    assert config["model_type"] == "kimi_k2"
    spec = bf16(config)
    assert spec.family == "deepseek_v3" and spec.arch.mla is not None
    total, active = params(spec)
    assert (total, active) == deepseek_count(config)
    # Moonshot's model card: 1T total, 32B activated
    assert total == pytest.approx(1.03e12, rel=0.01) and active == pytest.approx(32e9, rel=0.03)
    # the block after its single dense layer
    assert (spec.block.prefix_layers, spec.block.period_layers) == (1, 1)
    # without architectures, model_type kimi_k2 still names the family
    no_arch = {k: v for k, v in config.items() if k != "architectures"}
    assert bf16(no_arch).family == "deepseek_v3"


def test_mla_kv_cache_per_token_and_its_tp_replication() -> None:
    config = builtin_config("deepseek-v3")
    spec = bf16(config)
    per_token = (
        config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    )
    assert float(spec.state_bytes_per_request(4096)) == per_token * 4096
    ops = list(spec.operators)
    # one latent shared by all heads: every TP rank holds the whole cache (vLLM's MLA layout)
    for tp in (2, 8):
        assert state_bytes_per_rank(ops, tp, 32, 4096) == state_bytes_per_rank(ops, 1, 32, 4096)
    # a GQA model's cache splits by KV heads instead
    gqa = load_model("llama-3.3-70b")
    gqa_ops = list(gqa.operators)
    assert state_bytes_per_rank(gqa_ops, 8, 32, 4096) == pytest.approx(
        state_bytes_per_rank(gqa_ops, 1, 32, 4096) / 8
    )
    # ... while MLA's attention FLOPs split by heads: 2(L + R) + 2L per head per context token
    core = next(op for op in spec.layers[0].ops if op.name == "core_attn")
    heads = config["num_attention_heads"]
    lkv, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    assert core.attn_flops_per_context_token == heads * (2 * (lkv + rope) + 2 * lkv)
    # memory per GPU falls from tp 1 to tp 8 by the weights alone: the cache does not split
    h200 = default_catalog().get("h200")
    one = estimate_step(spec, h200, tp=1, batch=32, context=4096)
    eight = estimate_step(spec, h200, tp=8, batch=32, context=4096)
    assert one.memory_bytes_per_gpu - eight.memory_bytes_per_gpu == pytest.approx(
        weight_bytes_per_rank(ops, 1) - weight_bytes_per_rank(ops, 8)
    )


def test_analysis_units_hold_the_latent_cache_on_every_gpu() -> None:
    # the paper's §3 unit of tp GPUs: MLA's cache is held tp times, so fewer requests fit
    spec = model_spec_from_config(SMALL["deepseek_v3"])
    h100 = default_catalog().get("h100")
    m_kv = float(spec.state_bytes_per_request(4096))
    for tp in (1, 2):
        unit = analyze(spec, [h100], [4096], tp=tp).gpus[0]
        usable = tp * h100.usable_memory_bytes
        assert float(unit.b_max[0]) == pytest.approx((usable - spec.weight_bytes) / (tp * m_kv))


def test_deepseek_dense_prefix_and_operators() -> None:
    spec = bf16(builtin_config("deepseek-v3"))
    assert [layer.moe for layer in spec.layers[:4]] == [False, False, False, True]
    block = spec.block
    assert (block.prefix_layers, block.period_layers, block.num_full_blocks) == (3, 1, 58)
    dense = [op.name for op in spec.layers[0].ops]
    sparse = [op.name for op in spec.layers[3].ops]
    assert dense[-3:] == ["ffn_norm", "gate_up_proj", "down_proj"]
    assert sparse[-4:] == ["ffn_norm", "router", "experts", "shared_expert"]
    # AFD and CAD cut the dense prefix layers as the block's layer: attention | FFN, and core
    # attention alone
    afd = {op.key: seg.owner for seg in segments(spec, afd_template(spec), 2) for op in seg.ops}
    assert afd["L0.core_attn"] == afd["L3.core_attn"] != afd["L0.gate_up_proj"]
    assert afd["L0.down_proj"] == afd["L3.experts"]
    cad = {op.key: seg.owner for seg in segments(spec, cad_template(spec), 2) for op in seg.ops}
    assert cad["L0.core_attn"] == cad["L3.core_attn"] != cad["L0.gate_up_proj"]
    assert cad["L0.qkv_proj"] == cad["L0.o_proj"] == cad["L3.experts"]
    names = {linear.module for op in spec.layers[3].ops for linear in op.linears}
    assert {
        "self_attn.q_a_proj",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_b_proj",
        "self_attn.o_proj",
        "mlp.gate",
        "mlp.experts.gate_proj",
        "mlp.experts.up_proj",
        "mlp.experts.down_proj",
        "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.down_proj",
    } <= names
    experts = next(op for op in spec.layers[3].ops if op.name == "experts")
    assert {linear.count for linear in experts.linears} == {256}
    # the linears hold every matmul weight of the layer (the rest: norms, the score bias)
    for layer in (spec.layers[0], spec.layers[3]):
        linear_params = sum(linear.params for op in layer.ops for linear in op.linears)
        norms = 2 * 7168 + 1536 + 512
        bias = 256 if layer.moe else 0
        assert linear_params + norms + bias == sum(op.weight_bytes for op in layer.ops) / 2


def test_yarn_mscale_enters_the_attention_scale() -> None:
    # vLLM deepseek_v2.py / transformers: scale = qk_head_dim^-0.5 * mscale^2,
    # mscale = 0.1 * mscale_all_dim * ln(factor) + 1
    arch = bf16(builtin_config("deepseek-v3")).arch
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert arch.attn_scale == pytest.approx(192**-0.5 * mscale**2)


def test_qwen3_5_is_397b_with_17b_active() -> None:
    config = builtin_config("qwen3.5-397b-a17b")
    spec = bf16(config)
    t = config["text_config"]
    assert spec.family == "qwen3_5_moe"
    h, layers, d = t["hidden_size"], t["num_hidden_layers"], t["head_dim"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    nk, nv, dk, dv = (
        t["linear_num_key_heads"],
        t["linear_num_value_heads"],
        t["linear_key_head_dim"],
        t["linear_value_head_dim"],
    )
    e, k, im, shared = (
        t["num_experts"],
        t["num_experts_per_tok"],
        t["moe_intermediate_size"],
        t["shared_expert_intermediate_size"],
    )
    full_layers = t["layer_types"].count("full_attention")
    # gated attention: q_proj carries the output gate; q/k norms of one head each
    full = h * (2 * nq * d + 2 * nkv * d) + 2 * d + nq * d * h
    conv = 2 * nk * dk + nv * dv
    deltanet = (
        h * (2 * nk * dk + 2 * nv * dv)
        + h * 2 * nv  # in_proj_qkv, _z, _b, _a
        + conv * t["linear_conv_kernel_dim"]
        + 2 * nv  # conv1d, A_log, dt_bias
        + nv * dv * h
        + dv  # out_proj, gated norm
    )
    moe = e * 3 * h * im + e * h + 3 * h * shared + h  # + router, shared expert and its gate
    total = (
        full_layers * full
        + (layers - full_layers) * deltanet
        + layers * (moe + 2 * h)
        + 2 * t["vocab_size"] * h
        + h
    )
    got_total, got_active = params(spec)
    assert got_total == total
    assert got_active == total - layers * (e - k) * 3 * h * im
    # Qwen's name: 397B total, 17B active (the vision tower's ~0.4B is not the text model's)
    assert got_total == pytest.approx(397e9, rel=0.005)
    assert got_active == pytest.approx(17e9, rel=0.03)
    assert (spec.block.prefix_layers, spec.block.period_layers) == (0, 4)


@pytest.mark.parametrize(
    ("ssm_dtype", "state_bytes"), [(None, 2), ("auto", 2), ("float32", 4), ("bfloat16", 2)]
)
def test_qwen3_5_recurrent_state_in_the_configs_ssm_dtype(
    ssm_dtype: str | None, state_bytes: int
) -> None:
    """The state matrices in ``mamba_ssm_dtype`` (as vLLM's Qwen3.5 hook keeps them), the conv
    window in the model's dtype, the full-attention layers' KV cache unchanged."""
    config = builtin_config("qwen3.5-397b-a17b")
    assert config["text_config"]["mamba_ssm_dtype"] == "float32"  # as released
    text = {k: v for k, v in config["text_config"].items() if k != "mamba_ssm_dtype"}
    if ssm_dtype is not None:
        text["mamba_ssm_dtype"] = ssm_dtype
    spec = model_spec_from_config({**config, "text_config": text}, dtype="bfloat16")
    t = config["text_config"]
    nk, nv, dk, dv = (
        t["linear_num_key_heads"],
        t["linear_num_value_heads"],
        t["linear_key_head_dim"],
        t["linear_value_head_dim"],
    )
    conv = (2 * nk * dk + nv * dv) * (t["linear_conv_kernel_dim"] - 1) * 2
    linear = t["layer_types"].count("linear_attention")
    full = t["num_hidden_layers"] - linear
    kv_per_token = full * 2 * t["num_key_value_heads"] * t["head_dim"] * 2
    per_request = linear * (nv * dk * dv * state_bytes + conv)
    got = state_bytes_per_rank(spec.operators, tp=1, batch=1, context=1000)
    assert got == per_request + 1000 * kv_per_token


def test_qwen3_5_bad_ssm_dtype_names_the_key() -> None:
    config = builtin_config("qwen3.5-397b-a17b")
    text = {**config["text_config"], "mamba_ssm_dtype": "float8"}
    with pytest.raises(ConfigError, match=r"^mamba_ssm_dtype: 'float8' .*auto, float32"):
        model_spec_from_config({**config, "text_config": text})


def test_qwen3_5_dense_27b_against_its_shapes() -> None:
    spec = model_spec_from_config(QWEN3_5_27B)
    t = QWEN3_5_27B["text_config"]
    assert spec.family == "qwen3_5" and spec.arch.moe is None
    h, layers, d, im = t["hidden_size"], t["num_hidden_layers"], t["head_dim"], 17408
    nq, nkv, nk, nv, dk, dv = 24, 4, 16, 48, 128, 128
    full = h * (2 * nq * d + 2 * nkv * d) + 2 * d + nq * d * h  # q carries the output gate
    conv = 2 * nk * dk + nv * dv
    deltanet = h * (conv + nv * dv + 2 * nv) + conv * 4 + 2 * nv + nv * dv * h + dv
    total = 16 * full + 48 * deltanet + layers * (3 * h * im + 2 * h) + 2 * 248320 * h + h
    assert spec.weight_bytes == 2 * total
    assert total == pytest.approx(26.9e9, rel=0.01)  # "27B": the text model's weights
    # the KV cache grows in the 16 full-attention layers only; the 48 DeltaNet layers hold a
    # fixed recurrent state (a (dk x dv) matrix per value head, and the convolution's window)
    per_token = 16 * 2 * nkv * d * 2
    state = 48 * (nv * dk * dv + conv * (4 - 1)) * 2
    one = float(state_bytes_per_rank(spec.operators, 1, 1.0, 1000.0))
    two = float(state_bytes_per_rank(spec.operators, 1, 1.0, 2000.0))
    assert two - one == pytest.approx(1000 * per_token)
    assert one - 1000 * per_token == pytest.approx(state, rel=0.01)


def test_glm_4_5_is_355b_with_32b_active() -> None:
    c = GLM_4_5
    spec = bf16(c)
    assert spec.family == "glm4_moe"
    h, d, nq, nkv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], 8
    layers, dense_layers = c["num_hidden_layers"], c["first_k_dense_replace"]
    e, k, im = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    # q/k/v with biases, o without; a q and a k norm of one head each
    attn = h * (nq + 2 * nkv) * d + (nq + 2 * nkv) * d + nq * d * h + 2 * d
    moe = e * 3 * h * im + e * h + e + 3 * h * im  # experts, router + selection bias, shared
    total = (
        layers * (attn + 2 * h)
        + dense_layers * 3 * h * c["intermediate_size"]
        + (layers - dense_layers) * moe
        + 2 * c["vocab_size"] * h
        + h
    )
    got_total, got_active = params(spec)
    assert got_total == total
    assert got_active == total - (layers - dense_layers) * (e - k) * 3 * h * im
    # Z.ai's "355B total, 32B active": the total with the multi-token-prediction layer the
    # decode leaves out (about 4B, one more MoE layer), the active without the embeddings
    embeddings = 2 * c["vocab_size"] * h
    assert got_total == pytest.approx(355e9, rel=0.01)
    assert got_active - embeddings == pytest.approx(32e9, rel=0.01)
    # GQA: the cache holds the 8 key/value heads of every layer
    per_token = float(state_bytes_per_rank(spec.operators, 1, 1.0, 2.0)) - float(
        state_bytes_per_rank(spec.operators, 1, 1.0, 1.0)
    )
    assert per_token == layers * 2 * nkv * d * 2


def test_glm_4_7_flash_is_deepseek_v3s_layout_at_30b() -> None:
    """zai-org/GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's MLA layers and MoE layout, counted
    module by module as DeepSeek-V3 is; "30B-A3B" as Z.ai names it. Its config is
    transformers' Glm4MoeLiteConfig defaults. The router keeps its selection bias whatever
    topk_method says (GLM-4.5's router), and the latent cache is DeepSeek-V3's."""
    c = json.loads((CHECKPOINTS / "glm-4.7-flash.json").read_text())
    spec = bf16(c)
    assert spec.family == "glm4_moe_lite"
    total, active = deepseek_count(c)
    assert params(spec) == (total, active)
    embeddings = 2 * c["vocab_size"] * c["hidden_size"]
    assert (round(total / 1e9), round((active - embeddings) / 1e9)) == (30, 3)  # 29.9B, 3.3B
    assert params(bf16({"model_type": "glm4_moe_lite"})) == (total, active)
    no_method = bf16({k: v for k, v in c.items() if k != "topk_method"})
    assert no_method.arch.moe is not None and no_method.arch.moe.score_correction_bias
    per_token = float(state_bytes_per_rank(spec.operators, 1, 1.0, 2.0)) - float(
        state_bytes_per_rank(spec.operators, 1, 1.0, 1.0)
    )
    assert per_token == c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2


def test_glm_4_7_flash_mlp_layer_types_must_agree_with_first_k_dense() -> None:
    c = json.loads((CHECKPOINTS / "glm-4.7-flash.json").read_text())
    n = c["num_hidden_layers"]
    agree = {**c, "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1)}
    assert params(bf16(agree)) == params(bf16(c))
    disagree = {**c, "mlp_layer_types": ["dense"] * 2 + ["sparse"] * (n - 2)}
    with pytest.raises(ConfigError, match="^mlp_layer_types: disagrees with first_k_dense"):
        bf16(disagree)


def test_glm_4_5_air_is_the_schema_default() -> None:
    # zai-org/GLM-4.5-Air: transformers' Glm4MoeConfig defaults, with its attention biases
    spec = bf16({"model_type": "glm4_moe", "head_dim": 128, "attention_bias": True})
    total, active = params(spec)
    embeddings = 2 * 151552 * 4096
    assert total == pytest.approx(106e9, rel=0.01)
    assert active - embeddings == pytest.approx(12e9, rel=0.02)
    assert not spec.arch.qk_norm and spec.arch.moe is not None


def test_minimax_m2_5_size_and_layer() -> None:
    config = builtin_config("minimax-m2.5")
    spec = bf16(config)
    h, layers, d = config["hidden_size"], config["num_hidden_layers"], config["head_dim"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    e, k, inter = (
        config["num_local_experts"],
        config["num_experts_per_tok"],
        config["intermediate_size"],
    )
    # q/k norms over all heads (qk_norm_type per_layer); the routing bias (use_routing_bias)
    attn = h * (nq + 2 * nkv) * d + (nq + nkv) * d + nq * d * h
    moe = e * 3 * h * inter + e * h + e
    total = layers * (attn + moe + 2 * h) + 2 * config["vocab_size"] * h + h
    got_total, got_active = params(spec)
    assert got_total == total
    # MiniMax-M2's model card: 230B total, 10B activated (Hugging Face counts the M2.5
    # checkpoint at 229B); MiniMax's activated count leaves out the embedding and the head
    vocab = config["vocab_size"] * h
    assert got_total == pytest.approx(229e9, rel=0.005)
    assert got_active - 2 * vocab == pytest.approx(10e9, rel=0.03)
    rope = spec.arch.rope["full_attention"]
    assert rope.partial_rotary_factor == config["rotary_dim"] / d
    assert spec.arch.moe is not None and spec.arch.moe.scoring_func == "sigmoid"
    assert spec.arch.moe.shared_intermediate_size == 0
    # the per-layer q/k norm all-reduces two float32 per token under TP
    qkv = next(op for op in spec.layers[0].ops if op.name == "qkv_proj")
    assert qkv.tp_collective_bytes_per_token == 8.0
    assert got_active == total - layers * (e - k) * 3 * h * inter


SMALL = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 2,
        "vocab_size": 100,
        "torch_dtype": "float32",
    },
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "vocab_size": 100,
        },
        "torch_dtype": "float32",
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_group": 2,
        "topk_group": 1,
        "vocab_size": 100,
        "torch_dtype": "float32",
    },
    "minimax_m2": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rotary_dim": 8,
        "vocab_size": 100,
        "torch_dtype": "float32",
    },
}


# Qwen3.5's dense sibling: the same small text model with a dense MLP instead of experts
SMALL["qwen3_5"] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        k: v
        for k, v in SMALL["qwen3_5_moe"]["text_config"].items()
        if "expert" not in k and not k.startswith("num_experts")
    }
    | {"intermediate_size": 96},
    "torch_dtype": "float32",
}


@pytest.mark.parametrize("family", sorted(SMALL))
def test_small_configs_of_each_new_family_estimate(family: str, tmp_path) -> None:
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL[family]))
    spec = load_model(folder)
    assert spec.family == family
    est = estimate_step(spec, default_catalog().get("h100"), tp=2, batch=4, context=64)
    assert est.fits and est.step_latency_s > 0


def test_released_smaller_siblings() -> None:
    # moonshotai/Moonlight-16B-A3B (DeepSeek-V3 architecture, no q LoRA): 16B total, 3B active
    moonlight = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "first_k_dense_replace": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "vocab_size": 163840,
    }
    spec = bf16(moonlight)
    total, active = params(spec)
    assert (total, active) == deepseek_count(moonlight)
    assert total == pytest.approx(16e9, rel=0.01) and active == pytest.approx(3e9, rel=0.05)
    assert "self_attn.q_proj" in {linear.module for linear in spec.layers[0].ops[1].linears}
    # Qwen/Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults are that checkpoint's
    qwen = bf16({"model_type": "qwen3_5_moe", "text_config": {}})
    total, active = params(qwen)
    assert total == pytest.approx(35e9, rel=0.02) and active == pytest.approx(3.5e9, rel=0.05)


@pytest.mark.parametrize(
    ("family", "key", "value", "message"),
    [
        ("deepseek_v3", "kv_lora_rank", 0, r"kv_lora_rank: 0 is out of range \(1\.\.1048576\)"),
        ("deepseek_v3", "q_lora_rank", "x", "q_lora_rank: expected an integer, got 'x'"),
        ("deepseek_v3", "n_group", 3, "n_group: 8 experts do not split into 3 groups"),
        ("deepseek_v3", "topk_group", 5, "topk_group: 5 is more than the 4 groups"),
        ("deepseek_v3", "routed_scaling_factor", -1, "routed_scaling_factor: expected a finite"),
        ("deepseek_v3", "scoring_func", "tanh", "scoring_func: 'tanh' is not supported"),
        ("deepseek_v3", "first_k_dense_replace", -1, r"first_k_dense_replace: -1 is out of"),
        ("minimax_m2", "rotary_dim", 1.5, r"rotary_dim: expected an integer, got 1\.5"),
        ("minimax_m2", "use_routing_bias", "yes", "use_routing_bias: expected true or false"),
        ("minimax_m2", "num_local_experts", 1, "num_experts_per_tok: 2 is more than the 1"),
        ("glm4_moe", "use_qk_norm", "yes", "use_qk_norm: expected true or false"),
        ("glm4_moe", "n_group", 3, "n_group: 8 experts do not split into 3 groups"),
        ("glm4_moe", "partial_rotary_factor", 2, r"partial_rotary_factor: expected a number in \("),
    ],
)
def test_bad_new_family_fields_name_the_field(
    family: str, key: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match="^" + message):
        model_spec_from_config(dict(SMALL[family], **{key: value}))


def test_bad_qwen3_5_text_config_field_names_the_field() -> None:
    config = json.loads(json.dumps(SMALL["qwen3_5_moe"]))
    config["text_config"]["linear_num_value_heads"] = 3
    with pytest.raises(ConfigError, match="^linear_num_value_heads: 3 is not a multiple of"):
        model_spec_from_config(config)
    config["text_config"]["attn_output_gate"] = 1
    with pytest.raises(ConfigError, match="^attn_output_gate: expected true or false, got 1"):
        model_spec_from_config(config)


def _qwen3_count(c: dict[str, Any]) -> tuple[int, int]:
    """(total, active) parameters of a Qwen3 dense or Qwen3-MoE config, from its shapes: q/k
    norms per head, no biases, untied head; a routed layer's router and ``num_experts`` experts
    of three ``moe_intermediate_size`` projections, of which ``num_experts_per_tok`` are read."""
    h, d, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    attn = h * (nq + 2 * nkv) * d + nq * d * h + 2 * d
    vocab = 2 * c["vocab_size"] * h + h
    if "num_experts" not in c:
        total = layers * (attn + 3 * h * c["intermediate_size"] + 2 * h) + vocab
        return total, total
    e, k, im = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    total = layers * (attn + e * 3 * h * im + e * h + 2 * h) + vocab
    return total, total - layers * (e - k) * 3 * h * im


@pytest.mark.parametrize(
    ("name", "billions_total", "billions_active"),
    # Qwen's model cards: Qwen3-8B 8.2B; Qwen3-235B-A22B 235B total, 22B activated;
    # Qwen3-Coder-480B-A35B-Instruct 480B total, 35B activated
    [("qwen3-8b", 8.2, 8.2), ("qwen3-235b-a22b", 235, 22), ("qwen3-coder-480b-a35b", 480, 35)],
)
def test_qwen3_builtins_count_their_parameters(name, billions_total, billions_active) -> None:
    config = builtin_config(name)
    spec = load_model(name)
    assert not spec.precision.quantized  # BF16 releases: weight bytes are 2 per parameter
    total, active = _qwen3_count(config)
    assert params(spec) == (total, active)
    assert total == pytest.approx(billions_total * 1e9, rel=0.01)
    assert active == pytest.approx(billions_active * 1e9, rel=0.03)


def test_minimax_m2_is_m2_5s_architecture_in_block_fp8() -> None:
    m2, m25 = load_model("minimax-m2"), load_model("minimax-m2.5")
    assert m2.precision.quant == "fp8-block"
    assert m2.weight_bytes == m25.weight_bytes
    assert params(bf16(builtin_config("minimax-m2"))) == params(
        bf16(builtin_config("minimax-m2.5"))
    )


def test_qwen3_vl_wrappers_cost_their_qwen3_text_models() -> None:
    """Qwen/Qwen3-VL-8B-Instruct and -30B-A3B-Instruct (released configs, byte copies in
    checkpoints/): the text model under text_config is Qwen3 / Qwen3-MoE; the vision tower is
    not part of the decode."""
    checkpoints = Path(__file__).with_name("checkpoints")
    dense = load_model(checkpoints / "qwen3-vl-8b.json")
    t = json.loads((checkpoints / "qwen3-vl-8b.json").read_text())["text_config"]
    assert dense.family == "qwen3_vl"
    total, _ = params(dense)
    assert total == _qwen3_count(t)[0]  # q/k norms per head, untied head
    assert total == pytest.approx(8.2e9, rel=0.01)
    moe = load_model(checkpoints / "qwen3-vl-30b-a3b.json")
    t = json.loads((checkpoints / "qwen3-vl-30b-a3b.json").read_text())["text_config"]
    assert moe.family == "qwen3_vl_moe"
    assert params(moe) == _qwen3_count(t)
    assert params(moe)[0] == pytest.approx(30.5e9, rel=0.01)
    assert params(moe)[1] == pytest.approx(3.3e9, rel=0.03)


def test_a_multimodal_checkpoint_is_costed_as_its_text_model_and_says_so() -> None:
    """Qwen3-VL, Kimi-K2.5 and Qwen3.5 wrap their text model beside a ``vision_config``: the
    spec names the encoder it leaves out, every plan's and serving estimate's assumptions say
    so, and a text-only config says nothing."""
    from opweave.costmodel import Lengths, Workload, estimate_serving
    from opweave.planner import plan

    for name in ("qwen3-vl-8b.json", "kimi-k2.5.json"):
        assert load_model(CHECKPOINTS / name).encoders_not_costed == ("vision_config",)
    assert load_model("qwen3.5-397b-a17b").encoders_not_costed == ("vision_config",)
    assert load_model("qwen3-8b").encoders_not_costed == ()
    assert load_model("qwen3-8b").scope_note is None
    vl = load_model(CHECKPOINTS / "qwen3-vl-8b.json")
    note = vl.scope_note
    assert note is not None and "its encoders (vision_config) are not costed" in note
    assert "--language-model-only" in note
    h100 = default_catalog().get("h100")
    w = Workload(isl=Lengths.fixed(512), osl=Lengths.fixed(64), concurrency=2)
    assert note in estimate_serving(vl, h100, tp=1, workload=w).assumptions
    result = plan(vl, ["h100"], context=4096, tpot_slo_s=0.05)
    assert note in result.assumptions()
