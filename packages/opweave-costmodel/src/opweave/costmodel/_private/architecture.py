"""What a decoder computes, read once from a Hugging Face config: :class:`Architecture`.

The cost model's operators (bytes, FLOPs, state) and the runtime's operators (the numerics) are
built from this one description, so the two can never disagree about a model. The config is
checked key by key against its family's schema (``family_schemas.py``): a malformed config fails
here with ``<field>: <what is wrong>``, never later inside an operator. What the layers do comes
from the family's flags (``registry.py``), and is recorded here as fields the operators read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError, validation_message
from .base import Frozen
from .config_fields import MAX_CONTEXT, defaulted_sizes, parse_config, show
from .registry import Family, resolve_family

LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
FULL: LayerType = "full_attention"
SLIDING: LayerType = "sliding_attention"
LINEAR: LayerType = "linear_attention"

_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
# a recurrent state's dtypes (vLLM's MambaDType less "auto", config/cache.py)
_STATE_DTYPES = ("float32", "float16", "bfloat16")


# RoPE variants of transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py), and mrope, the
# legacy type of Qwen2-VL's configs that vLLM reads (get_rope): they change positions' angles,
# never a step's cost, so the cost model takes each; the runtime implements some (its rope.py)
KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "mrope")


class RopeSpec(Frozen):
    """Rotary embedding of one attention layer type, legacy keys folded in."""

    # Values come straight from a config file: no string-to-number coercion, no NaN or inf.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    theta: float = Field(gt=0)
    rope_type: str = "default"
    factor: float = Field(default=1.0, gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, ge=1, le=MAX_CONTEXT)
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1)
    # YaRN (DeepSeek-V3, Kimi-K2): frequency band edges and the attention-scale correction
    beta_fast: float = Field(default=32.0, gt=0)
    beta_slow: float = Field(default=1.0, gt=0)
    mscale: float = Field(default=1.0, ge=0)
    mscale_all_dim: float = Field(default=0.0, ge=0)
    truncate: bool = Field(
        default=True, description="YaRN rounds its ramp's band edges outwards (gpt-oss: false)."
    )
    attention_factor: float | None = Field(
        default=None,
        gt=0,
        description="What YaRN multiplies cos and sin by, as given (transformers' "
        "attention_factor); None: from factor, mscale and mscale_all_dim.",
    )

    @field_validator("rope_type")
    @classmethod
    def _known_type(cls, rope_type: str) -> str:
        if rope_type not in KNOWN_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is none that transformers or vLLM know "
                f"({', '.join(KNOWN_ROPE_TYPES)})"
            )
        return rope_type

    @model_validator(mode="after")
    def _llama3_band(self) -> RopeSpec:
        # Llama 3.1 blends frequencies over (high - low); equal factors would divide by zero.
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self

    @property
    def yarn_attention_mscale(self) -> float:
        """YaRN's softmax-scale correction ``0.1 * mscale_all_dim * ln(factor) + 1`` (1 without
        YaRN scaling): DeepSeek multiplies the attention scale by its square (vLLM
        ``deepseek_v2.py`` ``yarn_get_mscale``; transformers ``modeling_deepseek_v3.py``)."""
        if self.rope_type != "yarn" or self.factor <= 1:
            return 1.0
        return 0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0


class LinearAttentionSpec(Frozen):
    """Gated DeltaNet geometry (Qwen3-Next's and Qwen3.5's linear-attention layers)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    state_dtype: str | None = Field(
        default=None,
        description="Dtype of the recurrent state when the config names one (Qwen3.5's "
        "mamba_ssm_dtype); None: the model's dtype. The conv window is in the model's dtype.",
    )
    split_projections: bool = Field(
        default=False,
        description="The checkpoint holds the input projections as four linears "
        "(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: Qwen3.5) rather than two fused ones "
        "(in_proj_qkvz, in_proj_ba: Qwen3-Next).",
    )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class MLASpec(Frozen):
    """Multi-head latent attention geometry (DeepSeek-V2 paper, arXiv:2405.04434, §2.1)."""

    q_lora_rank: int | None = Field(description="Query down-projection rank; None: q_proj.")
    kv_lora_rank: int = Field(description="Width of the compressed KV latent c_KV.")
    qk_nope_head_dim: int
    qk_rope_head_dim: int = Field(description="Width of the decoupled RoPE key (one per token).")
    v_head_dim: int
    rope_interleave: bool = Field(
        default=True,
        description="RoPE rotates adjacent channel pairs (DeepSeek's checkpoints), not halves.",
    )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values a token caches per layer: the latent and the rope key, shared by all heads."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class ExpertsSpec(Frozen):
    """Routed experts of the sparse layers, their router and any always-on shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = Field(
        default=False, description="A sigmoid gate scales the shared expert (Qwen3-Next)."
    )
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"
    num_groups: int = Field(default=1, description="Expert groups of group-limited routing.")
    topk_groups: int = Field(default=1, description="Groups a token may route into.")
    score_correction_bias: bool = Field(
        default=False, description="A per-expert bias added to the scores for selection only."
    )
    routed_scaling_factor: float = 1.0
    routing_weights_fp32: bool = Field(
        default=False, description="Routing weights stay float32 (Mixtral); else model dtype."
    )
    router_bias: bool = False
    expert_bias: bool = False
    experts_in_out: bool = Field(
        default=False,
        description="Checkpoints may store the fused experts as [E, in, out] (Qwen3-VL-MoE's "
        "released files; transformers transposes them on load) as well as [E, out, in].",
    )
    swiglu_limit: float | None = Field(
        default=None,
        description="gpt-oss's clamped SwiGLU: gate clamped above, up on both sides at this.",
    )
    swiglu_alpha: float = Field(
        default=1.0, description="gpt-oss's SwiGLU: gate * sigmoid(alpha * gate) * (up + 1)."
    )


class SparseIndexSpec(Frozen):
    """DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer scores every
    cached token with ``index_n_heads`` small heads of ``index_head_dim`` over its own key cache,
    and MLA attends only the ``index_topk`` best (DeepSeek-V3.2-Exp report, arXiv:2512.02556;
    ``DeepseekV32Indexer`` in transformers)."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_layers: tuple[int, ...] = Field(
        description="Layers that run an indexer of their own (the others reuse another "
        "layer's selection: GLM-5.2's 'shared' indexer_types)."
    )


