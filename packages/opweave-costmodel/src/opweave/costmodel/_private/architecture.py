"""What a decoder computes, read once from a Hugging Face config: :class:`Architecture`.

The cost model's operators (bytes, FLOPs, state) and the runtime's operators (the numerics) are
built from this one description, so the two can never disagree about a model. Every field is
type- and range-checked where it is read: a malformed config fails here with
``<field>: <what is wrong>``, never later inside an operator.

Hugging Face saves only the keys that differ from its config class's defaults, so a missing key
takes that class's default (transformers 5.x, ``configuration_<family>.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError, UnsupportedModelError
from .base import Frozen

LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
FULL: LayerType = "full_attention"
SLIDING: LayerType = "sliding_attention"
LINEAR: LayerType = "linear_attention"

SUPPORTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma3",
    "gemma3_text",
    "qwen3_next",
    "gpt_oss",
)

# Bounds far beyond any released model; past them a config is a typo or an attack, and a
# 10^12-expert model would only exhaust memory further down.
_MAX_LAYERS = 10_000
_MAX_WIDTH = 1 << 20  # hidden, intermediate, head dims
_MAX_HEADS = 1 << 14
_MAX_VOCAB = 1 << 24
_MAX_EXPERTS = 1 << 16
_MAX_CONTEXT = 1 << 31

# Defaults of the transformers config classes for the keys read here.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        hidden_act="silu",
        sliding_window=4096,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        hidden_act="silu",
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=True,  # Qwen2 always biases q/k/v (and never o)
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        hidden_act="silu",
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        hidden_act="silu",
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=False,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        hidden_act="silu",
        num_experts_per_tok=2,
        num_local_experts=8,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        attention_bias=False,
        tie_word_embeddings=True,
    ),
    "qwen3_next": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        hidden_act="silu",
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        decoder_sparse_step=1,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts_per_tok=10,
        num_experts=512,
        norm_topk_prob=True,
        mlp_only_layers=[],
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "gpt_oss": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=150_000.0,
        hidden_act="silu",
        sliding_window=128,
        num_local_experts=128,
        num_experts_per_tok=4,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
}

# Keys that name the same thing in different transformers versions: a default for one must not
# shadow a value given under the other.
_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}
_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


class RopeSpec(Frozen):
    """Rotary embedding of one attention layer type, legacy keys folded in."""

    # Values come straight from a config file: no string-to-number coercion, no NaN or inf.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    theta: float = Field(gt=0)
    rope_type: str = "default"
    factor: float = Field(default=1.0, gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, ge=1, le=_MAX_CONTEXT)
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _llama3_band(self) -> RopeSpec:
        # Llama 3.1 blends frequencies over (high - low); equal factors would divide by zero.
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self


class LinearAttentionSpec(Frozen):
    """Gated DeltaNet geometry (Qwen3-Next's linear-attention layers)."""

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


class ExpertsSpec(Frozen):
    """Routed experts of the sparse layers (plus Qwen3-Next's always-on shared expert)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0


class Architecture(Frozen):
    """Everything a decode step computes, resolved from a config once.

    >>> arch = resolve_architecture({"model_type": "llama", "hidden_size": 64,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "intermediate_size": 128, "vocab_size": 512})
    >>> arch.head_dim, arch.layer_types
    (16, ('full_attention', 'full_attention'))
    """

    family: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    layer_types: tuple[LayerType, ...]
    sliding_window: int | None = Field(description="Window of the sliding layers, if any.")
    rope: dict[str, RopeSpec] = Field(description="Per attention layer type that has RoPE.")
    attn_scale: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    moe: ExpertsSpec | None = None
    moe_layers: tuple[int, ...] = ()
    linear_attn: LinearAttentionSpec | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    quant_method: str | None = None
    dtype: str = Field(description="Storage dtype of the weights (config's dtype).")
    eos_token_ids: tuple[int, ...] = ()

    @property
    def gemma_norms(self) -> bool:
        """Gemma-style RMSNorm: scale by ``1 + w`` in float32 before casting back."""
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

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: multimodal Gemma-3 nests it under ``text_config``."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json must hold a JSON object")
    if config.get("model_type") != "gemma3":
        return dict(config)
    inner = config.get("text_config", {})
    if not isinstance(inner, Mapping):
        raise ConfigError(f"text_config: expected an object, got {_show(inner)}")
    text = dict(inner)
    text.setdefault("model_type", "gemma3_text")
    for key in ("torch_dtype", "dtype", "tie_word_embeddings", "eos_token_id"):
        if key in config and key not in text:
            text[key] = config[key]
    return text


def family_defaults(family: str, present: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers defaults of ``family`` for the keys absent from ``present``.

    >>> family_defaults("gemma3_text", {"hidden_size": 5376})["vocab_size"]
    262208
    """
    if family not in DEFAULTS:
        raise UnsupportedModelError(
            f"model_type {family!r} is not supported; supported families: "
            + ", ".join(SUPPORTED_FAMILIES)
        )
    return {
        k: v
        for k, v in DEFAULTS[family].items()
        if k not in present and _ALIASES.get(k) not in present
    }


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """A family's config with its defaults; each getter checks type and range of one key."""

    def __init__(self, family: str, raw: Mapping[str, Any]) -> None:
        self.family = family
        self.raw = raw

    def present(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def value(self, key: str, default: Any = None) -> Any:
        if key in self.raw:
            return self.raw[key]
        return DEFAULTS[self.family].get(key, default)

    def int(self, key: str, *, low: int = 1, high: int = _MAX_WIDTH, default: Any = ...) -> int:
        value = self.value(key, None if default is ... else default)
        if value is None and default is ...:
            raise ConfigError(f"{key}: missing; add it to config.json")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {_show(value)}")
        if not low <= value <= high:
            raise ConfigError(f"{key}: {value} is out of range ({low}..{high})")
        return value

    def opt_int(self, key: str, *, low: int = 1, high: int = _MAX_WIDTH) -> int | None:
        return self.int(key, low=low, high=high) if self.value(key) is not None else None

    def float(self, key: str, *, positive: bool = True, default: Any = ...) -> float:
        value = self.value(key, None if default is ... else default)
        if value is None and default is ...:
            raise ConfigError(f"{key}: missing; add it to config.json")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {_show(value)}")
        value = float(value)
        if not math.isfinite(value) or (positive and value <= 0):
            raise ConfigError(f"{key}: expected a finite positive number, got {value!r}")
        return value

    def opt_float(self, key: str) -> float | None:
        return self.float(key) if self.value(key) is not None else None

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.value(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_show(value)}")
        return value

    def str(self, key: str, default: str) -> str:
        value = self.value(key, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_show(value)}")
        return value

    def int_list(self, key: str, *, high: int) -> list[int]:
        value = self.value(key, [])
        if value is None:
            return []
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= high for v in value
        ):
            raise ConfigError(
                f"{key}: expected a list of integers in 0..{high}, got {_show(value)}"
            )
        return list(value)

    def obj(self, key: str) -> dict[str, Any]:
        value = self.value(key, None)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected an object, got {_show(value)}")
        return dict(value)


def resolve_architecture(config: Mapping[str, Any], *, dtype: str | None = None) -> Architecture:
    """Read a Hugging Face config (multimodal Gemma 3 included) into an :class:`Architecture`."""
    text = text_config(config)
    family = text.get("model_type")
    if not isinstance(family, str) or family not in DEFAULTS:
        raise UnsupportedModelError(
            f"model_type {family!r} is not supported; supported families: "
            + ", ".join(SUPPORTED_FAMILIES)
        )
    f = _Fields(family, text)
    hidden = f.int("hidden_size")
    num_layers = f.int("num_hidden_layers", high=_MAX_LAYERS)
    heads = f.int("num_attention_heads", high=_MAX_HEADS)
    kv_heads = f.opt_int("num_key_value_heads", high=_MAX_HEADS) or heads
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads: {heads} is not a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = f.opt_int("head_dim") or hidden // heads
    if head_dim < 1:
        raise ConfigError(f"head_dim: hidden_size {hidden} / {heads} heads leaves no head dim")
    vocab = f.int("vocab_size", high=_MAX_VOCAB)
    layer_types, window = _layers(f, num_layers)
    moe, moe_layers = _experts(f, num_layers)
    inter = f.int("intermediate_size", low=0 if moe_layers else 1, default=0)
    if len(moe_layers) < num_layers and inter < 1:
        raise ConfigError("intermediate_size: dense feed-forward layers need a positive size")
    gemma = family == "gemma3_text"
    quant = f.obj("quantization_config").get("quant_method")
    return Architecture(
        family=family,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        max_position_embeddings=f.int("max_position_embeddings", high=_MAX_CONTEXT),
        rms_norm_eps=f.float("rms_norm_eps"),
        hidden_act=(
            f.str("hidden_activation", f.str("hidden_act", "gelu_pytorch_tanh"))
            if gemma
            else f.str("hidden_act", "silu")
        ),
        layer_types=layer_types,
        sliding_window=window,
        rope=_rope(f, set(layer_types)),
        attn_scale=(f.float("query_pre_attn_scalar") if gemma else float(head_dim)) ** -0.5,
        tie_word_embeddings=f.bool("tie_word_embeddings"),
        qkv_bias=family == "qwen2" or f.bool("attention_bias"),
        o_bias=family != "qwen2" and f.bool("attention_bias"),
        mlp_bias=f.bool("mlp_bias"),
        moe=moe,
        moe_layers=moe_layers,
        linear_attn=_linear_attention(f) if LINEAR in layer_types else None,
        attn_softcap=f.opt_float("attn_logit_softcapping") if gemma else None,
        final_softcap=f.opt_float("final_logit_softcapping") if gemma else None,
        quant_method=quant if isinstance(quant, str) else None,
        dtype=_dtype(text, dtype),
        eos_token_ids=_eos(text, vocab),
    )


def _dtype(text: Mapping[str, Any], override: str | None) -> str:
    name = override or text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"dtype: {name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return name


def _eos(text: Mapping[str, Any], vocab: int) -> tuple[int, ...]:
    eos = text.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"eos_token_id: expected token ids, got {_show(eos)}")
    outside = [i for i in ids if i >= vocab]
    if outside:
        raise ConfigError(
            f"eos_token_id: {outside[0]} is outside the vocabulary (vocab_size {vocab})"
        )
    return tuple(ids)


