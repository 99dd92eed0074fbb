"""Config normalisation (the cost model's Architecture, which the runtime's operators compute
from) and the operator sequence derived from it (the planner's contract)."""

from __future__ import annotations

import pytest
import torch

from opweave.costmodel import Architecture, UnsupportedModelError, model_spec_from_config
from opweave.runtime import (
    StageModule,
    layer_operator_names,
    operator_sequence,
    write_tiny_model,
)
from opweave.runtime._private.rope import attention_scaling, inverse_frequencies


def parse_config(config: dict) -> Architecture:
    return model_spec_from_config(config).arch


# Abridged released configs, in the key styles they ship with (transformers 4.x era).
LLAMA_33_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "eos_token_id": [128001, 128008, 128009],
}
GEMMA3_27B = {
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
}
QWEN3_NEXT_80B = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 5120,
    "vocab_size": 151936,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "use_sliding_window": False,
    "sliding_window": None,
    "rope_theta": 1000000.0,
}


def test_llama3_rope_and_eos_list():
    spec = parse_config(LLAMA_33_70B)
    assert spec.head_dim == 128 and spec.dtype == "bfloat16"
    assert spec.rope["full_attention"].rope_type == "llama3"
    assert spec.rope["full_attention"].original_max_position_embeddings == 8192
    assert spec.eos_token_ids == (128001, 128008, 128009)


def test_gemma3_multimodal_config_uses_text_config():
    spec = parse_config(GEMMA3_27B)
    assert spec.family == "gemma3_text" and spec.num_layers == 62
    assert spec.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (
        spec.rope["full_attention"].rope_type == "linear"
        and spec.rope["full_attention"].factor == 8.0
    )
    assert spec.rope["full_attention"].theta == 1_000_000.0
    assert (
        spec.rope["sliding_attention"].theta == 10_000.0
        and spec.rope["sliding_attention"].rope_type == "default"
    )
    assert spec.attn_scale == pytest.approx(168**-0.5)
    assert spec.hidden_act == "gelu_pytorch_tanh" and spec.tie_word_embeddings
    assert spec.eos_token_ids == (1, 106)


def test_qwen3_next_layers_and_moe():
    spec = parse_config(QWEN3_NEXT_80B)
    assert spec.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert spec.rope["full_attention"].partial_rotary_factor == 0.25
    assert spec.moe is not None and spec.moe.shared_intermediate_size == 512
    assert spec.linear_attn is not None and spec.linear_attn.conv_dim == 2 * 16 * 128 + 32 * 128
    assert layer_operator_names(QWEN3_NEXT_80B, 0) == (
        "attn_norm",
        "qkv_proj",
        "core_attn",
        "o_proj",
        "ffn_norm",
        "router",
        "experts",
        "shared_expert",
    )
    assert layer_operator_names(QWEN3_NEXT_80B, 3) == (
        "attn_norm",
        "qkv_proj",
        "rope",
        "core_attn",
        "o_proj",
        "ffn_norm",
        "router",
        "experts",
        "shared_expert",
    )


