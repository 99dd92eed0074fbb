"""ModelSpec from Hugging Face configs: sizes against hand counts, blocks, errors."""

from __future__ import annotations

import json

import pytest

from opweave.costmodel import (
    BUILTIN_MODELS,
    AttentionKind,
    ConfigError,
    UnknownModelError,
    UnsupportedModelError,
    load_model,
    model_spec_from_config,
)
from opweave.costmodel._private.models import builtin_config
from tests.helpers import TINY_LLAMA


def test_llama_70b_matches_hand_count() -> None:
    # Llama-3.3-70B: h=8192, I=28672, 80 layers, 64 q heads, 8 kv heads of 128, vocab 128256.
    h, inter, layers, v = 8192, 28672, 80, 128256
    per_layer = h * (64 + 2 * 8) * 128 + 64 * 128 * h + 3 * h * inter + 2 * h
    params = layers * per_layer + 2 * v * h + h
    spec = load_model("llama-3.3-70b")
    assert spec.weight_bytes == 2 * params
    assert spec.gemm_flops_per_token == pytest.approx(
        2 * (params - v * h) + 4 * h * layers * 2 + 4 * h + v, rel=1e-3
    )
    # KV: 2 (k, v) x 8 heads x 128 x 2 bytes x 80 layers per token.
    assert float(spec.state_bytes_per_request(1000)) == 2 * 8 * 128 * 2 * 80 * 1000
    assert spec.block.period_layers == 1 and spec.block.num_full_blocks == 80


def test_gemma3_multimodal_config_uses_text_config_and_defaults() -> None:
    spec = load_model("gemma-3-27b")
    assert spec.family == "gemma3_text"
    assert spec.vocab_size == 262208  # absent from the file: transformers' default
    kinds = [layer.attention for layer in spec.layers]
    assert kinds[:6] == [AttentionKind.SLIDING] * 5 + [AttentionKind.FULL]
    assert spec.block.period_layers == 6
    assert (spec.block.num_full_blocks, spec.block.remainder_layers) == (10, 2)
    # Sliding layers hold at most the 1024-token window; 10 global layers grow with context.
    per_token = 2 * 16 * 128 * 2
    assert float(spec.state_bytes_per_request(4096)) == per_token * (52 * 1024 + 10 * 4096)
    # Tied embedding counted once.
    head = next(op for op in spec.post_ops if op.name == "lm_head")
    assert spec.weight_bytes == sum(op.weight_bytes for op in spec.operators) - head.weight_bytes


def test_qwen3_next_hybrid_block_and_recurrent_state() -> None:
    spec = load_model("qwen3-next-80b-a3b")
    assert spec.block.period_layers == 4
    assert [layer.attention for layer in spec.layers[:4]] == [AttentionKind.LINEAR] * 3 + [
        AttentionKind.FULL
    ]
    linear = next(op for op in spec.layers[0].ops if op.name == "core_attn")
    # 32 value heads x 128 x 128 state + conv (2*16*128 + 32*128) x 3, bf16.
    assert linear.state_bytes_fixed == (32 * 128 * 128 + (4096 + 4096) * 3) * 2
    assert [op.name for op in spec.layers[0].ops][-3:] == ["router", "experts", "shared_expert"]
    assert "rope" not in [op.name for op in spec.layers[0].ops]
    # ~80B parameters in bf16, ~3B active.
    assert 158e9 < spec.weight_bytes < 161e9
    assert 5.5e9 < spec.gemm_flops_per_token < 7.5e9


def test_builtins_all_load() -> None:
    for name in BUILTIN_MODELS:
        spec = load_model(name)
        assert spec.name == name and spec.num_layers == len(spec.layers)


def test_moe_dense_layers_change_the_block(write_config) -> None:
    cfg = dict(
        TINY_LLAMA,
        model_type="qwen3_moe",
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[3],
    )
    spec = load_model(write_config(cfg))
    assert [layer.moe for layer in spec.layers] == [True, True, True, False]
    assert spec.block.period_layers == 4
    experts = next(op for op in spec.layers[0].ops if op.name == "experts")
    assert experts.moe is not None and experts.moe.num_experts == 8
    # Expected distinct experts touched by b tokens each picking 2 of 8.
    assert float(experts.weight_bytes_read(1)) == pytest.approx(2 * experts.moe.expert_weight_bytes)
    assert float(experts.weight_bytes_read(10_000)) == pytest.approx(experts.weight_bytes)


def test_leading_dense_layers_form_a_prefix_before_the_block(write_config) -> None:
    cfg = dict(
        TINY_LLAMA,
        model_type="qwen3_moe",
        num_hidden_layers=6,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0, 1],
    )
    spec = load_model(write_config(cfg))
    block = spec.block
    # 2 dense layers then a 1-layer MoE block: 2 + 1 layers described, not a 6-layer period
    assert (block.prefix_layers, block.period_layers, block.num_full_blocks) == (2, 1, 4)
    assert block.op_names[-2:] == ("router", "experts")
    # a dense layer at the end is no prefix: the period covers the whole model
    tail = model_spec_from_config(dict(cfg, mlp_only_layers=[5]))
    assert (tail.block.prefix_layers, tail.block.period_layers) == (0, 6)
    # layers of another attention kind cannot be tiled with the block's cuts: no prefix
    gemma = load_model("gemma-3-27b").block
    assert (gemma.prefix_layers, gemma.period_layers) == (0, 6)