def _layers(f: _Fields, n: int) -> tuple[tuple[LayerType, ...], int | None]:
    """Each layer's attention type, and the window of the sliding ones (None: no window)."""
    family = f.family
    window = f.opt_int("sliding_window", high=_MAX_CONTEXT)
    if family == "qwen3_next":
        window = None
    if family in ("qwen2", "qwen3", "qwen3_moe") and not f.bool("use_sliding_window"):
        window = None
    given = f.value("layer_types")
    if given is not None:
        if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
            raise ConfigError(f"layer_types: expected a list of strings, got {_show(given)}")
        if len(given) != n:
            raise ConfigError(f"layer_types: {len(given)} entries for {n} layers")
        unknown = sorted(set(given) - {FULL, SLIDING, LINEAR})
        if unknown:
            raise ConfigError(f"layer_types: unknown types {unknown}")
        types: list[LayerType] = list(given)  # type: ignore[arg-type]
    elif family == "gemma3_text":
        key = "sliding_window_pattern" if f.present("sliding_window_pattern") else None
        pattern = (
            f.int(key, high=_MAX_LAYERS)
            if key
            else f.int("_sliding_window_pattern", high=_MAX_LAYERS, default=6)
        )
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    elif family == "qwen3_next":
        interval = f.int("full_attention_interval", high=_MAX_LAYERS)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    elif family == "gpt_oss":
        types = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        first = f.int("max_window_layers", low=0, high=_MAX_LAYERS)
        types = [SLIDING if i >= first else FULL for i in range(n)]
    else:  # Mistral and Mixtral apply their window (if any) to every layer.
        types = [SLIDING] * n
    if LINEAR in types and family != "qwen3_next":
        raise ConfigError(f"layer_types: {family} has no linear-attention layers")
    if window is None:
        types = [FULL if t == SLIDING else t for t in types]
    return tuple(types), window if SLIDING in types else None


