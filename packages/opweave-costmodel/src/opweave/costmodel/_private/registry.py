"""One place per family: which configs it covers, the keys it reads and its feature flags.

Every supported family is one :class:`Family` entry of :data:`FAMILIES`: the ``architectures``
and ``model_type`` names that select it, its config schema (``family_schemas.py``), its feature
flags (:class:`FamilyFlags`: norms, biases, layer pattern, MoE layout, attention kind) and the
module names of its checkpoints. :mod:`.architecture` turns a config into an
:class:`~.architecture.Architecture` from these; the cost model and the runtime read the
Architecture's fields, never the family name.

A config selects its family the way vLLM selects a model class: by its ``architectures`` entry
(vLLM's model registry maps e.g. ``DeepseekV3ForCausalLM`` to its DeepSeek implementation, which
is why Kimi-K2, ``model_type`` ``kimi_k2``, runs as DeepSeek-V3), and by ``model_type`` when no
entry is known.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from ..errors import ConfigError, UnsupportedModelError
from .base import Frozen
from .config_fields import ConfigSchema, field_names, show
from .family_schemas import (
    DeepseekV3Config,
    DeepseekV32Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmMoeDsaConfig,
    GptOssConfig,
    LlamaConfig,
    MiniMaxM2Config,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Qwen3VLMoeTextConfig,
    Qwen3VLTextConfig,
)


class FamilyFlags(Frozen):
    """What a family's decoder layer does, as data (defaults: a Llama layer)."""

    attention: Literal["gqa", "mla"] = "gqa"
    sparse_index: bool = False  # a DSA indexer selects the tokens MLA attends
    qk_norm: Literal["none", "per_head", "per_layer", "use_qk_norm"] = "none"
    gemma_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    attn_output_gate: Literal["never", "always", "config"] = "never"
    qkv_bias: Literal["attention_bias", "qkv_only", "qkv_if_attention_bias"] = "attention_bias"
    attn_sinks: bool = False
    scale_from_query_pre_attn_scalar: bool = False
    logit_softcapping: bool = False
    local_rope: bool = False
    activation_key: Literal["hidden_act", "hidden_activation"] = "hidden_act"
    layer_pattern: Literal[
        "uniform", "max_window_layers", "every_nth_full", "full_every_interval", "alternating"
    ] = "uniform"
    window_needs_use_sliding_window: bool = False
    reads_sliding_window: bool = True
    linear_attention: bool = False
    moe: Literal["none", "every_layer", "sparse_step", "first_k_dense"] = "none"
    expert_size_key: Literal["moe_intermediate_size", "intermediate_size"] = "moe_intermediate_size"
    shared_experts: Literal["none", "gated", "n_shared"] = "none"
    router_scoring: Literal["softmax", "sigmoid", "config"] = "softmax"
    router_groups: bool = False
    router_score_bias: Literal["none", "noaux_tc", "use_routing_bias", "always"] = "none"
    routed_scaling: bool = False
    norm_topk: Literal["config", "always"] = "config"
    routing_weights_fp32: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    experts_in_out: bool = False


class CheckpointNames(Frozen):
    """Module names of a family's checkpoints, relative to the decoder layer (for
    :class:`~.model.LinearShape`)."""

    attention: str = "self_attn"
    linear_attention: str = "linear_attn"
    gdn_split_projections: bool = False
    mlp: str = "mlp"
    moe: str = "mlp"
    router: str = "gate"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_gate_up: str | None = Field(
        default=None, description="One tensor holds every expert's gate and up (gpt-oss)."
    )
    shared_expert: str = "shared_expert"
    shared_expert_gate: str | None = None


@dataclass(frozen=True)
class Family:
    """One supported family."""

    name: str
    schema: type[ConfigSchema]
    flags: FamilyFlags
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    wrapper_model_types: tuple[str, ...] = ()
    wrapper_architectures: tuple[str, ...] = ()
    checkpoint: CheckpointNames = dataclasses.field(default_factory=CheckpointNames)


def _flags(base: FamilyFlags, **changes: Any) -> FamilyFlags:
    """``base`` with some flags changed (validated)."""
    return FamilyFlags.model_validate({**base.model_dump(), **changes})


def _wrapper(name: str, schema: type[ConfigSchema], flags: FamilyFlags, cls: str) -> Family:
    """A family known only as a multimodal wrapper: ``model_type`` ``name`` around a
    ``{name}_text`` text model, architecture ``{cls}ForConditionalGeneration``."""
    return Family(
        name,
        schema,
        flags,
        (f"{name}_text",),
        (),
        wrapper_model_types=(name,),
        wrapper_architectures=(f"{cls}ForConditionalGeneration",),
    )


