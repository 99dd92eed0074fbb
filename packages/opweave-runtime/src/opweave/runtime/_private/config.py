"""Normalise a Hugging Face ``config.json`` into the few facts the operators need.

Real configs come in several generations: ``rope_theta`` + ``rope_scaling`` (transformers 4.x),
``rope_parameters`` (5.x, nested per layer type for Gemma 3), multimodal wrappers with a
``text_config``, and keys left out in favour of class defaults. Operators should not each re-derive
these, so this module resolves them once, with the defaults the transformers config classes use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opweave.costmodel import family_defaults

from ..errors import UnsupportedModelError

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma3_text",
    "qwen3_next",
)

# Fallbacks for keys a config may omit; they mirror the transformers config classes' defaults.
_DEFAULT_ROPE_THETA = {"mixtral": 1_000_000.0}
_DEFAULT_EPS = {"mixtral": 1e-5}
_DEFAULT_HEAD_DIM = {"qwen3": 128, "qwen3_next": 256, "gemma3_text": 256}
_DEFAULT_SLIDING = {"mistral": 4096, "gemma3_text": 4096}

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters of one layer type (after legacy keys are folded in)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts of a sparse layer (plus Qwen3-Next's always-on shared expert, if any)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class LinearAttnSpec:
    """Gated DeltaNet geometry (Qwen3-Next linear-attention layers)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelSpec:
    """Everything the runtime's operators read from a model config, resolved once."""

    family: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: Mapping[str, RopeSpec]
    attn_scale: float
    tie_word_embeddings: bool
    dtype: torch.dtype
    moe: MoeSpec | None = None
    moe_layers: frozenset[int] = frozenset()
    linear_attn: LinearAttnSpec | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def gemma_norms(self) -> bool:
        """Gemma-style RMSNorm: scale by ``1 + w`` and multiply in float32 before casting back."""
        return self.family in ("gemma3_text", "qwen3_next")

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 3 also normalises the attention and MLP outputs before each residual add."""
        return self.family == "gemma3_text"

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_next")

    @property
    def embed_scale(self) -> float | None:
        return self.hidden_size**0.5 if self.family == "gemma3_text" else None

    @property
    def attn_output_gate(self) -> bool:
        """Qwen3-Next's full attention multiplies its output by a sigmoid gate from ``q_proj``."""
        return self.family == "qwen3_next"

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def load_config(model: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Read ``config.json`` from a folder or file path; pass a dict through unchanged."""
    if isinstance(model, Mapping):
        return dict(model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    with path.open() as f:
        return json.load(f)


def parse_config(model: str | Path | Mapping[str, Any]) -> ModelSpec:
    """Resolve a Hugging Face config (dict, ``config.json`` or model folder) into a ModelSpec.

    >>> spec = parse_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    ...     "vocab_size": 512})
    >>> spec.head_dim, spec.layer_types
    (16, ('full_attention', 'full_attention'))
    """
    raw = load_config(model)
    if raw.get("model_type") == "gemma3" and "text_config" in raw:
        outer = raw
        raw = {**raw["text_config"], "model_type": "gemma3_text"}
        raw.setdefault("eos_token_id", outer.get("eos_token_id"))
        raw.setdefault("dtype", outer.get("dtype", outer.get("torch_dtype")))
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}"
        )
    # A saved config omits keys equal to transformers' defaults: fill them as the cost model does.
    raw = {**family_defaults(family, raw), **raw}

    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    num_layers = int(raw["num_hidden_layers"])
    head_dim = raw.get("head_dim") or _DEFAULT_HEAD_DIM.get(family) or hidden // heads
    layer_types = _layer_types(family, raw, num_layers)
    sliding = _sliding_window(family, raw)
    if sliding is None:
        layer_types = tuple(FULL if t == SLIDING else t for t in layer_types)

    if family == "gemma3_text":
        scale = float(raw.get("query_pre_attn_scalar", 256)) ** -0.5
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        tie = bool(raw.get("tie_word_embeddings", True))
        eps = float(raw.get("rms_norm_eps", 1e-6))
    else:
        scale = float(head_dim) ** -0.5
        act = raw.get("hidden_act", "silu")
        tie = bool(raw.get("tie_word_embeddings", False))
        eps = float(raw.get("rms_norm_eps", _DEFAULT_EPS.get(family, 1e-6)))

    moe, moe_layers = _moe(family, raw, num_layers)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ModelSpec(
        family=family,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=int(raw["vocab_size"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(raw.get("intermediate_size", 0)),
        rms_norm_eps=eps,
        hidden_act=act,
        layer_types=layer_types,
        sliding_window=sliding,
        rope=_rope(family, raw, set(layer_types)),
        attn_scale=scale,
        tie_word_embeddings=tie,
        dtype=_dtype(raw),
        moe=moe,
        moe_layers=moe_layers,
        linear_attn=_linear_attn(raw) if LINEAR in layer_types else None,
        attn_softcap=raw.get("attn_logit_softcapping") if family == "gemma3_text" else None,
        final_softcap=raw.get("final_logit_softcapping") if family == "gemma3_text" else None,
        eos_token_ids=eos_ids,
    )


def _dtype(raw: Mapping[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedModelError(f"unknown dtype {name!r} in config")
    return dtype


def _sliding_window(family: str, raw: Mapping[str, Any]) -> int | None:
    if family == "qwen3_next":
        return None
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window", _DEFAULT_SLIDING.get(family))
    return None if window is None else int(window)


def _layer_types(family: str, raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    given = raw.get("layer_types")
    if given:
        if len(given) != num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(given)} entries for {num_layers} layers"
            )
        unknown = set(given) - {FULL, SLIDING, LINEAR}
        if unknown:
            raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}")
        return tuple(given)
    if family == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if family == "qwen3_next":
        interval = int(raw.get("full_attention_interval", 4))
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))
    if family in ("qwen2", "qwen3"):
        first_sliding = int(raw.get("max_window_layers", 28))
        return tuple(SLIDING if i >= first_sliding else FULL for i in range(num_layers))
    # Mistral, Mixtral and Qwen3-MoE apply their window (if any) to every layer.
    return (SLIDING,) * num_layers


def _rope(family: str, raw: Mapping[str, Any], layer_types: set[str]) -> dict[str, RopeSpec]:
    """One RopeSpec per attention layer type, folding legacy ``rope_theta``/``rope_scaling`` in."""
    params = raw.get("rope_parameters") or {}
    nested = {k: v for k, v in params.items() if k in (FULL, SLIDING)}
    partial = raw.get("partial_rotary_factor", 0.25 if family == "qwen3_next" else None)
    if family == "gemma3_text":
        # Legacy Gemma 3 configs scale only the global layers' RoPE (e.g. linear x8 on 27B).
        full = dict(nested.get(FULL) or {"rope_type": "default", **(raw.get("rope_scaling") or {})})
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local = dict(nested.get(SLIDING) or {"rope_type": "default"})
        local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
        per_type = {FULL: full, SLIDING: local}
    else:
        flat = dict(params or raw.get("rope_scaling") or {})
        flat.setdefault(
            "rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA.get(family, 10_000.0))
        )
        per_type = {FULL: flat, SLIDING: flat}
    out = {}
    for kind, p in per_type.items():
        if kind not in layer_types:
            continue
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} is not implemented (default, linear, llama3 are)"
            )
        out[kind] = RopeSpec(
            theta=float(p["rope_theta"]),
            rope_type=rope_type,
            factor=float(p.get("factor", 1.0)),
            low_freq_factor=float(p.get("low_freq_factor", 1.0)),
            high_freq_factor=float(p.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                p.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
            ),
            partial_rotary_factor=float(p.get("partial_rotary_factor", partial or 1.0)),
        )
    return out


def _moe(
    family: str, raw: Mapping[str, Any], num_layers: int
) -> tuple[MoeSpec | None, frozenset[int]]:
    if family == "mixtral":
        spec = MoeSpec(
            num_experts=int(raw.get("num_local_experts", 8)),
            top_k=int(raw.get("num_experts_per_tok", 2)),
            intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
        return spec, frozenset(range(num_layers))
    if family not in ("qwen3_moe", "qwen3_next"):
        return None, frozenset()
    # transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`; released configs
    # say `num_experts`.
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    layers = frozenset(
        i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    spec = MoeSpec(
        num_experts=num_experts,
        top_k=int(raw.get("num_experts_per_tok", 8)),
        intermediate_size=int(raw.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", family == "qwen3_next")),
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0))
        if family == "qwen3_next"
        else 0,
    )
    return (spec if layers else None), layers


def _linear_attn(raw: Mapping[str, Any]) -> LinearAttnSpec:
    return LinearAttnSpec(
        num_k_heads=int(raw.get("linear_num_key_heads", 16)),
        num_v_heads=int(raw.get("linear_num_value_heads", 32)),
        k_head_dim=int(raw.get("linear_key_head_dim", 128)),
        v_head_dim=int(raw.get("linear_value_head_dim", 128)),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
    )