def _rope(f: _Fields, layer_types: set[str]) -> dict[str, RopeSpec]:
    """One RopeSpec per attention layer type, folding legacy ``rope_theta``/``rope_scaling`` in."""
    params = f.obj("rope_parameters")
    nested = {k: v for k, v in params.items() if k in (FULL, SLIDING)}
    for kind, value in nested.items():
        if not isinstance(value, Mapping):
            raise ConfigError(f"rope_parameters.{kind}: expected an object, got {_show(value)}")
    partial = f.value("partial_rotary_factor")
    if f.family == "gemma3_text":
        # Legacy Gemma 3 configs scale only the global layers' RoPE (e.g. linear x8 on 27B).
        full: dict[str, Any] = dict(
            nested.get(FULL) or {"rope_type": "default", **f.obj("rope_scaling")}
        )
        full.setdefault("rope_theta", f.float("rope_theta"))
        local: dict[str, Any] = dict(nested.get(SLIDING) or {"rope_type": "default"})
        local.setdefault("rope_theta", f.float("rope_local_base_freq"))
        per_type: dict[str, dict[str, Any]] = {FULL: full, SLIDING: local}
    else:
        flat = dict(params or f.obj("rope_scaling"))
        flat.setdefault("rope_theta", f.float("rope_theta"))
        per_type = {FULL: flat, SLIDING: flat}
    out = {}
    for kind, p in per_type.items():
        if kind not in layer_types:
            continue
        rope_type = p.get("rope_type", p.get("type", "default"))
        try:
            out[kind] = RopeSpec(
                theta=p["rope_theta"],
                rope_type=rope_type,
                factor=p.get("factor", 1.0),
                low_freq_factor=p.get("low_freq_factor", 1.0),
                high_freq_factor=p.get("high_freq_factor", 4.0),
                original_max_position_embeddings=p.get(
                    "original_max_position_embeddings",
                    f.int("max_position_embeddings", high=_MAX_CONTEXT),
                ),
                partial_rotary_factor=p.get("partial_rotary_factor", partial or 1.0),
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            key = _ROPE_KEYS.get(field, field)
            section = "rope_parameters" if params else "rope_scaling"
            where = key if key in ("rope_theta", "rope_local_base_freq") else f"{section}.{key}"
            where = where.rstrip(".") if key else section
            raise ConfigError(f"{where} ({kind} layers): {first['msg']}") from None
    return out


# RopeSpec field -> the config key it comes from
_ROPE_KEYS = {"theta": "rope_theta"}


def _experts(f: _Fields, n: int) -> tuple[ExpertsSpec | None, tuple[int, ...]]:
    family = f.family
    if family not in ("qwen3_moe", "qwen3_next", "mixtral", "gpt_oss"):
        return None, ()
    # transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`; released configs
    # say `num_experts`.
    key = next(
        (k for k in ("num_experts", "num_local_experts") if f.present(k)),
        "num_experts" if "num_experts" in DEFAULTS[family] else "num_local_experts",
    )
    experts = f.int(key, low=0, high=_MAX_EXPERTS)
    if family in ("mixtral", "gpt_oss"):
        layers = tuple(range(n)) if experts else ()
    else:
        step = f.int("decoder_sparse_step", high=_MAX_LAYERS)
        dense = set(f.int_list("mlp_only_layers", high=_MAX_LAYERS))
        layers = tuple(i for i in range(n) if experts and i not in dense and (i + 1) % step == 0)
    if not layers:
        return None, ()
    top_k = f.int("num_experts_per_tok", high=_MAX_EXPERTS)
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {experts} experts")
    moe_inter = family in ("qwen3_moe", "qwen3_next")
    spec = ExpertsSpec(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=f.int("moe_intermediate_size" if moe_inter else "intermediate_size"),
        norm_topk_prob=family == "mixtral" or f.bool("norm_topk_prob"),
        shared_intermediate_size=(
            f.int("shared_expert_intermediate_size", low=0) if family == "qwen3_next" else 0
        ),
    )
    return spec, layers


def _linear_attention(f: _Fields) -> LinearAttentionSpec:
    nk = f.int("linear_num_key_heads", high=_MAX_HEADS)
    nv = f.int("linear_num_value_heads", high=_MAX_HEADS)
    if nv % nk:
        raise ConfigError(
            f"linear_num_value_heads: {nv} is not a multiple of linear_num_key_heads ({nk})"
        )
    return LinearAttentionSpec(
        num_k_heads=nk,
        num_v_heads=nv,
        k_head_dim=f.int("linear_key_head_dim"),
        v_head_dim=f.int("linear_value_head_dim"),
        conv_kernel=f.int("linear_conv_kernel_dim", high=1024),
    )