_QWEN_WINDOW = FamilyFlags(layer_pattern="max_window_layers", window_needs_use_sliding_window=True)
_HYBRID_DELTANET = FamilyFlags(
    qk_norm="per_head",
    gemma_norms=True,
    linear_attention=True,
    layer_pattern="full_every_interval",
    reads_sliding_window=False,
    shared_experts="gated",
)

# DeepSeek-V3: MLA, the first layers dense, shared + group-limited routed experts
_DEEPSEEK = FamilyFlags(
    attention="mla",
    moe="first_k_dense",
    shared_experts="n_shared",
    router_scoring="config",
    router_groups=True,
    router_score_bias="noaux_tc",
    routed_scaling=True,
)
_DSA = _flags(_DEEPSEEK, sparse_index=True)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", LlamaConfig, FamilyFlags(), ("llama",), ("LlamaForCausalLM",)),
        Family("mistral", MistralConfig, FamilyFlags(), ("mistral",), ("MistralForCausalLM",)),
        Family(
            "qwen2",
            Qwen2Config,
            _flags(_QWEN_WINDOW, qkv_bias="qkv_only"),
            ("qwen2",),
            ("Qwen2ForCausalLM",),
        ),
        Family(
            "qwen3",
            Qwen3Config,
            _flags(_QWEN_WINDOW, qk_norm="per_head"),
            ("qwen3",),
            ("Qwen3ForCausalLM",),
        ),
        Family(
            "qwen3_moe",
            Qwen3MoeConfig,
            _flags(_QWEN_WINDOW, qk_norm="per_head", moe="sparse_step"),
            ("qwen3_moe",),
            ("Qwen3MoeForCausalLM",),
        ),
        # Qwen3-VL: multimodal wrappers around Qwen3 and Qwen3-MoE text models
        _wrapper(
            "qwen3_vl", Qwen3VLTextConfig, _flags(_QWEN_WINDOW, qk_norm="per_head"), "Qwen3VL"
        ),
        _wrapper(
            "qwen3_vl_moe",
            Qwen3VLMoeTextConfig,
            # transformers' router normalises the top-k weights whatever the config says
            _flags(
                _QWEN_WINDOW,
                qk_norm="per_head",
                moe="sparse_step",
                norm_topk="always",
                experts_in_out=True,
            ),
            "Qwen3VLMoe",
        ),
        Family(
            "mixtral",
            MixtralConfig,
            FamilyFlags(
                moe="every_layer",
                expert_size_key="intermediate_size",
                norm_topk="always",
                routing_weights_fp32=True,
            ),
            ("mixtral",),
            ("MixtralForCausalLM",),
        ),
        Family(
            "gemma3_text",
            Gemma3TextConfig,
            FamilyFlags(
                qk_norm="per_head",
                gemma_norms=True,
                sandwich_norms=True,
                embed_scale=True,
                scale_from_query_pre_attn_scalar=True,
                logit_softcapping=True,
                local_rope=True,
                activation_key="hidden_activation",
                layer_pattern="every_nth_full",
            ),
            ("gemma3_text",),
            ("Gemma3ForCausalLM",),
            wrapper_model_types=("gemma3",),
            wrapper_architectures=("Gemma3ForConditionalGeneration",),
        ),
        Family(
            "qwen3_next",
            Qwen3NextConfig,
            _flags(_HYBRID_DELTANET, attn_output_gate="always", moe="sparse_step"),
            ("qwen3_next",),
            ("Qwen3NextForCausalLM",),
            checkpoint=CheckpointNames(shared_expert_gate="shared_expert_gate"),
        ),
        Family(
            "gpt_oss",
            GptOssConfig,
            FamilyFlags(
                attn_sinks=True,
                layer_pattern="alternating",
                moe="every_layer",
                expert_size_key="intermediate_size",
                router_bias=True,
                expert_bias=True,
            ),
            ("gpt_oss",),
            ("GptOssForCausalLM",),
            checkpoint=CheckpointNames(router="router", fused_gate_up="gate_up_proj"),
        ),
        Family(
            "deepseek_v3",
            DeepseekV3Config,
            _DEEPSEEK,
            # DeepSeek-V3, -R1, -V3.1; Kimi-K2 ships model_type kimi_k2 with this architecture,
            # and Kimi-K2.5 its multimodal wrapper around that text model
            ("deepseek_v3", "kimi_k2"),
            ("DeepseekV3ForCausalLM",),
            wrapper_model_types=("kimi_k25",),
            wrapper_architectures=("KimiK25ForConditionalGeneration",),
            checkpoint=CheckpointNames(shared_expert="shared_experts"),
        ),
        # DeepSeek Sparse Attention over DeepSeek-V3's layers: DeepSeek-V3.2, GLM-5
        Family(
            "deepseek_v32",
            DeepseekV32Config,
            _DSA,
            ("deepseek_v32",),
            ("DeepseekV32ForCausalLM",),
            checkpoint=CheckpointNames(shared_expert="shared_experts"),
        ),
        Family(
            "glm_moe_dsa",
            GlmMoeDsaConfig,
            _DSA,
            ("glm_moe_dsa",),
            ("GlmMoeDsaForCausalLM",),
            checkpoint=CheckpointNames(shared_expert="shared_experts"),
        ),
        Family(
            "glm4_moe",
            Glm4MoeConfig,
            FamilyFlags(
                qk_norm="use_qk_norm",
                qkv_bias="qkv_if_attention_bias",
                moe="first_k_dense",
                shared_experts="n_shared",
                router_scoring="sigmoid",
                router_groups=True,
                router_score_bias="always",
                routed_scaling=True,
            ),
            # GLM-4.5, -4.5-Air, -4.6, -4.7: GQA attention (partial RoPE, q/k/v biases, optional
            # per-head q/k norms) over DeepSeek-V3's MoE layout
            ("glm4_moe",),
            ("Glm4MoeForCausalLM",),
            checkpoint=CheckpointNames(shared_expert="shared_experts"),
        ),
        # GLM-4.7-Flash: DeepSeek-V3's MLA layers with GLM-4.5's router (vLLM's glm4_moe_lite.py:
        # DeepseekV2MLAAttention over Glm4MoE, whose selection bias is always there)
        Family(
            "glm4_moe_lite",
            Glm4MoeLiteConfig,
            _flags(_DEEPSEEK, router_scoring="sigmoid", router_score_bias="always"),
            ("glm4_moe_lite",),
            ("Glm4MoeLiteForCausalLM",),
            checkpoint=CheckpointNames(shared_expert="shared_experts"),
        ),
        Family(
            "qwen3_5_moe",
            Qwen3_5MoeTextConfig,
            _flags(
                _HYBRID_DELTANET, attn_output_gate="config", moe="every_layer", norm_topk="always"
            ),
            ("qwen3_5_moe_text",),
            ("Qwen3_5MoeForCausalLM",),
            wrapper_model_types=("qwen3_5_moe",),
            wrapper_architectures=("Qwen3_5MoeForConditionalGeneration",),
            checkpoint=CheckpointNames(
                gdn_split_projections=True, shared_expert_gate="shared_expert_gate"
            ),
        ),
        Family(
            "qwen3_5",
            Qwen3_5TextConfig,
            _flags(_HYBRID_DELTANET, attn_output_gate="config", shared_experts="none"),
            ("qwen3_5_text",),
            ("Qwen3_5ForCausalLM",),
            wrapper_model_types=("qwen3_5",),
            wrapper_architectures=("Qwen3_5ForConditionalGeneration",),
            checkpoint=CheckpointNames(gdn_split_projections=True),
        ),
        Family(
            "minimax_m2",
            MiniMaxM2Config,
            FamilyFlags(
                qk_norm="per_layer",
                moe="every_layer",
                expert_size_key="intermediate_size",
                router_scoring="config",
                router_score_bias="use_routing_bias",
                norm_topk="always",
            ),
            ("minimax_m2",),
            ("MiniMaxM2ForCausalLM",),
            checkpoint=CheckpointNames(moe="block_sparse_moe", experts=("w1", "w3", "w2")),
        ),
    )
}