class Architecture(Frozen):
    """Everything a decode step computes, resolved from a config once.

    >>> arch = resolve_architecture({"model_type": "llama", "hidden_size": 64,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "intermediate_size": 128, "vocab_size": 512})
    >>> arch.head_dim, arch.layer_types
    (16, ('full_attention', 'full_attention'))
    """

    family: str = Field(description="The registry family the config resolved to.")
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = Field(description="Query/key head width (MLA: nope + rope dims).")
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
    qk_norm: bool = Field(default=False, description="RMSNorm on queries and keys.")
    qk_norm_per_layer: bool = Field(
        default=False,
        description="The q/k norms span all heads of the layer (MiniMax-M2), not one head.",
    )
    gemma_norms: bool = Field(
        default=False, description="RMSNorm scales by 1 + w in float32 before casting back."
    )
    sandwich_norms: bool = Field(
        default=False,
        description="The attention and MLP outputs are normalised before each residual add.",
    )
    embed_scale: float | None = Field(default=None, description="Embeddings times this.")
    attn_output_gate: bool = Field(
        default=False, description="Full attention's output times a sigmoid gate from q_proj."
    )
    attn_sinks: bool = Field(default=False, description="A learned sink logit per head.")
    mla: MLASpec | None = None
    sparse_index: SparseIndexSpec | None = None
    moe: ExpertsSpec | None = None
    moe_layers: tuple[int, ...] = ()
    linear_attn: LinearAttentionSpec | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    quant_method: str | None = None
    dtype: str = Field(description="Storage dtype of the weights (config's dtype).")
    eos_token_ids: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def config_defaults(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The sizes a (text) config leaves to its family's transformers defaults, as
    ``key=value``: what :func:`resolve_architecture` read without the config saying so."""
    family, text = resolve_family(config)
    return defaulted_sizes(parse_config(family.schema, text))


def resolve_architecture(config: Mapping[str, Any], *, dtype: str | None = None) -> Architecture:
    """Read a Hugging Face config (multimodal wrappers included) into an :class:`Architecture`."""
    family, text = resolve_family(config)
    # the family's schema: its keys vary by family, which its flags say how to read
    cfg: Any = parse_config(family.schema, text)
    flags = family.flags
    hidden = cfg.hidden_size
    num_layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads or heads
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads: {heads} is not a multiple of num_key_value_heads ({kv_heads})"
        )
    mla = _mla(cfg) if flags.attention == "mla" else None
    head_dim = mla.qk_head_dim if mla is not None else cfg.head_dim or hidden // heads
    if head_dim < 1:
        raise ConfigError(f"head_dim: hidden_size {hidden} / {heads} heads leaves no head dim")
    vocab = cfg.vocab_size
    layer_types, window = _layers(family, cfg, num_layers)
    moe, moe_layers = _experts(family, cfg, num_layers)
    inter = cfg.intermediate_size
    if len(moe_layers) < num_layers and inter < 1:
        raise ConfigError("intermediate_size: dense feed-forward layers need a positive size")
    quant = cfg.quantization_config.get("quant_method")
    rope = _rope(family, cfg, set(layer_types), head_dim)
    if flags.scale_from_query_pre_attn_scalar:
        attn_scale = cfg.query_pre_attn_scalar**-0.5
    else:
        yarn = max((r.yarn_attention_mscale for r in rope.values()), default=1.0)
        attn_scale = float(head_dim) ** -0.5 * (yarn * yarn if mla is not None else 1.0)
    qkv_only = flags.qkv_bias == "qkv_only"
    # biases on q, k and v as the config says, never on o (GLM-4.5)
    qkv_as_config = flags.qkv_bias == "qkv_if_attention_bias"
    return Architecture(
        family=family.name,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act=(
            cfg.hidden_activation or cfg.hidden_act
            if flags.activation_key == "hidden_activation"
            else cfg.hidden_act
        ),
        layer_types=layer_types,
        sliding_window=window,
        rope=rope,
        attn_scale=attn_scale,
        tie_word_embeddings=cfg.tie_word_embeddings,
        qkv_bias=qkv_only or cfg.attention_bias,
        o_bias=not (qkv_only or qkv_as_config) and cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        qk_norm=flags.qk_norm in ("per_head", "per_layer")
        or (flags.qk_norm == "use_qk_norm" and cfg.use_qk_norm),
        qk_norm_per_layer=flags.qk_norm == "per_layer",
        gemma_norms=flags.gemma_norms,
        sandwich_norms=flags.sandwich_norms,
        embed_scale=hidden**0.5 if flags.embed_scale else None,
        attn_output_gate=(
            flags.attn_output_gate == "always"
            or (flags.attn_output_gate == "config" and cfg.attn_output_gate)
        ),
        attn_sinks=flags.attn_sinks,
        mla=mla,
        sparse_index=_sparse_index(cfg, num_layers) if flags.sparse_index else None,
        moe=moe,
        moe_layers=moe_layers,
        linear_attn=(
            _linear_attention(cfg, family.checkpoint.gdn_split_projections)
            if LINEAR in layer_types
            else None
        ),
        attn_softcap=cfg.attn_logit_softcapping if flags.logit_softcapping else None,
        final_softcap=cfg.final_logit_softcapping if flags.logit_softcapping else None,
        quant_method=quant if isinstance(quant, str) else None,
        dtype=_dtype(text, dtype),
        eos_token_ids=_eos(text, vocab),
    )


def _dtype(text: Mapping[str, Any], override: str | None) -> str:
    for key in ("torch_dtype", "dtype"):
        value = text.get(key)
        if value is not None and not (isinstance(value, str) and value):
            # 0, false, "" or [] read as "unset" and were costed as bfloat16
            raise ConfigError(f"{key}: expected a dtype's name, e.g. bfloat16, got {show(value)}")
    name = override or text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"dtype: {name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return name


def _eos(text: Mapping[str, Any], vocab: int) -> tuple[int, ...]:
    eos = text.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"eos_token_id: expected token ids, got {show(eos)}")
    outside = [i for i in ids if i >= vocab]
    if outside:
        given = "" if "vocab_size" in text else ", transformers' default: the config gives none"
        raise ConfigError(
            f"eos_token_id: {outside[0]} is outside the vocabulary (vocab_size {vocab}{given})"
        )
    return tuple(ids)


def _layers(family: Family, cfg: Any, n: int) -> tuple[tuple[LayerType, ...], int | None]:
    """Each layer's attention type, and the window of the sliding ones (None: no window)."""
    flags = family.flags
    window = cfg.sliding_window if flags.reads_sliding_window else None
    if flags.window_needs_use_sliding_window and not cfg.use_sliding_window:
        window = None
    given = cfg.layer_types
    if given is not None and flags.sparse_index:
        # transformers 5 names GLM-5's layers by their attention: DSA over full attention
        given = [FULL if t == "deepseek_sparse_attention" else t for t in given]
    if given is not None:
        if len(given) != n:
            raise ConfigError(f"layer_types: {len(given)} entries for {n} layers")
        unknown = sorted(set(given) - {FULL, SLIDING, LINEAR})
        if unknown:
            raise ConfigError(f"layer_types: unknown types {unknown}")
        types: list[LayerType] = list(given)  # type: ignore[arg-type]
    elif flags.layer_pattern == "every_nth_full":
        given_pattern = "sliding_window_pattern" in cfg.model_fields_set
        pattern = (given_pattern and cfg.sliding_window_pattern) or (
            cfg.legacy_sliding_window_pattern
        )
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    elif flags.layer_pattern == "full_every_interval":
        interval = cfg.full_attention_interval
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    elif flags.layer_pattern == "alternating":
        types = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    elif flags.layer_pattern == "max_window_layers":
        first = cfg.max_window_layers
        types = [SLIDING if i >= first else FULL for i in range(n)]
    else:  # the window (if any) applies to every layer (Mistral, Mixtral)
        types = [SLIDING] * n
    if LINEAR in types and not flags.linear_attention:
        raise ConfigError(f"layer_types: {family.name} has no linear-attention layers")
    if window is None:
        types = [FULL if t == SLIDING else t for t in types]
    return tuple(types), window if SLIDING in types else None


def _rope(family: Family, cfg: Any, layer_types: set[str], head_dim: int) -> dict[str, RopeSpec]:
    """One RopeSpec per attention layer type, folding legacy ``rope_theta``/``rope_scaling`` in."""
    params = cfg.rope_parameters
    nested = {k: v for k, v in params.items() if k in (FULL, SLIDING)}
    for kind, value in nested.items():
        if not isinstance(value, Mapping):
            raise ConfigError(f"rope_parameters.{kind}: expected an object, got {show(value)}")
    partial = cfg.partial_rotary_factor
    if partial is not None and not (
        isinstance(partial, int | float)
        and not isinstance(partial, bool)
        and math.isfinite(partial)
        and 0 < partial <= 1
    ):
        raise ConfigError(
            f"partial_rotary_factor: expected a number in (0, 1], got {show(partial)}"
        )
    rotary_dim = getattr(cfg, "rotary_dim", None)
    own = family.schema.model_fields["partial_rotary_factor"].default is not None
    if not own and family.flags.attention != "mla" and rotary_dim is None:
        given = [partial, *(v.get("partial_rotary_factor") for v in (params, *nested.values()))]
        part = next((f for f in given if f is not None and f != 1), None)
        if part is not None:
            raise ConfigError(
                f"partial_rotary_factor: {family.name} models rotate the whole head (as "
                f"transformers implements them); a factor of {show(part)} is not supported"
            )
    if partial is None and rotary_dim is not None:
        # MiniMax-M2 rotates the first rotary_dim channels of each head (vLLM minimax_m2.py)
        partial = rotary_dim / head_dim
    if family.flags.attention == "mla":
        # MLA rotates only the decoupled rope part of each query/key head
        partial = cfg.qk_rope_head_dim / head_dim
    if family.flags.local_rope:
        # Legacy Gemma 3 configs scale only the global layers' RoPE (e.g. linear x8 on 27B).
        full: dict[str, Any] = dict(
            nested.get(FULL) or {"rope_type": "default", **cfg.rope_scaling}
        )
        full.setdefault("rope_theta", cfg.rope_theta)
        local: dict[str, Any] = dict(nested.get(SLIDING) or {"rope_type": "default"})
        local.setdefault("rope_theta", cfg.rope_local_base_freq)
        per_type: dict[str, dict[str, Any]] = {FULL: full, SLIDING: local}
    else:
        flat = dict(params or cfg.rope_scaling)
        flat.setdefault("rope_theta", cfg.rope_theta)
        per_type = {FULL: flat, SLIDING: flat}
    out = {}
    for kind, p in per_type.items():
        if kind not in layer_types:
            continue
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type in _NEEDS_FACTOR and "factor" not in p:
            # transformers' rope validation requires it: the scaling has no default
            section = "rope_parameters" if params else "rope_scaling"
            raise ConfigError(f"{section} ({kind} layers): rope_type {rope_type!r} needs a factor")
        try:
            out[kind] = RopeSpec(
                theta=p["rope_theta"],
                rope_type=rope_type,
                factor=p.get("factor", 1.0),
                low_freq_factor=p.get("low_freq_factor", 1.0),
                high_freq_factor=p.get("high_freq_factor", 4.0),
                original_max_position_embeddings=p.get(
                    "original_max_position_embeddings", cfg.max_position_embeddings
                ),
                partial_rotary_factor=p.get("partial_rotary_factor", partial or 1.0),
                **{k: p[k] for k in _YARN_KEYS if k in p},
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            key = _ROPE_KEYS.get(field, field)
            section = "rope_parameters" if params else "rope_scaling"
            where = key if key in ("rope_theta", "rope_local_base_freq") else f"{section}.{key}"
            where = where.rstrip(".") if key else section
            message = validation_message(first)
            raise ConfigError(f"{where} ({kind} layers): {message}") from None
    return out


# the RoPE types whose parameters require a scaling factor (transformers' modeling_rope_utils,
# each type's _validate_*_parameters: required_keys)
_NEEDS_FACTOR = ("linear", "dynamic", "yarn", "llama3")
# RopeSpec field -> the config key it comes from
_ROPE_KEYS = {"theta": "rope_theta"}
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor")


def _experts(family: Family, cfg: Any, n: int) -> tuple[ExpertsSpec | None, tuple[int, ...]]:
    flags = family.flags
    if flags.moe == "none":
        return None, ()
    experts = cfg.num_experts
    if not experts:
        if flags.moe == "sparse_step":  # transformers' and vLLM's Qwen MoE: no experts, dense
            return None, ()
        # every other family builds its MoE layers whatever the count: zero is no model
        raise ConfigError(
            f"the config gives 0 routed experts, but a {family.name} model routes each token "
            f"to {cfg.num_experts_per_tok} of its MoE layers' experts; give the expert count"
        )
    if flags.moe == "every_layer":
        layers = tuple(range(n))
    elif flags.moe == "sparse_step":
        step = cfg.decoder_sparse_step
        dense = set(cfg.mlp_only_layers)
        layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    else:  # first_k_dense: vLLM deepseek_v2.py's is_moe_layer
        first, freq = cfg.first_k_dense_replace, cfg.moe_layer_freq
        layers = tuple(i for i in range(n) if i >= first and i % freq == 0)
        mlp_types = getattr(cfg, "mlp_layer_types", None)  # transformers' list, where read
        if mlp_types is not None:
            sparse = tuple(i for i, t in enumerate(mlp_types) if t == "sparse")
            if len(mlp_types) != n or sparse != layers:
                raise ConfigError(
                    "mlp_layer_types: disagrees with first_k_dense_replace and moe_layer_freq "
                    f"(MoE layers {layers[:4]}...); give consistent values"
                )
    if not layers:
        return None, ()
    top_k = cfg.num_experts_per_tok
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {experts} experts")
    groups, topk_groups = (cfg.n_group, cfg.topk_group) if flags.router_groups else (1, 1)
    if experts % groups:
        raise ConfigError(f"n_group: {experts} experts do not split into {groups} groups")
    if topk_groups > groups:
        raise ConfigError(f"topk_group: {topk_groups} is more than the {groups} groups")
    if top_k > topk_groups * (experts // groups):
        raise ConfigError(
            f"num_experts_per_tok: {top_k} is more than the {topk_groups * (experts // groups)} "
            "experts of the topk_group groups a token may use"
        )
    scoring = cfg.scoring_func if flags.router_scoring == "config" else flags.router_scoring
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"scoring_func: {scoring!r} is not supported; use softmax or sigmoid")
    shared = 0
    if flags.shared_experts == "gated":
        shared = cfg.shared_expert_intermediate_size
    elif flags.shared_experts == "n_shared":
        shared = cfg.n_shared_experts * cfg.moe_intermediate_size
    if flags.router_score_bias == "use_routing_bias" and not cfg.use_routing_bias:
        raise ConfigError(
            "use_routing_bias: false is not supported: transformers' MiniMax-M2 adds the "
            "router's e_score_correction_bias whatever the key says and vLLM leaves it out, so "
            "the model is ambiguous; set it to true (as released checkpoints do) or remove it"
        )
    spec = ExpertsSpec(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=getattr(cfg, flags.expert_size_key),
        norm_topk_prob=flags.norm_topk == "always" or cfg.norm_topk_prob,
        shared_intermediate_size=shared,
        shared_expert_gate=flags.shared_experts == "gated" and shared > 0,
        scoring_func=scoring,
        num_groups=groups,
        topk_groups=topk_groups,
        score_correction_bias=(
            flags.router_score_bias == "always"
            or (flags.router_score_bias == "noaux_tc" and cfg.topk_method == "noaux_tc")
            or (flags.router_score_bias == "use_routing_bias" and cfg.use_routing_bias)
        ),
        routed_scaling_factor=cfg.routed_scaling_factor if flags.routed_scaling else 1.0,
        routing_weights_fp32=flags.routing_weights_fp32,
        router_bias=flags.router_bias,
        expert_bias=flags.expert_bias,
        experts_in_out=flags.experts_in_out,
        swiglu_limit=getattr(cfg, "swiglu_limit", None),
        swiglu_alpha=getattr(cfg, "swiglu_alpha", 1.0),
    )
    return spec, layers


def _mla(cfg: Any) -> MLASpec:
    return MLASpec(
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleave,
    )


def _sparse_index(cfg: Any, n: int) -> SparseIndexSpec:
    """The DSA indexer of a config; its per-layer list must agree with the layer count."""
    types = cfg.indexer_types
    if types is None:
        indexer_layers = tuple(range(n))
    else:
        if len(types) != n or any(t not in ("full", "shared") for t in types):
            raise ConfigError(
                f"indexer_types: expected {n} entries of 'full' or 'shared', got {show(types)}"
            )
        indexer_layers = tuple(i for i, t in enumerate(types) if t == "full")
        if types and types[0] != "full":
            raise ConfigError(
                "indexer_types: the first layer must run its own indexer ('full'); a 'shared' "
                "layer reuses the selection of a layer before it"
            )
    return SparseIndexSpec(
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        indexer_layers=indexer_layers,
    )


def _linear_attention(cfg: Any, split_projections: bool) -> LinearAttentionSpec:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nv % nk:
        raise ConfigError(
            f"linear_num_value_heads: {nv} is not a multiple of linear_num_key_heads ({nk})"
        )
    state_dtype = getattr(cfg, "mamba_ssm_dtype", None)
    if state_dtype == "auto":
        state_dtype = None
    if state_dtype not in (None, *_STATE_DTYPES):
        raise ConfigError(
            f"mamba_ssm_dtype: {state_dtype!r} is not a state dtype vLLM keeps; use one of "
            f"auto, {', '.join(_STATE_DTYPES)}"
        )
    return LinearAttentionSpec(
        state_dtype=state_dtype,
        num_k_heads=nk,
        num_v_heads=nv,
        k_head_dim=cfg.linear_key_head_dim,
        v_head_dim=cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim,
        split_projections=split_projections,
    )