def test_layer_types_and_sliding_window_families() -> None:
    mistral = model_spec_from_config(dict(TINY_LLAMA, model_type="mistral", sliding_window=16))
    assert {layer.window_tokens for layer in mistral.layers} == {16}
    config = dict(
        TINY_LLAMA,
        model_type="qwen3",
        num_hidden_layers=4,
        sliding_window=8,
        use_sliding_window=True,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    explicit = model_spec_from_config(config)
    assert explicit.block.period_layers == 2
    assert float(explicit.state_bytes_per_request(100)) == 2 * 2 * 16 * 4 * (8 + 100) * 2
    # transformers' Qwen3 drops the window unless use_sliding_window: every layer attends fully
    unwindowed = model_spec_from_config(dict(config, use_sliding_window=False))
    assert unwindowed.block.period_layers == 1
    assert {layer.window_tokens for layer in unwindowed.layers} == {None}


def test_gpt_oss_mxfp4_experts_are_smaller() -> None:
    base = dict(
        TINY_LLAMA,
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        torch_dtype="bfloat16",
    )
    plain = model_spec_from_config(base)
    quant = model_spec_from_config(dict(base, quantization_config={"quant_method": "mxfp4"}))
    e_plain = next(o for o in plain.layers[0].ops if o.name == "experts").weight_bytes
    e_quant = next(o for o in quant.layers[0].ops if o.name == "experts").weight_bytes
    # 4 experts of gate_up (64 -> 256) and down (128 -> 64): MXFP4 values (4 bits) with an E8M0
    # scale per 32 (4.25 bits), their biases (256 + 64) in bf16
    h, inter = 64, 128
    assert e_plain == 4 * (3 * h * inter + 2 * inter + h) * 2
    assert e_quant == 4 * (3 * h * inter * 4.25 / 8 + (2 * inter + h) * 2)
    assert [layer.attention for layer in plain.layers] == [
        AttentionKind.SLIDING,
        AttentionKind.FULL,
    ]


def test_unsupported_family_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported.*llama.*qwen3_next"):
        model_spec_from_config({"model_type": "bert"})


def test_bad_configs_get_clear_errors(write_config, tmp_path) -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'nope'"):
        load_model("nope")
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(bad)
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        model_spec_from_config(dict(TINY_LLAMA, num_key_value_heads=3))
    with pytest.raises(ConfigError, match="^hidden_size: expected an integer, got 'big'$"):
        model_spec_from_config(dict(TINY_LLAMA, hidden_size="big"))
    with pytest.raises(ConfigError, match="^layer_types: 1 entries for 2 layers$"):
        model_spec_from_config(dict(TINY_LLAMA, layer_types=["full_attention"]))
    with pytest.raises(ConfigError, match="^dtype: 'int3' is not supported"):
        model_spec_from_config(dict(TINY_LLAMA, torch_dtype="int3"))
    for falsy in (0, False, "", []):  # read as "unset", they were costed as bfloat16
        with pytest.raises(ConfigError, match="^torch_dtype: expected a dtype's name, e.g."):
            model_spec_from_config(dict(TINY_LLAMA, torch_dtype=falsy))
    assert model_spec_from_config(dict(TINY_LLAMA, torch_dtype=None)).dtype == "bfloat16"
    with pytest.raises(ConfigError, match="^num_experts_per_tok: 9 is more than the 8 experts$"):
        model_spec_from_config(
            dict(TINY_LLAMA, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=9)
        )
    # Qwen's MoE families build dense layers without experts; DeepSeek-V3's MoE layers would
    # route each token to 8 of none
    qwen_moe = dict(TINY_LLAMA, model_type="qwen3_moe", num_experts=0, num_experts_per_tok=2)
    assert model_spec_from_config(qwen_moe).arch.moe is None
    with pytest.raises(ConfigError, match="^the config gives 0 routed experts, but a deepseek_v3"):
        model_spec_from_config(builtin_config("deepseek-v3") | {"n_routed_experts": 0})
    with pytest.raises(ConfigError, match=r"^num_hidden_layers: 10000000 is out of range"):
        model_spec_from_config(dict(TINY_LLAMA, num_hidden_layers=10**7))
    with pytest.raises(ConfigError, match="^text_config: expected an object, got 3$"):
        model_spec_from_config({"model_type": "gemma3", "text_config": 3})
    broken = write_config(dict(TINY_LLAMA, rms_norm_eps=float("inf")), "broken")
    with pytest.raises(ConfigError, match=r"config\.json: rms_norm_eps: expected a finite"):
        load_model(broken)
    folder = write_config(TINY_LLAMA, "tiny")
    assert load_model(folder).name == "tiny"
    assert load_model(folder / "config.json").num_layers == 2
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