SUPPORTED_FAMILIES: tuple[str, ...] = tuple(
    dict.fromkeys(n for f in FAMILIES.values() for n in (*f.wrapper_model_types, f.name))
)
"""The families (and the wrapper ``model_type`` of the multimodal ones) a config may name."""

# name -> (family, whether the text model sits under text_config)
_BY_ARCHITECTURE: dict[str, tuple[Family, bool]] = {}
_BY_MODEL_TYPE: dict[str, tuple[Family, bool]] = {}
for _f in FAMILIES.values():
    _BY_ARCHITECTURE.update({a: (_f, False) for a in _f.architectures})
    _BY_ARCHITECTURE.update({a: (_f, True) for a in _f.wrapper_architectures})
    _BY_MODEL_TYPE.update({t: (_f, False) for t in _f.model_types})
    _BY_MODEL_TYPE.update({t: (_f, True) for t in _f.wrapper_model_types})

# Keys a multimodal wrapper holds for its text model.
_CARRIED = ("torch_dtype", "dtype", "tie_word_embeddings", "eos_token_id")


def _architectures(config: Mapping[str, Any]) -> list[str]:
    names = config.get("architectures")
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"architectures: expected a list of strings, got {show(names)}")
    return names


def _unsupported(config: Mapping[str, Any], archs: list[str]) -> UnsupportedModelError:
    if config.get("model_type") is None and not archs:
        return UnsupportedModelError(
            "the config has neither model_type nor architectures: it is not a model's config.json "
            "(give the model's config.json or its folder)"
        )
    named = f" (nor architectures {', '.join(archs)})" if archs else ""
    return UnsupportedModelError(
        f"model_type {config.get('model_type')!r} is not supported{named}; supported "
        f"families: {', '.join(SUPPORTED_FAMILIES)}"
    )