def test_qwen3_moe_dense_layers_from_mlp_only_and_sparse_step():
    config = {
        **QWEN3_30B_A3B,
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert sorted(parse_config(config).moe_layers) == [1, 5]
    assert layer_operator_names(config, 0)[-2:] == ("gate_up_proj", "down_proj")
    assert layer_operator_names(config, 1)[-2:] == ("router", "experts")
    assert layer_operator_names(config, 3)[-2:] == ("gate_up_proj", "down_proj")


def test_operator_sequence_brackets_layers_with_model_ops():
    seq = operator_sequence(QWEN3_30B_A3B)
    assert seq[0] == (None, "embed") and [r.name for r in seq[-3:]] == [
        "final_norm",
        "lm_head",
        "sample",
    ]
    assert len(seq) == 1 + 48 * 8 + 3


@pytest.mark.parametrize(
    ("rope_scaling", "rope_theta"),
    [
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            500000.0,
        ),
        ({"rope_type": "linear", "factor": 4.0}, 10000.0),
        (None, 1000000.0),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
            1000000.0,
        ),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}, 1e4),
        (  # gpt-oss's: the ramp's band edges not rounded
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            150000.0,
        ),
    ],
)
def test_inverse_frequencies_match_transformers(rope_scaling, rope_theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {**LLAMA_33_70B, "rope_scaling": rope_scaling, "rope_theta": rope_theta}
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    rope_type = hf_config.rope_parameters["rope_type"]
    init = (
        LlamaRotaryEmbedding.compute_default_rope_parameters
        if rope_type == "default"
        else ROPE_INIT_FUNCTIONS[rope_type]
    )
    expected, scaling = init(hf_config)

    spec = parse_config(raw)
    rope = spec.rope["full_attention"]
    assert torch.equal(inverse_frequencies(rope, spec.head_dim), expected)
    assert attention_scaling(rope) == pytest.approx(scaling, rel=1e-12)


def test_unsupported_inputs_raise_user_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        parse_config({"model_type": "gpt2"})
    # The cost model plans a dynamic-NTK llama; the runtime refuses to build its rope.
    folder = write_tiny_model(
        "llama", tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic", "factor": 4.0}
    )
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    assert parse_config(LLAMA_33_70B | {"rope_scaling": dynamic}).rope
    with pytest.raises(UnsupportedModelError, match="RoPE type 'dynamic' is not implemented"):
        StageModule(folder, [(0, "rope")])


@pytest.mark.parametrize(
    ("checkpoint", "family"),
    [("deepseek-v3.2.json", "deepseek_v32"), ("glm-5.2-fp8.json", "glm_moe_dsa")],
)
def test_a_family_the_runtime_does_not_run_is_refused_by_name(checkpoint, family) -> None:
    """Planned and estimated, not served: the runtime has no DSA indexer; serving DeepSeek-V3.2
    or GLM-5 is a one-line refusal."""
    from pathlib import Path

    from opweave.costmodel import load_model
    from opweave.runtime._private.graph import check_runtime_support

    config = Path(__file__).parents[1] / "costmodel/checkpoints" / checkpoint
    with pytest.raises(UnsupportedModelError, match=f"^the runtime does not implement {family}"):
        check_runtime_support(load_model(config))


def test_shipped_configs_that_omit_default_keys_parse() -> None:
    """Released gemma-3 configs omit vocab_size & co. (equal to transformers' defaults)."""
    from opweave.costmodel import BUILTIN_MODELS, load_model
    from opweave.costmodel._private.models import builtin_config

    for name in BUILTIN_MODELS:
        spec = parse_config(builtin_config(name))
        cost = load_model(name)
        assert (spec.vocab_size, spec.num_layers, spec.hidden_size) == (
            cost.vocab_size,
            cost.num_layers,
            cost.hidden_size,
        )
    assert parse_config(builtin_config("gemma-3-27b")).vocab_size == 262208


def test_a_config_and_weights_that_disagree_on_precision_are_refused(tmp_path):
    """A config that says block FP8 over unquantised weights, and a plan for an FP8 KV cache
    checked against a model loaded without one, are one-line errors naming the difference."""
    import json

    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import CheckpointError, PlanMismatchError, check_plan, plan_model

    folder = write_tiny_model("qwen3", tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model.layers.0.self_attn.q_proj.weight' is stored unquantised \(float32\), "
        r"but the config \(config.json quantization_config: fp8, 128x128 blocks\) quantises "
        r"model.layers.0.self_attn.q_proj as fp8-block",
    ):
        StageModule(folder, [(0, "qkv_proj")])
    plain = write_tiny_model("qwen3", tmp_path / "plain")
    planned = load_model(plain, kv_cache_dtype="fp8")
    plan = canonical_plan(planned, "colocated", gpu="cpu", batch=1)
    with pytest.raises(PlanMismatchError, match="the plan assumes a fp8 KV cache, the model is"):
        check_plan(plan, load_model(plain))
    check_plan(plan, plan_model(plan, plain))
    check_plan(
        canonical_plan(load_model(plain), "colocated", gpu="cpu", batch=1), load_model(plain)
    )
