"""The config keys each family reads, with their types, ranges and transformers' defaults.

One pydantic model per family (``configuration_<family>.py`` of transformers 5.x gives the
defaults; Hugging Face saves only the keys that differ from them, so an absent key takes the
default declared here). Keys that vLLM reads from remote-code configs (DeepSeek's
``moe_layer_freq``, MiniMax-M2's ``rotary_dim``) take vLLM's ``getattr`` default. What the keys
mean for the operators is decided in ``architecture.py`` from the family's flags
(``registry.py``), never from its name.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AliasChoices, Field

from .config_fields import (
    PLACEMENT,
    ConfigSchema,
    ConvKernel,
    Experts,
    Experts0,
    Flag,
    Heads,
    LayerList,
    Layers,
    Layers0,
    Obj,
    OptHeads,
    OptLayers,
    OptPositive,
    OptStr,
    OptStrList,
    OptTokens,
    OptWidth,
    Positive,
    Str,
    Tokens,
    Vocab,
    Width,
    Width0,
)


def _experts_key(*names: str) -> Any:
    """The expert count, read under whichever of its names a config uses (transformers 5
    saves Qwen3-MoE's as ``num_local_experts``; released configs say ``num_experts``)."""
    return AliasChoices(*names)


class DecoderConfig(ConfigSchema):
    """Keys every decoder family reads."""

    hidden_size: Width
    num_hidden_layers: Layers
    num_attention_heads: Heads
    num_key_value_heads: OptHeads = None
    head_dim: OptWidth = None
    vocab_size: Vocab
    intermediate_size: Width
    max_position_embeddings: Tokens
    rms_norm_eps: Positive = 1e-6
    hidden_act: Str = "silu"
    rope_theta: Positive = 10_000.0
    rope_scaling: Obj = Field(default_factory=dict)
    rope_parameters: Obj = Field(default_factory=dict)
    partial_rotary_factor: Any = None  # checked with the rest of the RoPE parameters
    tie_word_embeddings: Flag = False
    attention_bias: Flag = False
    mlp_bias: Flag = False
    layer_types: OptStrList = None
    sliding_window: OptTokens = None
    quantization_config: Obj = Field(default_factory=dict)


class LlamaConfig(DecoderConfig):
    vocab_size: Vocab = 32000
    hidden_size: Width = 4096
    intermediate_size: Width = 11008
    num_hidden_layers: Layers = 32
    num_attention_heads: Heads = 32
    max_position_embeddings: Tokens = 2048


class MistralConfig(DecoderConfig):
    vocab_size: Vocab = 32000
    hidden_size: Width = 4096
    intermediate_size: Width = 14336
    num_hidden_layers: Layers = 32
    num_attention_heads: Heads = 32
    num_key_value_heads: OptHeads = 8
    max_position_embeddings: Tokens = 131072
    sliding_window: OptTokens = 4096


class Qwen2Config(DecoderConfig):
    vocab_size: Vocab = 151936
    hidden_size: Width = 4096
    intermediate_size: Width = 22016
    num_hidden_layers: Layers = 32
    num_attention_heads: Heads = 32
    max_position_embeddings: Tokens = 32768
    attention_bias: Flag = True  # Qwen2 always biases q/k/v (and never o)
    use_sliding_window: Flag = False
    max_window_layers: Annotated[Layers0, PLACEMENT] = 28  # read with use_sliding_window


class Qwen3Config(Qwen2Config):
    head_dim: OptWidth = 128
    attention_bias: Flag = False


class Qwen3VLTextConfig(Qwen3Config):
    """Qwen3-VL's text model (transformers ``Qwen3VLTextConfig``): Qwen3's layers (the
    multimodal RoPE reduces to Qwen3's for text, whose three position rows are equal)."""

    max_position_embeddings: Tokens = 128000


class _RoutedExperts(DecoderConfig):
    """Keys of the routed-expert families."""

    num_experts: Experts0 = Field(
        128, validation_alias=_experts_key("num_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 8


class Qwen3MoeConfig(Qwen3Config, _RoutedExperts):
    head_dim: OptWidth = None
    hidden_size: Width = 2048
    intermediate_size: Width0 = 6144
    num_hidden_layers: Layers = 24
    num_key_value_heads: OptHeads = 4
    decoder_sparse_step: Layers = 1
    moe_intermediate_size: Width = 768
    norm_topk_prob: Flag = False
    mlp_only_layers: LayerList = Field(default_factory=list)


class Qwen3VLMoeTextConfig(Qwen3MoeConfig):
    """Qwen3-VL-MoE's text model (transformers ``Qwen3VLMoeTextConfig``): Qwen3-MoE's layers."""

    hidden_size: Width = 2048
    intermediate_size: Width0 = 5632
    num_hidden_layers: Layers = 24
    num_attention_heads: Heads = 16
    num_key_value_heads: OptHeads = 16
    max_position_embeddings: Tokens = 128000
    tie_word_embeddings: Flag = True
    moe_intermediate_size: Width = 1408
    num_experts: Experts0 = Field(
        60, validation_alias=_experts_key("num_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 4


class MixtralConfig(_RoutedExperts):
    vocab_size: Vocab = 32000
    hidden_size: Width = 4096
    intermediate_size: Width = 14336
    num_hidden_layers: Layers = 32
    num_attention_heads: Heads = 32
    num_key_value_heads: OptHeads = 8
    max_position_embeddings: Tokens = 131072
    rms_norm_eps: Positive = 1e-5
    rope_theta: Positive = 1_000_000.0
    num_experts: Experts0 = Field(
        8, validation_alias=_experts_key("num_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 2


class Gemma3TextConfig(DecoderConfig):
    vocab_size: Vocab = 262208
    hidden_size: Width = 2304
    intermediate_size: Width = 9216
    num_hidden_layers: Layers = 26
    num_attention_heads: Heads = 8
    num_key_value_heads: OptHeads = 4
    head_dim: OptWidth = 256
    max_position_embeddings: Tokens = 131072
    rope_theta: Positive = 1_000_000.0
    hidden_act: Str = "gelu_pytorch_tanh"  # read only when hidden_activation is null
    hidden_activation: OptStr = "gelu_pytorch_tanh"
    rope_local_base_freq: Positive = 10_000.0
    query_pre_attn_scalar: Positive = 256
    sliding_window: OptTokens = 4096
    sliding_window_pattern: Annotated[OptLayers, PLACEMENT] = 6  # read without layer_types
    # transformers 4.5x saved the pattern under this private name
    legacy_sliding_window_pattern: Layers = Field(6, validation_alias="_sliding_window_pattern")
    attn_logit_softcapping: OptPositive = None
    final_logit_softcapping: OptPositive = None
    tie_word_embeddings: Flag = True


class _GatedDeltaNet(DecoderConfig):
    """Keys of the hybrid gated-DeltaNet families (Qwen3-Next, Qwen3.5)."""

    full_attention_interval: Layers = 4
    linear_conv_kernel_dim: ConvKernel = 4
    linear_key_head_dim: Width = 128
    linear_value_head_dim: Width = 128
    linear_num_key_heads: Heads = 16
    linear_num_value_heads: Heads = 32


class Qwen3NextConfig(_GatedDeltaNet, _RoutedExperts):
    vocab_size: Vocab = 151936
    hidden_size: Width = 2048
    intermediate_size: Width0 = 5632
    num_hidden_layers: Layers = 48
    num_attention_heads: Heads = 16
    num_key_value_heads: OptHeads = 2
    head_dim: OptWidth = 256
    max_position_embeddings: Tokens = 32768
    partial_rotary_factor: Any = 0.25
    decoder_sparse_step: Layers = 1
    moe_intermediate_size: Width = 512
    shared_expert_intermediate_size: Width0 = 512
    num_experts: Experts0 = Field(
        512, validation_alias=_experts_key("num_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 10
    norm_topk_prob: Flag = True
    mlp_only_layers: LayerList = Field(default_factory=list)


class _Qwen3_5(_GatedDeltaNet):
    """Keys both Qwen3.5 text models add to Qwen3-Next's."""

    # vLLM's qwen3_5.py: getattr(config, "attn_output_gate", True)
    attn_output_gate: Flag = True
    # The recurrent state's dtype (the released checkpoints say float32): vLLM's Qwen3.5
    # config hook makes it the cache's ``mamba_ssm_cache_dtype`` (Qwen3_5ForConditional-
    # GenerationConfig in model_executor/models/config.py). Unset: the model's dtype.
    mamba_ssm_dtype: OptStr = None


class Qwen3_5MoeTextConfig(_Qwen3_5, _RoutedExperts):
    """Qwen3.5-MoE's text model (transformers ``Qwen3_5MoeTextConfig``): Qwen3-Next's layers
    with every layer sparse (no ``decoder_sparse_step``, ``mlp_only_layers`` nor dense
    ``intermediate_size``) and the router always renormalising its top-k."""

    vocab_size: Vocab = 248320
    hidden_size: Width = 2048
    intermediate_size: Width0 = 0
    num_hidden_layers: Layers = 40
    num_attention_heads: Heads = 16
    num_key_value_heads: OptHeads = 2
    head_dim: OptWidth = 256
    max_position_embeddings: Tokens = 32768
    partial_rotary_factor: Any = 0.25
    moe_intermediate_size: Width = 512
    shared_expert_intermediate_size: Width0 = 512
    num_experts: Experts0 = Field(
        256, validation_alias=_experts_key("num_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 8


class Qwen3_5TextConfig(_Qwen3_5):
    """Qwen3.5's dense text model (transformers ``Qwen3_5TextConfig``: Qwen3.5-27B and the
    0.8B-9B models): the MoE models' layers with a dense SwiGLU MLP in every layer."""

    vocab_size: Vocab = 248320
    hidden_size: Width = 4096
    intermediate_size: Width = 12288
    num_hidden_layers: Layers = 32
    num_attention_heads: Heads = 16
    num_key_value_heads: OptHeads = 4
    head_dim: OptWidth = 256
    max_position_embeddings: Tokens = 32768
    partial_rotary_factor: Any = 0.25


class GptOssConfig(_RoutedExperts):
    vocab_size: Vocab = 201088
    hidden_size: Width = 2880
    intermediate_size: Width = 2880
    num_hidden_layers: Layers = 36
    num_attention_heads: Heads = 64
    num_key_value_heads: OptHeads = 8
    head_dim: OptWidth = 64
    max_position_embeddings: Tokens = 131072
    rms_norm_eps: Positive = 1e-5
    rope_theta: Positive = 150_000.0
    sliding_window: OptTokens = 128
    num_experts: Experts0 = Field(
        128, validation_alias=_experts_key("num_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 4
    norm_topk_prob: Flag = False
    attention_bias: Flag = True
    swiglu_alpha: Positive = 1.702
    swiglu_limit: Positive = 7.0


class DeepseekV3Config(_RoutedExperts):
    """transformers ``DeepseekV3Config`` (``configuration_deepseek_v3.py``); ``moe_layer_freq``,
    ``scoring_func`` and ``topk_method`` as vLLM's ``deepseek_v2.py`` reads them from the
    remote-code configs the checkpoints ship."""

    vocab_size: Vocab = 129280
    hidden_size: Width = 7168
    intermediate_size: Width = 18432
    num_hidden_layers: Layers = 61
    num_attention_heads: Heads = 128
    num_key_value_heads: OptHeads = 128
    max_position_embeddings: Tokens = 4096
    q_lora_rank: OptWidth = 1536  # null: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: Width = 512
    qk_nope_head_dim: Width = 128
    qk_rope_head_dim: Width = 64
    v_head_dim: Width = 128
    rope_interleave: Flag = True  # transformers' default: the released checkpoints' layout
    moe_intermediate_size: Width = 2048
    num_experts: Experts0 = Field(
        256, validation_alias=_experts_key("n_routed_experts", "num_local_experts")
    )
    n_shared_experts: Experts0 = 1
    num_experts_per_tok: Experts = 8
    n_group: Experts = 8
    topk_group: Experts = 4
    routed_scaling_factor: Positive = 2.5
    norm_topk_prob: Flag = True
    first_k_dense_replace: Layers0 = 3
    moe_layer_freq: Layers = 1
    scoring_func: Str = "sigmoid"
    topk_method: Str = "noaux_tc"


class Glm4MoeLiteConfig(DeepseekV3Config):
    """transformers ``Glm4MoeLiteConfig`` (GLM-4.7-Flash): DeepSeek-V3's MLA layers and MoE
    layout at its own sizes. vLLM's ``glm4_moe_lite.py`` makes layers from
    ``first_k_dense_replace`` on MoE; transformers reads ``mlp_layer_types`` (by default one
    dense layer, then MoE), so the two must agree where both are given."""

    vocab_size: Vocab = 154880
    hidden_size: Width = 2048
    intermediate_size: Width = 10240
    num_hidden_layers: Layers = 47
    num_attention_heads: Heads = 20
    num_key_value_heads: OptHeads = 20
    max_position_embeddings: Tokens = 202752
    rms_norm_eps: Positive = 1e-5
    q_lora_rank: OptWidth = 768
    qk_nope_head_dim: Width = 192
    v_head_dim: Width = 256
    moe_intermediate_size: Width = 1536
    num_experts: Experts0 = Field(
        64, validation_alias=_experts_key("n_routed_experts", "num_local_experts")
    )
    num_experts_per_tok: Experts = 4
    n_group: Experts = 1
    topk_group: Experts = 1
    routed_scaling_factor: Positive = 1.8
    first_k_dense_replace: Layers0 = 1
    mlp_layer_types: OptStrList = None


class Glm4MoeConfig(_RoutedExperts):
    """transformers ``Glm4MoeConfig`` (its defaults are GLM-4.5-Air's): GQA attention with
    partial RoPE, q/k/v biases (``attention_bias``) and per-head q/k norms (``use_qk_norm``),
    over DeepSeek-V3's MoE layout (sigmoid routing with a selection bias, groups, shared experts,
    the first ``first_k_dense_replace`` layers dense)."""

    vocab_size: Vocab = 151552
    hidden_size: Width = 4096
    intermediate_size: Width = 10944
    num_hidden_layers: Layers = 46
    num_attention_heads: Heads = 96
    num_key_value_heads: OptHeads = 8
    max_position_embeddings: Tokens = 131072
    rms_norm_eps: Positive = 1e-5
    partial_rotary_factor: Any = 0.5
    use_qk_norm: Flag = False
    moe_intermediate_size: Width = 1408
    num_experts: Experts0 = Field(
        128, validation_alias=_experts_key("n_routed_experts", "num_local_experts")
    )
    n_shared_experts: Experts0 = 1
    num_experts_per_tok: Experts = 8
    n_group: Experts = 1
    topk_group: Experts = 1
    routed_scaling_factor: Positive = 1.0
    norm_topk_prob: Flag = True
    first_k_dense_replace: Layers0 = 1
    moe_layer_freq: Layers = 1


class DeepseekV32Config(DeepseekV3Config):
    """transformers ``DeepseekV32Config``: DeepSeek-V3's keys and the DSA indexer's."""

    max_position_embeddings: Tokens = 163840
    index_topk: Tokens = 2048
    index_head_dim: Width = 128
    index_n_heads: Heads = 64
    indexer_types: OptStrList = None
    mlp_layer_types: OptStrList = None


class GlmMoeDsaConfig(DeepseekV32Config):
    """transformers ``GlmMoeDsaConfig`` (GLM-5): DeepSeek-V3.2's layout at its own sizes."""

    vocab_size: Vocab = 154880
    hidden_size: Width = 6144
    intermediate_size: Width = 12288
    num_hidden_layers: Layers = 78
    num_attention_heads: Heads = 64
    num_key_value_heads: OptHeads = 64
    max_position_embeddings: Tokens = 202752
    q_lora_rank: OptWidth = 2048
    qk_nope_head_dim: Width = 192
    v_head_dim: Width = 256
    rms_norm_eps: Positive = 1e-5
    n_group: Experts = 1
    topk_group: Experts = 1
    index_n_heads: Heads = 32


class MiniMaxM2Config(_RoutedExperts):
    """transformers ``MiniMaxM2Config``; ``rotary_dim``, ``scoring_func`` and
    ``use_routing_bias`` as vLLM's ``minimax_m2.py`` reads them from the remote-code config the
    checkpoints ship (vLLM builds the q/k norms whatever ``use_qk_norm`` says)."""

    vocab_size: Vocab = 200064
    hidden_size: Width = 3072
    intermediate_size: Width = 1536
    num_hidden_layers: Layers = 62
    num_attention_heads: Heads = 48
    num_key_value_heads: OptHeads = 8
    head_dim: OptWidth = 128
    max_position_embeddings: Tokens = 196608
    rope_theta: Positive = 5_000_000.0
    num_experts: Experts0 = Field(
        256, validation_alias=_experts_key("num_local_experts", "num_experts")
    )
    num_experts_per_tok: Experts = 8
    rotary_dim: OptWidth = None  # None: the whole head rotates
    scoring_func: Str = "sigmoid"
    # absent: applied, as every released checkpoint sets it and transformers' MiniMaxM2 (whose
    # config has no such key) always applies it; false is refused (architecture._experts)
    use_routing_bias: Flag = True


__all__ = [
    "DecoderConfig",
    "DeepseekV32Config",
    "DeepseekV3Config",
    "Gemma3TextConfig",
    "Glm4MoeConfig",
    "GlmMoeDsaConfig",
    "GptOssConfig",
    "LlamaConfig",
    "MiniMaxM2Config",
    "MistralConfig",
    "MixtralConfig",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "Qwen3NextConfig",
    "Qwen3VLMoeTextConfig",
    "Qwen3VLTextConfig",
    "Qwen3_5MoeTextConfig",
    "Qwen3_5TextConfig",
]