# Architectures of a family's model type that have no language-model head: transformers' bare
# ``...Model`` (embedding checkpoints such as google/embeddinggemma-300m: Gemma3TextModel; reward
# heads, ``...ForRewardModel``, end the same way) and its classification heads.
_HEADLESS = re.compile(r"(Model|For(Sequence|Token)Classification|ForQuestionAnswering|Embedding)$")


def resolve_family(config: Mapping[str, Any]) -> tuple[Family, dict[str, Any]]:
    """The family of a Hugging Face config and its text model's keys.

    >>> family, text = resolve_family({"model_type": "kimi_k2",
    ...                                "architectures": ["DeepseekV3ForCausalLM"]})
    >>> family.name
    'deepseek_v3'
    """
    if not isinstance(config, Mapping):
        raise ConfigError("config.json must hold a JSON object")
    archs = _architectures(config)
    model_type = config.get("model_type")
    if "model_type" in config and not (
        isinstance(model_type, str) and re.fullmatch(r"[A-Za-z0-9_.\-]{1,100}", model_type)
    ):
        # transformers' AutoConfig, which engines load a config with, finds no such type
        raise ConfigError(
            f"model_type: expected a model type's name (letters, digits, _ . -), got "
            f"{show(model_type)}"
        )
    found = next((_BY_ARCHITECTURE[a] for a in archs if a in _BY_ARCHITECTURE), None)
    if found is None:
        found = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
        if found is not None and archs and all(_HEADLESS.search(a) for a in archs):
            raise ConfigError(
                f"architectures {', '.join(archs)}: a model without a language-model head "
                "(an embedding, classification or reward model, which vLLM runs as a pooling "
                "model and which never decodes); OpWeave costs the decode of generative models "
                "(architectures ...ForCausalLM)"
            )
    if found is None:
        raise _unsupported(config, archs)
    family, nested = found
    if not nested:
        return family, dict(config)
    inner = config.get("text_config", {})
    if inner is None:
        inner = {}
    if not isinstance(inner, Mapping):
        raise ConfigError(f"text_config: expected an object, got {show(inner)}")
    text = dict(inner)
    text.setdefault("model_type", family.model_types[0])
    text.pop("architectures", None)  # the wrapper's, if a converter copied them in
    for key in _CARRIED:
        if key in config and key not in text:
            text[key] = config[key]
    return family, text


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: multimodal Gemma 3 and Qwen3.5 nest it under ``text_config``.

    >>> text_config({"model_type": "gemma3", "text_config": {"hidden_size": 64}})["model_type"]
    'gemma3_text'
    """
    return resolve_family(config)[1]


def family_defaults(family: str, present: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers defaults of ``family`` for the keys absent from ``present``.

    >>> family_defaults("gemma3_text", {"hidden_size": 5376})["vocab_size"]
    262208
    """
    found = _BY_MODEL_TYPE.get(family) or (
        (FAMILIES[family], False) if family in FAMILIES else None
    )
    if found is None:
        raise UnsupportedModelError(
            f"model_type {family!r} is not supported; supported families: "
            + ", ".join(SUPPORTED_FAMILIES)
        )
    out: dict[str, Any] = {}
    for name, field in found[0].schema.model_fields.items():
        names = field_names(name, field.validation_alias)
        if any(n in present for n in names) or names[0].startswith("_"):
            continue
        if field.default is not None:
            out[names[0]] = field.get_default(call_default_factory=True)
    return out
