"""Configs of supported families that are not built in, against their published sizes.

Parameter counts are the ones the model cards state (Mixtral-8x7B 46.7B, Mistral-7B 7.24B,
Qwen2.5-7B 7.61B, Qwen3-8B 8.2B, Gemma-3-4B's language model 3.88B); gpt-oss-20b's checkpoint
is 12.8 GiB with MXFP4 experts (OpenAI's model card).
"""

from __future__ import annotations

import pytest

from opweave.costmodel import model_spec_from_config

BF16 = {"torch_dtype": "bfloat16"}
CONFIGS = {
    "mixtral-8x7b": (
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "sliding_window": None,
        },
        46.7e9,
    ),
    "mistral-7b": (
        {
            "model_type": "mistral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "sliding_window": 4096,
        },
        7.24e9,
    ),
    "qwen2.5-7b": (
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
        7.61e9,
    ),
    "qwen3-8b": (
        {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
        },
        8.2e9,
    ),
    "gemma-3-4b": (
        {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "sliding_window": 1024,
        },
        3.88e9,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_matches_the_model_card(name: str) -> None:
    config, params = CONFIGS[name]
    spec = model_spec_from_config(config | BF16)
    assert spec.weight_bytes / 2 == pytest.approx(params, rel=0.01)


def test_mistral_sliding_window_and_gemma_block() -> None:
    mistral = model_spec_from_config(CONFIGS["mistral-7b"][0] | BF16)
    assert {layer.window_tokens for layer in mistral.layers} == {4096}
    gemma = model_spec_from_config(CONFIGS["gemma-3-4b"][0] | BF16)
    assert (gemma.block.period_layers, gemma.block.remainder_layers) == (6, 4)


def test_gpt_oss_20b_checkpoint_size_with_mxfp4_experts() -> None:
    spec = model_spec_from_config(
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 24,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "vocab_size": 201088,
            "sliding_window": 128,
            "quantization_config": {"quant_method": "mxfp4"},
            **BF16,
        }
    )
    assert spec.weight_bytes / 2**30 == pytest.approx(12.8, rel=0.02)
    assert spec.block.period_layers == 2
