"""The family registry: which configs select which family, and how their keys read."""

from __future__ import annotations

import pytest

from opweave.costmodel import (
    SUPPORTED_FAMILIES,
    ConfigError,
    UnsupportedModelError,
    family_defaults,
    model_spec_from_config,
    resolve_architecture,
)
from tests.helpers import TINY_LLAMA


def test_architectures_select_the_family_as_vllm_does() -> None:
    # vLLM maps the architectures entry to its model class; model_type only names the config.
    arch = resolve_architecture(
        dict(TINY_LLAMA, model_type="my_fork", architectures=["MistralForCausalLM"])
    )
    assert arch.family == "mistral"
    # no known architecture: model_type decides
    assert resolve_architecture(dict(TINY_LLAMA, architectures=["Whatever"])).family == "llama"


def test_unknown_family_is_one_line_naming_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        resolve_architecture({"model_type": "bert", "architectures": ["BertModel"]})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model_type 'bert' is not supported (nor architectures BertModel)")
    assert message.endswith("supported families: " + ", ".join(SUPPORTED_FAMILIES))
    with pytest.raises(ConfigError, match="^architectures: expected a list of strings, got 3$"):
        resolve_architecture(dict(TINY_LLAMA, architectures=3))


@pytest.mark.parametrize(
    "architecture", ["LlamaModel", "LlamaForSequenceClassification", "Gemma3TextModel"]
)
def test_a_supported_model_type_without_a_language_model_head_is_refused(
    architecture: str,
) -> None:
    """An embedding or classification checkpoint of a supported model type (e.g.
    google/embeddinggemma-300m: gemma3_text, Gemma3TextModel) never decodes; it was costed as a
    decoder."""
    config = dict(TINY_LLAMA, architectures=[architecture])
    with pytest.raises(ConfigError) as info:
        model_spec_from_config(config)
    assert str(info.value).startswith(
        f"architectures {architecture}: a model without a language-model head"
    )
    # beside a generative architecture it is served as that one
    both = dict(TINY_LLAMA, architectures=[architecture, "LlamaForCausalLM"])
    assert resolve_architecture(both).family == "llama"


def test_null_keys_read_as_the_family_defaults_or_as_missing() -> None:
    # a null string or object takes the default; a null required number is missing
    arch = resolve_architecture(dict(TINY_LLAMA, hidden_act=None, rope_scaling=None))
    assert arch.hidden_act == "silu" and arch.rope["full_attention"].rope_type == "default"
    with pytest.raises(ConfigError, match="^hidden_size: missing; add it to config.json$"):
        resolve_architecture(dict(TINY_LLAMA, hidden_size=None))
    # an expert count spelled both ways is read where it holds a value
    arch = resolve_architecture(
        dict(TINY_LLAMA, model_type="mixtral", num_experts=None, num_local_experts=4)
    )
    assert arch.moe is not None and arch.moe.num_experts == 4
    with pytest.raises(ConfigError, match=r"^num_local_experts: -1 is out of range \(0\.\.65536\)"):
        resolve_architecture(dict(TINY_LLAMA, model_type="mixtral", num_local_experts=-1))


def test_defaults_are_transformers_defaults() -> None:
    # transformers 5 configuration_*.py
    assert family_defaults("mixtral", {})["rope_theta"] == 1_000_000.0
    assert family_defaults("qwen3_next", {})["num_experts"] == 512
    gemma = family_defaults("gemma3_text", {"hidden_size": 5376})
    assert "hidden_size" not in gemma and gemma["query_pre_attn_scalar"] == 256
    assert "num_experts" not in family_defaults("qwen3_moe", {"num_local_experts": 8})


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "gpt_oss"])
def test_attention_bias_biases_the_output_projection_too(family: str) -> None:
    # transformers builds o_proj with bias=config.attention_bias in these families (Qwen2 never)
    h = TINY_LLAMA["hidden_size"]
    base = dict(TINY_LLAMA, model_type=family, head_dim=16, num_local_experts=2)
    base["num_experts_per_tok"] = 1
    without = model_spec_from_config(dict(base, attention_bias=False)).layers[0].ops
    with_bias = model_spec_from_config(dict(base, attention_bias=True)).layers[0].ops
    o_without = next(op for op in without if op.name == "o_proj")
    o_with = next(op for op in with_bias if op.name == "o_proj")
    assert o_with.weight_bytes - o_without.weight_bytes == 4 * h  # float32


def test_qwen2_biases_qkv_whatever_attention_bias_says_and_never_o() -> None:
    h, q, kv = 64, 64, 2 * 2 * 16
    for flag in (False, True):
        ops = (
            model_spec_from_config(dict(TINY_LLAMA, model_type="qwen2", attention_bias=flag))
            .layers[0]
            .ops
        )
        qkv = next(op for op in ops if op.name == "qkv_proj")
        o = next(op for op in ops if op.name == "o_proj")
        assert qkv.weight_bytes == 4 * (h * (q + kv) + q + kv)
        assert o.weight_bytes == 4 * q * h
